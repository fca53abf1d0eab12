"""Topology discovery and worker placement against fake sysfs trees, plus this machine's real /sys.

Runs in: the pytest process.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

from powerinfer.cpu_workers import topology as topo_mod
from powerinfer.cpu_workers.topology import (
    Core,
    Placement,
    Topology,
    default_workers,
    parse_cpulist,
    plan_placement,
    read_topology,
    split_threads,
)
from powerinfer.errors import InvalidArgumentError


@dataclass(frozen=True)
class FakeCpu:
    core_id: int | None
    package: int | None
    siblings: str | None  # thread_siblings_list text; None = file missing
    online: str | None = None  # per-CPU "online" file; None = missing (as for cpu0 on real boxes)
    topology_dir: bool = True


def make_sysfs(root: Path, nodes: dict[int, str] | None, cpus: dict[int, FakeCpu], online: str | None = None) -> Path:
    """Write a sysfs tree under root; nodes=None means the kernel has no node directory at all."""
    system = root / "devices" / "system"
    (system / "cpu").mkdir(parents=True)
    if online is not None:
        (system / "cpu" / "online").write_text(online + "\n")
    if nodes is not None:
        for node, cpulist in nodes.items():
            (system / "node" / f"node{node}").mkdir(parents=True)
            (system / "node" / f"node{node}" / "cpulist").write_text(cpulist + "\n")
    for cpu, spec in cpus.items():
        d = system / "cpu" / f"cpu{cpu}"
        d.mkdir()
        if spec.online is not None:
            (d / "online").write_text(spec.online + "\n")
        if not spec.topology_dir:
            continue
        (d / "topology").mkdir()
        for name, value in (("core_id", spec.core_id), ("physical_package_id", spec.package), ("thread_siblings_list", spec.siblings)):
            if value is not None:
                (d / "topology" / name).write_text(f"{value}\n")
    return root


def intel_2x4x2(root: Path) -> Path:
    """2 sockets x 4 cores x 2 threads, Intel numbering: siblings n and n+8, socket 1 = cpus 4-7,12-15."""
    cpus = {}
    for cpu in range(16):
        first = cpu % 8
        cpus[cpu] = FakeCpu(core_id=first % 4, package=first // 4, siblings=f"{first},{first + 8}")
    return make_sysfs(root, {0: "0-3,8-11", 1: "4-7,12-15"}, cpus, online="0-15")


@pytest.fixture
def box(tmp_path: Path) -> Topology:
    return read_topology(intel_2x4x2(tmp_path), allowed=range(16))


# ---------------------------------------------------------------------------------------------
# parse_cpulist


@pytest.mark.parametrize(
    "text, expected",
    [
        ("0-3,8,10-11", [0, 1, 2, 3, 8, 10, 11]),
        ("0\n", [0]),
        ("", []),
        ("  \n", []),
        ("5-5", [5]),
        ("8,0-1", [0, 1, 8]),
        ("0-2,1-3", [0, 1, 2, 3]),
        ("0, 2", [0, 2]),
    ],
)
def test_parse_cpulist(text: str, expected: list[int]) -> None:
    assert parse_cpulist(text) == expected


@pytest.mark.parametrize("text", ["abc", "1,,2", "1,", ",1", "3-1", "-1", "1-", "0-3:2", "1.5", "0x3", "0-99999999999", "١"])
def test_parse_cpulist_garbage(text: str) -> None:
    with pytest.raises(ValueError):
        parse_cpulist(text)


# ---------------------------------------------------------------------------------------------
# read_topology


def test_two_nodes_with_hyperthreads(box: Topology) -> None:
    assert box.nodes == (0, 1)
    assert box.n_physical == 8
    assert [c.cpus for c in box.cores_of(0)] == [(0, 8), (1, 9), (2, 10), (3, 11)]
    assert [c.cpus for c in box.cores_of(1)] == [(4, 12), (5, 13), (6, 14), (7, 15)]
    assert [(c.node, c.package, c.id) for c in box.cores] == [(n, n, i) for n in (0, 1) for i in range(4)]
    assert box.cpus == tuple(range(16))


def test_amd_style_adjacent_siblings_and_sparse_core_ids(tmp_path: Path) -> None:
    # Siblings 2k,2k+1; core ids with holes and listed out of order must still sort by id.
    ids = [4, 0, 9, 1]
    cpus = {cpu: FakeCpu(core_id=ids[cpu // 2], package=0, siblings=f"{cpu & ~1}-{cpu | 1}") for cpu in range(8)}
    topo = read_topology(make_sysfs(tmp_path, {0: "0-7"}, cpus), allowed=range(8))
    assert [(c.id, c.cpus) for c in topo.cores] == [(0, (2, 3)), (1, (6, 7)), (4, (0, 1)), (9, (4, 5))]


def test_no_node_directory(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cpus = {cpu: FakeCpu(core_id=cpu % 2, package=0, siblings=f"{cpu % 2},{cpu % 2 + 2}") for cpu in range(4)}
    with caplog.at_level(logging.INFO, logger=topo_mod.__name__):
        topo = read_topology(make_sysfs(tmp_path, None, cpus), allowed=range(4))
    assert topo.nodes == (0,)
    assert [c.cpus for c in topo.cores] == [(0, 2), (1, 3)]
    assert "no NUMA node information" in caplog.text


def test_no_sysfs_at_all_uses_allowed_cpus(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger=topo_mod.__name__):
        topo = read_topology(tmp_path / "nothing-here", allowed=[3, 1])
    assert topo.nodes == (0,)
    assert topo.cores == (Core(id=1, node=0, package=0, cpus=(1,)), Core(id=3, node=0, package=0, cpus=(3,)))
    assert caplog.records


def test_offline_cpus_and_missing_topology_files(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cpus = {
        0: FakeCpu(0, 0, "0,4"),
        1: FakeCpu(1, 0, "1,5", online="1"),
        2: FakeCpu(None, None, None, topology_dir=False),  # online but no topology dir: its own core
        3: FakeCpu(None, None, None, online="0", topology_dir=False),  # offline: dropped
        4: FakeCpu(0, 0, "0,4"),
        5: FakeCpu(1, 0, "1,5", online="0"),  # offline sibling: core 1 keeps only cpu 1
        6: FakeCpu(-1, 0, "6"),  # odd core_id: falls back to the CPU number
        7: FakeCpu(3, 0, "garbage"),  # unparseable siblings: its own core, keeps its core_id
    }
    nodes = {0: "0-2,4,6-7", 1: ""}  # memory-only node 1 has no CPUs
    with caplog.at_level(logging.INFO, logger=topo_mod.__name__):
        topo = read_topology(make_sysfs(tmp_path, nodes, cpus), allowed=range(8))
    assert topo.nodes == (0,)
    assert sorted(c.cpus for c in topo.cores) == [(0, 4), (1,), (2,), (6,), (7,)]
    by_cpu = {c.cpus[0]: c for c in topo.cores}
    assert (by_cpu[2].id, by_cpu[6].id, by_cpu[7].id) == (2, 6, 3)
    assert "offline" in caplog.text and "incomplete topology" in caplog.text


def test_global_online_list_and_unreadable_node_cpulist(tmp_path: Path) -> None:
    # node1's cpulist is garbage: its CPUs are found through the per-CPU node1 link instead.
    cpus = {cpu: FakeCpu(cpu, 0, str(cpu)) for cpu in range(4)}
    root = make_sysfs(tmp_path, {0: "0-1", 1: "2-x"}, cpus, online="0-2")
    (root / "devices/system/cpu/cpu2/node1").mkdir()
    topo = read_topology(root, allowed=range(4))
    assert [(c.node, c.cpus) for c in topo.cores] == [(0, (0,)), (0, (1,)), (1, (2,))]


def test_allowed_subset(tmp_path: Path) -> None:
    # A cgroup giving us 0-1 and 4-5 and 12: node 1 keeps two cores, one of them without its sibling.
    topo = read_topology(intel_2x4x2(tmp_path), allowed={0, 1, 4, 5, 12})
    assert topo.nodes == (0, 1)
    assert [(c.node, c.cpus) for c in topo.cores] == [(0, (0,)), (0, (1,)), (1, (4, 12)), (1, (5,))]
    assert default_workers(topo) == 4
    only_node1 = read_topology(tmp_path, allowed=[13, 5])
    assert only_node1.nodes == (1,) and only_node1.cores == (Core(id=1, node=1, package=1, cpus=(5, 13)),)


def test_allowed_disjoint_from_sysfs_and_empty(tmp_path: Path) -> None:
    intel_2x4x2(tmp_path)
    topo = read_topology(tmp_path, allowed=[40])
    assert topo.cores == (Core(id=40, node=0, package=0, cpus=(40,)),)
    with pytest.raises(InvalidArgumentError):
        read_topology(tmp_path, allowed=[])


# ---------------------------------------------------------------------------------------------
# plan_placement


def check_invariants(topo: Topology, plan: list[Placement], n: int) -> None:
    assert [p.worker for p in plan] == list(range(n))
    assert [p.node for p in plan] == sorted(p.node for p in plan), "workers of a node must be consecutive"
    core_of = {cpu: core for core in topo.cores for cpu in core.cpus}
    for p in plan:
        assert p.cpus and all(core_of[cpu].node == p.node for cpu in p.cpus)
        for cpu in p.cpus:  # whole cores: every hyperthread sibling comes along
            assert set(core_of[cpu].cpus) <= set(p.cpus)


@pytest.mark.parametrize(
    "n, per_node, cpus",
    [
        (1, [1, 0], [(0, 8)]),
        (2, [1, 1], [(0, 8), (4, 12)]),
        (3, [2, 1], [(0, 8), (1, 9), (4, 12)]),
        (8, [4, 4], [(0, 8), (1, 9), (2, 10), (3, 11), (4, 12), (5, 13), (6, 14), (7, 15)]),
    ],
)
def test_plan_fits(box: Topology, n: int, per_node: list[int], cpus: list[tuple[int, ...]], caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=topo_mod.__name__):
        plan = plan_placement(box, n)
    check_invariants(box, plan, n)
    assert [sum(p.node == node for p in plan) for node in (0, 1)] == per_node
    assert [p.cpus for p in plan] == cpus
    used = [cpu for p in plan for cpu in p.cpus]
    assert len(used) == len(set(used)), "no CPU is shared without oversubscription"
    assert "oversubscribed" not in caplog.text


def test_plan_oversubscribed_shares_round_robin(box: Topology, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=topo_mod.__name__):
        plan = plan_placement(box, 16)
    check_invariants(box, plan, 16)
    assert [p.node for p in plan] == [0] * 8 + [1] * 8
    assert Counter(p.cpus for p in plan) == Counter({core.cpus: 2 for core in box.cores})
    assert plan[0].cpus == plan[4].cpus == (0, 8) and plan[8].cpus == plan[12].cpus == (4, 12)
    assert "oversubscribed" in caplog.text


def test_plan_threads_per_worker(box: Topology, caplog: pytest.LogCaptureFixture) -> None:
    plan = plan_placement(box, 4, threads_per_worker=2)
    check_invariants(box, plan, 4)
    assert [p.cpus for p in plan] == [(0, 1, 8, 9), (2, 3, 10, 11), (4, 5, 12, 13), (6, 7, 14, 15)]
    assert "oversubscribed" not in caplog.text
    with caplog.at_level(logging.WARNING, logger=topo_mod.__name__):
        big = plan_placement(box, 2, threads_per_worker=6)  # 6 cores wanted, node has 4: each gets all 4
    assert [p.cpus for p in big] == [(0, 1, 2, 3, 8, 9, 10, 11), (4, 5, 6, 7, 12, 13, 14, 15)]
    assert "oversubscribed" in caplog.text


def test_plan_unequal_nodes(tmp_path: Path) -> None:
    # 6 cores on node 0, 2 on node 1: 4 workers split 3 + 1.
    cpus = {cpu: FakeCpu(cpu, cpu // 6, str(cpu)) for cpu in range(8)}
    topo = read_topology(make_sysfs(tmp_path, {0: "0-5", 1: "6-7"}, cpus), allowed=range(8))
    assert [p.node for p in plan_placement(topo, 4)] == [0, 0, 0, 1]
    # 3 workers x 2 threads: quotas 2.25 / 0.75 round to 2 / 1, and each node has the cores for them.
    plan = plan_placement(topo, 3, threads_per_worker=2)
    check_invariants(topo, plan, 3)
    assert [p.node for p in plan] == [0, 0, 1]


def test_plan_moves_worker_that_rounding_put_on_too_small_node(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # 2 cores on node 0, 6 on node 1, 2 workers x 3 threads: proportional rounding gives each node one
    # worker, but node 0 cannot hold 3 cores; node 1 can hold both, so nothing is shared.
    cpus = {cpu: FakeCpu(cpu, 0, str(cpu)) for cpu in range(8)}
    topo = read_topology(make_sysfs(tmp_path, {0: "0-1", 1: "2-7"}, cpus), allowed=range(8))
    with caplog.at_level(logging.WARNING, logger=topo_mod.__name__):
        plan = plan_placement(topo, 2, threads_per_worker=3)
    check_invariants(topo, plan, 2)
    assert [(p.node, p.cpus) for p in plan] == [(1, (2, 3, 4)), (1, (5, 6, 7))]
    assert "oversubscribed" not in caplog.text


def test_plan_bad_arguments(box: Topology) -> None:
    for n, t in [(0, 1), (-3, 1), (2, 0)]:
        with pytest.raises(InvalidArgumentError):
            plan_placement(box, n, threads_per_worker=t)
    with pytest.raises(InvalidArgumentError):
        plan_placement(Topology(nodes=(), cores=()), 1)


def test_threads_go_to_one_worker_per_node_unless_told(box: Topology) -> None:
    one_node = Topology(nodes=(0,), cores=tuple(Core(id=i, node=0, package=0, cpus=(i,)) for i in range(4)))
    assert split_threads(one_node, 4) == (1, 4) and split_threads(one_node, 1) == (1, 1)
    assert split_threads(one_node, 6) == (1, 6)  # more threads than cores: still one process (plan_placement warns)
    assert split_threads(box, 8) == (2, 4) and split_threads(box, 2) == (2, 1)
    assert [p.node for p in plan_placement(box, *split_threads(box, 8))] == [0, 1]  # a worker on each node, its cores as threads
    assert split_threads(box, 3) == (1, 3) and split_threads(box, 1) == (1, 1)  # as many workers as divide the threads
    assert split_threads(box, 8, 1) == (8, 1) and split_threads(box, 8, 2) == (4, 2) and split_threads(one_node, 4, 4) == (1, 4)
    with pytest.raises(InvalidArgumentError, match="multiple of --worker-threads"):
        split_threads(box, 8, 3)
    for n, k in [(0, None), (2, 0), (-1, 1)]:
        with pytest.raises(InvalidArgumentError):
            split_threads(box, n, k)


# ---------------------------------------------------------------------------------------------
# this machine, pinning, memory policy


def test_real_sys() -> None:
    topo = read_topology()
    logging.getLogger(__name__).info("real topology: %s", topo)
    assert topo.n_physical >= 1 and topo.nodes
    assert default_workers() >= 1
    if hasattr(os, "sched_getaffinity"):
        assert set(topo.cpus) <= os.sched_getaffinity(0)
    plan = plan_placement(topo, default_workers())
    check_invariants(topo, plan, len(plan))


def test_plan_spans_nodes_rather_than_double_up(box: Topology, caplog: pytest.LogCaptureFixture) -> None:
    """One rank of 6 threads on two nodes of 4 cores: the machine has the cores, so the rank takes
    node 0's four and two of node 1's, instead of six threads on node 0's four cores."""
    with caplog.at_level(logging.INFO, logger=topo_mod.__name__):
        plan = plan_placement(box, 1, threads_per_worker=6)
    assert [(p.node, p.cpus) for p in plan] == [(0, (0, 1, 2, 3, 4, 5, 8, 9, 10, 11, 12, 13))]
    assert "spans nodes [0, 1]" in caplog.text and "oversubscribed" not in caplog.text
    plan = plan_placement(box, 2, threads_per_worker=3)  # fits: one per node, nobody spans
    check_invariants(box, plan, 2)
    plan = plan_placement(box, 3, threads_per_worker=2)  # 2 + 1 per node fits as well
    check_invariants(box, plan, 3)
    used = [cpu for p in plan_placement(box, 2, threads_per_worker=4) for cpu in p.cpus]
    assert len(used) == len(set(used)) == 16


