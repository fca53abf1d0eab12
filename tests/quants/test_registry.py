"""The quant registry (quants/registry.py) agrees with every layer that implements a type: the numpy
decoders, the native decoder's C registry and eight-row layouts, and the GPU kernel sources.

Runs in: the pytest process (the native library where a C compiler is present).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT

from powerinfer.native.decoder_lib import decoder_lib
from powerinfer.quants.formats import FLOAT_TYPES, QUANT_TYPES
from powerinfer.quants.registry import REGISTRY, types_where

KERNELS = Path(__file__).resolve().parents[2] / "powerinfer" / "gpu_worker" / "kernels"


def test_records_are_consistent() -> None:
    assert set(REGISTRY) == FLOAT_TYPES | QUANT_TYPES
    for q, t in REGISTRY.items():
        assert t.qtype is q and (t.block, t.block_bytes) == GGML_QUANT_SIZES[q]
        assert not (t.four_bit and t.int4_split), q  # a type packs to int4 one way
        assert t.is_float == (q in (QT.F32, QT.F16, QT.BF16))
        if t.native_align is not None:
            assert t.native_align == t.block, q  # the native dot products take whole blocks
        assert all(0 <= off <= t.block_bytes - 2 for off in t.scale_fields), q
    assert types_where(four_bit=True) == {QT.Q4_0, QT.Q4_1, QT.Q4_K}


def test_gpu_kernels_exist_for_every_suffix() -> None:
    for q, t in REGISTRY.items():
        if t.gpu_suffix is not None:
            src = (KERNELS / f"{t.gpu_suffix}.cu").read_text()  # quant_ops.cuh names the kernels gemv_/axpy_<SUFFIX>
            assert f"#define SUFFIX {t.gpu_suffix}\n" in src and '#include "quant_ops.cuh"' in src, q


@pytest.mark.skipif(decoder_lib() is None, reason="no C compiler for the native decoder")
def test_native_eight_row_layouts_match() -> None:
    lib = decoder_lib()
    assert lib is not None
    if lib.pi_isa() == 0:
        pytest.skip("the portable build has no eight-row layout")
    for q, t in REGISTRY.items():
        assert bool(lib.pi_x8_supported(int(q))) == (t.x8_group_bytes is not None), q
