"""`powerinfer` command: one-shot generation (llama.cpp-style flags) and subcommands.

Runs in: the user's process (the coordinator).

    powerinfer -m smollm2 -p "The capital of France is" -n 32 --temp 0
    powerinfer fetch gemma3-270m
    powerinfer bench -m smollm2 --threads 1,2

Expected errors print one ``error:`` line on stderr and exit with status 2 for a usage error (a
flag's value refused, as argparse does) or 1 for a runtime failure (missing or malformed files, a
full disk); only genuine bugs show a traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import Callable, Sequence

from powerinfer.flags import (
    CLIError,
    Parser,
    add_gpu_args,
    add_lookup_arg,
    add_model_args,
    check_gpu_flags,
    configure_logging,
    exit_status,
    load_llm,
)
from powerinfer.errors import ContextOverflowError, PowerInferError

log = logging.getLogger("powerinfer")


def _fetch(argv: Sequence[str]) -> int:
    from powerinfer.fetch import add_fetch_subcommand, run_fetch

    p = Parser(prog="powerinfer")
    add_fetch_subcommand(p.add_subparsers(dest="command"))
    return run_fetch(p.parse_args(["fetch", *argv]))


def _calibrate(argv: Sequence[str]) -> int:
    from powerinfer.cli.sparsity_cmds import run_calibrate

    return run_calibrate(argv)


def _perplexity(argv: Sequence[str]) -> int:
    from powerinfer.cli.sparsity_cmds import run_perplexity

    return run_perplexity(argv)


def _sparsity_curve(argv: Sequence[str]) -> int:
    from powerinfer.cli.sparsity_cmds import run_sparsity_curve

    return run_sparsity_curve(argv)


def _inspect(argv: Sequence[str]) -> int:
    from powerinfer.cli.inspect_cmd import run_inspect

    return run_inspect(argv)


def _bench(argv: Sequence[str]) -> int:
    from powerinfer.cli.bench import run_bench

    return run_bench(argv)


def _serve(argv: Sequence[str]) -> int:
    from powerinfer.server.main import serve

    return serve(argv, prog="powerinfer serve")


def _convert(argv: Sequence[str]) -> int:
    from powerinfer.cli.convert_cmd import run_convert

    return run_convert(argv)


def _train_relu(argv: Sequence[str]) -> int:
    from powerinfer.cli.train_cmd import run_train

    return run_train(argv)


def _synth(argv: Sequence[str]) -> int:
    from powerinfer.cli.synth_cmd import run_synth

    return run_synth(argv)


def _loadtest(argv: Sequence[str]) -> int:
    from powerinfer.devtools.harness.loadtest import main as run_loadtest

    return run_loadtest(argv)


# Subcommand -> its runner (argv after the name); each imports its module when called, so that
# `fetch` and `--help` stay light. Anything else is one-shot generation.
COMMANDS: dict[str, Callable[[Sequence[str]], int]] = {
    "fetch": _fetch, "bench": _bench, "inspect": _inspect, "calibrate": _calibrate, "perplexity": _perplexity,
    "sparsity-curve": _sparsity_curve, "serve": _serve, "loadtest": _loadtest, "convert": _convert,
    "train-relu": _train_relu, "synth": _synth,
}  # fmt: skip
SUBCOMMANDS = tuple(COMMANDS)


def build_generate_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="powerinfer",
        description="Generate text from a GGUF model. Subcommands: " + ", ".join(SUBCOMMANDS) + " (powerinfer SUB --help).",
    )
    add_model_args(p)
    src = p.add_mutually_exclusive_group()
    src.add_argument("-p", "--prompt", default=None, help="prompt text")
    src.add_argument("-f", "--file", default=None, help="read the prompt from a file")
    p.add_argument("-n", "--n-predict", type=int, default=-1, help="tokens to generate; -1 = until end of text or context (default -1)")
    p.add_argument("--temp", type=float, default=0.8, help="temperature; 0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=40, help="top-k sampling; 0 = off (default 40)")
    p.add_argument("--top-p", type=float, default=0.95, help="top-p sampling; 1.0 = off (default 0.95)")
    p.add_argument("--min-p", type=float, default=0.05, help="min-p sampling; 0 = off (default 0.05)")
    p.add_argument("--repeat-penalty", type=float, default=1.0, help="repeat penalty; 1.0 = off (default 1.0)")
    p.add_argument("--repeat-last-n", type=int, default=64, help="tokens the penalty looks back; -1 = context (default 64)")
    add_lookup_arg(p)
    p.add_argument("--seed", type=int, default=-1, help="random seed; -1 = random (default -1)")
    p.add_argument("-i", "--interactive", action="store_true",
                   help="chat with the model's chat template (Ctrl+C stops an answer; Ctrl+D or /exit quits; "
                        "when the context fills up the oldest turns are dropped, the system prompt is kept)")
    p.add_argument("--system", default=None, help="system prompt for -i")
    add_gpu_args(p)
    p.add_argument("--predictor", default=None, help="a .predictor file (from `powerinfer calibrate`, or PowerInfer's): sparse FFN")
    p.add_argument("--no-sparse", action="store_true", help="compute every FFN neuron even when a predictor is given (dense, exact)")
    return p


def run_generate(argv: Sequence[str]) -> int:
    from powerinfer.cli import report
    from powerinfer.cli.interactive import run_chat
    from powerinfer.sampling import SamplingParams

    args = build_generate_parser().parse_args(argv)
    configure_logging(args.log_level, args.verbose)
    if args.n_predict == 0 or args.n_predict < -1:
        raise CLIError(f"--n-predict must be positive or -1, got {args.n_predict}")
    if args.system and not args.interactive:
        log.warning("--system is the chat's system prompt (-i); without -i it is ignored")
    prompt = args.prompt
    if args.file is not None:
        try:
            with open(args.file, encoding="utf-8") as fh:
                prompt = fh.read()
        except (OSError, UnicodeDecodeError) as e:
            raise PowerInferError(f"cannot read prompt file {args.file}: {e}") from None
    if not prompt and not args.interactive:
        raise CLIError("no prompt: give -p TEXT or -f FILE (or -i to chat)")
    params = SamplingParams(
        temperature=args.temp,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repeat_penalty=args.repeat_penalty,
        repeat_last_n=args.repeat_last_n,
        seed=args.seed,
    )
    check_gpu_flags(args)
    llm = load_llm(args)
    try:
        if args.verbose or args.log_level in ("INFO", "DEBUG") or sys.stderr.isatty():
            print(report.load_summary(llm), file=sys.stderr)
        elif llm.predictor is not None:  # sparse or not, a loaded predictor is said in one line
            print(report.mode_line(llm), file=sys.stderr)
        if args.interactive:
            return run_chat(llm, params, args.system, args.n_predict, first=prompt or None)
        ids = llm.tokenize(prompt, add_bos=True, special=True)  # as llama.cpp: "<|im_start|>" in -p is that token
        if len(ids) > llm.n_ctx:  # said before the prompt is echoed, so stdout holds nothing of a failed run
            raise ContextOverflowError(f"{len(ids)} tokens do not fit the context of {llm.n_ctx} (raise -c/--ctx-size)")
        out = sys.stdout
        out.write(prompt)
        out.flush()
        interrupted = False
        try:
            for chunk in llm.generate(ids, args.n_predict, sampling=params):
                if chunk.text:
                    out.write(chunk.text)
                    out.flush()
        except KeyboardInterrupt:
            interrupted = True
        out.write("\n")
        out.flush()
        print("[interrupted]" if interrupted else "", file=sys.stderr)  # stdout carries only the text
        report.print_report(llm, sys.stderr, verbose=args.verbose or args.log_level == "DEBUG")
        return 130 if interrupted else 0
    finally:
        llm.close()


def _terminate(signum: int, frame: object) -> None:
    # SIGTERM unwinds like Ctrl+C would, so `finally` blocks shut the worker pool down in order.
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    signal.signal(signal.SIGTERM, _terminate)
    try:
        command = COMMANDS.get(argv[0]) if argv else None
        rc = command(argv[1:]) if command is not None else run_generate(argv)
        sys.stdout.flush()  # here, not at exit: a full disk behind stdout is then reported below
        return rc
    except PowerInferError as e:
        print(f"error: {e}", file=sys.stderr)
        return exit_status(e)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        _drop_stdout()
        return 0
    except OSError as e:  # writing the output failed (ENOSPC, EIO), or a file the command named: no traceback
        print(f"error: {e.strerror or e}" + (f": {e.filename}" if e.filename else " (writing the output)"), file=sys.stderr)
        _drop_stdout()
        return 1


def _drop_stdout() -> None:
    """Point stdout at /dev/null: what could not be written must not be retried (and fail) at exit."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())
