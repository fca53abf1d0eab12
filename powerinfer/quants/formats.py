"""GGML tensor decoders: raw GGUF rows (quantized blocks or floats) to :class:`Grouped` or float32.

Runs in: any process (coordinator or worker); pure numpy, no global state besides constant tables.

``decode`` is vectorized over all blocks of all rows it is given (no Python loop over blocks), and
reads the raw bytes without writing them: they are usually a read-only view into the memory-mapped
model file. Its cost and transient memory scale with the rows passed in, so callers that need a
huge tensor (a 262144-row embedding) pass row chunks (see :func:`powerinfer.quants.linear_from_tensor`).
Bit layouts follow ggml's ``dequantize_row_*`` exactly (reference: ``gguf/quants.py``).
"""

from __future__ import annotations

import logging
from typing import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT

from powerinfer.errors import ModelFileError, UnsupportedModelError
from powerinfer.quants.formats_kquants import (
    decode_q4_k,
    decode_q5_k,
    decode_q6_k,
    f16_field,
)
from powerinfer.quants.grouped import Grouped
from powerinfer.quants.registry import REGISTRY, types_where

log = logging.getLogger(__name__)

# The types and their traits come from the registry (quants/registry.py).
FLOAT_TYPES: frozenset[QT] = frozenset(q for q, t in REGISTRY.items() if t.is_float)
QUANT_TYPES: frozenset[QT] = frozenset(q for q, t in REGISTRY.items() if not t.is_float)
SUPPORTED_TYPES: frozenset[QT] = FLOAT_TYPES | QUANT_TYPES
# Formats whose codes are all 0..15 (Grouped.bits == 4): these pack to int4 without requantizing.
FOUR_BIT_TYPES: frozenset[QT] = types_where(four_bit=True)

# Bytes per element of the float formats; BF16 is read as uint16 and widened by a shift.
_FLOAT_ITEMSIZE: dict[QT, int] = {q: REGISTRY[q].float_itemsize for q in FLOAT_TYPES}
# Typed arrays accepted besides raw bytes (bf16 has no numpy dtype: 16-bit integers carry its bits).
_FLOAT_DTYPES: dict[QT, tuple[np.dtype, ...]] = {
    QT.F32: (np.dtype(np.float32),),
    QT.F16: (np.dtype(np.float16),),
    QT.BF16: (np.dtype(np.uint16), np.dtype(np.int16)),
}


def check_supported(qtype: QT) -> None:
    """Raise UnsupportedModelError naming ``qtype`` unless we can decode it."""
    if qtype not in SUPPORTED_TYPES:
        name = getattr(qtype, "name", str(qtype))
        supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise UnsupportedModelError(f"tensor type {name} is not supported (supported: {supported})")


def row_bytes(qtype: QT, n_cols: int) -> int:
    """Bytes one row of ``n_cols`` weights takes in the file; ModelFileError if not whole blocks."""
    check_supported(qtype)
    block, size = GGML_QUANT_SIZES[qtype]
    if n_cols <= 0 or n_cols % block:
        raise ModelFileError(f"{qtype.name} row of {n_cols} values is not a whole number of {block}-value blocks")
    return n_cols // block * size


def _as_rows(raw: np.ndarray, width: int, what: str) -> np.ndarray:
    """View ``raw`` as [N, width]: 2-D input must already have that width, 1-D input is split into rows."""
    if raw.ndim == 2 and raw.shape[1] == width:
        return raw
    if raw.ndim == 1 and raw.shape[0] % width == 0:
        return raw.reshape(-1, width)
    raise ModelFileError(f"{what}: raw data of shape {list(raw.shape)} is not rows of {width} elements")


# --- float formats ---------------------------------------------------------------------------------


def _decode_float(qtype: QT, rows: np.ndarray) -> np.ndarray:
    """Validated F32/F16/BF16 rows (typed [N, K] or uint8 [N, K * itemsize]) -> float32 [N, K].

    F32 input that is already float32 comes back as a view (no copy, possibly read-only);
    the other formats allocate a new float32 array.
    """
    if rows.dtype == np.uint8:
        # Byte rows have a contiguous last axis, so reinterpreting them copies nothing.
        rows = rows.view({QT.F32: np.float32, QT.F16: np.float16, QT.BF16: np.uint16}[qtype])
    if qtype == QT.BF16:
        # bf16 is the top half of a float32: widen to 32 bits and shift into place.
        bits = rows.view(np.uint16).astype(np.uint32) << np.uint32(16)
        return bits.view(np.float32)
    return rows.astype(np.float32, copy=False)


# --- legacy 32-value block formats ------------------------------------------------------------------


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """uint8 [N, nb, 16] -> uint8 [N, nb, 32]: element j is qs[j] & 15, element j + 16 is qs[j] >> 4."""
    n, nb = qs.shape[:2]
    out = np.empty((n, nb, 2, 16), dtype=np.uint8)
    np.bitwise_and(qs, 0x0F, out=out[:, :, 0])
    np.right_shift(qs, 4, out=out[:, :, 1])
    return out.reshape(n, nb, 32)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """uint8 [N, nb, 4] (a little-endian uint32) -> uint8 [N, nb, 32] with bit j of that uint32 << 4."""
    return np.unpackbits(qh, axis=-1, bitorder="little") << np.uint8(4)


def _grouped(codes: np.ndarray, scale: np.ndarray, zero: np.ndarray | None, bits: int) -> Grouped:
    """Wrap uint8/int8 codes [N, nb, 32] and per-block [N, nb] scale/zero as a group-32 Grouped."""
    n, nb = codes.shape[:2]
    zero_arr = np.zeros_like(scale) if zero is None else zero
    return Grouped(codes.view(np.int8).reshape(n, nb * 32), scale, zero_arr, 32, bits)


