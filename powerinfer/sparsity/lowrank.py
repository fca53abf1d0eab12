"""A predictor read off the gate matrix itself: its leading singular directions, no training.

Runs in: the calibrating process (``powerinfer calibrate --mode lowrank``, built by calibrate.py's
build_predictor).

In a ReLU-family FFN a neuron is zero exactly when its gate pre-activation g_j = G_j . x is not
positive. Where G [n_ff, d] is close to a matrix of low rank k (the gate rows share a few directions,
as trained ReLU models' do and `powerinfer synth`'s files are made to), G_k x = U_k S_k V_k^T x is
close to G x and its sign says which neurons fire, from k numbers instead of d. In the predictor's
shape fc2(relu(fc1 x)) with no biases that is exact for any k: fc1 = [V_k^T; -V_k^T] (2k rows) and
fc2 = [G V_k, -G V_k], since relu(z) - relu(-z) = z. Without biases the logits scale with the
input, so the same predictor means the same on the normed input (ours) and, with the norm's weight
folded into fc1, on the residual stream (PowerInfer's): `powerinfer convert --powerinfer` exports it
exactly, and both engines then choose the same neurons.

The width: given (``--rank``), 2k = that; else the least k of WIDTHS whose predicted sets keep the
calibration's recall of the layer's activation mass on its profiled rows (``choose_width``): the
gate's rank is the model's, not ours to guess (the 7B synth file's gate needs k > 64, the 1.1B one
k >= 32), and every extra direction is read each token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from powerinfer.config import ModelConfig
from powerinfer.errors import InvalidArgumentError
from powerinfer.gguf_file import GGUFFile
from powerinfer.model.reference import weight
from powerinfer.model.weights import layer_tensor

# What the gate's sign decides: ReGLU's and FATReLU's zeros (FATReLU: a superset, g > 0 for g > t),
# dReLU's gate half (relu(up) zeroes more: a superset again).
LOWRANK_ACTIVATIONS = ("relu", "fatrelu", "drelu")


def lowrank_applies(cfg: ModelConfig) -> bool:
    """Whether the gate's sign says which neurons are zero (a gated ReLU-family FFN)."""
    return cfg.activation in LOWRANK_ACTIVATIONS and cfg.gated_ffn


def check_lowrank(cfg: ModelConfig) -> None:
    if not lowrank_applies(cfg):
        raise InvalidArgumentError(f"--mode lowrank reads the gate's sign: it needs a gated ReLU-family FFN "
                                   f"({', '.join(LOWRANK_ACTIVATIONS)}), not {cfg.arch} with {cfg.activation}")


# the half-widths k choose_width tries, smallest first (each a multiple of 16: 2k pads to Q8_0's 32)
WIDTHS = (16, 32, 48, 64, 96, 128, 192, 256)


def gate_basis(f: GGUFFile, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """(G [n_ff, d], V [d, d]): the layer's gate and its right singular vectors, largest first."""
    g = weight(f, layer_tensor(layer, "ffn_gate"), np.float32)  # [n_ff, d]
    # from the d x d Gram matrix: eigh of G^T G (float64 for its small eigenvalues)
    vals, vecs = np.linalg.eigh((g.T @ g).astype(np.float64))
    return g, np.ascontiguousarray(vecs[:, np.argsort(vals)[::-1]], dtype=np.float32)


def lowrank_pair(g: np.ndarray, v: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(fc1 [2k, d], fc2 [n_ff, 2k]) float32: fc2(relu(fc1 x)) = G V_k V_k^T x."""
    vk = np.ascontiguousarray(v[:, :k])  # [d, k]
    p = g @ vk  # [n_ff, k] = U_k S_k
    return np.concatenate([vk.T, -vk.T]), np.concatenate([p, -p], axis=1)


def gate_lowrank(f: GGUFFile, cfg: ModelConfig, layer: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """(fc1 [2k, d], fc2 [n_ff, 2k]) float32 for k = width // 2."""
    k = width // 2
    if not 1 <= k < cfg.d_model:
        raise InvalidArgumentError(f"a low-rank predictor's width must be in [2, 2 * d_model), got {width}")
    g, v = gate_basis(f, layer)
    return lowrank_pair(g, v, k)


@dataclass(frozen=True)
class WidthChoice:
    """What choose_width settled on for one layer: k, and on the profiled rows the recall of the
    activation mass and the share of neurons its predicted sets hold."""

    k: int
    recall: float
    share: float


def choose_width(f: GGUFFile, cfg: ModelConfig, layer: int, x: np.ndarray, act: np.ndarray, norms: np.ndarray,
                 recall: float) -> tuple[np.ndarray, np.ndarray, WidthChoice]:
    """The least k of WIDTHS (below d_model) whose predictor, on the profiled FFN inputs x [T, d],
    chooses neurons holding at least recall of the activation mass |act| [T, n_ff] weighted by the
    down columns' norms [n_ff]; the widest tried where none does. Returns (fc1, fc2, the choice)."""
    g, v = gate_basis(f, layer)
    mass = np.abs(act.astype(np.float32)) * norms[None, :]  # [T, n_ff]
    total = max(float(mass.sum()), 1e-30)
    choice = WidthChoice(0, 0.0, 0.0)
    widths = [w for w in WIDTHS if w < cfg.d_model]
    xv, gv = x @ v[:, : widths[-1]], g @ v[:, : widths[-1]]  # [T, k_max], [n_ff, k_max]: each k is a prefix
    for k in widths:
        logits = xv[:, :k] @ gv[:, :k].T  # [T, n_ff]: the predictor's output, without the relu pair
        chosen = logits > 0
        choice = WidthChoice(k, float(mass[chosen].sum()) / total, float(chosen.mean()))
        if choice.recall >= recall:
            break
    fc1, fc2 = lowrank_pair(g, v, choice.k)
    return fc1, fc2, choice
