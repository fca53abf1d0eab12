"""cpu_workers/cache_domains.py and what split_threads makes of its domains.

Runs in: the test process, on fake sysfs trees (test_topology.py's writer) with cache directories.
"""

from __future__ import annotations

from pathlib import Path

from powerinfer.cpu_workers.cache_domains import cache_domains, in_vm
from powerinfer.cpu_workers.topology import Core, Topology, plan_placement, read_topology, split_threads

from tests.cpu_workers.test_topology import FakeCpu, make_sysfs


def two_complexes(root: Path, l3: bool = True) -> Path:
    """One node, 4 cores, 2 threads each (siblings n and n + 4); cores 0-1 share one L3, 2-3 another."""
    cpus = {cpu: FakeCpu(core_id=cpu % 4, package=0, siblings=f"{cpu % 4},{cpu % 4 + 4}") for cpu in range(8)}
    make_sysfs(root, {0: "0-7"}, cpus, online="0-7")
    for cpu in range(8):
        for index, (level, shared) in enumerate(((1, f"{cpu % 4},{cpu % 4 + 4}"), (2, f"{cpu % 4},{cpu % 4 + 4}"),
                                                 (3, "0-1,4-5" if cpu % 4 < 2 else "2-3,6-7"))):
            if level == 3 and not l3:
                continue
            d = root / "devices" / "system" / "cpu" / f"cpu{cpu}" / "cache" / f"index{index}"
            d.mkdir(parents=True)
            (d / "level").write_text(f"{level}\n")
            (d / "shared_cpu_list").write_text(shared + "\n")
    return root


def test_cores_under_one_l3_form_a_domain_and_a_worker(tmp_path: Path) -> None:
    topo = read_topology(two_complexes(tmp_path), allowed=range(8))
    assert topo.domains == ((0, 1, 4, 5), (2, 3, 6, 7)) and topo.n_groups() == 2
    assert split_threads(topo, 4) == (2, 2)  # a worker per L3, its two cores as threads
    assert [p.cpus for p in plan_placement(topo, 2, 2)] == [(0, 1, 4, 5), (2, 3, 6, 7)]
    assert split_threads(topo, 1) == (1, 1) and split_threads(topo, 4, 4) == (1, 4)  # one thread; or asked for


def test_the_highest_cache_level_counts_and_no_cache_files_mean_a_node(tmp_path: Path) -> None:
    l2_only = read_topology(two_complexes(tmp_path / "a", l3=False), allowed=range(8))
    assert l2_only.domains == ((0, 4), (1, 5), (2, 6), (3, 7))  # the last level it has: each core's L2
    cpus = {cpu: FakeCpu(core_id=cpu, package=0, siblings=str(cpu)) for cpu in range(4)}
    bare = read_topology(make_sysfs(tmp_path / "b", {0: "0-3"}, cpus, online="0-3"), allowed=range(4))
    assert bare.domains == () and bare.n_groups() == 1 and split_threads(bare, 4) == (1, 4)


def test_in_a_vm_each_core_is_a_domain(tmp_path: Path) -> None:
    """A hypervisor's L3 is what it declares, not where the vCPUs run: every core its own worker."""
    root = two_complexes(tmp_path)
    (root / "hypervisor").mkdir()
    (root / "hypervisor" / "type").write_text("xen\n")
    assert in_vm(root)
    topo = read_topology(root, allowed=range(8))
    assert topo.domains == ((0, 4), (1, 5), (2, 6), (3, 7)) and split_threads(topo, 4) == (4, 1)
    assert cache_domains(root, [(0, 4), (1, 5)]) == ((0, 4), (1, 5))
    assert not in_vm(tmp_path / "elsewhere")


def test_groups_count_node_and_domain_together() -> None:
    """A domain spanning two nodes (an L3 over sub-NUMA clusters) still gives a worker per node."""
    cores = tuple(Core(id=i, node=i // 2, package=0, cpus=(i,)) for i in range(4))
    assert Topology(nodes=(0, 1), cores=cores, domains=((0, 1, 2, 3),)).n_groups() == 2
    assert Topology(nodes=(0, 1), cores=cores).n_groups() == 2
    assert Topology(nodes=(0,), cores=tuple(Core(id=i, node=0, package=0, cpus=(i,)) for i in range(4)),
                    domains=((0, 1), (2, 3))).n_groups() == 2