def _decode_q4_0(b: np.ndarray) -> Grouped:
    # 18 bytes: d f16, qs[16]. w = (code - 8) * d: keep the unsigned code and fold -8d into zero.
    d = f16_field(b, 0)
    return _grouped(_nibbles(b[..., 2:18]), d, d * np.float32(-8.0), 4)


def _decode_q4_1(b: np.ndarray) -> Grouped:
    # 20 bytes: d f16, m f16, qs[16]. w = code * d + m.
    return _grouped(_nibbles(b[..., 4:20]), f16_field(b, 0), f16_field(b, 2), 4)


def _decode_q5_0(b: np.ndarray) -> Grouped:
    # 22 bytes: d f16, qh u32, qs[16]. w = (code - 16) * d; code - 16 (-16..15) stored signed.
    codes = _nibbles(b[..., 6:22])
    codes |= _fifth_bits(b[..., 2:6])
    codes -= np.uint8(16)  # wraps mod 256; the int8 view reads code - 16
    return _grouped(codes, f16_field(b, 0), None, 8)


def _decode_q5_1(b: np.ndarray) -> Grouped:
    # 24 bytes: d f16, m f16, qh u32, qs[16]. w = code * d + m with code 0..31 (fits int8).
    codes = _nibbles(b[..., 8:24])
    codes |= _fifth_bits(b[..., 4:8])
    return _grouped(codes, f16_field(b, 0), f16_field(b, 2), 8)


def _decode_q8_0(b: np.ndarray) -> Grouped:
    # 34 bytes: d f16, qs int8[32]. w = q * d. The slice is copied so the result owns its memory.
    return _grouped(np.ascontiguousarray(b[..., 2:34]), f16_field(b, 0), None, 8)


_QUANT_DECODERS: dict[QT, Callable[[np.ndarray], Grouped]] = {
    QT.Q4_0: _decode_q4_0,
    QT.Q4_1: _decode_q4_1,
    QT.Q5_0: _decode_q5_0,
    QT.Q5_1: _decode_q5_1,
    QT.Q8_0: _decode_q8_0,
    QT.Q4_K: decode_q4_k,
    QT.Q5_K: decode_q5_k,
    QT.Q6_K: decode_q6_k,
}
if set(_QUANT_DECODERS) != QUANT_TYPES:  # a registered block type without a decoder, or the reverse
    raise ImportError(f"quants/formats.py decodes {sorted(t.name for t in _QUANT_DECODERS)}, the registry lists "
                      f"{sorted(t.name for t in QUANT_TYPES)}")


# --- public entry points ----------------------------------------------------------------------------


def raw_rows(qtype: QT, raw: np.ndarray, n_cols: int) -> np.ndarray:
    """Check ``raw`` against the type and row length and view it as 2-D rows, decoding nothing.

    Quantized types: uint8 [N, row_bytes]. Float types: typed [N, K] or uint8 [N, K * itemsize].
    1-D input is split into rows. Raises UnsupportedModelError / ModelFileError.
    """
    check_supported(qtype)
    if qtype in FLOAT_TYPES:
        if n_cols <= 0:
            raise ModelFileError(f"{qtype.name}: invalid row length {n_cols}")
        itemsize = _FLOAT_ITEMSIZE[qtype]
        if raw.dtype == np.uint8:
            return _as_rows(raw, n_cols * itemsize, qtype.name)
        if raw.dtype not in _FLOAT_DTYPES[qtype]:
            raise ModelFileError(f"{qtype.name}: raw data has dtype {raw.dtype}, expected uint8 bytes or {_FLOAT_DTYPES[qtype]}")
        return _as_rows(raw, n_cols, qtype.name)
    width = row_bytes(qtype, n_cols)
    if raw.dtype != np.uint8:
        raise ModelFileError(f"{qtype.name}: raw data must be uint8 bytes, got {raw.dtype}")
    return _as_rows(raw, width, qtype.name)


def decode(qtype: QT, raw: np.ndarray, n_cols: int) -> Grouped | np.ndarray:
    """Decode rows of a GGUF tensor.

    raw: for quantized types uint8 [N, row_bytes] (typically a read-only view into the mapped file;
    never written); for F32/F16/BF16 the typed array [N, K] (float32 / float16 / uint16 for bf16)
    or its uint8 bytes [N, K * itemsize]. 1-D input is split into rows of ``n_cols``.
    Returns :class:`Grouped` for quantized types and float32 [N, K] for float types.
    Raises UnsupportedModelError for other types, ModelFileError when the size does not match.
    """
    rows = raw_rows(qtype, raw, n_cols)
    if qtype in FLOAT_TYPES:
        return _decode_float(qtype, rows)
    block, size = GGML_QUANT_SIZES[qtype]
    # [N, row_bytes] -> [N, nb, type_size]: a view when the rows are contiguous, which mapped
    # tensors and row-indexed copies are; a strided view of a column slice would be copied here.
    blocks = rows.reshape(rows.shape[0], n_cols // block, size)
    return _QUANT_DECODERS[qtype](blocks)


def dequantize_rows(qtype: QT, raw: np.ndarray, n_cols: int) -> np.ndarray:
    """float32 [N, K] of the given rows (embedding lookups, norm vectors); always a new writable array."""
    out = decode(qtype, raw, n_cols)
    if isinstance(out, Grouped):
        return out.dequantize()
    return np.array(out, dtype=np.float32, copy=True)
