"""Tests of the GGML block decoders and the Grouped form against gguf's reference dequantizer.

Runs in: the pytest process (any worker process layout; pure numpy). Only synthetic tensors:
gguf's quantizer where it has one, otherwise random but valid K-quant blocks.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT
from gguf import quants as gq

from powerinfer.errors import ModelFileError, UnsupportedModelError
from powerinfer.quants import SUPPORTED_TYPES, Grouped, decode, dequantize_rows

# K-quants: gguf 0.19 has a reference dequantizer but no quantizer for these.
RANDOM_BLOCK_TYPES = {QT.Q4_K, QT.Q5_K, QT.Q6_K}
ALL_TYPES = sorted(SUPPORTED_TYPES, key=lambda t: t.value)
QUANT_TYPES = [t for t in ALL_TYPES if t not in (QT.F32, QT.F16, QT.BF16)]


def synthetic_weights(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    """float32 [n, k]: normal(0, 0.05) with ~0.1% outliers at 8x, like real projection weights."""
    w = rng.standard_normal((n, k)).astype(np.float32) * np.float32(0.05)
    idx = rng.integers(0, n * k, max(1, n * k // 1000))
    w.flat[idx] *= np.float32(8.0)
    return w


def _f16_bytes(rng: np.random.Generator, shape: tuple[int, int], lo: float, hi: float) -> np.ndarray:
    values = (rng.random(shape) * (hi - lo) + lo).astype(np.float16)
    return values.view(np.uint8).reshape(*shape, 2)


def synthetic_raw(qtype: QT, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Raw GGUF rows for [n, k]: uint8 [n, row_bytes] for quant types, typed/bytes for floats."""
    rng = np.random.default_rng(seed)
    if qtype not in RANDOM_BLOCK_TYPES:
        return gq.quantize(synthetic_weights(rng, n, k), qtype)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n, k // block * size), dtype=np.uint8)
    blocks = raw.reshape(n, k // block, size)
    # Random codes and sub-scales are all valid; only the f16 super-block scales need sane values
    # (random bits would give inf/nan). Chosen so weights are of order 0.05 like the other types.
    if qtype == QT.Q6_K:
        blocks[..., 208:210] = _f16_bytes(rng, blocks.shape[:2], 2e-5, 1e-4)
    else:
        blocks[..., 0:2] = _f16_bytes(rng, blocks.shape[:2], 1e-4, 5e-4)  # d
        blocks[..., 2:4] = _f16_bytes(rng, blocks.shape[:2], 1e-4, 5e-4)  # dmin
    return raw


def oracle(qtype: QT, raw: np.ndarray, n: int, k: int) -> np.ndarray:
    """gguf's reference dequantization as float32 [n, k]."""
    data = raw.view(np.uint8) if qtype == QT.BF16 else raw
    return np.asarray(gq.dequantize(data, qtype), dtype=np.float32).reshape(n, k)


def read_only(a: np.ndarray) -> np.ndarray:
    """A read-only copy, like a view into the mapped file: any write by a decoder would raise."""
    b = a.copy()
    b.setflags(write=False)
    return b


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("shape", [(64, 1024), (48, 512)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_decode_matches_gguf_reference(qtype: QT, shape: tuple[int, int]) -> None:
    n, k = shape
    raw = synthetic_raw(qtype, n, k)
    ref = oracle(qtype, raw, n, k)
    out = decode(qtype, read_only(raw), k)
    got = out.dequantize() if isinstance(out, Grouped) else out
    assert got.dtype == np.float32 and got.shape == (n, k)
    # The decoders reproduce ggml's float32 arithmetic; observed bit-exact for every type.
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=0)


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda t: t.name)
def test_grouped_code_convention(qtype: QT) -> None:
    g = decode(qtype, synthetic_raw(qtype, 32, 512), 512)
    assert isinstance(g, Grouped)
    assert g.q.dtype == np.int8 and g.q.shape == (32, 512)
    assert g.group == (16 if qtype == QT.Q6_K else 32)
    assert g.scale.shape == g.zero.shape == (32, 512 // g.group)
    assert g.scale.dtype == g.zero.dtype == np.float32
    lo, hi = int(g.q.min()), int(g.q.max())
    expected = {
        QT.Q4_0: (4, 0, 15),
        QT.Q4_1: (4, 0, 15),
        QT.Q4_K: (4, 0, 15),
        QT.Q5_0: (8, -16, 15),
        QT.Q5_1: (8, 0, 31),
        QT.Q5_K: (8, 0, 31),
        QT.Q6_K: (8, -32, 31),
        QT.Q8_0: (8, -128, 127),
    }[qtype]
    assert g.bits == expected[0]
    assert expected[1] <= lo and hi <= expected[2]
    if qtype in (QT.Q5_0, QT.Q8_0, QT.Q6_K):
        assert not g.zero.any()  # symmetric formats have no offset
    if qtype == QT.Q4_0:
        np.testing.assert_array_equal(g.zero, -8 * g.scale)


@pytest.mark.parametrize("qtype", [QT.F32, QT.F16, QT.BF16], ids=lambda t: t.name)
def test_float_types_accept_typed_and_byte_rows(qtype: QT) -> None:
    n, k = 8, 96
    raw = synthetic_raw(qtype, n, k)
    ref = oracle(qtype, raw, n, k)
    as_bytes = np.ascontiguousarray(raw).view(np.uint8).reshape(n, -1)
    typed = as_bytes.view({QT.F32: np.float32, QT.F16: np.float16, QT.BF16: np.uint16}[qtype])
    for form in (as_bytes, typed, typed.reshape(-1)):
        got = decode(qtype, read_only(form), k)
        assert isinstance(got, np.ndarray) and got.dtype == np.float32
        np.testing.assert_array_equal(got, ref)


def test_one_dimensional_raw_is_split_into_rows() -> None:
    raw = synthetic_raw(QT.Q8_0, 4, 64)
    flat = decode(QT.Q8_0, raw.reshape(-1), 64)
    assert isinstance(flat, Grouped) and flat.shape == (4, 64)
    np.testing.assert_array_equal(flat.dequantize(), oracle(QT.Q8_0, raw, 4, 64))


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q6_K, QT.Q8_0, QT.F32], ids=lambda t: t.name)
def test_dequantize_rows_matches_and_is_writable(qtype: QT) -> None:
    raw = read_only(synthetic_raw(qtype, 16, 256))
    rows = np.array([3, 0, 15])
    got = dequantize_rows(qtype, raw[rows], 256)
    np.testing.assert_array_equal(got, oracle(qtype, raw, 16, 256)[rows])
    assert got.flags.writeable and got.dtype == np.float32


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K, QT.Q5_1], ids=lambda t: t.name)
def test_grouped_rows_cols_concat_follow_the_dense_matrix(qtype: QT) -> None:
    n, k = 40, 512
    g = decode(qtype, synthetic_raw(qtype, n, k), k)
    assert isinstance(g, Grouped)
    dense = g.dequantize()
    idx = np.array([5, 1, 39, 1])
    np.testing.assert_array_equal(g.rows(idx).dequantize(), dense[idx])
    np.testing.assert_array_equal(g.rows(slice(3, 17)).dequantize(), dense[3:17])
    start, stop = 2 * g.group, 10 * g.group
    np.testing.assert_array_equal(g.cols(start, stop).dequantize(), dense[:, start:stop])
    parts = [g.rows(slice(0, 7)), g.rows(slice(20, 40)), g.rows(slice(7, 20))]
    cat = Grouped.concat_rows(parts)
    assert cat.group == g.group and cat.bits == g.bits
    np.testing.assert_array_equal(cat.dequantize(), np.concatenate([dense[0:7], dense[20:40], dense[7:20]]))
    with pytest.raises(ValueError):
        g.cols(1, g.group * 2)
    with pytest.raises(ValueError):
        g.cols(0, k + g.group)


