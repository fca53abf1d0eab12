"""Oracle 2's file half: PWRI files written by PowerInfer's own converter (and quantized by its own
``quantize``) from seeded tiny checkpoints, run by our engine against transformers.

Runs in: a shell, from the repository root, with a PowerInfer checkout built as in
../shared/notes/powerinfer-oracle.md and a Python whose packages its converter needs (numpy<2, torch,
transformers, sentencepiece, safetensors), e.g. a venv:

    python -m tests.convert.powerinfer_files /path/to/PowerInfer /path/to/venv/bin/python

For each family (ReluLLaMA: ReGLU; Bamboo: dReLU) and type (its F16, then its Q4_0) it prints our
logits' distance from transformers' on 64 held-out tokens, dense (``--no-sparse``) and sparse
(PowerInfer's rule as a transformers hook), as a share of the dense logits' range. Then OPT, F16,
dense and sparse (its predictors read the residual stream before the LayerNorm, as in PowerInfer)
on each executor; the Q4_0 one too when ``build/bin/quantize`` is there; and PowerInfer's own
``build/bin/main`` on its OPT files when it is built (does it load them; its greedy tokens against transformers).
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
    _opt(pi, python, root)
    shutil.rmtree(root, ignore_errors=True)
    return 0


def _as_original_opt(src: Path) -> None:
    """PowerInfer's converter reads the original OPT release's layout: decoder.* keys, no lm_head,
    vocab.json + merges.txt, and a tokenizer class its AutoTokenizer loads from tokenizer.json."""
    import json

    from safetensors.torch import load_file, save_file

    st = load_file(str(src / "model.safetensors"))
    save_file({k.removeprefix("model."): v.contiguous() for k, v in st.items() if k != "lm_head.weight"},
              str(src / "model.safetensors"), metadata={"format": "pt"})
    tok = json.loads((src / "tokenizer.json").read_text())
    (src / "vocab.json").write_text(json.dumps(tok["model"]["vocab"]))
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    (src / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    config = json.loads((src / "tokenizer_config.json").read_text())
    (src / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "PreTrainedTokenizerFast"}))


def _opt(pi: Path, python: str, root: Path) -> None:
    src = make_checkpoint(root / "hf-opt", "opt", seed=3, train_steps=120)
    ids = tokens(src, TEXT[SPLIT : SPLIT + 400])[:64]
    ref_model = load_oracle(src)
    ref = oracle_logits(ref_model, ids)
    span = ref.max() - ref.min()
    preds = write_predictor_dir(root / "pred-opt", src, rank=32, seed=4, threshold=0.0)
    sparse_model = hook_powerinfer_rule(load_oracle(src), preds)  # loaded before the rewrite below
    sparse_ref = oracle_logits(sparse_model, ids)
    _as_original_opt(src)
    f16 = root / "opt-f16.powerinfer.gguf"
    env = {**os.environ, "PATH": f"{Path(python).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    subprocess.run([python, "convert.py", "--outtype", "f16", "--outfile", str(f16), str(src), str(preds)], cwd=pi, check=True,
                   capture_output=True, env=env)
    paths = [f16]
    if (pi / "build/bin/quantize").exists():
        paths.append(root / "opt-q4_0.powerinfer.gguf")
        subprocess.run([str(pi / "build/bin/quantize"), str(f16), str(paths[-1]), "q4_0"], check=True, capture_output=True)
    if (pi / "build/bin/main").exists():
        for path in paths:
            _powerinfer_runs(pi, path, src, ref_model, sparse_model)
    for path in paths:
        for name, kw in (("native", dict(executor="inprocess")), ("pool", dict(executor="process", n_threads=2)),
                         ("torch", dict(executor="inprocess", native=False))):
            for sparse, want in ((False, ref), (True, sparse_ref)):
                llm = LLM(path, n_ctx=128, sparse=sparse, **kw)  # type: ignore[arg-type]
                got = llm.logits(ids)
                llm.close()
                err = np.abs(got - want).max(-1) / span
                print(f"  {path.name:28} {'sparse' if sparse else 'dense ':6} {name:6} first step {err[0]:.1e}, worst {err.max():.1e}, "
                      f"median {np.median(err):.1e}, top-1 {(got.argmax(-1) == want.argmax(-1)).mean():.1%}")


def _powerinfer_runs(pi: Path, path: Path, src: Path, ref_model: object, sparse_model: object) -> None:
    """PowerInfer's own main on its own OPT file, greedy, dense (LLAMA_SPARSE_PRED_THRESHOLD=-1e30) and
    sparse (its predictors, threshold 0): whether it loads, and its continuation's teacher-forced top-1
    agreement with transformers, plain (dense) or with PowerInfer's rule hooked in (sparse)."""
    prompt = TEXT[SPLIT : SPLIT + 120]
    for mode, extra, model in (("dense", {"LLAMA_SPARSE_PRED_THRESHOLD": "-1e30"}, ref_model), ("sparse", {}, sparse_model)):
        r = subprocess.run([str(pi / "build/bin/main"), "-m", str(path), "-p", prompt, "-n", "24", "--temp", "0", "--repeat-penalty",
                            "1.0", "-t", os.environ.get("PI_THREADS", "2"), "-c", "256"], capture_output=True, text=True, env={**os.environ, **extra}, timeout=300)
        if r.returncode != 0 or prompt not in r.stdout:
            last = [line for line in r.stderr.splitlines() if "error" in line.lower()] or r.stderr.splitlines()[-3:]
            print(f"  {path.name:28} PowerInfer's main ({mode}): exit {r.returncode}: {' | '.join(last)[:300]}")
            continue
        continuation = r.stdout.split(prompt, 1)[1]
        full = tokens(src, prompt + continuation)
        n = len(tokens(src, prompt))
        logits = oracle_logits(model, full)  # type: ignore[arg-type]
        agree = np.mean([logits[i - 1].argmax() == full[i] for i in range(n, len(full))]) if len(full) > n else float("nan")
        print(f"  {path.name:28} PowerInfer's main, {mode} greedy: {len(full) - n} tokens; transformers' top-1 "
              f"({'plain' if mode == 'dense' else 'its rule hooked in'}) agrees on {agree:.1%} (teacher-forced)")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
