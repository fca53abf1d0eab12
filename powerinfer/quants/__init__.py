"""GGML quantized weights: block decoders (numpy) and packed torch linears that compute from them.

Runs in: any process (coordinator and workers); no global state, no process-level setup.

``decode`` turns raw GGUF rows into a :class:`Grouped` (integer codes plus per-group scale and
zero) or float32; ``pack_linear`` / ``linear_from_tensor`` turn those into a :class:`PackedLinear`
(int4 / int8 / bf16 / f32) whose ``__call__`` computes ``x @ W.T``.
"""

from powerinfer.quants.formats import FOUR_BIT_TYPES, SUPPORTED_TYPES, decode, dequantize_rows, raw_rows, row_bytes
from powerinfer.quants.from_tensor import linear_from_tensor
from powerinfer.quants.grouped import Grouped
from powerinfer.quants.linear import (
    KINDS,
    DenseLinear,
    Int4Linear,
    Int8Linear,
    Int8Packer,
    PackedLinear,
    choose_kind,
    pack_linear,
)

__all__ = [
    "FOUR_BIT_TYPES",
    "KINDS",
    "SUPPORTED_TYPES",
    "DenseLinear",
    "Grouped",
    "Int4Linear",
    "Int8Linear",
    "Int8Packer",
    "PackedLinear",
    "choose_kind",
    "decode",
    "dequantize_rows",
    "linear_from_tensor",
    "pack_linear",
    "raw_rows",
    "row_bytes",
]
