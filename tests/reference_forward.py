"""An independent float64 numpy forward pass, the oracle for the engine's tests on synthetic models.

Runs in: the pytest process. Written from the architectures' definitions, sharing no code with
the engine except the GGUF reader and config; weights come from ``gguf.quants.dequantize``.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from powerinfer.config import ModelConfig
from powerinfer.gguf_file import GGUFFile


def weight(f: GGUFFile, name: str) -> np.ndarray:
    info = f.tensor(name)
    raw = np.asarray(f.raw(name))
    if info.qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return raw.astype(np.float64)
    return dequantize(raw, info.qtype).reshape(info.shape).astype(np.float64)


def _norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x: np.ndarray, pos: np.ndarray, base: float, style: str) -> np.ndarray:
    """x [T, H, D]"""
    D = x.shape[-1]
    inv = base ** (-np.arange(0, D, 2) / D)
    ang = pos[:, None, None] * inv[None, None, :]  # [T, 1, D/2]
    c, s = np.cos(ang), np.sin(ang)
    if style == "norm":
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = a * c - b * s, a * s + b * c
        return out
    a, b = x[..., : D // 2], x[..., D // 2 :]
    return np.concatenate([a * c - b * s, a * s + b * c], -1)


def reference_logits(f: GGUFFile, cfg: ModelConfig, ids: list[int]) -> np.ndarray:
    """Logits [T, vocab] for the whole sequence from scratch."""
    T, D = len(ids), cfg.head_dim
    pos = np.arange(T)
    x = weight(f, "token_embd.weight")[ids] * cfg.embed_scale
    for i in range(cfg.n_layers):
        w = lambda part: weight(f, f"blk.{i}.{part}.weight")  # noqa: E731
        h = _norm(x, w("attn_norm"), cfg.norm_eps)
        q, k, v = h @ w("attn_q").T, h @ w("attn_k").T, h @ w("attn_v").T
        if cfg.qkv_bias:
            q, k, v = (a + weight(f, f"blk.{i}.{p}.bias") for a, p in ((q, "attn_q"), (k, "attn_k"), (v, "attn_v")))
        q, k, v = q.reshape(T, -1, D), k.reshape(T, -1, D), v.reshape(T, -1, D)
        if cfg.qk_norm:
            q, k = _norm(q, w("attn_q_norm"), cfg.norm_eps), _norm(k, w("attn_k_norm"), cfg.norm_eps)
        base = cfg.rope_base if cfg.global_layers[i] else cfg.rope_base_local
        q, k = _rope(q, pos, base, cfg.rope_style), _rope(k, pos, base, cfg.rope_style)
        g = cfg.n_heads // cfg.n_kv_heads
        k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
        scores = np.einsum("thd,shd->hts", q, k) * cfg.attn_scale
        allowed = pos[None, :] <= pos[:, None]
        if not cfg.global_layers[i]:
            allowed &= pos[:, None] - pos[None, :] < cfg.sliding_window
        scores = np.where(allowed[None], scores, -np.inf)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        a = np.einsum("hts,shd->thd", p, v).reshape(T, -1) @ w("attn_output").T
        if cfg.post_norms:
            a = _norm(a, w("post_attention_norm"), cfg.norm_eps)
        x = x + a
        h = _norm(x, w("ffn_norm"), cfg.norm_eps)
        gate, up = h @ w("ffn_gate").T, h @ w("ffn_up").T
        if cfg.activation == "silu":
            act = gate / (1 + np.exp(-gate))
        else:
            act = 0.5 * gate * (1 + np.tanh(np.sqrt(2 / np.pi) * (gate + 0.044715 * gate**3)))
        m = (act * up) @ w("ffn_down").T
        if cfg.post_norms:
            m = _norm(m, w("post_ffw_norm"), cfg.norm_eps)
        x = x + m
    x = _norm(x, weight(f, "output_norm.weight"), cfg.norm_eps)
    head = "token_embd.weight" if cfg.tied_embeddings else "output.weight"
    return x @ weight(f, head).T
