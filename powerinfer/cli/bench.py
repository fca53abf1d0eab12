"""`powerinfer bench`: load time, peak memory, prefill and decode speed at several thread counts.

Runs in: the user's process, which starts one child process per thread count (so each figure's
load time and peak RSS belong to that configuration alone) and prints a table; ``--json FILE``
also writes the figures.

    powerinfer bench -m smollm2 --threads 1,2 --prompt-tokens 128 --gen-tokens 64
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any, Sequence

from powerinfer.errors import PowerInferError

log = logging.getLogger(__name__)

# Deterministic prompt material; repeated until the requested token count is reached.
_TEXT = (
    "The history of computing is a story of machines that learned to do arithmetic faster than people, "
    "then to store programs, then to talk to each other across the world. Each step made memory and "
    "bandwidth, not raw arithmetic, the limit that mattered. "
)


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    from powerinfer.cli.main import _Parser, positive_int

    p = _Parser(prog="powerinfer bench", description="Measure load time, peak RSS, prefill and decode tokens/s.")
    p.add_argument("-m", "--model", required=True, help="GGUF file or known model name")
    p.add_argument("--threads", "-t", type=_int_list, default=[1, 2], help="comma-separated thread counts (default 1,2)")
    p.add_argument("--prompt-tokens", type=positive_int, default=128, help="prefill length (default 128)")
    p.add_argument("--gen-tokens", type=positive_int, default=64, help="decode steps (default 64)")
    p.add_argument("--repeat", type=positive_int, default=3, help="runs per figure; the median is reported (default 3)")
    p.add_argument("-b", "--batch-size", type=positive_int, default=512)
    p.add_argument("--json", default=None, help="also write the figures to this JSON file")
    p.add_argument("--one", type=positive_int, default=None, help=argparse.SUPPRESS)  # child mode
    return p


def measure(model: str, threads: int, prompt_tokens: int, gen_tokens: int, repeat: int, n_batch: int) -> dict[str, Any]:
    """Measure one configuration in this process."""
    import torch

    from powerinfer.api import LLM

    t0 = time.perf_counter()
    llm = LLM(model, n_ctx=prompt_tokens + gen_tokens + 8, n_batch=n_batch, n_threads=threads)
    load_s = time.perf_counter() - t0
    ids = llm.tokenize(_TEXT * (1 + prompt_tokens // 20))[:prompt_tokens]
    eng = llm.engine
    prefill, decode = [], []
    for _ in range(repeat):
        eng.rewind(0)
        t = time.perf_counter()
        logits = eng.eval(ids)
        prefill.append(prompt_tokens / (time.perf_counter() - t))
        token = int(torch.argmax(logits[-1]))
        t = time.perf_counter()
        for _ in range(gen_tokens):  # greedy, never stopping at end-of-text, so every run is equal
            token = int(torch.argmax(eng.eval([token])[-1]))
        decode.append(gen_tokens / (time.perf_counter() - t))
    return {
        "model": llm.config.name,
        "threads": threads,
        "load_s": round(load_s, 3),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "weights_mib": round(eng.weight_bytes / 2**20, 1),
        "prompt_tokens": prompt_tokens,
        "prefill_tps": round(statistics.median(prefill), 1),
        "gen_tokens": gen_tokens,
        "decode_tps": round(statistics.median(decode), 1),
    }


def run_bench(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(argv)
    from powerinfer.fetch import resolve_model

    model = str(resolve_model(args.model, progress=sys.stderr.isatty()))
    if args.one is not None:
        print(json.dumps(measure(model, args.one, args.prompt_tokens, args.gen_tokens, args.repeat, args.batch_size)))
        return 0
    rows = []
    for threads in args.threads:
        cmd = [sys.executable, "-m", "powerinfer.cli.main", "bench", "-m", model, "--one", str(threads),
               "--prompt-tokens", str(args.prompt_tokens), "--gen-tokens", str(args.gen_tokens),
               "--repeat", str(args.repeat), "-b", str(args.batch_size)]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise PowerInferError(f"benchmark at {threads} threads failed: {proc.stderr.strip().splitlines()[-1:] or proc.returncode}")
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    cols = ["threads", "load_s", "peak_rss_mib", "weights_mib", "prefill_tps", "decode_tps"]
    print(f"model: {rows[0]['model']}  prompt: {args.prompt_tokens} tokens  decode: {args.gen_tokens} tokens  (median of {args.repeat})")
    print("  ".join(f"{c:>12}" for c in cols))
    for r in rows:
        print("  ".join(f"{r[c]:>12}" for c in cols))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(rows, fh, indent=2)
    return 0
