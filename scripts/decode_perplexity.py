"""Perplexity through the native decoder's decode path, one token a step: dense and sparse alike.

Runs in: a developer's shell, outside the product (docs/sparsity.md, "A 4-bit down copy").
``powerinfer perplexity`` scores whole windows through the torch executor's sparse FFN, so what
only decode does (the neuron-major down copy, the hot block) is not in its figure; this script
feeds every token as its own decode step to the in-process native decoder and scores the next
token's log-probability. ``python scripts/decode_perplexity.py MODEL TEXT TOKENS CTX [PREDICTOR]``;
``POWERINFER_DOWN_T`` picks the down copy's type as in the product.
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

from powerinfer.api import LLM
from powerinfer.sparsity.profile import windows_of


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("text")
    ap.add_argument("tokens", type=int, help="score at most this many tokens")
    ap.add_argument("ctx", type=int, help="window length (each window starts from an empty cache)")
    ap.add_argument("predictor", nargs="?", default=None)
    args = ap.parse_args()
    llm = LLM(args.model, n_ctx=args.ctx + 8, n_threads=2, executor="inprocess", predictor=args.predictor)
    engine = llm.engine
    with open(args.text, encoding="utf-8") as fh:
        ids = llm.tokenize(fh.read())[: args.tokens + 1]
    nll, count, t0 = 0.0, 0, time.perf_counter()
    for window in windows_of(ids, args.ctx, None):
        engine.rewind_all()
        for cur, nxt in zip(window[:-1], window[1:]):
            logits = engine.eval([cur])[-1].astype(np.float64)
            top = float(logits.max())
            nll += top + math.log(float(np.exp(logits - top).sum())) - float(logits[nxt])
            count += 1
    print(f"{'sparse' if args.predictor else 'dense'} decode-path perplexity {math.exp(nll / count):.4f} over {count} tokens "
          f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
