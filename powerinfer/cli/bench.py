"""`powerinfer bench`: thread/worker scaling of load time, memory, prefill and decode speed.

Runs in: the user's process, which starts one child process per configuration (so each figure's
load time and memory belong to that configuration alone), prints a table, and optionally writes
JSON and a PNG plot of decode tokens/s against threads with the memory-bandwidth ceiling.

    powerinfer bench -m smollm2 -t 1,2 --prompt-tokens 128 --gen-tokens 64 --plot scaling.png
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Sequence

import numpy as np

from powerinfer.errors import PowerInferError
from powerinfer.sparsity.speed import PROMPT_TEXT

log = logging.getLogger(__name__)


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    from powerinfer.flags import Parser, positive_int

    p = Parser(prog="powerinfer bench", description="Measure load time, memory, prefill and decode tokens/s per thread count.")
    p.add_argument("-m", "--model", default=None, help="GGUF file or known model name (not needed for --merge)")
    p.add_argument("--workers", "-t", "--threads", dest="workers", type=_int_list, default=[1, 2],
                   help="comma-separated CPU thread counts (default 1,2), in worker processes as --worker-threads lays them out")
    p.add_argument("--executor", choices=["process", "inprocess"], default="process", help="default: process (the product path)")
    p.add_argument("--worker-threads", type=positive_int, default=None,
                   help="threads per worker process, dividing --threads (default: one worker process per NUMA node and L3; in a VM per core)")
    p.add_argument("--predictor", default=None, help="measure sparse decode with this .predictor file")
    p.add_argument("--vs-dense", action="store_true",
                   help="with --predictor: load the model dense and sparse in one process, alternate decode rounds "
                        "and print the paired sparse/dense speed ratio (uses the first --workers value)")
    p.add_argument("--sparse", action="store_true",
                   help="with --predictor: --vs-dense plus the weight bytes each decode step reads, the GB/s they make against "
                        "the machine's streaming read bandwidth, paired prefill of --prompt-tokens, the memory of all processes and, "
                        "replayed in process, the predictor's time per step and its recall and precision")
    p.add_argument("--vs-powerinfer", metavar="PATH", default=None,
                   help="with --sparse or --vs-dense: PowerInfer's CPU build (its main binary, or a checkout with build/bin/main) "
                        "decodes the same model with the same threads in the same rounds, from -m when it is a PowerInfer (PWRI) file "
                        "or from --powerinfer-model")
    p.add_argument("--powerinfer-model", metavar="FILE", default=None,
                   help="with --vs-powerinfer and a GGUF -m: the same model and predictor in PowerInfer's layout "
                        "(powerinfer convert MODEL --predictor P --powerinfer) for PowerInfer to run")
    p.add_argument("--rounds", type=positive_int, default=12, help="alternating rounds for --vs-dense, --vs-llama-cpp and --paired (default 12; at least 2: a ratio is a median over rounds)")
    p.add_argument("--vs-llama-cpp", action="store_true",
                   help="run llama.cpp (llama-cpp-python) on the same file with the same threads in alternating rounds and print "
                        "the paired ratios for prefill and decode (first --workers value; --rounds); with --vs-dense: a column "
                        "of the sparse/dense comparison")
    p.add_argument("--profile", action="store_true",
                   help="native decoder: split a decode step's time into its layer phases, the head and the rest "
                        "(in process, first --workers value, --gen-tokens steps)")
    p.add_argument("--paired", action="store_true",
                   help="the default executor at each --workers (thread) count, single-thread worker processes and the in-process decoder in alternating rounds of one run "
                        "(--rounds): paired ratios, merge latency, wait share, memory; --plot draws the scaling")
    p.add_argument("--merge", action="store_true",
                   help="the shared-memory merge alone between real rank processes (first --workers value, at least 2), then the GPU rank's "
                        "hand-off with as many CPU ranks: "
                        "latency per sync")
    p.add_argument("--lookup", type=int, default=0, metavar="N",
                   help="prompt lookup decoding with drafts of up to N tokens against plain decoding, paired rounds (--rounds, "
                        "--gen-tokens) on a quoting task and a free-writing one; the tokens must match")
    p.add_argument("--prompt-tokens", type=positive_int, default=128, help="prefill length (default 128)")
    p.add_argument("--gen-tokens", type=positive_int, default=64, help="decode steps (default 64)")
    p.add_argument("--repeat", type=positive_int, default=3, help="runs per figure; the median is reported (default 3)")
    p.add_argument("-b", "--batch-size", type=positive_int, default=512, help="prompt tokens per prefill step (default 512)")
    p.add_argument("--json", default=None, help="also write the figures to this JSON file")
    p.add_argument("--plot", default=None, help="also write a PNG plot of decode tokens/s against threads")
    p.add_argument("--one", type=positive_int, default=None, help=argparse.SUPPRESS)  # child mode
    return p


def _peak_rss(pid: int) -> float:
    """VmHWM (the kernel's peak RSS) of a live process, in bytes; 0 where /proc lacks it."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return 0.0


def _memory(pids: Sequence[int]) -> tuple[float, float, float]:
    """(sum of peak RSS, sum of RSS, sum of PSS) in MiB over these processes.

    RSS counts shared pages (libraries, page cache) once per process; PSS splits them fairly.
    """
    import psutil

    peak = rss = pss = 0.0
    for pid in pids:
        try:
            info = psutil.Process(pid).memory_full_info()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        peak += _peak_rss(pid)
        rss += info.rss
        pss += getattr(info, "pss", info.rss)
    return peak / 2**20, rss / 2**20, pss / 2**20


def measure(model: str, workers: int, executor: str, prompt_tokens: int, gen_tokens: int, repeat: int, n_batch: int,
            worker_threads: int | None = None, predictor: str | None = None) -> dict[str, Any]:
    """Measure one configuration in this process (plus its workers)."""
    from powerinfer.api import LLM

    t0 = time.perf_counter()
    llm = LLM(model, n_ctx=prompt_tokens + gen_tokens + 8, n_batch=n_batch, n_threads=workers, executor=executor,
              worker_threads=worker_threads, predictor=predictor)
    load_s = time.perf_counter() - t0
    try:
        ids = llm.tokenize(PROMPT_TEXT * (1 + prompt_tokens // 20))[:prompt_tokens]
        eng = llm.engine
        prefill, decode = [], []
        for _ in range(repeat):
            eng.rewind(0)
            t = time.perf_counter()
            logits = eng.eval(ids)
            prefill.append(prompt_tokens / (time.perf_counter() - t))
            token = int(np.argmax(logits[-1]))
            eng.executor.reset_stats()
            t = time.perf_counter()
            for _ in range(gen_tokens):  # greedy, never stopping at end-of-text, so every run is equal
                token = int(np.argmax(eng.eval([token])[-1]))
            decode.append(gen_tokens / (time.perf_counter() - t))
        desc = eng.executor.describe()
        pids = [os.getpid(), *desc.pids]
        peak, rss, pss = _memory(pids)
        from powerinfer.model.weights import decode_weight_bytes

        read = decode_weight_bytes(llm.file, llm.config.n_layers, llm.config.tied_embeddings)  # the file's bytes per step
        row: dict[str, Any] = {
            "model": llm.config.name,
            "sparse": llm.sparse,
            "executor": executor,
            "threads": workers,
            "workers": len(desc.pids),  # worker processes (0: in process)
            "load_s": round(load_s, 3),
            "peak_rss_mib": round(peak, 1),
            "total_rss_mib": round(rss, 1),
            "total_pss_mib": round(pss, 1),
            "weights_mib": round(eng.weight_bytes / 2**20, 1),
            "prompt_tokens": prompt_tokens,
            "prefill_tps": round(statistics.median(prefill), 1),
            "gen_tokens": gen_tokens,
            "decode_tps": round(statistics.median(decode), 1),
            "read_mib_per_token": round(read / 2**20, 1),
            "decode_gbs": round(statistics.median(decode) * read / 1e9, 2),
        }
        row.update(desc.numbers)  # the executor's own step figures (merges, IPC per layer)
        return row
    finally:
        llm.close()


def _plot(rows: list[dict[str, Any]], ceiling_tps: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r["threads"] for r in rows]
    ax.plot(xs, [r["decode_tps"] for r in rows], "o-", label="decode")
    ax.plot(xs, [r["prefill_tps"] for r in rows], "s-", label="prefill")
    ax.axhline(ceiling_tps, color="red", linestyle="--", label=f"bandwidth ceiling (decode) {ceiling_tps:.0f}")
    ax.set_xlabel(f"CPU threads ({rows[0]['executor']} executor)")
    ax.set_ylabel("tokens/s")
    ax.set_xticks(xs)
    ax.set_title(rows[0]["model"])
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def run_bench(argv: Sequence[str]) -> int:
    from powerinfer.flags import CLIError, report_paths

    args = build_parser().parse_args(argv)
    report_paths(args.json, args.plot)
    if args.merge:
        from powerinfer.devtools.harness.bench_merge import bench_handoff, bench_merge

        if args.workers[0] < 2:
            raise CLIError(f"--merge measures a merge between ranks: give --workers 2 or more, got {args.workers[0]}")
        mb, hb = bench_merge(ranks=args.workers[0]), bench_handoff(ranks=args.workers[0])
        print(mb.report())
        print(hb.report())
        if args.json:
            with open(args.json, "w", encoding="utf-8") as fh:
                json.dump({**mb.__dict__, "handoff": hb.__dict__}, fh, indent=2)
        return 0
    if not args.model:
        raise PowerInferError("powerinfer bench needs -m MODEL")
    from powerinfer.fetch import resolve_model

    from powerinfer.predictors.pwri_model import runnable_model

    source = resolve_model(args.model, progress=sys.stderr.isatty())
    path, pwri = runnable_model(source)
    model = str(path)
    pi_model = args.powerinfer_model or (str(source) if pwri is not None else None)
    if args.vs_powerinfer and (pi_model is None or not (args.vs_dense or args.sparse)):
        raise CLIError("--vs-powerinfer runs PowerInfer on the same model: give -m a PowerInfer file, or --powerinfer-model one "
                       "(powerinfer convert --powerinfer writes it), and --sparse or --vs-dense")
    if args.powerinfer_model and not args.vs_powerinfer:
        raise CLIError("--powerinfer-model is the file for --vs-powerinfer: give --vs-powerinfer PATH too")
    if pwri is not None and not args.predictor:
        args.predictor = str(pwri.predictor)  # a PowerInfer model file runs with its own predictors
    if args.profile:
        from powerinfer.devtools.harness.bench_profile import as_dict, profile_decode

        prof = profile_decode(model, threads=args.workers[0], prompt_tokens=args.prompt_tokens, gen_tokens=args.gen_tokens,
                              predictor=args.predictor)
        print(prof.report())
        if args.json:
            with open(args.json, "w", encoding="utf-8") as fh:
                json.dump(as_dict(prof), fh, indent=2)
        return 0
    if args.lookup:
        from powerinfer.devtools.harness.bench_lookup import compare_lookup

        lk = compare_lookup(model, args.lookup, args.workers[0], args.executor, args.gen_tokens, args.rounds)
        print(lk.report())
        if args.json:
            with open(args.json, "w", encoding="utf-8") as fh:
                json.dump(lk.as_dict(), fh, indent=2)
        return 0
    if args.paired:
        from powerinfer.devtools.harness.bench_scaling import compare_scaling, plot_scaling

        sc = compare_scaling(model, args.workers, prompt_tokens=args.prompt_tokens, gen_tokens=args.gen_tokens, rounds=args.rounds,
                             worker_threads=args.worker_threads, n_batch=args.batch_size, predictor=args.predictor)
        print(sc.report())
        if args.json:
            with open(args.json, "w", encoding="utf-8") as fh:
                json.dump(sc.as_dict(), fh, indent=2)
        if args.plot:
            plot_scaling(sc, args.plot)
        return 0
    if args.vs_llama_cpp and not (args.vs_dense or args.sparse):
        if args.predictor:
            raise PowerInferError("--predictor with --vs-llama-cpp compares sparse decode: give --vs-dense too")
        from powerinfer.devtools.harness.bench_llama import compare_llama_cpp

        vs = compare_llama_cpp(model, threads=args.workers[0], executor=args.executor, prompt_tokens=args.prompt_tokens,
                               gen_tokens=args.gen_tokens, rounds=args.rounds, n_batch=args.batch_size)
        print(vs.report())
        if args.json:
            with open(args.json, "w", encoding="utf-8") as fh:
                json.dump(vs.as_dict(), fh, indent=2)
        return 0
    if args.vs_dense or args.sparse:
        if not args.predictor:
            raise PowerInferError(f"{'--sparse' if args.sparse else '--vs-dense'} compares against a sparse engine: give it --predictor FILE")
        from powerinfer.sparsity.speed import compare_decode

        cmp = compare_decode(model, args.predictor, threads=args.workers[0], executor=args.executor, prompt_tokens=args.prompt_tokens,
                             gen_tokens=args.gen_tokens, rounds=args.rounds, worker_threads=args.worker_threads,
                             llama_cpp=args.vs_llama_cpp, read_bytes=args.sparse,
                             powerinfer=(args.vs_powerinfer, pi_model) if args.vs_powerinfer and pi_model else None)
        print(cmp.report())
        if args.json:
            with open(args.json, "w", encoding="utf-8") as fh:
                json.dump(cmp.as_dict(), fh, indent=2)
        return 0
    if args.one is not None:
        print(json.dumps(measure(model, args.one, args.executor, args.prompt_tokens, args.gen_tokens, args.repeat, args.batch_size,
                                 args.worker_threads, args.predictor)))
        return 0
    rows = []
    for workers in args.workers:
        cmd = [sys.executable, "-m", "powerinfer.cli.main", "bench", "-m", model, "--one", str(workers), "--executor", args.executor,
               "--prompt-tokens", str(args.prompt_tokens), "--gen-tokens", str(args.gen_tokens),
               "--repeat", str(args.repeat), "-b", str(args.batch_size)]
        if args.worker_threads is not None:
            cmd += ["--worker-threads", str(args.worker_threads)]
        if args.predictor:
            cmd += ["--predictor", args.predictor]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise PowerInferError(f"benchmark with {workers} threads failed: {(proc.stderr.strip().splitlines() or [proc.returncode])[-1]}")
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    from powerinfer.sparsity.speed import read_bandwidth

    bandwidth = read_bandwidth(max(args.workers))
    ceiling = bandwidth * 1e9 / (rows[0]["read_mib_per_token"] * 2**20)
    cols = ["threads", "workers", "load_s", "peak_rss_mib", "total_rss_mib", "total_pss_mib", "prefill_tps", "decode_tps", "decode_gbs"]
    if "decode_layer_us" in rows[0]:
        cols += ["decode_layer_us", "decode_layer_compute_us", "decode_layer_ipc_us"]
    if "merge_median_us" in rows[0]:
        cols += ["decode_step_us", "merge_median_us", "merge_p99_us", "merge_wait_share"]
    print(f"model: {rows[0]['model']}  executor: {args.executor}  {'sparse: ' + args.predictor if args.predictor else 'dense'}  prompt: {args.prompt_tokens} tokens  "
          f"decode: {args.gen_tokens} tokens  (median of {args.repeat})")
    print(f"streaming read with {max(args.workers)} threads: {bandwidth:.1f} GB/s; a decode step reads {rows[0]['read_mib_per_token']} MiB "
          f"of the file's weights -> decode ceiling {ceiling:.0f} tokens/s (decode_gbs: what each row reached)")
    print("  ".join(f"{c:>12}" for c in cols))
    for r in rows:
        print("  ".join(f"{r[c]:>12}" for c in cols))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"bandwidth_gbs": bandwidth, "ceiling_tps": ceiling, "rows": rows}, fh, indent=2)
    if args.plot:
        _plot(rows, ceiling, args.plot)
    return 0
