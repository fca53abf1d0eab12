"""GGML quantized weights: block decoders (numpy) and packed torch linears that compute from them.

Runs in: any process (coordinator and workers); no global state, no process-level setup.
The decoders are numpy-only; the linears (and torch) are imported lazily.

``decode`` turns raw GGUF rows into a :class:`Grouped` (integer codes plus per-group scale and
zero) or float32; ``pack_linear`` / ``linear_from_tensor`` turn those into a :class:`PackedLinear`
(int4 / int8 / bf16 / f32) whose ``__call__`` computes ``x @ W.T``.
"""

import importlib
from typing import Any

from powerinfer.quants.formats import (
    FOUR_BIT_TYPES,
    SUPPORTED_TYPES,
    decode,
    dequantize_rows,
    raw_rows,
    row_bytes,
)
from powerinfer.quants.grouped import Grouped

# The packed linears need torch; they load on first use so that the coordinator, which only
# decodes a few rows with numpy, never imports torch when worker processes do the math.
_TORCH_NAMES = {
    "linear_from_tensor": "powerinfer.quants.from_tensor",
    **{n: "powerinfer.quants.linear" for n in ("KINDS", "DenseLinear", "Int4Linear", "Int8Linear", "Int8Packer", "PackedLinear", "choose_kind", "pack_linear")},
}


def __getattr__(name: str) -> Any:
    if name in _TORCH_NAMES:
        return getattr(importlib.import_module(_TORCH_NAMES[name]), name)
    raise AttributeError(f"module 'powerinfer.quants' has no attribute {name!r}")


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
