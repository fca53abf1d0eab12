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
"""

from __future__ import annotations

import numpy as np

from powerinfer.config import ModelConfig
from powerinfer.errors import InvalidArgumentError
from powerinfer.gguf_file import GGUFFile
from powerinfer.model.reference import weight
from powerinfer.model.weights import layer_tensor

# What the gate's sign decides: ReGLU's and FATReLU's zeros (FATReLU: a superset, g > 0 for g > t),
# dReLU's gate half (relu(up) zeroes more: a superset again).
LOWRANK_ACTIVATIONS = ("relu", "fatrelu", "drelu")


def check_lowrank(cfg: ModelConfig) -> None:
    if cfg.activation not in LOWRANK_ACTIVATIONS or not cfg.gated_ffn:
        raise InvalidArgumentError(f"--mode lowrank reads the gate's sign: it needs a gated ReLU-family FFN "
                                   f"({', '.join(LOWRANK_ACTIVATIONS)}), not {cfg.arch} with {cfg.activation}")


def gate_lowrank(f: GGUFFile, cfg: ModelConfig, layer: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """(fc1 [2k, d], fc2 [n_ff, 2k]) float32 for k = width // 2: fc2(relu(fc1 x)) = G V_k V_k^T x."""
    k = width // 2
    if not 1 <= k < cfg.d_model:
        raise InvalidArgumentError(f"a low-rank predictor's width must be in [2, 2 * d_model), got {width}")
    g = weight(f, layer_tensor(layer, "ffn_gate"), np.float32)  # [n_ff, d]
    # the right singular vectors from the d x d Gram matrix: eigh of G^T G (float64 for its small eigenvalues)
    vals, vecs = np.linalg.eigh((g.T @ g).astype(np.float64))
    v = np.ascontiguousarray(vecs[:, np.argsort(vals)[::-1][:k]], dtype=np.float32)  # [d, k]
    p = g @ v  # [n_ff, k] = U_k S_k
    return np.concatenate([v.T, -v.T]), np.concatenate([p, -p], axis=1)
