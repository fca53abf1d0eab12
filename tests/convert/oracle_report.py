"""Prints the Oracle-1 table for docs/powerinfer-models.md: each family's converted tiny checkpoint
against transformers on every executor, and Q8_0's top-1 agreement on held-out text.

Runs in: a shell, from the repository root: ``python -m tests.convert.oracle_report`` (about a minute).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from powerinfer.api import LLM
from powerinfer.convert.run import convert
from tests.convert.hf_models import load_oracle, make_checkpoint, oracle_logits, q8_0_agreement

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
    print("Q8_0, held-out text (2368 positions a checkpoint), checkpoints trained 120 steps, seeds 3-12: top-1 agreement")
    for act in ("relu", "fatrelu", "drelu", "opt"):
        counts = [q8_0_agreement(root / f"q8-{act}-{seed}", act, seed) for seed in range(3, 13)]
        a, b, c, n = (sum(x[i] for x in counts) for i in range(4))
        each = [x[0] / x[3] for x in counts]
        print(f"  {act:8} ours vs transformers {a / n:.2%} (one seed: {min(each):.2%}-{max(each):.2%}); transformers with the "
              f"Q8_0 weights vs itself {b / n:.2%}; ours vs transformers with the Q8_0 weights {c / n:.2%} ({n} positions)")

if __name__ == "__main__":
    main()
