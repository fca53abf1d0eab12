"""Predictors for ``powerinfer convert --predictor``: PowerInfer's predictor folders and our files.

Runs in: the CLI process (``powerinfer convert``).

PowerInfer's folder (what its ``convert.py`` takes) holds ``model_0.pt``, ``model_1.pt``, ... one per
layer, each a state dict of exactly ``fc1.weight`` [r, d] and ``fc2.weight`` [n_ff, r] (no biases),
and optionally ``config.json`` with ``sparse_threshold`` (the cut-off on the predictor's output).
Its predictors read the residual stream before ffn_norm; ours read the normed input.

* Into our files: :func:`powerinfer_formats.powerinfer_predictor` folds fc1 onto the normed input
  (exact for threshold 0, since the bias-free predictor is positively homogeneous).
* Into PowerInfer's layout: PowerInfer's own fc1/fc2 as they are, or ours unfolded
  (fc1 * ffn_norm.weight), exact only for bias-free predictors (fc2(relu(fc1 x)) scales with
  the norm's 1/rms, so a bias would move with it): ours with biases are refused.
"""

from __future__ import annotations

import json
import math
import pickle
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from powerinfer.errors import ModelFileError, UnsupportedModelError, quoted
from powerinfer.predictors.predictor_file import PredictorFile, read_predictor

_LAYER_FILE = re.compile(r"model_(\d+)\.pt")


@dataclass(frozen=True)
class ResidualPredictors:
    """PowerInfer's form: per layer fc1 [r, d], fc2 [n_ff, r] on the residual stream, and the cut-off."""

    fc1: tuple[np.ndarray, ...]
    fc2: tuple[np.ndarray, ...]
    threshold: float


def read_powerinfer_dir(folder: Path, n_layers: int, d: int, n_ff: int) -> ResidualPredictors:
    import torch  # PowerInfer's predictors are torch pickles; read with the weights-only unpickler

    numbers = sorted(int(m.group(1)) for p in folder.glob("model_*.pt") if (m := _LAYER_FILE.fullmatch(p.name)))
    missing = next((i for i in range(n_layers) if i not in set(numbers)), None)
    if missing is not None:
        raise ModelFileError(f"{folder}: no model_{missing}.pt (PowerInfer's predictor folder holds one per layer, "
                             f"{n_layers} for this model)")
    if numbers and numbers[-1] >= n_layers:
        raise ModelFileError(f"{folder}: model_{numbers[-1]}.pt is beyond the model's {n_layers} layers")
    fc1s, fc2s = [], []
    for i in range(n_layers):
        path = folder / f"model_{i}.pt"
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            raise ModelFileError(f"{path}: refused: the pickle holds more than tensors: {str(e).splitlines()[0]}") from None
        except (RuntimeError, OSError, EOFError, ValueError) as e:
            raise ModelFileError(f"{path}: cannot read: {str(e).splitlines()[0] if str(e) else e}") from None
        if not isinstance(state, dict) or set(state) != {"fc1.weight", "fc2.weight"}:
            keys = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ModelFileError(f"{path}: expected exactly fc1.weight and fc2.weight, found {quoted(keys)}")
        fc1, fc2 = (state[k].detach().to(torch.float32).numpy() for k in ("fc1.weight", "fc2.weight"))
        if fc1.ndim != 2 or fc2.ndim != 2 or fc1.shape[1] != d or fc2.shape != (n_ff, fc1.shape[0]):
            raise ModelFileError(f"{path}: fc1 {list(fc1.shape)} and fc2 {list(fc2.shape)} do not fit a model of width {d} "
                                 f"and {n_ff} FFN neurons (expected [r, {d}] and [{n_ff}, r])")
        if not (np.isfinite(fc1).all() and np.isfinite(fc2).all()):
            raise ModelFileError(f"{path}: NaN or infinite weights")
        fc1s.append(fc1)
        fc2s.append(fc2)
    threshold = 0.0
    cfg = folder / "config.json"
    if cfg.exists():
        try:
            value = json.loads(cfg.read_text(encoding="utf-8")).get("sparse_threshold", 0.0)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
            raise ModelFileError(f"{cfg}: cannot read: {e}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ModelFileError(f"{cfg}: sparse_threshold must be a finite number, got {quoted(value)}")
        threshold = float(value)
    return ResidualPredictors(tuple(fc1s), tuple(fc2s), threshold)


def ours_as_residual(pf: PredictorFile, norms: list[np.ndarray] | None, where: str) -> ResidualPredictors:
    """Our predictor in PowerInfer's form (on the residual stream): one on the normed input gets
    fc1 * ffn_norm.weight (norms: each layer's; None for a LayerNorm, which no predictor crosses);
    one that reads the residual already is as it is. Only bias-free ones are exact."""
    if pf.mode != "predictor":
        raise ModelFileError(f"{where}: a '{pf.mode}' mode predictor has no fc1/fc2 for PowerInfer's layout "
                             f"(calibrate with --mode predictor)")
    if not pf.reads_residual and norms is None:
        raise UnsupportedModelError(f"{where}: this predictor reads the normed FFN input, and it cannot be moved across the "
                                    "model's LayerNorm onto the residual stream PowerInfer's predictors read")
    for i, lp in enumerate(pf.layers):
        if np.any(lp.fc1_b) or np.any(lp.fc2_b):
            raise ModelFileError(f"{where}: layer {i}'s predictor has biases, which PowerInfer's layout cannot hold "
                                 f"(its predictors are fc2(relu(fc1 x)) on the residual stream)")
    fc1 = [lp.fc1_w if pf.reads_residual or norms is None else lp.fc1_w * norms[i][None, :] for i, lp in enumerate(pf.layers)]
    return ResidualPredictors(tuple(np.ascontiguousarray(w, dtype=np.float32) for w in fc1),
                              tuple(np.ascontiguousarray(lp.fc2_w, dtype=np.float32) for lp in pf.layers), 0.0)


def read_ours(path: Path) -> PredictorFile:
    return read_predictor(path)
