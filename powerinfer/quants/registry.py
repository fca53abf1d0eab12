"""The quant registry: one typed record per GGML weight type, the one place its traits are written.

Runs in: every process (a foundation: pure data, no numpy work, no torch).

Every layer reads its facts about a type from here: the numpy decoders (quants/formats.py) which
types they decode and how wide a float type's elements are; the torch packers
(quants/from_tensor.py) which codes pack to int4 as they are and which split exactly into two
int4 halves; the native decoder (native/decoder_lib.py, native/decoder.py) which types have a
dot product, the row length their blocks need and the bytes of an eight-row group; the GPU worker
(gpu_worker/kernels.py) its kernels' names; the GPU check (tools/gpu_check.py) where a block's
float16 scales sit. Adding a type is one record here plus its kernels (a numpy decoder, the C
dot product, the CUDA gemv/axpy) and their tests.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT


@dataclass(frozen=True)
class QuantType:
    qtype: QT
    float_itemsize: int = 0  # bytes per element of a float type; 0: a block type
    four_bit: bool = False  # codes are 0..15: packs to int4 without requantizing (torch path)
    int4_split: bool = False  # 5..8-bit codes in groups of 32: exactly two int4 halves (torch path)
    native_align: int | None = None  # the native decoder has a dot product; rows must be a multiple of this
    x8_group_bytes: int | None = None  # qx8.h's PI_X8_BYTES: one block of eight rows repacked (None: row layout)
    gpu_suffix: str | None = None  # the GPU kernels gemv_<suffix> / axpy_<suffix> (None: no GPU kernel)
    scale_fields: tuple[int, ...] = ()  # byte offsets of a block's float16 scale (and min) fields

    @property
    def is_float(self) -> bool:
        return self.float_itemsize > 0

    @property
    def block(self) -> int:
        """Values per block (1 for float types)."""
        return GGML_QUANT_SIZES[self.qtype][0]

    @property
    def block_bytes(self) -> int:
        return GGML_QUANT_SIZES[self.qtype][1]


_TYPES = (
    QuantType(QT.F32, float_itemsize=4, native_align=1, gpu_suffix="f32"),
    QuantType(QT.F16, float_itemsize=2, native_align=1, gpu_suffix="f16"),
    QuantType(QT.BF16, float_itemsize=2, native_align=1),
    QuantType(QT.Q4_0, four_bit=True, native_align=32, x8_group_bytes=16 + 128, gpu_suffix="q4_0", scale_fields=(0,)),
    QuantType(QT.Q4_1, four_bit=True, native_align=32, x8_group_bytes=32 + 128, gpu_suffix="q4_1", scale_fields=(0, 2)),
    QuantType(QT.Q5_0, int4_split=True, native_align=32, x8_group_bytes=48 + 128, gpu_suffix="q5_0", scale_fields=(0,)),
    QuantType(QT.Q5_1, int4_split=True, native_align=32, gpu_suffix="q5_1", scale_fields=(0, 2)),
    QuantType(QT.Q8_0, int4_split=True, native_align=32, x8_group_bytes=16 + 256, gpu_suffix="q8_0", scale_fields=(0,)),
    QuantType(QT.Q4_K, four_bit=True, native_align=256, gpu_suffix="q4_k", scale_fields=(0, 2)),
    QuantType(QT.Q5_K, int4_split=True, native_align=256),
    QuantType(QT.Q6_K, native_align=256, x8_group_bytes=32 + 256, gpu_suffix="q6_k", scale_fields=(208,)),
)

REGISTRY: Mapping[QT, QuantType] = MappingProxyType({t.qtype: t for t in _TYPES})


def types_where(**traits: object) -> frozenset[QT]:
    """The registered types whose records have these field values (e.g. four_bit=True)."""
    return frozenset(q for q, t in REGISTRY.items() if all(getattr(t, k) == v for k, v in traits.items()))
