"""The residual stream through a run of layers: norms, the two sub-layers and their residual adds.

Runs in: the coordinator (the engine's loop over every layer). The GPU worker runs the same recipe
over a run of layers that lives wholly on the GPU with the stream on the device
(gpu_worker/model.py ``layers``); its numpy backend's norm is :func:`rms_norm` itself, so there the
run is the engine's float operations bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from powerinfer.config import ModelConfig
from powerinfer.gguf_file import GGUFFile
from powerinfer.model.weights import layer_tensor, load_vector

# attention(layer, x_normed [T, d], positions [T], slots [T]) -> [T, d]; ffn(layer, x_normed [T, d]) -> [T, d]
AttentionFn = Callable[[int, np.ndarray, np.ndarray, np.ndarray], np.ndarray]
FfnFn = Callable[[int, np.ndarray], np.ndarray]


@dataclass(frozen=True)
class LayerNorms:
    """One layer's RMSNorm weights, float32 [d] (post norms: Gemma-3's, else None)."""

    attn: np.ndarray
    ffn: np.ndarray
    post_attn: np.ndarray | None
    post_ffn: np.ndarray | None


def load_layer_norms(f: GGUFFile, cfg: ModelConfig) -> list[LayerNorms]:
    d = cfg.d_model
    return [
        LayerNorms(
            attn=load_vector(f, layer_tensor(i, "attn_norm"), d),
            ffn=load_vector(f, layer_tensor(i, "ffn_norm"), d),
            post_attn=load_vector(f, layer_tensor(i, "post_attention_norm"), d) if cfg.post_norms else None,
            post_ffn=load_vector(f, layer_tensor(i, "post_ffw_norm"), d) if cfg.post_norms else None,
        )
        for i in range(cfg.n_layers)
    ]


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x [T, n] normalised over n, times weight [n] (Gemma's +1 is baked into the file)."""
    ms = np.einsum("ij,ij->i", x, x)[:, None] / np.float32(x.shape[1])
    return x * (1.0 / np.sqrt(ms + np.float32(eps))).astype(np.float32) * weight


def run_layers(cfg: ModelConfig, norms: Sequence[LayerNorms], first: int, stop: int, x: np.ndarray, positions: np.ndarray,
               slots: np.ndarray, attention: AttentionFn, ffn: FfnFn) -> np.ndarray:
    """x [T, d] float32, the residual stream entering layer `first` -> the stream leaving layer stop - 1."""
    eps = cfg.norm_eps
    for layer in range(first, stop):
        n = norms[layer]
        h = attention(layer, rms_norm(x, n.attn, eps), positions, slots)
        if n.post_attn is not None:
            h = rms_norm(h, n.post_attn, eps)
        x = x + h
        h = ffn(layer, rms_norm(x, n.ffn, eps))
        if n.post_ffn is not None:
            h = rms_norm(h, n.post_ffn, eps)
        x = x + h
    return x
