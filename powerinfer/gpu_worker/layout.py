"""What the GPU worker keeps on the device, in which format, and how many bytes it takes.

Runs in: the coordinator (the placement solver prices layers and neurons with these functions)
and the GPU worker (which allocates exactly these sizes, so the solver's total is what the
ledger sees). numpy only.

Per offloaded layer (fixed cost):
  * q, k, v rows and the output projection in the file's own block format when a kernel reads it
    (kernels.SUFFIX), else dequantized once to F16 (BF16, Q5_K); q/k rows permuted for NEOX rope;
  * q/k/v biases (qwen2) and q/k norm weights (gemma3) as float32, the rope frequencies as float64;
  * the layer's RMSNorm weights (attention and FFN norms, and Gemma-3's post norms), float32 [d]
    each, for runs of whole layers with the residual stream on the device;
  * the KV cache, float16 [n_slots, Hkv, n_ctx, D] for k and [.., Dv] for v;
  * in predictor mode, the predictor's first layer fc1 [r, d] + bias, float32.
Per hot neuron: its gate and up rows (file format), its row of the transposed down projection
(Q8_0 for quantized files: requantized from the exact values in blocks of 32 along d, the format
ggml uses for activations; F16/F32 for float files), and in predictor mode its fc2 row + bias.
Once, when any layer is offloaded: the scratch buffers for up to ``max_tokens`` tokens per call
(among them a run's residual stream and a normed sub-layer output, [max_tokens, d] each).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT

from powerinfer.config import ModelConfig
from powerinfer.gguf_file import GGUFFile
from powerinfer.gpu_worker.kernels import SUFFIX
from powerinfer.model.weights import layer_tensor

DEFAULT_MAX_TOKENS = 128  # tokens per GPU call; longer prompt chunks are split (bounds the scratch)
F32, I32, I64, F16, F64 = 4, 4, 8, 2, 8  # element bytes on the device


def device_qtype(qtype: QT) -> QT:
    """The format a weight of this file type takes on the device."""
    return qtype if qtype in SUFFIX else QT.F16


def device_row_bytes(qtype: QT, k: int) -> int:
    block, size = GGML_QUANT_SIZES[device_qtype(qtype)]
    return k // block * size


def down_t_qtype(down_qtype: QT, d: int) -> QT:
    """Format of the transposed down-projection rows [n_hot, d] (requantized along d)."""
    if down_qtype == QT.F32:
        return QT.F32
    if down_qtype in (QT.F16, QT.BF16) or d % 32:
        return QT.F16
    return QT.Q8_0


def qkv_width(cfg: ModelConfig) -> int:
    """Columns of the fused q|k|v activation [T, (Hq + Hkv) * D + Hkv * Dv]."""
    return (cfg.n_heads + cfg.n_kv_heads) * cfg.head_dim + cfg.n_kv_heads * cfg.v_head_dim


def attention_bytes(f: GGUFFile, cfg: ModelConfig, layer: int) -> int:
    """Attention weights, biases, norms and rope table of one layer (no KV cache); with them the
    layer's RMSNorm weights (2, or 4 with post norms, of [d]), which a run of whole layers on the
    device uses."""
    d, D, Dv = cfg.d_model, cfg.head_dim, cfg.v_head_dim
    rows = {"attn_q": cfg.n_heads * D, "attn_k": cfg.n_kv_heads * D, "attn_v": cfg.n_kv_heads * Dv}
    total = sum(n * device_row_bytes(f.tensor(layer_tensor(layer, p)).qtype, d) for p, n in rows.items())
    total += d * device_row_bytes(f.tensor(layer_tensor(layer, "attn_output")).qtype, cfg.n_heads * Dv)
    if cfg.qkv_bias:
        total += qkv_width(cfg) * F32
    if cfg.qk_norm:
        total += 2 * D * F32
    total += (4 if cfg.post_norms else 2) * d * F32
    return total + cfg.rope_dim // 2 * F64


def kv_bytes(cfg: ModelConfig, n_ctx: int, n_slots: int) -> int:
    return n_slots * cfg.n_kv_heads * n_ctx * (cfg.head_dim + cfg.v_head_dim) * F16


def predictor_fixed_bytes(cfg: ModelConfig, rank: int) -> int:
    return (rank * cfg.d_model + rank) * F32


def neuron_bytes(f: GGUFFile, cfg: ModelConfig, layer: int, rank: int) -> int:
    """One hot neuron: gate row, up row, transposed down row, predictor fc2 row and bias (a gate-less
    FFN, OPT: its fc1 row, in the gate's place, and fc1's bias instead of an up row)."""
    d = cfg.d_model
    gate = device_row_bytes(f.tensor(layer_tensor(layer, cfg.gate_part)).qtype, d)
    up = device_row_bytes(f.tensor(layer_tensor(layer, "ffn_up")).qtype, d) if cfg.gated_ffn else F32
    down = device_row_bytes(down_t_qtype(f.tensor(layer_tensor(layer, "ffn_down")).qtype, d), d)
    return gate + up + down + ((rank + 1) * F32 if rank else 0)


def workspace_bytes(cfg: ModelConfig, max_tokens: int, max_rank: int) -> int:
    """Scratch of one call: x, y, positions, slots, qkv, attention output, gate/up/h (and the
    predictor's hidden layer and logits) for max_tokens tokens, the active-neuron list and count."""
    t, d, n = max_tokens, cfg.d_model, cfg.n_ff
    floats = 4 * t * d + t * qkv_width(cfg) + t * cfg.n_heads * cfg.v_head_dim + 3 * t * n  # x, y, the stream, a normed y
    if max_rank:
        floats += t * max_rank + t * n
    return floats * F32 + 2 * t * I64 + (n + 1) * I32


@dataclass(frozen=True)
class GpuPlan:
    """What the GPU holds: per layer the hot neurons and whether attention (+ KV cache) is there."""

    hot: tuple[np.ndarray, ...]  # per layer: sorted int neuron ids on the GPU
    gpu_layers: tuple[bool, ...]
    sparse: bool = True  # compute hot neurons sparsely when a predictor file is given
    max_tokens: int = DEFAULT_MAX_TOKENS

    def to_json(self) -> str:
        return json.dumps({"hot": [h.tolist() for h in self.hot], "gpu_layers": list(self.gpu_layers),
                           "sparse": self.sparse, "max_tokens": self.max_tokens})

    @classmethod
    def from_json(cls, text: str) -> GpuPlan:
        d = json.loads(text)
        return cls(tuple(np.array(h, dtype=np.int64) for h in d["hot"]), tuple(bool(g) for g in d["gpu_layers"]),
                   bool(d["sparse"]), int(d["max_tokens"]))
