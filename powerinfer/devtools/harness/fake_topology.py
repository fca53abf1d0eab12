"""A fake sysfs tree that splits this machine's cores into NUMA nodes, to run multi-socket placement here.

Runs in: a tool process (``python -m powerinfer.devtools.harness.fake_topology OUT --nodes 2``), and
tests. Point ``POWERINFER_SYSFS`` at OUT and the coordinator plans, and the workers pin, as on a
machine of that many sockets (topology.py): rank i lands on the cores of "its" node, and a rank
with more threads than a node has cores spans nodes. Memory stays where the kernel puts it: the
workers do not bind memory under a fake tree (its node numbers are not the kernel's), so what
this measures is the placement and the merges between pinned ranks, not remote-memory latency.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from powerinfer.cpu_workers.topology import Topology, read_topology
from powerinfer.errors import InvalidArgumentError

log = logging.getLogger(__name__)


def _cpulist(cpus: list[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))


def write_fake_sysfs(root: Path, n_nodes: int, topo: Topology | None = None) -> Path:
    """Write a sysfs tree under root (which must not exist yet): topo's physical cores (default:
    this process's real ones), in order, split into n_nodes nodes of consecutive cores (the
    remainder to the first nodes), each node one package. Returns root."""
    topo = topo if topo is not None else read_topology("/sys")
    cores = list(topo.cores)
    if n_nodes < 1:
        raise InvalidArgumentError(f"need at least one node, got {n_nodes}")
    if n_nodes > len(cores):
        raise InvalidArgumentError(f"{n_nodes} nodes need at least {n_nodes} physical cores; this process may use {len(cores)}")
    if root.exists():
        raise InvalidArgumentError(f"{root} exists; give a new directory for the fake sysfs tree")
    system = root / "devices" / "system"
    base, extra = divmod(len(cores), n_nodes)
    start = 0
    all_cpus: list[int] = []
    for node in range(n_nodes):
        mine = cores[start : start + base + (node < extra)]
        start += len(mine)
        node_cpus = [cpu for core in mine for cpu in core.cpus]
        (system / "node" / f"node{node}").mkdir(parents=True)
        (system / "node" / f"node{node}" / "cpulist").write_text(_cpulist(node_cpus) + "\n")
        for core_id, core in enumerate(mine):
            for cpu in core.cpus:
                d = system / "cpu" / f"cpu{cpu}" / "topology"
                d.mkdir(parents=True)
                (d / "core_id").write_text(f"{core_id}\n")
                (d / "physical_package_id").write_text(f"{node}\n")
                (d / "thread_siblings_list").write_text(_cpulist(list(core.cpus)) + "\n")
        all_cpus += node_cpus
    (system / "cpu" / "online").write_text(_cpulist(all_cpus) + "\n")
    return root


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m powerinfer.devtools.harness.fake_topology",
                                 description="Write a sysfs tree splitting this machine's cores into NUMA nodes "
                                             "(then run powerinfer with POWERINFER_SYSFS=OUT).")
    ap.add_argument("out", type=Path, help="a new directory")
    ap.add_argument("--nodes", type=int, default=2, help="how many nodes (default 2)")
    args = ap.parse_args(argv)
    try:
        root = write_fake_sysfs(args.out, args.nodes)
    except InvalidArgumentError as e:
        ap.error(str(e))
    topo = read_topology(root)
    for node in topo.nodes:
        cpus = [cpu for core in topo.cores_of(node) for cpu in core.cpus]
        print(f"node {node}: CPUs {_cpulist(cpus)}")  # CLI output
    print(f"export POWERINFER_SYSFS={root.resolve()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
