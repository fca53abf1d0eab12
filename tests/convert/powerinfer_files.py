"""Oracle 2's file half: PWRI files written by PowerInfer's own converter (and quantized by its own
``quantize``) from seeded tiny checkpoints, run by our engine against transformers.

Runs in: a shell, from the repository root, with a PowerInfer checkout built as in
../shared/notes/powerinfer-oracle.md and a Python whose packages its converter needs (numpy<2, torch,
transformers, sentencepiece, safetensors), e.g. a venv:

    python -m tests.convert.powerinfer_files /path/to/PowerInfer /path/to/venv/bin/python

For each family (ReluLLaMA: ReGLU; Bamboo: dReLU) and type (its F16, then its Q4_0) it prints our
logits' distance from transformers' on 64 held-out tokens, dense (``--no-sparse``) and sparse
(PowerInfer's rule as a transformers hook), as a share of the dense logits' range.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from powerinfer.api import LLM
from tests.convert.hf_models import SPLIT, TEXT, hook_powerinfer_rule, load_oracle, make_checkpoint, oracle_logits, tokens, write_predictor_dir


def main(argv: list[str]) -> int:
    if len(argv) != 2 or not (Path(argv[0]) / "convert.py").exists():
        print("usage: python -m tests.convert.powerinfer_files POWERINFER_SOURCE_DIR ITS_CONVERTER_PYTHON "
              "(with its build/bin/quantize built)", file=sys.stderr)
        return 2
    pi, python = Path(argv[0]).resolve(), argv[1]
    root = Path(tempfile.mkdtemp(prefix="pi-files-"))
    os.environ["POWERINFER_CACHE"] = str(root / "cache")
    print(f"PowerInfer at {pi}, its converter run by {python}")
    for act in ("relu", "drelu"):
        src = make_checkpoint(root / f"hf-{act}", act, seed=3, train_steps=120, spm=True)
        preds = write_predictor_dir(root / f"pred-{act}", src, rank=32, seed=4, threshold=0.0)  # a rank of whole Q4_0 blocks
        f16 = root / f"{act}-f16.powerinfer.gguf"
        # its convert.py re-runs a helper with the "python3" on PATH: the venv's bin goes first
        env = {**os.environ, "PATH": f"{Path(python).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
        subprocess.run([python, "convert.py", "--outtype", "f16", "--outfile", str(f16), str(src), str(preds)], cwd=pi, check=True,
                       capture_output=True, env=env)
        q4 = root / f"{act}-q4_0.powerinfer.gguf"
        subprocess.run([str(pi / "build/bin/quantize"), str(f16), str(q4), "q4_0"], check=True, capture_output=True)
        ids = [1] + tokens(src, TEXT[SPLIT : SPLIT + 400])[:63]
        dense_ref = oracle_logits(load_oracle(src), ids)
        sparse_ref = oracle_logits(hook_powerinfer_rule(load_oracle(src), preds), ids)
        span = dense_ref.max() - dense_ref.min()
        for path in (f16, q4):
            for sparse, ref in ((False, dense_ref), (True, sparse_ref)):
                llm = LLM(path, n_ctx=128, executor="inprocess", sparse=sparse)
                got = llm.logits(ids)
                llm.close()
                err = np.abs(got - ref).max(-1) / span
                print(f"  {path.name:28} {'sparse' if sparse else 'dense ':6} first step {err[0]:.1e}, worst {err.max():.1e}, "
                      f"median {np.median(err):.1e}, top-1 {(got.argmax(-1) == ref.argmax(-1)).mean():.1%}")
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
