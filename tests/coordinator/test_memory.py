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
llm = LLM(sys.argv[1], n_ctx=200, n_threads=2, worker_threads=1, executor=sys.argv[2], native=None if sys.argv[3] == "auto" else sys.argv[3] == "native")
ids = list(range(1000, 1128))
llm.engine.eval(ids)
for _ in range(16):
    llm.engine.eval([5])
pids = [os.getpid(), *getattr(llm.engine.executor, "pids", [])]
print(sum(psutil.Process(p).memory_info().rss for p in pids))
llm.close()
"""


def _total_rss(model: Path, executor: str, kind: str = "auto") -> int:
    out = subprocess.run([sys.executable, "-c", _MEASURE, str(model), executor, kind], capture_output=True, text=True, timeout=300,
                         check=True)
    return int(out.stdout.strip().splitlines()[-1])


def test_two_workers_cost_less_than_one_and_a_half_engines(smollm2_path: Path) -> None:
    inprocess = _total_rss(smollm2_path, "inprocess", "torch")
    workers = _total_rss(smollm2_path, "process")
    # coordinator (no torch) + 2 workers (each: torch + half the packed weights + its KV cache)
    assert workers < 1.5 * inprocess, (workers / 2**20, inprocess / 2**20)


def test_native_engine_holds_no_copy_of_the_weights(smollm2_path: Path) -> None:
    """The native decoder reads the mapped file and imports no torch: its RSS is the touched file
    pages (~94 MiB) plus the interpreter, numpy and the KV cache, well under the torch engine's."""
    native = _total_rss(smollm2_path, "inprocess", "native")
    torch_engine = _total_rss(smollm2_path, "inprocess", "torch")
    assert native < 300 * 2**20 and native < 0.6 * torch_engine, (native / 2**20, torch_engine / 2**20)
