"""Helpers shared by the coordinator tests (worker processes and their fate)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import psutil

if TYPE_CHECKING:
    from powerinfer.coordinator.hybrid_executor import GpuOptions

LONG_PROMPT = " ".join(f"item {i} is {'red' if i % 3 else 'blue'}," for i in range(40))  # 200-odd tokens


def long_prompt_runs(model: Path, gpu: "GpuOptions") -> dict[str, tuple[str, np.ndarray]]:
    """LONG_PROMPT on the pool with a GPU rank (process) and the hybrid executor (inprocess):
    each one's greedy 8-token completion and the prompt's logits [T, V]."""
    from powerinfer.api import LLM

    out = {}
    for executor in ("process", "inprocess"):
        with LLM(model, gpu=gpu, executor=executor, n_threads=2, n_ctx=512) as llm:
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
