"""Pinning a worker process and preferring its node's memory (pinning.py).

Runs in: the pytest process; the pinning and memory-policy checks in spawned children, so the test
process keeps its own affinity and memory policy.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import os
import platform
from pathlib import Path

import pytest

from powerinfer.cpu_workers import pinning as pin_mod
from powerinfer.cpu_workers.pinning import bind_memory_to_node, pin_current_process
from powerinfer.cpu_workers.topology import SYSFS_ENV, Placement
from tests.cpu_workers.test_topology import intel_2x4x2


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="platform lacks sched_setaffinity")
def test_pin_child_process() -> None:
    target = max(os.sched_getaffinity(0))
    # One spawned worker runs both calls in order, so the second sees the first's effect.
    with mp.get_context("spawn").Pool(1) as pool:
        before = pool.apply(os.sched_getaffinity, (0,))
        pool.apply(pin_current_process, (Placement(worker=0, node=0, cpus=(target,)),))
        after = pool.apply(os.sched_getaffinity, (0,))
    assert before == os.sched_getaffinity(0)
    assert after == {target}
    assert os.sched_getaffinity(0) == before, "the test process itself stays unpinned"


def test_pin_failure_only_warns(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def refuse(pid: int, cpus: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "sched_setaffinity", refuse, raising=False)
    with caplog.at_level(logging.WARNING, logger=pin_mod.__name__):
        pin_current_process(Placement(worker=3, node=0, cpus=(0,)))
        pin_current_process(Placement(worker=4, node=0, cpus=()))
    assert "worker 3: could not pin" in caplog.text and "worker 4" in caplog.text


def test_pin_psutil_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[int]] = []

    class FakeProcess:
        def cpu_affinity(self, cpus: list[int]) -> None:
            calls.append(cpus)

    monkeypatch.delattr(os, "sched_setaffinity", raising=False)
    monkeypatch.setattr(pin_mod.psutil, "Process", FakeProcess)
    pin_current_process(Placement(worker=0, node=1, cpus=(9, 1, 1)))
    assert calls == [[1, 9]]


def test_bind_memory_unsupported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    intel_2x4x2(tmp_path)
    assert bind_memory_to_node(0, sysfs=tmp_path / "no-numa") is False  # single node
    assert bind_memory_to_node(5, sysfs=tmp_path) is False  # no such node
    monkeypatch.setattr(platform, "machine", lambda: "sparc64")
    assert bind_memory_to_node(0, sysfs=tmp_path) is False


def bind_and_read_policy(node: int, sysfs: str | None) -> tuple[bool, int, int]:
    """In a child: bind, then read the thread's policy back with get_mempolicy(2) -> (ok, mode, mask)."""
    ok = bind_memory_to_node(node, sysfs=sysfs)
    nr = {"x86_64": 239, "aarch64": 236}[platform.machine()]
    mode, mask = ctypes.c_int(-1), (ctypes.c_ulong * 16)()
    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.syscall(ctypes.c_long(nr), ctypes.byref(mode), mask, ctypes.c_ulong(16 * 64 + 1), ctypes.c_ulong(0), ctypes.c_ulong(0))
    return ok, (mode.value if rc == 0 else -1), mask[0]


@pytest.mark.skipif(platform.system() != "Linux" or platform.machine() not in ("x86_64", "aarch64"), reason="Linux x86_64/aarch64 only")
def test_bind_memory_child(tmp_path: Path) -> None:
    # The fake tree claims two nodes, so the real syscall is made for node 0 (which always exists).
    # Containers may refuse it (EPERM): then it returns False and the policy stays default.
    intel_2x4x2(tmp_path)
    with mp.get_context("spawn").Pool(1) as pool:
        ok, mode, mask = pool.apply(bind_and_read_policy, (0, str(tmp_path)))
    with mp.get_context("spawn").Pool(1) as pool:
        refused = pool.apply(bind_memory_to_node, (1,), {"sysfs": str(tmp_path)})
    if ok:
        assert (mode, mask) == (1, 1), "MPOL_PREFERRED for node 0"
    elif mode != -1:
        assert mode == 0, "a refused call leaves MPOL_DEFAULT"
    if len(list(Path("/sys/devices/system/node").glob("node[0-9]*"))) < 2:
        assert refused is False  # node 1 does not exist on this kernel: EINVAL


def test_no_binding_under_a_fake_tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fake tree's node numbers are not the kernel's: a worker must not bind its memory by them."""
    monkeypatch.setenv(SYSFS_ENV, str(intel_2x4x2(tmp_path)))
    with mp.get_context("spawn").Pool(1) as pool:
        ok, mode, _ = pool.apply(bind_and_read_policy, (0, None))
    assert ok is False and mode in (0, -1)  # MPOL_DEFAULT kept (-1: get_mempolicy itself refused)
