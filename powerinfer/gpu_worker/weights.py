"""What a layer uploads to the GPU: the host-side arrays (attention weights, hot neurons, predictor)
and the records of the device buffers they become (DeviceMat, DeviceAttention, DeviceFfn, DeviceNorms).

Runs in: the GPU worker process (or the coordinator for the in-process GPU worker). numpy only.
Formats and sizes are the ones :mod:`powerinfer.gpu_worker.layout` prices; every matrix is rows of
raw bytes (uint8 [n, row_bytes]) that a ``gemv_<suffix>`` / ``axpy_<suffix>`` kernel reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf.quants import quantize

from powerinfer.config import ModelConfig
from powerinfer.gpu_worker.backend import Buf
from powerinfer.gguf_file import GGUFFile
from powerinfer.gpu_worker.kernels import MAX_HEAD_DIM, SUFFIX
from powerinfer.gpu_worker.layout import device_qtype, down_t_qtype
from powerinfer.model.sharding import down_columns
from powerinfer.model.weights import layer_bias, layer_tensor, load_vector
from powerinfer.quants import dequantize_rows
from powerinfer.predictors.predictor_file import LayerPredictor


def neox_perm(head_dim: int, rope_dim: int) -> np.ndarray:
    """model/ops.py neox_to_norm_perm (rows 2i, 2i + 1 <- i, i + r/2), restated here because that
    module imports torch and the GPU worker does not need it (tests check they agree)."""
    half = rope_dim // 2
    perm = np.arange(head_dim)
    perm[:rope_dim:2] = np.arange(half)
    perm[1:rope_dim:2] = np.arange(half, rope_dim)
    return perm


@dataclass(frozen=True)
class DeviceMatrix:
    """Rows [n, k] in a kernel's format: ``data`` uint8 [n, row_bytes]."""

    suffix: str
    data: np.ndarray
    k: int

    @property
    def n(self) -> int:
        return int(self.data.shape[0])

    @property
    def row_bytes(self) -> int:
        return int(self.data.shape[1])


def as_device(qtype: QT, rows: np.ndarray, k: int) -> DeviceMatrix:
    """Raw GGUF rows (uint8 blocks, or typed floats) -> the device format (same bytes when native)."""
    dq = device_qtype(qtype)
    if dq == qtype:
        data = np.ascontiguousarray(rows).view(np.uint8).reshape(rows.shape[0], -1)
    else:  # no kernel for this type: dequantize once, exactly, and round to float16
        data = dequantize_rows(qtype, rows, k).astype(np.float16).view(np.uint8)
    return DeviceMatrix(SUFFIX[dq], data, k)


def matrix_rows(f: GGUFFile, name: str, rows: np.ndarray | None = None) -> DeviceMatrix:
    info = f.tensor(name)
    raw = f.raw(name)
    return as_device(info.qtype, raw if rows is None else raw[np.asarray(rows, dtype=np.int64)], info.n_cols)


