"""The GPU worker's CUDA kernels: where their sources are, what they are called, and numpy oracles.

Runs in: the GPU worker process (the CPU backend computes with the oracles; the CUDA backend
compiles the sources), CI (the compile test) and the GPU check (CUDA against oracle). numpy only.

Each oracle has the semantics of one kernel over flat 1-D buffers (the same strides, offsets and
counts the kernel takes) and returns the values the kernel writes; :class:`CpuBackend` applies
them to its buffers. Weights are raw GGUF rows (uint8 [N * row_bytes]); the oracles dequantize
them with :mod:`powerinfer.quants` (which is checked against ``gguf``'s reference decoder) and
accumulate in float64, so a kernel that matches its oracle matches ggml's formats.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT

from powerinfer.model.layer_loop import rms_norm as rms_norm_f32
from powerinfer.quants import dequantize_rows
from powerinfer.quants.registry import REGISTRY

KERNEL_DIR = Path(__file__).resolve().parent / "kernels"
MAX_HEAD_DIM = 256  # attention.cu's MAX_D
BLOCK = 128  # threads per block of the element-wise, gemv and axpy launches
AXPY_CHUNK = 64  # rows of the down projection one axpy block sums before its atomic add

# GGUF weight type -> kernel suffix (gemv_<suffix>, axpy_<suffix>), one .cu file each.
SUFFIX: dict[QT, str] = {q: t.gpu_suffix for q, t in REGISTRY.items() if t.gpu_suffix is not None}
QTYPE_OF: dict[str, QT] = {s: q for q, s in SUFFIX.items()}


@dataclass(frozen=True)
class KernelSource:
    file: str  # under KERNEL_DIR
    functions: tuple[str, ...]  # extern "C" __global__ names it defines


SOURCES: tuple[KernelSource, ...] = (
    *(KernelSource(f"{s}.cu", (f"gemv_{s}", f"gemv_lanes_{s}", f"axpy_{s}")) for s in SUFFIX.values()),
    KernelSource("norm_rope.cu", ("rms_norm", "rope")),
    KernelSource("attention.cu", ("kv_store", "attend")),
    KernelSource("ffn_ops.cu", ("bias_act", "act_mul", "act_inplace", "compact", "gather_mul", "gather_add")),
    KernelSource("residual.cu", ("rms_norm_rows", "add_rows")),
)


def source_files() -> list[Path]:
    return [KERNEL_DIR / s.file for s in SOURCES]


# --- oracles ----------------------------------------------------------------------------------------


def _count(n_dev: np.ndarray | None, n: int) -> int:
    return n if n_dev is None else min(int(n_dev[0]), n)


def dequant(suffix: str, w: np.ndarray, row_bytes: int, K: int, rows: np.ndarray) -> np.ndarray:
    """float64 [len(rows), K]: rows of a raw weight buffer (uint8 [N * row_bytes])."""
    mat = w.reshape(-1, row_bytes)[np.asarray(rows, dtype=np.int64)]
    return dequantize_rows(QTYPE_OF[suffix], mat, K).astype(np.float64)


def ref_gemv(suffix: str, w: np.ndarray, row_bytes: int, rows: np.ndarray | None, n_dev: np.ndarray | None, n: int,
             x: np.ndarray, K: int, T: int) -> np.ndarray:
    """gemv_<suffix>: float32 [T, count], y[t, i] = W[r_i] . x[t] (the kernel stores it at y[t * ldy + i])."""
    c = _count(n_dev, n)
    r = np.arange(c) if rows is None else rows[:c]
    return (x[: T * K].reshape(T, K).astype(np.float64) @ dequant(suffix, w, row_bytes, K, r).T).astype(np.float32)


def ref_axpy(suffix: str, w: np.ndarray, row_bytes: int, rows: np.ndarray | None, n_dev: np.ndarray | None, n: int,
             h: np.ndarray, ldh: int, K: int, T: int) -> np.ndarray:
    """axpy_<suffix>: float32 [T, K] to add to y: sum_j h[t, j] * W[r_j]."""
    c = _count(n_dev, n)
    r = np.arange(c) if rows is None else rows[:c]
    hh = np.stack([h[t * ldh : t * ldh + c] for t in range(T)]).astype(np.float64)  # [T, count]
    return (hh @ dequant(suffix, w, row_bytes, K, r)).astype(np.float32)


def _heads(x: np.ndarray, ld: int, T: int, H: int, D: int) -> np.ndarray:
    """[T, H, D] copy of heads starting at x[t * ld + h * D]."""
    return np.stack([x[t * ld : t * ld + H * D].reshape(H, D) for t in range(T)]).astype(np.float64)


def _put_heads(x: np.ndarray, ld: int, vals: np.ndarray) -> None:
    T, H, D = vals.shape
    for t in range(T):
        x[t * ld : t * ld + H * D] = vals[t].reshape(-1)


def ref_rms_norm(x: np.ndarray, ld: int, T: int, H: int, D: int, w: np.ndarray, eps: float) -> None:
    """rms_norm, in place on x."""
    v = _heads(x, ld, T, H, D)
    v = v / np.sqrt((v * v).mean(-1, keepdims=True) + eps) * w[:D].astype(np.float64)
    _put_heads(x, ld, v.astype(np.float32))


def ref_rope(x: np.ndarray, ld: int, pos: np.ndarray, T: int, H: int, D: int, rope_dim: int, inv_freq: np.ndarray) -> None:
    """rope (adjacent pairs), in place on x."""
    v = _heads(x, ld, T, H, D)
    ang = pos[:T].astype(np.float64)[:, None, None] * inv_freq[None, None, : rope_dim // 2]  # [T, 1, R/2]
    c, s = np.cos(ang), np.sin(ang)
    a, b = v[..., 0:rope_dim:2].copy(), v[..., 1:rope_dim:2].copy()
    v[..., 0:rope_dim:2], v[..., 1:rope_dim:2] = a * c - b * s, a * s + b * c
    _put_heads(x, ld, v.astype(np.float32))


def ref_kv_store(qkv: np.ndarray, ld: int, k_off: int, v_off: int, pos: np.ndarray, slots: np.ndarray, T: int,
                 Hkv: int, D: int, Dv: int, k_cache: np.ndarray, v_cache: np.ndarray, n_ctx: int) -> None:
    """kv_store, in place on the float16 caches ([n_slots, Hkv, n_ctx, D] flat)."""
    kc = k_cache.reshape(-1, Hkv, n_ctx, D)
    vc = v_cache.reshape(-1, Hkv, n_ctx, Dv)
    for t in range(T):
        row = qkv[t * ld : (t + 1) * ld]
        kc[slots[t], :, pos[t]] = row[k_off : k_off + Hkv * D].reshape(Hkv, D)
        vc[slots[t], :, pos[t]] = row[v_off : v_off + Hkv * Dv].reshape(Hkv, Dv)


def ref_attend(qkv: np.ndarray, ld: int, pos: np.ndarray, slots: np.ndarray, T: int, Hq: int, Hkv: int, D: int, Dv: int,
               k_cache: np.ndarray, v_cache: np.ndarray, n_ctx: int, window: int, scale: float) -> np.ndarray:
    """attend: float32 [T, Hq * Dv]; token t sees positions [max(0, pos - window + 1) if window, pos] of its slot."""
    kc = k_cache.reshape(-1, Hkv, n_ctx, D)
    vc = v_cache.reshape(-1, Hkv, n_ctx, Dv)
    g = Hq // Hkv
    out = np.empty((T, Hq, Dv), dtype=np.float32)
    for t in range(T):
        hi = int(pos[t]) + 1
        lo = max(0, hi - window) if window > 0 else 0
        q = qkv[t * ld : t * ld + Hq * D].reshape(Hkv, g, D).astype(np.float64) * scale
        k = kc[slots[t], :, lo:hi].astype(np.float64)  # [Hkv, S, D]
        s = np.einsum("hgd,hsd->hgs", q, k)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[t] = np.einsum("hgs,hsd->hgd", p, vc[slots[t], :, lo:hi].astype(np.float64)).reshape(Hq, Dv)
    return out.reshape(T, Hq * Dv)


def act(x: np.ndarray, kind: int, athr: float = 0.0) -> np.ndarray:
    """act(gate) in float64 for config.py's ACT_CODES: 0 SiLU, 1 GELU (tanh approximation), 2 ReLU /
    FATReLU (x where x > athr, else 0), 3 dReLU's gate half (relu)."""
    x = x.astype(np.float64)
    if kind == 0:
        return x / (1.0 + np.exp(-x))
    if kind in (2, 3):
        return np.where(x > (athr if kind == 2 else 0.0), x, 0.0)
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