def _flat(nodes: list[int]) -> Topology:
    """Nodes of the given core counts, one CPU a core, numbered consecutively."""
    cores, cpu = [], 0
    for node, n in enumerate(nodes):
        for i in range(n):
            cores.append(Core(id=i, node=node, package=node, cpus=(cpu,)))
            cpu += 1
    return Topology(nodes=tuple(range(len(nodes))), cores=tuple(cores))


def test_only_the_workers_that_must_span_do() -> None:
    """4 nodes x 6 cores, 5 workers x 4 threads: one worker per node fits, the fifth spans the
    cores they left (review: laying every worker over consecutive cores made two of them span)."""
    topo = _flat([6, 6, 6, 6])
    plan = plan_placement(topo, 5, threads_per_worker=4)
    spans = [p for p in plan if len({topo.cores[c].node for c in p.cpus}) > 1]
    assert len(spans) == 1 and spans[0].cpus == (4, 5, 10, 11)
    used = [cpu for p in plan for cpu in p.cpus]
    assert len(used) == len(set(used)) == 20
    assert [p.node for p in plan[:4]] == [0, 1, 2, 3]


def test_an_oversubscribed_worker_uses_every_core_rather_than_leave_a_node_idle(caplog: pytest.LogCaptureFixture) -> None:
    topo = _flat([4, 4])
    with caplog.at_level(logging.WARNING, logger=topo_mod.__name__):
        assert plan_placement(topo, 1, threads_per_worker=9)[0].cpus == tuple(range(8))
        assert plan_placement(topo, 1, threads_per_worker=8)[0].cpus == tuple(range(8))  # no cliff at 8 and 9
    assert "oversubscribed" in caplog.text
    two = plan_placement(topo, 2, threads_per_worker=6)  # every node has a worker: each keeps its node's cores
    assert [p.cpus for p in two] == [(0, 1, 2, 3), (4, 5, 6, 7)]
