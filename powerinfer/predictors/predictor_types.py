"""What a predictor holds, per layer and for the file, and the checks every one of them passes
(ours and PowerInfer's, written or read).

Runs in: every process that reads or writes predictors (the coordinator, CPU and GPU workers).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from powerinfer.errors import InvalidArgumentError

MODES = ("predictor", "gate")
# What a predictor's fc1 reads: the FFN's normed input (ours, and PowerInfer's folded onto it) or
# the residual stream before the FFN norm (PowerInfer's predictors where the norm cannot be
# folded: OPT's LayerNorm subtracts each token's mean). Only the native decoder feeds the residual.
INPUTS = ("normed", "residual")
CalibrationValue = str | int | float


@dataclass(frozen=True)
class LayerPredictor:
    """One layer's predictor, activation threshold and neuron statistics.

    Arrays read from a file are read-only, zero-copy views of its mapping (processes reading the
    same file share its pages); copy one (``np.array(a)``) before modifying it or handing it to
    ``torch.from_numpy``, which warns about read-only memory.
    """

    fc1_w: np.ndarray  # float32 [r, d]
    fc1_b: np.ndarray  # float32 [r]
    fc2_w: np.ndarray  # float32 [n_ff, r]
    fc2_b: np.ndarray  # float32 [n_ff]
    threshold: float  # |activation| above which a neuron counts as active (calibrated per layer)
    act_freq: np.ndarray  # float32 [n_ff]: fraction of calibration tokens where the neuron was active
    act_mass: np.ndarray  # float32 [n_ff]: share of the layer's total |activation * ||down row||| mass

    @property
    def rank(self) -> int:
        return int(self.fc1_w.shape[0])

    def predict(self, x: np.ndarray) -> np.ndarray:
        """x [T, d] -> bool [T, n_ff]: neurons predicted active (numpy reference implementation)."""
        if self.rank == 0:
            raise ValueError("this layer has no predictor (rank 0, a 'gate' mode file)")
        if x.ndim != 2 or x.shape[1] != self.fc1_w.shape[1]:
            raise ValueError(f"predict expects x [T, {self.fc1_w.shape[1]}], got {list(x.shape)}")
        h = np.maximum(x.astype(np.float32, copy=False) @ self.fc1_w.T + self.fc1_b, 0.0)  # [T, r]
        return (h @ self.fc2_w.T + self.fc2_b) > 0.0  # logits [T, n_ff] -> bool


@dataclass(frozen=True)
class PredictorFile:
    """Everything a ``.predictor`` file holds; see the module docstring for the layout."""

    mode: str  # "predictor" | "gate"
    model_name: str
    fingerprint: str  # model_fingerprint() of the GGUF it was calibrated on; "" = unknown
    n_layers: int
    d_model: int
    n_ff: int
    rank: int  # largest predictor hidden width over the layers (0: no predictors, gate mode)
    target_sparsity: float  # fraction of neurons meant to be skipped, 0..1
    calibration: Mapping[str, CalibrationValue] = field(default_factory=dict)
    layers: tuple[LayerPredictor, ...] = ()
    input: str = "normed"  # one of INPUTS: what fc1 reads (predictor mode)

    @property
    def reads_residual(self) -> bool:
        """True where the predictor must be fed the residual stream before the FFN norm."""
        return self.mode == "predictor" and self.input == "residual"


def refuse_residual_input(pf: PredictorFile | None, where: str) -> None:
    """InvalidArgumentError when pf's predictors read the residual stream and ``where`` (an
    executor that hands its FFNs only the normed input) cannot feed them."""
    if pf is not None and pf.reads_residual:
        raise InvalidArgumentError(
            f"this predictor reads the residual stream before the FFN norm (PowerInfer's predictors for a LayerNorm model such "
            f"as OPT), which {where} does not pass to its FFNs; run it on the native executors (the default), or with --no-sparse")


# -- validation (shared by the writer, ValueError, and the reader, ModelFileError) -------------


def _check_array(a: object, name: str, shape: tuple[int, ...]) -> None:
    if not isinstance(a, np.ndarray):
        raise ValueError(f"{name} is a {type(a).__name__}, expected a numpy array")
    if a.dtype != np.float32:
        raise ValueError(f"{name} has dtype {a.dtype}, expected float32")
    if a.shape != shape:
        raise ValueError(f"{name} has shape {list(a.shape)}, expected {list(shape)}")
    if not np.isfinite(a).all():
        raise ValueError(f"{name} has non-finite values")


def validate_predictor(pf: PredictorFile) -> None:
    """Raise ValueError naming the first inconsistency (shapes, dtypes, ranges, non-finite values)."""
    if pf.mode not in MODES:
        raise ValueError(f"mode {pf.mode!r} is not one of {', '.join(MODES)}")
    if pf.input not in INPUTS:
        raise ValueError(f"input {pf.input!r} is not one of {', '.join(INPUTS)}")
    for what, value in (("n_layers", pf.n_layers), ("d_model", pf.d_model), ("n_ff", pf.n_ff)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{what} must be a positive integer, got {value!r}")
    if not isinstance(pf.rank, int) or pf.rank < 0:
        raise ValueError(f"rank must be a non-negative integer, got {pf.rank!r}")
    if not (isinstance(pf.target_sparsity, (int, float)) and 0.0 <= pf.target_sparsity <= 1.0):
        raise ValueError(f"target_sparsity must be in [0, 1], got {pf.target_sparsity!r}")
    for key, value in pf.calibration.items():
        if not key or not isinstance(key, str):
            raise ValueError(f"calibration key {key!r} must be a non-empty string")
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise ValueError(f"calibration[{key!r}] is a {type(value).__name__}; only str, int and float are stored")
    if len(pf.layers) != pf.n_layers:
        raise ValueError(f"{len(pf.layers)} layers given, n_layers is {pf.n_layers}")
    d, n_ff = pf.d_model, pf.n_ff
    max_rank = 0
    for i, lp in enumerate(pf.layers):
        r = lp.fc1_w.shape[0] if isinstance(lp.fc1_w, np.ndarray) and lp.fc1_w.ndim == 2 else -1
        if r < 0:
            raise ValueError(f"layer {i}: fc1_w must be a 2-D array [r, {d}]")
        if r == 0 and pf.mode == "predictor":
            raise ValueError(f"layer {i}: mode 'predictor' needs a predictor, but its rank is 0")
        max_rank = max(max_rank, r)
        for name, a, shape in (("fc1_w", lp.fc1_w, (r, d)), ("fc1_b", lp.fc1_b, (r,)), ("fc2_w", lp.fc2_w, (n_ff, r)),
                               ("fc2_b", lp.fc2_b, (n_ff,)), ("act_freq", lp.act_freq, (n_ff,)),
                               ("act_mass", lp.act_mass, (n_ff,))):
            _check_array(a, f"layer {i}: {name}", shape)
        if r == 0 and lp.fc2_b.any():
            raise ValueError(f"layer {i}: a rank-0 layer stores no predictor, so its fc2_b must be zeros")
        if not isinstance(lp.threshold, (int, float, np.floating)) or not math.isfinite(lp.threshold) or lp.threshold < 0:
            raise ValueError(f"layer {i}: threshold {lp.threshold!r} must be finite and >= 0")
        if (lp.act_freq < 0).any() or (lp.act_freq > 1).any():
            raise ValueError(f"layer {i}: act_freq has values outside [0, 1]")
        if (lp.act_mass < 0).any():
            raise ValueError(f"layer {i}: act_mass has negative values")
    if max_rank != pf.rank:
        raise ValueError(f"rank is {pf.rank}, but the largest layer predictor has rank {max_rank}")