def up(u: np.ndarray, kind: int) -> np.ndarray:
    """The up value as the activation multiplies it: dReLU (kind 3) rectifies it too."""
    return np.where(u > 0, u, 0.0) if kind == 3 else u


def ref_rms_norm_rows(x: np.ndarray, ldx: int, T: int, D: int, w: np.ndarray, eps: float) -> np.ndarray:
    """rms_norm_rows: float32 [T, D] to store at y[t * ldy]. The engine's own float32 norm
    (model/layer_loop.py), not float64: a run of layers on the numpy backend is then the engine's
    loop bit for bit (the CUDA kernel is checked against it within the usual tolerance)."""
    rows = np.stack([x[t * ldx : t * ldx + D] for t in range(T)]).astype(np.float32)
    return rms_norm_f32(rows, w[:D].astype(np.float32), eps)


def ref_add_rows(y: np.ndarray, ldy: int, x: np.ndarray, ldx: int, T: int, n: int) -> None:
    """add_rows, in place on y (float32, as the engine's residual add)."""
    for t in range(T):
        y[t * ldy : t * ldy + n] = y[t * ldy : t * ldy + n] + x[t * ldx : t * ldx + n]


def ref_bias_act(y: np.ndarray, ld: int, b: np.ndarray, T: int, n: int, relu: int) -> None:
    for t in range(T):
        v = y[t * ld : t * ld + n] + b[:n]
        y[t * ld : t * ld + n] = np.maximum(v, 0) if relu else v


