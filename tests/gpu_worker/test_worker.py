"""The GPU worker process over the wire protocol (CPU backend): same numbers as the in-process
worker, typed load errors, errors that leave it serving, death detection.

Runs in: the pytest process plus one GPU worker process per test.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from powerinfer.gpu_worker.client import GpuSetup, GpuWorkerProcess, LocalGpuWorker
from powerinfer.gpu_worker.errors import GpuMemoryError
from powerinfer.gpu_worker.layout import GpuPlan
from powerinfer.protocol import WorkerDiedError, WorkerError
from powerinfer.predictors.predictor_file import write_predictor
from tests.gpu_worker.helpers import load, make_predictor


def _setup(n_ff: int, budget: int = 1 << 30, backend: str = "cpu") -> GpuSetup:
    plan = GpuPlan((np.arange(0, n_ff, 2), np.arange(n_ff)), (True, False), True, 4)
    return GpuSetup(backend, budget, plan)


def test_process_worker_equals_the_in_process_one(make_model: Callable[..., Path], tmp_path: Path) -> None:
    path = make_model(arch="gemma3", qtype=QT.Q8_0)
    f, cfg = load(path)
    pf = make_predictor(f, cfg, "gate")
    write_predictor(tmp_path / "m.predictor", pf)
    setup = _setup(cfg.n_ff)
    local = LocalGpuWorker(f, cfg, setup, 32, 2, pf)
    remote = GpuWorkerProcess(str(path), setup, 32, 2, str(tmp_path / "m.predictor"))
    try:
        assert remote.weight_bytes == local.weight_bytes > 0
        rng = np.random.default_rng(0)
        for t, start, slot in ((6, 0, 1), (1, 6, 1), (1, 0, 0)):
            x = rng.standard_normal((t, cfg.d_model)).astype(np.float32)
            pos, slots = np.arange(start, start + t), np.full(t, slot)
            np.testing.assert_array_equal(remote.attention_begin(0, x, pos, slots).result(), local.attention_begin(0, x, pos, slots).result())
            for layer in (0, 1):
                np.testing.assert_array_equal(remote.ffn_begin(layer, x).result(), local.ffn_begin(layer, x).result())
    finally:
        remote.close()
        local.close()
    assert remote.proc.returncode == 0  # SHUTDOWN: a clean exit


def test_load_failure_is_the_typed_error_with_its_advice(make_model: Callable[..., Path]) -> None:
    path = make_model(arch="llama")
    _, cfg = load(path)
    with pytest.raises(GpuMemoryError, match=r"--vram-budget"):
        GpuWorkerProcess(str(path), _setup(cfg.n_ff, budget=1000), 32)


def test_errors_leave_it_serving_and_death_is_detected(make_model: Callable[..., Path]) -> None:
    path = make_model(arch="llama")
    _, cfg = load(path)
    w = GpuWorkerProcess(str(path), _setup(cfg.n_ff), 32)
    try:
        x = np.ones((1, cfg.d_model), np.float32)
        with pytest.raises(WorkerError, match="not on the GPU"):
            w.attention_begin(1, x, np.array([0]), None).result()  # layer 1's attention is on the CPU
        assert np.isfinite(w.ffn_begin(1, x).result()).all()
        # a result taken twice is refused at once (not a 600 s wait); an abandoned one frees the
        # handle for the next request, and its late reply is skipped as stale
        p = w.ffn_begin(1, x)
        first = p.result()
        with pytest.raises(RuntimeError, match="already taken"):
            p.result()
        w.ffn_begin(1, 2 * x).abandon()
        np.testing.assert_array_equal(w.ffn_begin(1, x).result(), first)
        os.kill(w.proc.pid, signal.SIGKILL)
        with pytest.raises(WorkerDiedError):
            w.ffn_begin(1, x).result()
    finally:
        w.close()
