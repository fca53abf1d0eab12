"""The readable model: a decoder's forward pass for llama, qwen2, gemma3 and OPT in plain numpy, from
the architectures' definitions, the oracle every fast path is tested against.

Runs in: whichever process asks (pytest, the sparsity measurements, the GPU benchmark); numpy only,
no engine code: weights come from ``gguf.quants.dequantize`` and the GGUF reader, shapes from the
config. The native decoder, the worker shards and the GPU worker are held to it by their tests;
``sparsity/relu_measure.py`` measures activations through :func:`layers`.

    x = embed(ids) * embed_scale (+ pos_embd[pos + 2], OPT)         [B, T, d]
    per layer:
        h = norm(x) * attn_norm (+ attn_norm_b)                     norm: RMSNorm, or LayerNorm (OPT)
        q, k, v = h Wq^T (+bq), h Wk^T (+bk), h Wv^T (+bv)           [B, T, H(kv), D]
        q, k = rmsnorm(q) * q_norm, rmsnorm(k) * k_norm             (gemma3)
        q, k = rope(q), rope(k)                                     (adjacent pairs, or NEOX halves; not OPT)
        a = softmax(scale q k^T + causal (+ sliding window)) v Wo^T (+ bo)
        x = x + post_attention_norm(a)                              (gemma3's post-norms)
        h = norm(x) * ffn_norm (+ ffn_norm_b)
        x = x + post_ffw_norm((act(h Wg^T) * h Wu^T) Wd^T)   act: silu, gelu (tanh), (FAT)ReLU;
                                                                    dReLU: relu(h Wg^T) * relu(h Wu^T)
            OPT: x = x + relu(h Wu^T + bu) Wd^T + bd                (no gate: "gate" below is h Wu^T + bu)
    logits = norm(x) * output_norm (+ output_norm_b)  Whead^T
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from powerinfer.config import ModelConfig
from powerinfer.gguf_file import GGUFFile


def weight(f: GGUFFile, name: str, dtype: type = np.float64) -> np.ndarray:
    """A tensor of the file, dequantized, in its GGUF shape."""
    info = f.tensor(name)
    raw = np.asarray(f.raw(name))
    if info.qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return raw.astype(dtype).reshape(info.shape)  # raw views are 2-D: a vector is [1, n]
    return dequantize(raw, info.qtype).reshape(info.shape).astype(dtype)


def rms_norm(x: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
    y = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    return y if w is None else y * w


def layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mu = x.mean(-1, keepdims=True)
    c = x - mu
    return c / np.sqrt((c * c).mean(-1, keepdims=True) + eps) * w + b


def norm(cfg: ModelConfig, x: np.ndarray, f: GGUFFile, name: str, dtype: type = np.float64) -> np.ndarray:
    """The model's norm of x with tensor ``name`` (``blk.N.attn_norm``, ``output_norm``; no suffix)."""
    if cfg.norm == "layer":
        return layer_norm(x, weight(f, name + ".weight", dtype), weight(f, name + ".bias", dtype), cfg.norm_eps)
    return rms_norm(x, weight(f, name + ".weight", dtype), cfg.norm_eps)


def rope(x: np.ndarray, pos: np.ndarray, base: float, style: str) -> np.ndarray:
    """x [..., T, H, D] rotated by position pos [T]: adjacent pairs ("norm", llama) or halves (NEOX)."""
    D = x.shape[-1]
    ang = pos[:, None, None] * base ** (-np.arange(0, D, 2) / D)  # [T, 1, D/2]
    c, s = np.cos(ang).astype(x.dtype), np.sin(ang).astype(x.dtype)
    if style == "norm":
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = a * c - b * s, a * s + b * c
        return out
    a, b = x[..., : D // 2], x[..., D // 2 :]
    return np.concatenate([a * c - b * s, a * s + b * c], -1)


def activation(g: np.ndarray, kind: str, threshold: float = 0.0) -> np.ndarray:
    """act(g) for config.py's activation kinds (threshold: FATReLU's)."""
    if kind == "silu":
        return g / (1 + np.exp(-np.clip(g, -80.0, 80.0)))
    if kind == "gelu_tanh":
        return 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g**3)))
    if kind in ("relu", "fatrelu", "drelu"):
        return np.where(g > (threshold if kind == "fatrelu" else 0.0), g, 0.0).astype(g.dtype)
    raise ValueError(f"unknown activation {kind!r}")


def up_value(u: np.ndarray, kind: str) -> np.ndarray:
    """The up projection as the activation multiplies it: dReLU rectifies it too."""
    return np.maximum(u, 0.0) if kind == "drelu" else u


def glu(g: np.ndarray, u: np.ndarray, kind: str, threshold: float = 0.0) -> np.ndarray:
    """The gated FFN's hidden state: act(g) * u, or relu(g) * relu(u) for dReLU."""
    return activation(g, kind, threshold) * up_value(u, kind)


def attention(cfg: ModelConfig, i: int, h: np.ndarray, w: "_Layer") -> np.ndarray:
    """Layer i's attention of normed h [B, T, d] -> its output before the residual [B, T, d]."""
    a = attention_heads(cfg, i, h, w) @ w("attn_output").T
    if cfg.proj_bias:
        a = a + w("attn_output", "bias")
    return rms_norm(a, w("post_attention_norm"), cfg.norm_eps) if cfg.post_norms else a


