"""Multiprocess executors: equal their in-process oracles, survive dead and hung workers, leave no orphans.

Transport "zmq" (torch shards, one message per layer) is held to the torch in-process executor;
transport "shm" (native ranks, the default) to the native one in tests/coordinator/test_native_pool.py.
The failure tests run on both."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from powerinfer.api import LLM
from powerinfer.protocol import WorkerDiedError
from tests.coordinator.helpers import gone

IDS = [256, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33]


@pytest.mark.slow
@pytest.mark.parametrize("n_workers", [1, 2, 3])
def test_equals_inprocess_oracle(make_model: Callable[..., Path], n_workers: int) -> None:
    # 3 workers: more than the 2 kv heads, and 160 neurons do not split evenly into 3 x 32-aligned ranges
    path = make_model(arch="gemma3", qtype=QT.Q8_0, n_layers=3)
    oracle = LLM(path, n_ctx=64, executor="inprocess", n_shards=n_workers, native=False)
    llm = LLM(path, n_ctx=64, n_threads=n_workers, worker_threads=1, pin=False, transport="zmq")
    try:
        np.testing.assert_allclose(llm.logits(IDS), oracle.logits(IDS), atol=1e-3, rtol=0)
        a = [c.token for c in llm.generate(IDS, 8, temperature=0)]
        b = [c.token for c in oracle.generate(IDS, 8, temperature=0)]
        assert a == b
    finally:
        pids = llm.engine.executor.pids  # type: ignore[attr-defined]
        llm.close()
    assert gone(pids)


@pytest.mark.parametrize("transport", ["shm", "zmq"])
def test_killed_worker_fails_request_then_pool_recovers(make_model: Callable[..., Path], transport: str) -> None:
    llm = LLM(make_model(arch="llama"), n_ctx=128, n_threads=2, worker_threads=1, pin=False, transport=transport)
    try:
        victim = llm.engine.executor.pids[1]  # type: ignore[attr-defined]
        gen = llm.generate(IDS, max_tokens=-1, temperature=0)
        next(gen)
        os.kill(victim, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(WorkerDiedError, match="killed by SIGKILL"):
            for _ in gen:
                pass
        assert time.monotonic() - t0 < 5.0
        assert gone([victim])
        # the pool was restored: the next request works and matches a fresh computation
        text, finish = llm.complete(IDS, max_tokens=4, temperature=0)
        assert finish in ("length", "stop")
        assert victim not in llm.engine.executor.pids  # type: ignore[attr-defined]
    finally:
        pids = llm.engine.executor.pids  # type: ignore[attr-defined]
        llm.close()
    assert gone(pids)


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["shm", "zmq"])
def test_stopped_worker_is_detected(make_model: Callable[..., Path], transport: str) -> None:
    llm = LLM(make_model(arch="llama"), n_ctx=128, n_threads=2, worker_threads=1, pin=False, transport=transport)
    victim = llm.engine.executor.pids[0]  # type: ignore[attr-defined]
    try:
        os.kill(victim, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(WorkerDiedError, match="stopped answering"):
            llm.complete(IDS, max_tokens=4, temperature=0)
        assert time.monotonic() - t0 < 5.0
        assert llm.complete(IDS, max_tokens=2, temperature=0)[1] in ("length", "stop")
    finally:
        pids = llm.engine.executor.pids  # type: ignore[attr-defined]
        llm.close()
    assert gone(pids + [victim])


_CHILD = """
import sys, time
from powerinfer.api import LLM
llm = LLM(sys.argv[1], n_ctx=64, n_threads=2, worker_threads=1, pin=False)
print(" ".join(map(str, llm.engine.executor.pids)), flush=True)
if sys.argv[2] == "serve":
    while True:
        llm.complete([256, 72, 101], max_tokens=2, temperature=0)
"""


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM])
def test_workers_exit_when_coordinator_dies(make_model: Callable[..., Path], how: signal.Signals) -> None:
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(make_model(arch="llama")), "serve"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2
        time.sleep(0.5)  # mid-generation
        proc.send_signal(how)
        proc.wait(timeout=5)
        assert gone(pids, timeout=5.0), "orphan worker processes"
    finally:
        proc.kill()
        proc.wait()


def test_slots_and_batched_decode_over_workers(make_model: Callable[..., Path]) -> None:
    """Protocol v3: ATTN carries each token's KV slot; workers keep one cache per slot."""
    path = make_model(arch="llama", qtype=QT.Q4_0, n_layers=2)
    oracle = LLM(path, n_ctx=32, executor="inprocess", n_slots=2, n_shards=2)
    llm = LLM(path, n_ctx=32, n_threads=2, worker_threads=1, pin=False, n_slots=2, transport="zmq")
    try:
        for eng in (oracle.engine, llm.engine):
            eng.eval(IDS[:5], slot=0)
            eng.eval(IDS[2:11], slot=1)
        want = oracle.engine.decode([7, 9], [0, 1])
        got = llm.engine.decode([7, 9], [0, 1])
        np.testing.assert_allclose(got, want, atol=1e-3, rtol=0)
        assert [len(t) for t in llm.engine.slot_tokens] == [6, 10]
    finally:
        llm.close()
