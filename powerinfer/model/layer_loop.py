"""The residual stream through a run of layers: norms, the two sub-layers and their residual adds.

Runs in: the coordinator (the engine's loop over every layer). The GPU worker runs the same recipe
over a run of layers that lives wholly on the GPU with the stream on the device
(gpu_worker/model.py ``layers``); its numpy backend's norm is :func:`rms_norm` itself, so there the
run is the engine's float operations bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import numpy as np

from powerinfer.config import ModelConfig
from powerinfer.gguf_file import GGUFFile
from powerinfer.model.weights import layer_bias, layer_tensor, load_vector

# attention(layer, x_normed [T, d], positions [T], slots [T]) -> [T, d]
AttentionFn = Callable[[int, np.ndarray, np.ndarray, np.ndarray], np.ndarray]


class FfnFn(Protocol):
    def __call__(self, layer: int, x: np.ndarray, resid: np.ndarray | None = None) -> np.ndarray:
        """x [T, d] normed (resid [T, d]: the residual stream it was normed from, which a predictor
        reading the residual needs) -> the FFN's output [T, d]."""
        ...


@dataclass(frozen=True)
class LayerNorms:
    """One layer's norm weights, float32 [d] (post norms: Gemma-3's, else None), and what OPT adds:
    LayerNorm biases (attn_b, ffn_b: a LayerNorm when set) and the biases of the two sub-layers'
    output projections, added once to the sum of the shards' partials (out_b: attention, down_b: FFN)."""

    attn: np.ndarray
    ffn: np.ndarray
    post_attn: np.ndarray | None
    post_ffn: np.ndarray | None
    attn_b: np.ndarray | None = None
    ffn_b: np.ndarray | None = None
    out_b: np.ndarray | None = None
    down_b: np.ndarray | None = None


def load_layer_norms(f: GGUFFile, cfg: ModelConfig) -> list[LayerNorms]:
    d = cfg.d_model

    def vec(i: int, part: str, bias: bool = False) -> np.ndarray:
        return load_vector(f, layer_bias(i, part) if bias else layer_tensor(i, part), d)

    ln, pb = cfg.norm == "layer", cfg.proj_bias
    return [
        LayerNorms(
            attn=vec(i, "attn_norm"),
            ffn=vec(i, "ffn_norm"),
            post_attn=vec(i, "post_attention_norm") if cfg.post_norms else None,
            post_ffn=vec(i, "post_ffw_norm") if cfg.post_norms else None,
            attn_b=vec(i, "attn_norm", True) if ln else None,
            ffn_b=vec(i, "ffn_norm", True) if ln else None,
            out_b=vec(i, "attn_output", True) if pb else None,
            down_b=vec(i, "ffn_down", True) if pb else None,
        )
        for i in range(cfg.n_layers)
    ]


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x [T, n] normalised over n, times weight [n] (Gemma's +1 is baked into the file)."""
    ms = np.einsum("ij,ij->i", x, x)[:, None] / np.float32(x.shape[1])
    return x * (1.0 / np.sqrt(ms + np.float32(eps))).astype(np.float32) * weight


def norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None, eps: float) -> np.ndarray:
    """RMSNorm of x [T, n], or LayerNorm when the norm has a bias [n] (OPT): (x - mean) / std * weight + bias."""
    if bias is None:
        return rms_norm(x, weight, eps)
    c = x - x.mean(1, keepdims=True, dtype=np.float32)
    var = np.einsum("ij,ij->i", c, c)[:, None] / np.float32(x.shape[1])
    return c * (1.0 / np.sqrt(var + np.float32(eps))).astype(np.float32) * weight + bias


def run_layers(cfg: ModelConfig, norms: Sequence[LayerNorms], first: int, stop: int, x: np.ndarray, positions: np.ndarray,
               slots: np.ndarray, attention: AttentionFn, ffn: FfnFn) -> np.ndarray:
    """x [T, d] float32, the residual stream entering layer `first` -> the stream leaving layer stop - 1."""
    eps = cfg.norm_eps
    for layer in range(first, stop):
        n = norms[layer]
        h = attention(layer, norm(x, n.attn, n.attn_b, eps), positions, slots)
        if n.out_b is not None:
            h = h + n.out_b
        if n.post_attn is not None:
            h = rms_norm(h, n.post_attn, eps)
        x = x + h
        h = ffn(layer, norm(x, n.ffn, n.ffn_b, eps), x)
        if n.down_b is not None:
            h = h + n.down_b
        if n.post_ffn is not None:
            h = rms_norm(h, n.post_ffn, eps)
        x = x + h
    return x
