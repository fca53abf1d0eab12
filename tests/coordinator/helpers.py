"""Helpers shared by the coordinator tests (worker processes and their fate)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import psutil

if TYPE_CHECKING:
    from powerinfer.coordinator.hybrid_executor import GpuOptions
    from powerinfer.coordinator.native_pool import NativePoolExecutor

LONG_PROMPT = " ".join(f"item {i} is {'red' if i % 3 else 'blue'}," for i in range(40))  # 200-odd tokens


def long_prompt_runs(model: Path, gpu: "GpuOptions") -> dict[str, tuple[str, np.ndarray]]:
    """LONG_PROMPT on the pool with a GPU rank (process) and the hybrid executor (inprocess):
    each one's greedy 8-token completion and the prompt's logits [T, V]."""
    from powerinfer.api import LLM

    out = {}
    for executor in ("process", "inprocess"):
        with LLM(model, gpu=gpu, executor=executor, n_threads=2, worker_threads=1, n_ctx=512) as llm:
            ids = llm.tokenize(LONG_PROMPT)
            assert len(ids) > 200
            out[executor] = (llm.complete(LONG_PROMPT, max_tokens=8, temperature=0)[0], llm.logits(ids))
    return out


def gone(pids: list[int], timeout: float = 5.0) -> bool:
    """True once none of pids is running (zombies count as gone: their parent reaps them)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
            return True
        time.sleep(0.05)
    return False


def kill_the_gpu_rank_mid_step(ex: "NativePoolExecutor", ids: list[int]) -> tuple[list[int], np.ndarray]:
    """Step ids[:6] on the pool, then stop its GPU rank and kill it half a second into the next
    step, which must fail within 5 s naming it -> (the pool's pids before, the first step's logits)."""
    import os
    import signal
    import threading

    import pytest

    from powerinfer.protocol import WorkerDiedError

    pids = list(ex.pids)
    before = ex.native_step(ids[:6], range(6), [0] * 6, False, 1.0, 8)
    victim = pids[-1]
    os.kill(victim, signal.SIGSTOP)
    threading.Timer(0.5, os.kill, (victim, signal.SIGKILL)).start()
    t0 = time.monotonic()
    with pytest.raises(WorkerDiedError, match="the GPU worker .* killed by SIGKILL"):
        ex.native_step([ids[6]], [6], [0], False, 1.0, 8)
    assert time.monotonic() - t0 < 5.0
    return pids, before
