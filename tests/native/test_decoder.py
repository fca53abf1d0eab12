"""The native decoder (kernels/decoder.c, qdot.h) against numpy: every type on every ISA this
CPU runs, odd shapes, and whole forward passes against the torch in-process executor."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGUFWriter
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize

from powerinfer.api import LLM
from powerinfer.native.decoder_lib import (
    ISA_CPU_FLAGS,
    best_isa,
    cpu_flags,
    decoder_lib,
    requested_isa,
)
from powerinfer.native.decoder import NativeMatmul
from powerinfer.errors import InvalidArgumentError
from powerinfer.gguf_file import GGUFFile

ISAS = [isa for isa in ("scalar", "avx2", "vnni") if ISA_CPU_FLAGS[isa] <= cpu_flags()]
FLOATS = (QT.F32, QT.F16, QT.BF16)
QUANTS = (QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.Q4_K, QT.Q5_K, QT.Q6_K)
SCALE_OFFSETS = {QT.Q4_0: [0], QT.Q4_1: [0, 2], QT.Q5_0: [0], QT.Q5_1: [0, 2], QT.Q8_0: [0], QT.Q4_K: [0, 2], QT.Q5_K: [0, 2],
                 QT.Q6_K: [208]}
# (rows, cols): one row, rows not a multiple of the 16-row work blocks, the test models' widths
SHAPES = {"32": [(1, 32), (37, 96), (17, 576), (3, 640)], "256": [(1, 256), (37, 512), (5, 1536)]}

pytestmark = pytest.mark.skipif(decoder_lib("scalar") is None, reason="no C compiler")


def random_matrix(rng: np.random.Generator, qt: QT, rows: int, cols: int) -> np.ndarray:
    """Any bit pattern of codes (so every code path of the unpacking is met), sane float16 scales."""
    if qt == QT.F32:
        return rng.normal(size=(rows, cols)).astype(np.float32)
    if qt == QT.F16:
        return rng.normal(size=(rows, cols)).astype(np.float16)
    if qt == QT.BF16:
        return (rng.normal(size=(rows, cols)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    block, size = GGML_QUANT_SIZES[qt]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for off in SCALE_OFFSETS[qt]:
        scales = rng.uniform(0.005, 0.05, size=(rows, cols // block)).astype(np.float16)
        raw[:, :, off : off + 2] = scales.view(np.uint8).reshape(rows, cols // block, 2)
    return raw.reshape(rows, -1)


def exact(f: GGUFFile, qt: QT, name: str) -> np.ndarray:
    """float64 [rows, cols]: gguf's own dequantization (bf16 widened by hand)."""
    raw = f.raw(name)
    if qt == QT.BF16:
        return (np.asarray(raw).view(np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return dequantize(np.asarray(raw), qt).reshape(f.tensor(name).shape).astype(np.float64)


def q8(x: np.ndarray) -> np.ndarray:
    """The activations as the kernels see them: blocks of 32 rounded to max|x| / 127 steps."""
    xb = x.reshape(x.shape[0], -1, 32).astype(np.float32)
    amax = np.abs(xb).max(-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    return (np.rint(xb * inv) * (amax / np.float32(127))).reshape(x.shape).astype(np.float64)


@pytest.fixture(scope="module")
def matrices(tmp_path_factory: pytest.TempPathFactory) -> tuple[GGUFFile, list[tuple[QT, str]]]:
    rng = np.random.default_rng(7)
    path = tmp_path_factory.mktemp("native") / "matrices.gguf"
    w = GGUFWriter(str(path), "llama")
    names = []
    for qt in FLOATS + QUANTS:
        for rows, cols in SHAPES["256" if qt in (QT.Q4_K, QT.Q5_K, QT.Q6_K) else "32"] + ([(5, 50)] if qt in FLOATS else []):
            m = random_matrix(rng, qt, rows, cols)
            name = f"{qt.name}.{rows}x{cols}"
            if qt in (QT.F32, QT.F16):
                w.add_tensor(name, m)
            else:
                w.add_tensor(name, m, raw_shape=(rows, m.shape[1]), raw_dtype=qt)
            names.append((qt, name))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return GGUFFile(path), names


@pytest.mark.parametrize("isa", ISAS)
def test_the_c_type_table_agrees_with_the_python_registry(isa: str) -> None:
    """qtypes.h's one table of type facts says what gguf-py and powerinfer/quants/registry.py say:
    values and bytes per block, the native alignment, an eight-row group's block bytes (which the
    bindings allocate from the Python side), the split layout; types it lacks are refused."""
    from powerinfer.quants.registry import REGISTRY

    lib = decoder_lib(isa)
    assert lib is not None
    for qt in (*FLOATS, *QUANTS):
        out = np.zeros(4, dtype=np.int32)
        assert lib.pi_qtype_facts(int(qt), out.ctypes.data) == 0, qt.name
        block, size = GGML_QUANT_SIZES[qt]
        t = REGISTRY[qt]
        assert (out[0], out[1]) == (block, size) and out[0] == t.native_align, qt.name
        assert out[2] == (t.x8_group_bytes or 0), qt.name
        assert bool(out[3]) == (qt in (QT.Q4_0, QT.Q4_1)), qt.name
        assert bool(lib.pi_x8_supported(int(qt))) == (isa != "scalar" and t.x8_group_bytes is not None), qt.name
    for qt in (QT.Q2_K, QT.Q3_K, QT.IQ4_NL, QT.Q8_1):
        assert lib.pi_qtype_facts(int(qt), np.zeros(4, dtype=np.int32).ctypes.data) == 1, qt.name


@pytest.mark.parametrize("isa", ISAS)
def test_every_type_against_numpy(isa: str, matrices: tuple[GGUFFile, list[tuple[QT, str]]]) -> None:
    f, names = matrices
    lib = decoder_lib(isa)
    assert lib is not None and lib.pi_isa() == {"scalar": 0, "avx2": 1, "vnni": 2}[isa]
    rng = np.random.default_rng(1)
    seen = set()
    for qt, name in names:
        W = exact(f, qt, name)
        for T in (1, 3, 11):  # one token; fewer than four; four-token groups, a remainder and two chunks
            x = rng.normal(size=(T, W.shape[1])).astype(np.float32)
            x[0, :7] *= 20  # an outlier block
            xr = x.astype(np.float64) if qt in FLOATS else q8(x)
            ref = xr @ W.T
            mm = NativeMatmul(lib, f, name, n_threads=2, max_t=9, x8=True)  # Q4_0 / Q4_1 / Q5_0 / Q8_0 / Q6_K: repacked rows too
            y = mm(x)
            # float32 summation error is relative to the sum of |terms|, not to the result
            err = np.abs(y - ref).max() / (np.abs(xr) @ np.abs(W).T).max()
            assert err < 1e-6, (isa, name, T, err)
        seen.add(qt)
        if qt in (QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q8_0, QT.Q6_K) and isa != "scalar" and W.shape[0] >= 8:
            assert mm.packed is not None
            seen.add(f"{qt.name}-x8")
    assert seen == set(FLOATS + QUANTS) | ({"Q4_0-x8", "Q4_1-x8", "Q5_0-x8", "Q8_0-x8", "Q6_K-x8"} if isa != "scalar" else set())


def test_quantized_activations_are_what_makes_the_error(matrices: tuple[GGUFFile, list[tuple[QT, str]]]) -> None:
    """Held to the float activations instead, the same kernels are off by the 8-bit rounding (the
    check above would fail if the kernels computed with x unrounded, or rounded differently)."""
    f, names = matrices
    lib = decoder_lib("scalar")
    assert lib is not None
    x = np.random.default_rng(2).normal(size=(1, 576)).astype(np.float32)
    W = exact(f, QT.Q4_1, "Q4_1.17x576")
    y = NativeMatmul(lib, f, "Q4_1.17x576")(x)
    assert np.abs(y - x.astype(np.float64) @ W.T).max() / np.abs(y).max() > 1e-4


def test_isa_choice_follows_the_cpu_and_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert best_isa(set()) == "scalar"
    assert best_isa({"avx2", "fma", "f16c"}) == "avx2"
    assert best_isa(ISA_CPU_FLAGS["vnni"]) == "vnni"
    monkeypatch.setenv("POWERINFER_ISA", "scalar")
    assert requested_isa() == "scalar"
    monkeypatch.setenv("POWERINFER_ISA", "sse9")
    with pytest.raises(InvalidArgumentError, match="POWERINFER_ISA"):
        requested_isa()


@pytest.mark.parametrize("arch,qtype", [("llama", QT.Q4_0), ("qwen2", QT.Q8_0), ("gemma3", QT.Q5_0), ("llama", QT.F16)])
def test_forward_equals_the_torch_executor(arch: str, qtype: QT, make_model: Callable[..., Path]) -> None:
    """Prefill in chunks, decode, and batched decode over slots: the native decoder's logits against
    the torch in-process executor's (which rounds activations to bf16, the native one to 8 bits).
    gguf-py cannot write K-quants; the real models' tests run Q4_K and Q6_K through the decoder."""
    path = make_model(arch=arch, qtype=qtype, n_layers=2)
    native = LLM(path, n_ctx=64, executor="inprocess", native=True, n_batch=5, n_slots=2, n_threads=2)
    oracle = LLM(path, n_ctx=64, executor="inprocess", native=False, n_batch=5, n_slots=2)
    try:
        ids = [256, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]  # 13 tokens: chunks of 5
        a, b = native.logits(ids), oracle.logits(ids)
        assert np.abs(a - b).max() < 0.05 * np.abs(b).max()
        assert (a.argmax(-1) == b.argmax(-1)).mean() >= 0.9
        for llm in (native, oracle):  # a second sequence in slot 1, then one batched step of both
            llm.engine.eval([256, 65, 66], slot=1)
        da = native.engine.decode([10, 20], [0, 1])
        db = oracle.engine.decode([10, 20], [0, 1])
        assert np.abs(da - db).max() < 0.05 * np.abs(db).max()
        alone = native.engine.decode([30], [1])  # slot 1 alone equals its row of a batched step
        native.engine.rewind(len(native.engine.slot_tokens[1]) - 1, slot=1)
        native.engine.rewind(len(native.engine.slot_tokens[0]) - 1, slot=0)
        both = native.engine.decode([40, 30], [0, 1])
        np.testing.assert_array_equal(both[1], alone[0])
    finally:
        native.close()
        oracle.close()


def test_native_true_refuses_what_it_cannot_run(make_model: Callable[..., Path]) -> None:
    path = make_model(arch="llama", qtype=QT.Q4_0, n_layers=2)
    with pytest.raises(InvalidArgumentError, match="one shard"):
        LLM(path, executor="inprocess", native=True, n_shards=2)
