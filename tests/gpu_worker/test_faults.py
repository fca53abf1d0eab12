"""The GPU worker process (numpy backend) killed or stopped mid-generation: the request gets a clear
WorkerDiedError, the next request starts a fresh GPU worker, and no process is left behind; a
server turns /health to 503 until it has replaced the worker.

Runs in: the pytest process (the coordinator), the GPU worker and the server in child processes.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Callable

import httpx
import psutil
import pytest
from gguf import GGMLQuantizationType as QT

from powerinfer.api import LLM
from powerinfer.coordinator.hybrid_executor import GpuOptions
from powerinfer.protocol import WorkerDiedError
from tests.processes.children import worker_children
from tests.server.conftest import start_server

OPTS = GpuOptions(backend="cpu", vram_budget_gib=0.002, n_gpu_layers=1)
IDS = [256, 72, 101, 108, 108, 111, 44, 32]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["SIGKILL", "SIGSTOP"])
def test_gpu_worker_fault_during_decode(make_model: Callable[..., Path], sig: signal.Signals) -> None:
    llm = LLM(make_model(arch="llama", qtype=QT.Q4_0, n_layers=2), n_ctx=256, executor="inprocess", gpu=OPTS)
    try:
        first = llm.engine.executor.pids  # type: ignore[attr-defined]
        assert len(first) == 1
        t0 = time.monotonic()
        with pytest.raises(WorkerDiedError, match="the GPU worker .* (killed by SIGKILL|stopped answering)"):
            for i, _ in enumerate(llm.generate(IDS, 200, temperature=0)):
                if i == 3:
                    os.kill(first[0], sig)
        assert time.monotonic() - t0 < 30
        text = [c.token for c in llm.generate(IDS, 4, temperature=0)]  # a fresh GPU worker serves this
        assert len(text) == 5
        second = llm.engine.executor.pids  # type: ignore[attr-defined]
        assert second != first and (not psutil.pid_exists(first[0]) or psutil.Process(first[0]).status() == psutil.STATUS_ZOMBIE)
    finally:
        pids = llm.engine.executor.pids  # type: ignore[attr-defined]
        llm.close()
    _, alive = psutil.wait_procs([psutil.Process(p) for p in pids if psutil.pid_exists(p)], timeout=5)
    assert not alive


def test_server_replaces_a_dead_gpu_worker(make_model: Callable[..., Path], tmp_path: Path) -> None:
    model = make_model(arch="llama", qtype=QT.Q4_0, n_layers=2)
    server = start_server(model, tmp_path, "-c", "64", "--executor", "inprocess", "-ngl", "1", "--vram-budget", "0.002",
                          "--gpu-backend", "cpu")
    try:
        gpu = worker_children(server.proc.pid, "gpu_worker.worker")
        assert len(gpu) == 1
        gpu[0].kill()
        codes = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (503 in codes and codes[-1] == 200):
            codes.append(httpx.get(server.url + "/health").status_code)
            time.sleep(0.05)
        assert 503 in codes and codes[-1] == 200, codes
        r = httpx.post(server.base_url + "/completions", json={"prompt": [256, 72, 101], "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        assert server.stop() == 0