def attention_heads(cfg: ModelConfig, i: int, h: np.ndarray, w: "_Layer") -> np.ndarray:
    """Layer i's heads' outputs of normed h [B, T, d], concatenated: the input of attn_output [B, T, H * D]."""
    B, T, _ = h.shape
    D, pos = cfg.head_dim, np.arange(T)
    q, k, v = h @ w("attn_q").T, h @ w("attn_k").T, h @ w("attn_v").T
    if cfg.qkv_bias:
        q, k, v = q + w("attn_q", "bias"), k + w("attn_k", "bias"), v + w("attn_v", "bias")
    q, k, v = q.reshape(B, T, -1, D), k.reshape(B, T, -1, D), v.reshape(B, T, -1, D)
    if cfg.qk_norm:
        q, k = rms_norm(q, w("attn_q_norm"), cfg.norm_eps), rms_norm(k, w("attn_k_norm"), cfg.norm_eps)
    base = cfg.rope_base if cfg.global_layers[i] else cfg.rope_base_local
    if cfg.rope_dim:
        q, k = rope(q, pos, base, cfg.rope_style), rope(k, pos, base, cfg.rope_style)
    g = cfg.n_heads // cfg.n_kv_heads
    k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    scores = np.einsum("bthd,bshd->bhts", q, k) * cfg.attn_scale
    allowed = pos[None, :] <= pos[:, None]
    if not cfg.global_layers[i]:
        allowed &= pos[:, None] - pos[None, :] < cfg.sliding_window
    scores = np.where(allowed[None, None], scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhts,bshd->bthd", p, v).reshape(B, T, -1)


@dataclass(frozen=True)
class LayerOut:
    """What one layer did to a batch: its FFN's input and pre-activations, and the residual after it."""

    layer: int
    ffn_in: np.ndarray  # [N, d] normed FFN input of the N = B * T tokens
    gate: np.ndarray  # [N, n_ff] (OPT: its only matrix before down, with the bias)
    up: np.ndarray  # [N, n_ff] (OPT: ones)
    residual: np.ndarray  # [B, T, d]


class _Layer:
    """Layer i's tensors by part name, read (and dequantized) when first asked for."""

    def __init__(self, f: GGUFFile, i: int, dtype: type) -> None:
        self.f, self.i, self.dtype = f, i, dtype

    def __call__(self, part: str, kind: str = "weight") -> np.ndarray:
        return weight(self.f, f"blk.{self.i}.{part}.{kind}", self.dtype)


def embed(f: GGUFFile, cfg: ModelConfig, ids: np.ndarray, dtype: type = np.float64) -> np.ndarray:
    """The residual stream entering layer 0 for token ids [B, T], each row from position 0 -> [B, T, d]."""
    x = weight(f, "token_embd.weight", dtype)[ids] * dtype(cfg.embed_scale)
    if cfg.learned_pos:
        x = x + weight(f, "position_embd.weight", dtype)[np.arange(ids.shape[-1]) + cfg.pos_offset]
    return x


def ffn_pre(cfg: ModelConfig, h: np.ndarray, w: "_Layer") -> tuple[np.ndarray, np.ndarray]:
    """(gate, up) [N, n_ff] of normed h [N, d]; OPT: (h Wu^T + bu, ones)."""
    if not cfg.gated_ffn:
        g = h @ w("ffn_up").T + w("ffn_up", "bias")
        return g, np.ones_like(g)
    return h @ w("ffn_gate").T, h @ w("ffn_up").T


def layers(f: GGUFFile, cfg: ModelConfig, ids: np.ndarray, n_layers: int | None = None, dtype: type = np.float64) -> Iterator[LayerOut]:
    """Token ids [B, T] (each row a sequence from position 0) through the first n_layers layers."""
    x = embed(f, cfg, ids, dtype)  # [B, T, d]
    for i in range(cfg.n_layers if n_layers is None else min(n_layers, cfg.n_layers)):
        w = _Layer(f, i, dtype)
        x = x + attention(cfg, i, norm(cfg, x, f, f"blk.{i}.attn_norm", dtype), w)
        h = norm(cfg, x, f, f"blk.{i}.ffn_norm", dtype).reshape(-1, cfg.d_model)
        gate, up = ffn_pre(cfg, h, w)
        m = (glu(gate, up, cfg.activation, cfg.act_threshold) @ w("ffn_down").T).reshape(x.shape)
        if cfg.proj_bias:
            m = m + w("ffn_down", "bias")
        x = x + (rms_norm(m, w("post_ffw_norm"), cfg.norm_eps) if cfg.post_norms else m)
        yield LayerOut(i, h, gate, up, x)


def logits(f: GGUFFile, cfg: ModelConfig, ids: list[int]) -> np.ndarray:
    """Logits [T, vocab] of a whole sequence from scratch (float64)."""
    batch = np.asarray(ids, dtype=np.int64)[None]
    x: np.ndarray | None = None
    for out in layers(f, cfg, batch):
        x = out.residual
    if x is None:  # a model with no layers: the embeddings go straight to the head
        x = embed(f, cfg, batch)
    h = norm(cfg, x[0], f, "output_norm")
    return h @ weight(f, "token_embd.weight" if cfg.tied_embeddings else "output.weight").T
