"""Prints the Oracle-1 table for docs/powerinfer-models.md: each family's converted tiny checkpoint
against transformers on every executor, and Q8_0's top-1 agreement on held-out text.

Runs in: a shell, from the repository root: ``python -m tests.convert.oracle_report`` (about a minute).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize, quantize

from powerinfer.api import LLM
from powerinfer.convert.run import convert
from tests.convert.hf_models import SPLIT, TEXT, load_oracle, make_checkpoint, oracle_logits, tokens

EXECUTORS = {"native in-process": dict(executor="inprocess"), "pool, 2 workers": dict(executor="process", n_threads=2),
             "torch path": dict(executor="inprocess", native=False)}


def main() -> None:
    root = Path(tempfile.mkdtemp())
    ids = [int(i) for i in np.random.default_rng(1).integers(2, 290, 64)]
    print("F32, 64-token prompt: max |ours - transformers| / range of transformers' logits (top-1 agreement)")
    for i, act in enumerate(("silu", "relu", "fatrelu", "drelu", "opt")):
        src = make_checkpoint(root / act, act, seed=i)
        path = convert(src, root / f"{act}.gguf", "f32")[0]
        ref = oracle_logits(load_oracle(src), ids)
        cells = []
        for name, kw in EXECUTORS.items():
            llm = LLM(path, n_ctx=128, **kw)  # type: ignore[arg-type]
            got = llm.logits(ids)
            llm.close()
            cells.append(f"{name}: {np.abs(got - ref).max() / (ref.max() - ref.min()):.1e} ({(got.argmax(-1) == ref.argmax(-1)).mean():.0%})")
        print(f"  {act:8} " + "; ".join(cells))
    print("Q8_0, held-out text, checkpoint trained 120 steps: top-1 agreement")
    for act in ("relu", "fatrelu", "drelu", "opt"):
        src = make_checkpoint(root / f"t-{act}", act, seed=3, train_steps=120)
        path = convert(src, root / f"t-{act}.gguf", "q8_0")[0]
        oracle, rounded = load_oracle(src), load_oracle(src)
        with torch.no_grad():
            for name, p in rounded.named_parameters():
                if p.ndim == 2 and "embed_positions" not in name:  # OPT's position table stays F32 in the file
                    p.copy_(torch.from_numpy(dequantize(quantize(p.numpy(), QT.Q8_0), QT.Q8_0).reshape(p.shape)))
        held = tokens(src, TEXT[SPLIT:])
        llm = LLM(path, n_ctx=128, executor="inprocess")
        a = b = c = n = 0
        for k in range(len(held) // 64):
            w = held[k * 64 : (k + 1) * 64]
            ref, q8, ours = (oracle_logits(oracle, w).argmax(-1), oracle_logits(rounded, w).argmax(-1), llm.logits(w).argmax(-1))
            a, b, c, n = a + int((ours == ref).sum()), b + int((q8 == ref).sum()), c + int((ours == q8).sum()), n + len(w)
        llm.close()
        print(f"  {act:8} ours vs transformers {a / n:.2%}; transformers with the Q8_0 weights vs itself {b / n:.2%}; "
              f"ours vs transformers with the Q8_0 weights {c / n:.2%} ({n} positions)")


if __name__ == "__main__":
    main()
