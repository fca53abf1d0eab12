"""`powerinfer` command: one-shot generation (llama.cpp-style flags) and subcommands.

Runs in: the user's process (the coordinator).

    powerinfer -m smollm2 -p "The capital of France is" -n 32 --temp 0
    powerinfer fetch gemma3-270m
    powerinfer bench -m smollm2 --threads 1,2

Expected errors (bad flags, missing or malformed files) print one ``error:`` line on stderr and
exit with status 1; only genuine bugs show a traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING, Sequence

from powerinfer.cli.common import Parser, positive_int
from powerinfer.errors import PowerInferError

if TYPE_CHECKING:
    from powerinfer.api import LLM
    from powerinfer.coordinator.hybrid_executor import (
        GpuOptions,  # imported lazily at run time: `fetch` and `--help` stay light
    )

log = logging.getLogger("powerinfer")

SUBCOMMANDS = ("fetch", "bench", "inspect", "calibrate", "perplexity", "sparsity-curve", "serve", "loadtest")


class CLIError(PowerInferError):
    """A bad command-line argument."""


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", required=True, help="GGUF file, or a known model name to fetch (smollm2, gemma3-270m)")
    p.add_argument("-t", "--threads", type=positive_int, default=None, help="CPU worker processes (default: one per physical core)")
    p.add_argument("--worker-threads", type=positive_int, default=1, help="threads per worker process (default 1)")
    p.add_argument("--executor", choices=["process", "inprocess"], default="process",
                   help="process: shards in CPU worker processes (default); inprocess: everything in this process")
    p.add_argument("--transport", choices=["auto", "shm", "zmq"], default="auto",
                   help="worker processes: shm = native ranks, one step per forward pass, merged in shared memory; zmq = torch "
                        "shards, one message per layer (predictors use it); auto (default): shm when the native decoder runs the model")
    p.add_argument("-c", "--ctx-size", type=int, default=None,
                   help="context size in tokens; 0 = the model's trained context (default: 4096, or less if the model was trained on less)")
    p.add_argument("-b", "--batch-size", type=positive_int, default=512, help="prompt tokens per prefill step (default 512)")
    p.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"], type=str.upper)
    p.add_argument("--verbose", action="store_true", help="same as --log-level DEBUG")


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
    p.add_argument("--seed", type=int, default=-1, help="random seed; -1 = random (default -1)")
    p.add_argument("-i", "--interactive", action="store_true",
                   help="chat with the model's chat template (Ctrl+C stops an answer; Ctrl+D or /exit quits; "
                        "when the context fills up the oldest turns are dropped, the system prompt is kept)")
    p.add_argument("--system", default=None, help="system prompt for -i")
    add_gpu_args(p)
    p.add_argument("--predictor", default=None, help="a .predictor file (from `powerinfer calibrate`, or PowerInfer's): sparse FFN")
    p.add_argument("--no-sparse", action="store_true", help="compute every FFN neuron even when a predictor is given (dense, exact)")
    return p


def add_gpu_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-ngl", "--n-gpu-layers", type=int, default=0,
                   help="layers that take part in GPU offload, from the first (default 0: CPU only; -1 or 99: all)")
    p.add_argument("--vram-budget", type=float, default=None, help="GiB of GPU memory to use (default: free memory minus a margin)")
    p.add_argument("--split", choices=["neuron", "layer"], default="neuron",
                   help="neuron: hot neurons on the GPU, cold on the CPU (PowerInfer, default); layer: whole layers (llama.cpp)")
    p.add_argument("--reset-gpu-index", action="store_true", help="re-solve the hot-neuron placement even if the cached one matches")
    p.add_argument("--gpu-backend", choices=["cuda", "cpu"], default="cuda",
                   help="cuda: the NVIDIA GPU (default); cpu: a numpy stand-in of the GPU worker, to check a placement without one")


def check_gpu_flags(args: argparse.Namespace) -> None:
    """-ngl / --vram-budget need an NVIDIA GPU; say so plainly instead of failing deep inside."""
    if args.n_gpu_layers < -1:
        raise CLIError(f"-ngl must be >= 0 (or -1 for all layers), got {args.n_gpu_layers}")
    if args.vram_budget is not None and not args.vram_budget > 0:
        raise CLIError(f"--vram-budget must be a positive number of GiB, got {args.vram_budget}")
    if args.n_gpu_layers == 0 and args.vram_budget is None:
        return
    if getattr(args, "gpu_backend", "cuda") == "cpu":
        return
    from powerinfer.gpu_worker.device import find_gpu

    probe = find_gpu()
    if probe.name is None:
        raise CLIError(f"-ngl/--vram-budget need an NVIDIA GPU, and none was found ({probe.reason}); use -ngl 0")


def gpu_options(args: argparse.Namespace) -> "GpuOptions | None":
    if args.n_gpu_layers == 0 and args.vram_budget is None:
        return None
    from powerinfer.coordinator.hybrid_executor import GpuOptions

    ngl = -1 if args.n_gpu_layers in (0, -1) else args.n_gpu_layers  # only --vram-budget given: every layer may take part
    return GpuOptions(backend=args.gpu_backend, split=args.split, vram_budget_gib=args.vram_budget, n_gpu_layers=ngl,
                      reset_index=args.reset_gpu_index)


def configure_logging(level: str, verbose: bool) -> None:
    logging.basicConfig(level="DEBUG" if verbose else level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)


def load_llm(args: argparse.Namespace, progress: bool = True) -> LLM:
    from powerinfer.api import LLM
    from powerinfer.fetch import MODELS, resolve_model

    if args.ctx_size is not None and args.ctx_size < 0:
        raise CLIError(f"--ctx-size must be >= 0, got {args.ctx_size}")
    path = resolve_model(args.model, progress=progress and sys.stderr.isatty())
    if not os.path.exists(path) and os.sep not in args.model and not args.model.endswith(".gguf"):
        raise CLIError(f"model {args.model!r} is neither a file nor a known model name ({', '.join(MODELS)})")
    return LLM(path, n_ctx=args.ctx_size, n_batch=args.batch_size, n_threads=args.threads, executor=args.executor,
               worker_threads=args.worker_threads, predictor=getattr(args, "predictor", None), sparse=not getattr(args, "no_sparse", False),
               progress=progress and sys.stderr.isatty(), n_slots=getattr(args, "n_slots", 1),
               gpu=gpu_options(args) if hasattr(args, "n_gpu_layers") else None, transport=args.transport)


def run_generate(argv: Sequence[str]) -> int:
    from powerinfer.cli import report
    from powerinfer.cli.interactive import run_chat
    from powerinfer.sampling import SamplingParams

    args = build_generate_parser().parse_args(argv)
    configure_logging(args.log_level, args.verbose)
    if args.n_predict == 0 or args.n_predict < -1:
        raise CLIError(f"--n-predict must be positive or -1, got {args.n_predict}")
    prompt = args.prompt
    if args.file is not None:
        try:
            with open(args.file, encoding="utf-8") as fh:
                prompt = fh.read()
        except (OSError, UnicodeDecodeError) as e:
            raise CLIError(f"cannot read prompt file {args.file}: {e}") from None
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
        if args.interactive:
            return run_chat(llm, params, args.system, args.n_predict, first=prompt or None)
        out = sys.stdout
        out.write(prompt)
        out.flush()
        try:
            for chunk in llm.generate(prompt, args.n_predict, sampling=params):
                if chunk.text:
                    out.write(chunk.text)
                    out.flush()
        except KeyboardInterrupt:
            out.write("\n[interrupted]")
        out.write("\n")
        print(file=sys.stderr)
        report.print_report(llm, sys.stderr, verbose=args.verbose or args.log_level == "DEBUG")
        return 0
    finally:
        llm.close()


def _terminate(signum: int, frame: object) -> None:
    # SIGTERM unwinds like Ctrl+C would, so `finally` blocks shut the worker pool down in order.
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    signal.signal(signal.SIGTERM, _terminate)
    try:
        if argv and argv[0] == "fetch":
            from powerinfer.fetch import add_fetch_subcommand, run_fetch

            p = Parser(prog="powerinfer")
            add_fetch_subcommand(p.add_subparsers(dest="command"))
            return run_fetch(p.parse_args(argv))
        if argv and argv[0] in ("calibrate", "perplexity"):
            from powerinfer.cli.sparsity_cmds import run_calibrate, run_perplexity

            return (run_calibrate if argv[0] == "calibrate" else run_perplexity)(argv[1:])
        if argv and argv[0] == "inspect":
            from powerinfer.cli.inspect_cmd import run_inspect

            return run_inspect(argv[1:])
        if argv and argv[0] == "serve":
            from powerinfer.server.main import serve

            return serve(argv[1:], prog="powerinfer serve")
        if argv and argv[0] == "sparsity-curve":
            from powerinfer.cli.sparsity_cmds import run_sparsity_curve as run_curve

            return run_curve(argv[1:])
        if argv and argv[0] == "loadtest":
            from powerinfer.server.loadtest import main as run_loadtest

            return run_loadtest(argv[1:])
        if argv and argv[0] == "bench":
            from powerinfer.cli.bench import run_bench

            return run_bench(argv[1:])
        return run_generate(argv)
    except PowerInferError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
