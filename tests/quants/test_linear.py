"""Tests of the packed torch linears against float64 ``x @ W.T`` of gguf's reference dequantization.

Runs in: the pytest process (CPU torch). Tolerances are relative output errors
``||y - y_ref|| / ||y_ref||`` measured on these synthetic matrices (normal(0, 0.05), 0.1% outliers
at 8x) with headroom of ~2x over the worst seen:

* int4 (exact GGML codes; bf16 scales/zeros and bf16 activations): worst 0.37% -> bound 1%
* bf16 dense (bf16 weights and activations): worst 0.32% -> bound 1%
* int8 (per-output-row requantization): worst 1.9% -> bound 3%
* f32 dense: float32 summation only -> bound 1e-5
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT
from gguf import quants as gq

import powerinfer.quants.from_tensor as from_tensor_mod
import powerinfer.quants.linear as linear_mod
from powerinfer.quants import (
    SUPPORTED_TYPES,
    Grouped,
    Int4Linear,
    PackedLinear,
    decode,
    linear_from_tensor,
    pack_linear,
)
from powerinfer.quants.grouped import split_nibbles

TOLERANCE = {"int4": 0.01, "int4x2": 0.01, "bf16": 0.01, "int8": 0.03, "f32": 1e-5}
ALL_TYPES = sorted(SUPPORTED_TYPES, key=lambda t: t.value)
RANDOM_BLOCK_TYPES = {QT.Q4_K, QT.Q5_K, QT.Q6_K}  # gguf has no quantizer for these


def synthetic_raw(qtype: QT, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Raw rows of a synthetic [n, k] weight (same recipe as test_formats.py)."""
    rng = np.random.default_rng(seed)
    if qtype not in RANDOM_BLOCK_TYPES:
        w = rng.standard_normal((n, k)).astype(np.float32) * np.float32(0.05)
        w.flat[rng.integers(0, n * k, max(1, n * k // 1000))] *= np.float32(8.0)
        return gq.quantize(w, qtype)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n, k // block * size), dtype=np.uint8)
    blocks = raw.reshape(n, k // block, size)

    def f16(lo: float, hi: float) -> np.ndarray:
        v = (rng.random(blocks.shape[:2]) * (hi - lo) + lo).astype(np.float16)
        return v.view(np.uint8).reshape(*blocks.shape[:2], 2)

    if qtype == QT.Q6_K:
        blocks[..., 208:210] = f16(2e-5, 1e-4)
    else:
        blocks[..., 0:2] = f16(1e-4, 5e-4)
        blocks[..., 2:4] = f16(1e-4, 5e-4)
    return raw


def oracle(qtype: QT, raw: np.ndarray, n: int, k: int) -> torch.Tensor:
    """float64 [n, k] of gguf's reference dequantization."""
    data = raw.view(np.uint8) if qtype == QT.BF16 else raw
    return torch.from_numpy(np.asarray(gq.dequantize(data, qtype), dtype=np.float64).reshape(n, k))


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_pack_linear_matches_reference_product(qtype: QT) -> None:
    n, k = 192, 512
    raw = synthetic_raw(qtype, n, k)
    ref_w = oracle(qtype, raw, n, k)
    x = torch.randn(8, k, generator=torch.Generator().manual_seed(1))
    y_ref = x.double() @ ref_w.T
    part = decode(qtype, raw, k)
    auto = pack_linear([part])
    expected = {QT.Q4_0: "int4", QT.Q4_1: "int4", QT.Q4_K: "int4", QT.Q6_K: "int8", QT.F32: "bf16", QT.F16: "bf16", QT.BF16: "bf16"}
    assert auto.kind == expected.get(qtype, "int4x2")
    for kind in ("auto", "int8", "bf16", "f32"):
        lin = pack_linear([part], kind)
        assert isinstance(lin, PackedLinear)
        assert (lin.out_features, lin.in_features) == (n, k)
        y = lin(x)
        assert y.dtype == torch.float32 and y.shape == (8, n)
        assert rel_err(y, y_ref) < TOLERANCE[lin.kind], (qtype.name, lin.kind, rel_err(y, y_ref))
        # dequantized() is what the kernel computes with: only activation/output rounding remains.
        own = x.double() @ lin.dequantized().double().T
        assert rel_err(y, own) < (1e-5 if lin.kind == "f32" else 0.005)


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1, QT.Q4_K], ids=lambda t: t.name)
def test_int4_zero_convention_against_numpy_dequantization(qtype: QT) -> None:
    # torch: w = (c - 8) * s + z_t; GGML: w = c * s + zero, so z_t = zero + 8 * s. A wrong
    # convention would be off by 8 * s per weight: ~50% error, far above bf16 rounding.
    n, k = 64, 256
    raw = synthetic_raw(qtype, n, k)
    g = decode(qtype, raw, k)
    assert isinstance(g, Grouped)
    lin = pack_linear([g])
    assert isinstance(lin, Int4Linear)
    np.testing.assert_array_equal(lin.codes().numpy(), g.q.view(np.uint8))
    deq = lin.dequantized().double()
    assert rel_err(deq, torch.from_numpy(g.dequantize()).double()) < 0.004  # bf16 scales/zeros only
    # Activations exactly representable in bf16: the kernel must agree with its own dequantization
    # up to bf16 output rounding.
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(2)).bfloat16().float()
    assert rel_err(lin(x), x.double() @ deq.T) < 0.003


@pytest.mark.parametrize("n", [16, 64, 80, 100, 200], ids=lambda n: f"N{n}")
def test_int4_layout_round_trip_and_row_padding(n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # N % 16 != 0 is padded to a multiple of 16; N % 64 != 0 exercises the tail-block layout.
    k = 128
    raw = synthetic_raw(QT.Q4_0, n, k, seed=n)
    g = decode(QT.Q4_0, raw, k)
    assert isinstance(g, Grouped)
    lin = pack_linear([g])
    assert isinstance(lin, Int4Linear) and lin.out_features == n
    np.testing.assert_array_equal(lin.codes().numpy(), g.q.view(np.uint8))
    x = torch.randn(3, k)
    y = lin(x)
    assert y.shape == (3, n)
    assert rel_err(y, x.double() @ oracle(QT.Q4_0, raw, n, k).T) < TOLERANCE["int4"]
    # Packing through a 64-row staging buffer (several torch calls, parts split across stages)
    # must give the same bytes as one call on the whole matrix.
    monkeypatch.setattr(linear_mod, "_INT4_PACK_ROWS", 64)
    staged = pack_linear([g.rows(slice(0, n // 3)), g.rows(slice(n // 3, n))])
    assert isinstance(staged, Int4Linear)
    assert torch.equal(staged.packed, lin.packed) and torch.equal(staged.scales_zeros, lin.scales_zeros)


def test_fused_parts_equal_separate_linears() -> None:
    k = 256
    raws = [synthetic_raw(QT.Q4_K, n, k, seed=i) for i, n in enumerate((48, 16, 16))]
    parts = [decode(QT.Q4_K, r, k) for r in raws]
    fused = pack_linear(parts)
    assert fused.kind == "int4" and fused.out_features == 80
    x = torch.randn(5, k)
    separate = torch.cat([pack_linear([p])(x) for p in parts], dim=1)
    torch.testing.assert_close(fused(x), separate, rtol=1e-2, atol=1e-3)
    ref = torch.cat([oracle(QT.Q4_K, r, r.shape[0], k) for r in raws])
    assert rel_err(fused(x), x.double() @ ref.T) < TOLERANCE["int4"]


def test_mixed_parts_fall_back_and_kind_errors() -> None:
    k = 128
    a, b = synthetic_raw(QT.Q4_0, 32, k), synthetic_raw(QT.Q8_0, 32, k, seed=1)
    c = synthetic_raw(QT.Q6_K, 32, 256, seed=2)
    lin = pack_linear([decode(QT.Q4_0, a, k), decode(QT.Q8_0, b, k)])
    assert lin.kind == "int4x2"  # every part has group 32: both split exactly
    x = torch.randn(4, k)
    ref = torch.cat([oracle(QT.Q4_0, a, 32, k), oracle(QT.Q8_0, b, 32, k)])
    assert rel_err(lin(x), x.double() @ ref.T) < TOLERANCE["int4x2"]
    b2 = synthetic_raw(QT.Q8_0, 32, 256, seed=3)
    mixed = pack_linear([decode(QT.Q6_K, c, 256), decode(QT.Q8_0, b2, 256)])
    assert mixed.kind == "int8"  # Q6_K's groups of 16 fit no int4 group
    x = torch.randn(4, 256)
    ref = torch.cat([oracle(QT.Q6_K, c, 32, 256), oracle(QT.Q8_0, b2, 32, 256)])
    assert rel_err(mixed(x), x.double() @ ref.T) < TOLERANCE["int8"]
    floats = np.asarray(oracle(QT.Q8_0, b, 32, k), dtype=np.float32)
    assert pack_linear([floats]).kind == "bf16"
    with pytest.raises(ValueError):
        pack_linear([decode(QT.Q8_0, b, k)], "int4")
    with pytest.raises(ValueError):
        pack_linear([floats], "int3")
    with pytest.raises(ValueError):
        pack_linear([floats, floats[:, :64]])
    with pytest.raises(ValueError):
        pack_linear([])


def test_int8_prefill_path_matches_decode_path() -> None:
    # M >= 32 widens int8 to bf16 for a dense matmul; it must compute the same product as the
    # int8 kernel used for small M (both round the output to bf16).
    k = 256
    lin = pack_linear([decode(QT.Q6_K, synthetic_raw(QT.Q6_K, 96, k), k)])
    assert lin.kind == "int8"
    x = torch.randn(40, k)
    big = lin(x)
    small = torch.cat([lin(x[i : i + 8]) for i in range(0, 40, 8)])
    assert rel_err(big, small.double()) < 0.005


def test_leading_dims_and_shape_errors() -> None:
    k = 64
    for kind in ("auto", "int8", "bf16", "f32"):
        lin = pack_linear([decode(QT.Q4_1, synthetic_raw(QT.Q4_1, 32, k), k)], kind)
        x = torch.randn(2, 3, k)
        y = lin(x)
        assert y.shape == (2, 3, 32)
        torch.testing.assert_close(y.reshape(6, 32), lin(x.reshape(6, k)))
        with pytest.raises(ValueError):
            lin(torch.randn(2, k + 32))


def test_nbytes() -> None:
    n, k = 64, 256
    g = decode(QT.Q4_0, synthetic_raw(QT.Q4_0, n, k), k)
    assert pack_linear([g], "int4").nbytes == n * k // 2 + (k // 32) * n * 2 * 2
    assert pack_linear([g], "int8").nbytes == n * k + n * (2 + 4)  # int8 + bf16 and float32 row scales
    assert pack_linear([g], "bf16").nbytes == n * k * 2
    assert pack_linear([g], "f32").nbytes == n * k * 4


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q8_0, QT.Q6_K, QT.F16], ids=lambda t: t.name)
def test_linear_from_tensor_rows_cols_and_chunks(qtype: QT, monkeypatch: pytest.MonkeyPatch) -> None:
    # Small chunks so selections span several decode and pack chunks.
    monkeypatch.setattr(from_tensor_mod, "CHUNK_ROWS", 48)
    monkeypatch.setattr(linear_mod, "CHUNK_ROWS", 40)
    n, k = 300, 512
    raw = synthetic_raw(qtype, n, k)
    raw.setflags(write=False)  # like a mapped file: must never be written
    whole = decode(qtype, raw, k)
    cases: list[tuple[np.ndarray | slice | None, tuple[int, int] | None]] = [
        (None, None),
        (slice(10, 250), None),
        (np.array([299, 0, 7, 7, 150] * 20), (256, 512)),
    ]
    for rows, cols in cases:
        lin = linear_from_tensor(qtype, raw, k, rows=rows, cols=cols)
        sel = whole if rows is None else (whole.rows(rows) if isinstance(whole, Grouped) else whole[rows])
        full = pack_linear([sel])
        if cols is None:
            expected = full.dequantized()
        elif full.kind == "int8":
            # int8 column ranges keep the full rows' scales: exactly the unsharded columns.
            expected = full.dequantized()[:, cols[0] : cols[1]]
        else:
            part = sel.cols(*cols) if isinstance(sel, Grouped) else sel[:, cols[0] : cols[1]]
            expected = pack_linear([part]).dequantized()
        assert lin.kind == full.kind
        torch.testing.assert_close(lin.dequantized(), expected, rtol=0, atol=0)


def test_int8_column_shards_sum_to_the_unsharded_product() -> None:
    n, k = 64, 768
    raw = synthetic_raw(QT.Q8_0, n, k)
    full = linear_from_tensor(QT.Q8_0, raw, k)
    shards = [linear_from_tensor(QT.Q8_0, raw, k, cols=c) for c in ((0, 256), (256, 512), (512, 768))]
    torch.testing.assert_close(torch.cat([s.dequantized() for s in shards], dim=1), full.dequantized(), rtol=0, atol=0)
    for m in (4, 40):  # kernel path and prefill path
        x = torch.randn(m, k)
        summed = sum(s(x[:, i * 256 : (i + 1) * 256]) for i, s in enumerate(shards))
        assert isinstance(summed, torch.Tensor)
        assert rel_err(summed, full(x).double()) < 0.005  # bf16 output rounding of each shard only


def test_linear_from_tensor_errors() -> None:
    raw = synthetic_raw(QT.Q8_0, 8, 64)
    with pytest.raises(ValueError):
        linear_from_tensor(QT.Q8_0, raw, 64, kind="int4")
    with pytest.raises(ValueError):
        linear_from_tensor(QT.Q8_0, raw, 64, cols=(0, 16))  # not a multiple of the group
    with pytest.raises(ValueError):
        linear_from_tensor(QT.Q8_0, raw, 64, rows=slice(3, 3))


def test_linear_from_tensor_peak_memory_stays_near_packed_size(monkeypatch: pytest.MonkeyPatch) -> None:
    # numpy allocations are visible to tracemalloc (torch's are not). int8: the weight buffer is
    # numpy, so the peak is the int8 size plus one chunk's transients; decoding everything first
    # would add int8 codes and a float32 copy. int4: only the staging buffer is numpy.
    monkeypatch.setattr(from_tensor_mod, "CHUNK_ROWS", 256)
    monkeypatch.setattr(linear_mod, "_INT4_PACK_ROWS", 512)
    n, k = 4096, 768  # K a multiple of Q6_K's 256-wide blocks
    for qtype, kind, bound in ((QT.Q6_K, "int8", 1.5 * n * k), (QT.Q8_0, "int4x2", 1.5 * n * k), (QT.Q4_0, "int4", 0.5 * n * k)):
        raw = synthetic_raw(qtype, n, k)
        tracemalloc.start()
        try:
            lin = linear_from_tensor(qtype, raw, k)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert lin.kind == kind
        assert peak < bound, (kind, peak)


@pytest.mark.parametrize("qtype", [QT.Q5_0, QT.Q5_1, QT.Q5_K, QT.Q8_0], ids=lambda t: t.name)
def test_int4x2_keeps_the_files_codes(qtype: QT) -> None:
    # The split is exact: the two halves dequantize to the file's weights up to bf16 scales (no
    # requantization), so the error is int4's, well under int8's per-row requantization.
    n, k = 96, 256
    raw = synthetic_raw(qtype, n, k)
    g = decode(qtype, raw, k)
    assert isinstance(g, Grouped)
    halves = split_nibbles(g)
    assert halves.shape == (n, 2 * k) and halves.bits == 4
    assert int(halves.q.min()) >= 0 and int(halves.q.max()) <= 15
    np.testing.assert_allclose(halves.dequantize()[:, :k] + halves.dequantize()[:, k:], g.dequantize(), rtol=1e-5, atol=1e-6)
    lin = pack_linear([g])
    assert lin.kind == "int4x2" and lin.in_features == k
    ref = oracle(qtype, raw, n, k)
    assert rel_err(lin.dequantized().double(), ref) < 0.004
    int8 = pack_linear([g], "int8")
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(2))
    y_ref = x.double() @ ref.T
    assert rel_err(lin(x), y_ref) < rel_err(int8(x), y_ref)