def test_concat_rows_mixed_bits_and_mismatches() -> None:
    a = decode(QT.Q4_0, synthetic_raw(QT.Q4_0, 8, 256), 256)
    b = decode(QT.Q8_0, synthetic_raw(QT.Q8_0, 4, 256, seed=1), 256)
    assert isinstance(a, Grouped) and isinstance(b, Grouped)
    cat = Grouped.concat_rows([a, b])
    assert cat.bits == 8 and cat.shape == (12, 256)
    np.testing.assert_array_equal(cat.dequantize(), np.concatenate([a.dequantize(), b.dequantize()]))
    q6 = decode(QT.Q6_K, synthetic_raw(QT.Q6_K, 4, 256), 256)
    assert isinstance(q6, Grouped)
    with pytest.raises(ValueError):
        Grouped.concat_rows([a, q6])  # group 32 vs 16
    with pytest.raises(ValueError):
        Grouped.concat_rows([a, a.cols(0, 128)])  # different K
    with pytest.raises(ValueError):
        Grouped.concat_rows([])


@pytest.mark.parametrize(
    ("qtype", "raw", "n_cols"),
    [
        (QT.Q8_0, np.zeros((4, 33), np.uint8), 32),  # 34 bytes per row expected
        (QT.Q4_K, np.zeros((2, 144), np.uint8), 128),  # K not a whole 256-block
        (QT.Q4_0, np.zeros(19, np.uint8), 32),  # 1-D, not whole rows
        (QT.Q5_0, np.zeros((2, 22), np.int8), 32),  # not bytes
        (QT.F32, np.zeros((2, 10), np.float32), 12),
        (QT.F16, np.zeros((2, 10), np.float32), 10),  # 4-byte elements for a 2-byte type
        (QT.BF16, np.zeros((2, 30), np.uint8), 16),
    ],
    ids=["q8_0-bytes", "q4_k-cols", "q4_0-1d", "q5_0-dtype", "f32-cols", "f16-dtype", "bf16-bytes"],
)
def test_wrong_raw_size_is_a_model_file_error(qtype: QT, raw: np.ndarray, n_cols: int) -> None:
    with pytest.raises(ModelFileError):
        decode(qtype, raw, n_cols)


@pytest.mark.parametrize("qtype", [QT.Q2_K, QT.IQ4_NL, QT.Q3_K, QT.I8], ids=lambda t: t.name)
def test_unsupported_type_names_the_type(qtype: QT) -> None:
    with pytest.raises(UnsupportedModelError, match=qtype.name):
        decode(qtype, np.zeros((1, 256), np.uint8), 256)
    with pytest.raises(UnsupportedModelError, match=qtype.name):
        dequantize_rows(qtype, np.zeros((1, 256), np.uint8), 256)
