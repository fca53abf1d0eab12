"""Worker processes share the model instead of copying it: total RSS against the in-process engine."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.real_model

_MEASURE = """
import os, sys, psutil
from powerinfer.api import LLM
llm = LLM(sys.argv[1], n_ctx=200, n_threads=2, executor=sys.argv[2])
ids = list(range(1000, 1128))
llm.engine.eval(ids)
for _ in range(16):
    llm.engine.eval([5])
pids = [os.getpid(), *getattr(llm.engine.executor, "pids", [])]
print(sum(psutil.Process(p).memory_info().rss for p in pids))
llm.close()
"""


def _total_rss(model: Path, executor: str) -> int:
    out = subprocess.run([sys.executable, "-c", _MEASURE, str(model), executor], capture_output=True, text=True, timeout=300, check=True)
    return int(out.stdout.strip().splitlines()[-1])


def test_two_workers_cost_less_than_one_and_a_half_engines(smollm2_path: Path) -> None:
    inprocess = _total_rss(smollm2_path, "inprocess")
    workers = _total_rss(smollm2_path, "process")
    # coordinator (no torch) + 2 workers (each: torch + half the packed weights + its KV cache)
    assert workers < 1.5 * inprocess, (workers / 2**20, inprocess / 2**20)
