"""Cache domains: which usable CPUs share a last-level cache, so that one worker process's threads do.

Runs in: the coordinator (topology.py's read_topology, whose Topology.domains split_threads reads).

Why: the default executor gives each worker process a group of cores as its OpenMP threads
(topology.py's split_threads). Those threads meet at barriers several times a layer and read each
other's activations, which is cheap under one L3 and dear across core complexes. On bare metal
sysfs says which CPUs share the L3 (cpu*/cache/index*/ with level 3: shared_cpu_list). In a VM it
says what the hypervisor declares, not where the vCPUs run, and that moves: this project's 2-vCPU
Zen 4 reports one L3 while a cache line's round trip between its vCPUs measured 53-63 ns at some
moments and 321-324 ns at others within one hour (two core complexes; a scratch ping-pong), and
one worker of two threads then decoded the 1.1B ReGLU file at 0.76x and 0.95x two single-thread
workers (docs/sparsity.md). So in a VM every physical core is a domain of its own.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger(__name__)


def in_vm(root: Path) -> bool:
    """A hypervisor runs this machine: ``<root>/hypervisor/type`` (Xen, or a test's tree) or, read
    from this machine's own /sys, the x86 ``hypervisor`` CPU flag in /proc/cpuinfo."""
    if (root / "hypervisor" / "type").is_file():
        return True
    if root.resolve() != Path("/sys"):
        return False
    try:
        with open("/proc/cpuinfo") as fh:
            return any(line.startswith("flags") and " hypervisor" in line for line in fh)
    except OSError:
        return False


def _l3_of(cpu_dir: Path) -> str | None:
    """The shared_cpu_list of a CPU's highest-level cache (the L3, or the last level it has)."""
    best: tuple[int, str] | None = None
    for index in sorted(cpu_dir.glob("cache/index[0-9]*")):
        try:
            level = int((index / "level").read_text())
            shared = (index / "shared_cpu_list").read_text().strip()
        except (OSError, ValueError):
            continue
        if best is None or level > best[0]:
            best = (level, shared)
    return best[1] if best is not None and best[0] >= 2 else None


def cache_domains(root: Path, cores: Iterable[tuple[int, ...]]) -> tuple[tuple[int, ...], ...]:
    """The cores' CPUs (each core's logical CPUs) grouped by the last-level cache they share; in a
    VM each core alone. () where sysfs names no such cache (then each NUMA node is one domain)."""
    cores = list(cores)
    if in_vm(root):
        return tuple(cores)
    groups: dict[str, list[int]] = {}
    for cpus in cores:
        shared = _l3_of(root / "devices" / "system" / "cpu" / f"cpu{cpus[0]}")
        if shared is None:
            return ()
        groups.setdefault(shared, []).extend(cpus)
    return tuple(tuple(sorted(g)) for g in groups.values())
