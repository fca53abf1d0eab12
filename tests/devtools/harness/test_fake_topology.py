"""The fake multi-socket tree: it reads back as the nodes it was written with, POWERINFER_SYSFS
makes the product plan with it, and the native pool's ranks then run pinned one per fake node and
give the in-process decoder's numbers.

Runs in: the pytest process (the pool test starts worker processes; it needs two usable CPUs).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from powerinfer.api import LLM
from powerinfer.devtools.harness.fake_topology import main, write_fake_sysfs
from powerinfer.native.decoder_lib import decoder_lib
from powerinfer.cpu_workers.topology import SYSFS_ENV, plan_placement, read_topology
from powerinfer.errors import InvalidArgumentError
from tests.cpu_workers.test_topology import intel_2x4x2

IDS = [256, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33]


def test_split_keeps_cores_and_siblings(tmp_path: Path) -> None:
    box = read_topology(intel_2x4x2(tmp_path / "real"), allowed=range(16))
    topo = read_topology(write_fake_sysfs(tmp_path / "fake", 4, box), allowed=range(16))
    assert topo.nodes == (0, 1, 2, 3)
    assert [c.cpus for c in topo.cores] == [c.cpus for c in box.cores]  # same cores, hyperthread pairs kept
    assert [len(topo.cores_of(n)) for n in topo.nodes] == [2, 2, 2, 2]
    three = read_topology(write_fake_sysfs(tmp_path / "three", 3, box), allowed=range(16))
    assert [len(three.cores_of(n)) for n in three.nodes] == [3, 3, 2]  # the remainder to the first nodes


def test_bad_requests_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    box = read_topology(intel_2x4x2(tmp_path / "real"), allowed=range(16))
    with pytest.raises(InvalidArgumentError, match="9 nodes need at least 9 physical cores"):
        write_fake_sysfs(tmp_path / "a", 9, box)
    with pytest.raises(InvalidArgumentError, match="at least one node"):
        write_fake_sysfs(tmp_path / "b", 0, box)
    (tmp_path / "c").mkdir()
    with pytest.raises(InvalidArgumentError, match="exists"):
        write_fake_sysfs(tmp_path / "c", 1, box)
    with pytest.raises(SystemExit):
        main([str(tmp_path / "c"), "--nodes", "1"])
    assert "exists" in capsys.readouterr().err


def test_environment_variable_redirects_the_planner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    root = intel_2x4x2(tmp_path)
    monkeypatch.setenv(SYSFS_ENV, str(root))
    topo = read_topology(allowed=range(16))
    assert topo.nodes == (0, 1) and topo.n_physical == 8
    monkeypatch.delenv(SYSFS_ENV)
    assert read_topology(allowed=range(16)) != topo
    monkeypatch.setenv(SYSFS_ENV, str(tmp_path / "typo"))
    with caplog.at_level(logging.WARNING):
        read_topology(allowed=range(2))
    assert "not a directory" in caplog.text


needs_two = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or decoder_lib() is None,
                               reason="needs two usable CPUs and a C compiler")


def _allowed(pid: int) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return line.split()[1]
    raise AssertionError(f"no Cpus_allowed_list for {pid}")


@needs_two
def test_pool_on_two_fake_nodes_pins_a_rank_per_node_and_equals_in_process(tmp_path: Path, make_model: Callable[..., Path],
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    mine = sorted(os.sched_getaffinity(0))[:2]
    real = read_topology("/sys", allowed=mine)
    if real.n_physical < 2:
        pytest.skip("the two usable CPUs are hyperthreads of one core")
    monkeypatch.setenv(SYSFS_ENV, str(write_fake_sysfs(tmp_path / "sys", 2, real)))
    fake = read_topology()
    assert [p.node for p in plan_placement(fake, 2)] == [0, 1]
    span = plan_placement(fake, 1, threads_per_worker=2)  # a rank wider than a node spans both, not one core twice
    assert span[0].cpus == fake.cpus
    path = make_model(arch="llama", qtype=QT.Q4_0, n_layers=2)
    oracle = LLM(path, n_ctx=64, executor="inprocess", n_threads=1, native=True)
    llm = LLM(path, n_ctx=64, n_threads=2, pin=True)
    try:
        pids = llm.engine.executor.pids  # type: ignore[attr-defined]
        want = [",".join(str(c) for core in fake.cores_of(node) for c in core.cpus) for node in fake.nodes]
        assert [_allowed(pid) for pid in pids] == want
        np.testing.assert_array_equal(llm.logits(IDS), oracle.logits(IDS))
    finally:
        llm.close()


@needs_two
def test_default_threads_on_one_fake_node_run_one_rank_equal_to_in_process(tmp_path: Path, make_model: Callable[..., Path],
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """-t 2 on one node: one rank process with both cores as its two threads, the in-process
    decoder's numbers to the bit; --worker-threads 1 still makes a rank per thread, and a count
    that does not divide the threads is refused."""
    real = read_topology("/sys", allowed=sorted(os.sched_getaffinity(0))[:2])
    if real.n_physical < 2:
        pytest.skip("the two usable CPUs are hyperthreads of one core")
    monkeypatch.setenv(SYSFS_ENV, str(write_fake_sysfs(tmp_path / "sys", 1, real)))
    path = make_model(arch="llama", qtype=QT.Q4_0, n_layers=2)
    oracle = LLM(path, n_ctx=64, executor="inprocess", n_threads=2, native=True)
    for worker_threads, ranks in ((None, 1), (1, 2)):
        with LLM(path, n_ctx=64, n_threads=2, worker_threads=worker_threads, pin=True) as llm:
            desc = llm.engine.executor.describe()
            assert len(desc.pids) == ranks, worker_threads
            assert desc.placement[0].startswith(f"placement  {ranks} CPU worker process{'es' if ranks > 1 else ''} of "
                                                f"{2 // ranks} thread{'s' if ranks == 1 else ''}")
            np.testing.assert_array_equal(llm.logits(IDS), oracle.logits(IDS))
    with pytest.raises(InvalidArgumentError, match="multiple of --worker-threads"):
        LLM(path, n_ctx=64, n_threads=3, worker_threads=2, pin=False)
    oracle.close()