def ref_act_mul(g: np.ndarray, u: np.ndarray | None, T: int, n: int, kind: int, athr: float, thr: float, logits: np.ndarray | None,
                n_dev: np.ndarray | None = None) -> np.ndarray:
    """act_mul: float32 [T * count] (count = n, or min(n_dev[0], n) for a compacted decode step);
    u None: a gate-less FFN, up = 1."""
    m = T * _count(n_dev, n)
    a = act(g[:m], kind, athr)
    on = logits[:m] > 0 if logits is not None else (np.abs(a) > thr if thr >= 0 else np.ones(m, dtype=bool))
    return np.where(on, a * (1.0 if u is None else up(u[:m], kind)), 0.0).astype(np.float32)


def ref_compact(v: np.ndarray, n: int, thr: float, use_abs: int) -> np.ndarray:
    """compact: int32 indices of the selected entries, increasing."""
    vals = np.abs(v[:n]) if use_abs else v[:n]
    return np.flatnonzero(vals > thr).astype(np.int32)


def ref_gather_mul(a: np.ndarray, idx: np.ndarray, count: np.ndarray, n: int, u: np.ndarray | None, kind: int) -> np.ndarray:
    c = min(int(count[0]), n)
    return (a[idx[:c]].astype(np.float64) * (1.0 if u is None else up(u[:c].astype(np.float64), kind))).astype(np.float32)


def ref_gather_add(y: np.ndarray, b: np.ndarray, idx: np.ndarray, count: np.ndarray, n: int) -> None:
    """gather_add, in place on y: y[j] += b[idx[j]] for j < count."""
    c = min(int(count[0]), n)
    y[:c] = y[:c] + b[idx[:c]]
