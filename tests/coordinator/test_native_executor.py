"""The native executor as the in-process default: fallbacks, every ISA through the engine, idle threads."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from powerinfer.api import LLM
from powerinfer.coordinator.inprocess import InProcessExecutor
from powerinfer.coordinator.native_executor import NativeExecutor
from powerinfer.native import decoder_lib as native_lib
from powerinfer.native.decoder_lib import ISA_CPU_FLAGS, cpu_flags, decoder_lib

pytestmark = pytest.mark.skipif(decoder_lib("scalar") is None, reason="no C compiler")
ISAS = [isa for isa in ("scalar", "avx2", "vnni") if ISA_CPU_FLAGS[isa] <= cpu_flags()]


@pytest.fixture(scope="module")
def model(make_model: Callable[..., Path]) -> Path:
    return make_model(arch="llama", qtype=QT.Q4_0, n_layers=2)


def test_inprocess_default_is_native_and_native_false_is_torch(model: Path) -> None:
    with LLM(model, executor="inprocess", n_ctx=32) as a, LLM(model, executor="inprocess", n_ctx=32, native=False) as b:
        assert isinstance(a.engine.executor, NativeExecutor) and isinstance(b.engine.executor, InProcessExecutor)


def test_native_disabled_by_environment_warns_and_uses_torch(model: Path, monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("POWERINFER_NATIVE", "0")
    with caplog.at_level(logging.WARNING), LLM(model, executor="inprocess", n_ctx=32) as llm:
        assert isinstance(llm.engine.executor, InProcessExecutor)
        assert [c.token for c in llm.generate([256, 65], 3, temperature=0)]
    assert sum("POWERINFER_NATIVE=0" in r.getMessage() for r in caplog.records) == 1


def test_no_compiler_warns_and_uses_torch(model: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
                                          tmp_path: Path) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("PATH", str(tmp_path))  # and no cc, gcc or clang on PATH
    monkeypatch.setenv("POWERINFER_CACHE", str(tmp_path / "cache"))  # nothing built yet
    native_lib._load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING), LLM(model, executor="inprocess", n_ctx=32) as llm:
            assert isinstance(llm.engine.executor, InProcessExecutor)
        assert any("native decoder unavailable" in r.getMessage() and "compiler" in r.getMessage() for r in caplog.records)
    finally:
        native_lib._load.cache_clear()


@pytest.mark.parametrize("isa", ISAS)
def test_every_isa_generates_what_the_best_one_does(isa: str, model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """POWERINFER_ISA picks the build the engine runs; logits agree across builds to float rounding."""
    ids = [256, 72, 101, 108, 108, 111, 33, 10, 65, 66]
    with LLM(model, executor="inprocess", n_ctx=64, n_batch=4) as best:
        want = best.logits(ids)
    monkeypatch.setenv("POWERINFER_ISA", isa)
    with LLM(model, executor="inprocess", n_ctx=64, n_batch=4) as llm:
        assert isinstance(llm.engine.executor, NativeExecutor)
        assert llm.engine.executor.decoder.lib.pi_isa() == {"scalar": 0, "avx2": 1, "vnni": 2}[isa]
        got = llm.logits(ids)
    np.testing.assert_allclose(got, want, atol=1e-3 * float(np.abs(want).max()), rtol=0)


def test_idle_threads_sleep(model: Path) -> None:
    import resource

    with LLM(model, executor="inprocess", n_ctx=64, n_threads=2) as llm:
        list(llm.generate([256, 65], 8, temperature=0))
        time.sleep(0.3)  # past OpenMP's spin before its threads block
        t0 = resource.getrusage(resource.RUSAGE_SELF)
        time.sleep(1.0)
        t1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (t1.ru_utime - t0.ru_utime) + (t1.ru_stime - t0.ru_stime)
    assert cpu < 0.05, f"{cpu:.3f} CPU-seconds in 1 s idle"