def floats_as_device(qtype: QT, w: np.ndarray) -> DeviceMatrix:
    """float32 rows [n, k] -> F32, F16 or Q8_0 rows (Q8_0 as ggml's quantize_row_q8_0)."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    if qtype == QT.F32:
        data = w.view(np.uint8)
    elif qtype == QT.F16:
        data = w.astype(np.float16).view(np.uint8)
    else:
        data = np.ascontiguousarray(quantize(w, qtype)).reshape(w.shape[0], -1)
    return DeviceMatrix(SUFFIX[qtype], data, int(w.shape[1]))


@dataclass(frozen=True)
class AttentionArrays:
    q: DeviceMatrix  # [Hq * D, d], rows permuted per head for NEOX models
    k: DeviceMatrix  # [Hkv * D, d], same permutation
    v: DeviceMatrix  # [Hkv * Dv, d]
    o: DeviceMatrix  # [d, Hq * Dv]
    bias: np.ndarray | None  # float32 [qkv_width] (q|k|v, permuted like the rows)
    q_norm: np.ndarray | None  # float32 [D]
    k_norm: np.ndarray | None  # float32 [D]
    inv_freq: np.ndarray  # float64 [rope_dim / 2]
    window: int  # sliding window (0: global attention)


def attention_arrays(f: GGUFFile, cfg: ModelConfig, layer: int) -> AttentionArrays:
    D, Dv = cfg.head_dim, cfg.v_head_dim
    if max(D, Dv) > MAX_HEAD_DIM:
        raise ValueError(f"head size {max(D, Dv)} exceeds the attention kernel's {MAX_HEAD_DIM}")
    # Same row order as the CPU shards (cpu_workers/shards.py): adjacent-pair rope for every model.
    perm = neox_perm(D, cfg.rope_dim) if cfg.rope_style == "neox" else np.arange(D)
    q_rows = (np.arange(cfg.n_heads)[:, None] * D + perm[None, :]).reshape(-1)
    k_rows = (np.arange(cfg.n_kv_heads)[:, None] * D + perm[None, :]).reshape(-1)
    v_rows = np.arange(cfg.n_kv_heads * Dv)
    bias = None
    if cfg.qkv_bias:
        bias = np.concatenate([load_vector(f, layer_bias(layer, "attn_q"))[q_rows], load_vector(f, layer_bias(layer, "attn_k"))[k_rows],
                               load_vector(f, layer_bias(layer, "attn_v"))[v_rows]]).astype(np.float32)
    q_norm = k_norm = None
    if cfg.qk_norm:
        q_norm = load_vector(f, layer_tensor(layer, "attn_q_norm"), D)[perm]
        k_norm = load_vector(f, layer_tensor(layer, "attn_k_norm"), D)[perm]
    base, scale = cfg.layer_rope(layer)
    # as model/ops.py RopeTable: inv_freq = base^(-2i / rope_dim) * position scale, in float64
    inv_freq = (1.0 / (base ** (np.arange(0, cfg.rope_dim, 2, dtype=np.float64) / cfg.rope_dim))) * scale
    return AttentionArrays(
        q=matrix_rows(f, layer_tensor(layer, "attn_q"), q_rows), k=matrix_rows(f, layer_tensor(layer, "attn_k"), k_rows),
        v=matrix_rows(f, layer_tensor(layer, "attn_v"), v_rows), o=matrix_rows(f, layer_tensor(layer, "attn_output")),
        bias=bias, q_norm=q_norm, k_norm=k_norm, inv_freq=inv_freq,
        window=0 if cfg.global_layers[layer] else cfg.sliding_window,
    )


@dataclass(frozen=True)
class HotArrays:
    gate: DeviceMatrix  # [n_hot, d] (a gate-less FFN, OPT: fc1's rows)
    up: DeviceMatrix | None  # [n_hot, d]; None for a gate-less FFN
    down_t: DeviceMatrix  # [n_hot, d]: row j is hot neuron j's output direction
    bias: np.ndarray | None = None  # float32 [n_hot]: a gate-less FFN's fc1 bias


def hot_arrays(f: GGUFFile, cfg: ModelConfig, layer: int, hot: np.ndarray) -> HotArrays:
    name = layer_tensor(layer, "ffn_down")
    down_t = down_columns(f, layer, hot)[0].T  # [n_hot, d]
    gated = cfg.gated_ffn
    return HotArrays(
        gate=matrix_rows(f, layer_tensor(layer, cfg.gate_part), hot),
        up=matrix_rows(f, layer_tensor(layer, "ffn_up"), hot) if gated else None,
        down_t=floats_as_device(down_t_qtype(f.tensor(name).qtype, cfg.d_model), down_t),
        bias=None if gated else np.ascontiguousarray(load_vector(f, layer_bias(layer, "ffn_up"), cfg.n_ff)[hot], dtype=np.float32),
    )


@dataclass(frozen=True)
class PredictorArrays:
    fc1: DeviceMatrix  # F32 [r, d]
    fc1_b: np.ndarray  # float32 [r]
    fc2: DeviceMatrix  # F32 [n_hot, r]: the hot neurons' rows
    fc2_b: np.ndarray  # float32 [n_hot]


def predictor_arrays(lp: LayerPredictor, hot: np.ndarray) -> PredictorArrays:
    # owned float32 copies: the predictor file's arrays are read-only views of its mapping
    return PredictorArrays(
        fc1=floats_as_device(QT.F32, np.array(lp.fc1_w, dtype=np.float32)), fc1_b=np.array(lp.fc1_b, dtype=np.float32),
        fc2=floats_as_device(QT.F32, np.array(lp.fc2_w[hot], dtype=np.float32)), fc2_b=np.array(lp.fc2_b[hot], dtype=np.float32),
    )


# -- what the device holds --------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceMat:
    """A matrix on the device: n rows of k values in a kernel's format (suffix), row_bytes each."""

    buf: Buf
    suffix: str
    row_bytes: int
    n: int
    k: int


@dataclass
class DeviceAttention:
    """An offloaded layer's attention: AttentionArrays uploaded, and its KV cache."""

    q: DeviceMat
    k: DeviceMat
    v: DeviceMat
    o: DeviceMat
    bias: Buf | None
    q_norm: Buf | None
    k_norm: Buf | None
    inv_freq: Buf
    window: int
    k_cache: Buf
    v_cache: Buf


@dataclass
class DeviceFfn:
    """A layer's hot neurons on the device (HotArrays uploaded) and, in predictor mode, their predictor."""

    gate: DeviceMat  # a gate-less FFN (OPT): fc1's rows
    up: DeviceMat | None  # None: a gate-less FFN
    down_t: DeviceMat
    threshold: float
    bias: Buf | None = None  # a gate-less FFN's fc1 bias [n_hot]
    fc1: DeviceMat | None = None  # predictor mode only
    fc1_b: Buf | None = None
    fc2: DeviceMat | None = None
    fc2_b: Buf | None = None


@dataclass
class DeviceNorms:
    """A whole layer's RMSNorm weights on the device (post norms: Gemma-3's, else None)."""

    attn: Buf
    ffn: Buf
    post_attn: Buf | None
    post_ffn: Buf | None
