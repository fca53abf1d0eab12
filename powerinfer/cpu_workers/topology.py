"""CPU / NUMA topology discovery and placement of CPU workers on cores and memory nodes.

Runs in: the coordinator (``read_topology``, ``split_threads``, ``plan_placement``,
``default_workers``); each CPU worker process then applies its placement with ``pinning.py``.

Why: a worker computes a shard of every layer and is bound by memory bandwidth. On a multi-socket
box its weights must sit on the NUMA node whose cores run it. Linux places a page on the node of
the CPU that first touches it, so a worker that pins itself and then fills its own buffers gets
local memory on the default policy (``pinning.bind_memory_to_node`` makes it explicit).
Everything here is best effort: missing sysfs files, containers and platforms without affinity
calls degrade to "one node, one core per logical CPU, unpinned", with a log line, never a crash.

``POWERINFER_SYSFS`` names another sysfs root (default /sys): with a fake tree (fake_topology.py)
the coordinator plans and the workers pin as on a multi-socket machine.
"""

from __future__ import annotations

import logging
import os
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import psutil

from powerinfer.cpu_workers.cache_domains import cache_domains
from powerinfer.errors import InvalidArgumentError

log = logging.getLogger(__name__)

_CPU_DIR = re.compile(r"cpu([0-9]+)")
_NODE_DIR = re.compile(r"node([0-9]+)")
_CPULIST_ITEM = re.compile(r"([0-9]+)(?:-([0-9]+))?")
# Linux caps NR_CPUS at 8192; the margin only keeps "0-99999999999" from eating all memory.
_MAX_CPU = 1 << 16
SYSFS_ENV = "POWERINFER_SYSFS"


def sysfs_root() -> Path:  # $POWERINFER_SYSFS, else /sys
    return Path(os.environ.get(SYSFS_ENV) or "/sys")


@dataclass(frozen=True)
class Core:
    """One physical core; ``cpus`` are its logical CPUs (hyperthread siblings) this process may use.

    ``id`` is the kernel's core_id, unique only within a package: (package, id) names a core. When
    sysfs has no topology for a CPU, that CPU is a core on its own with ``id`` = the CPU number and
    ``package`` = 0.
    """

    id: int
    node: int
    package: int
    cpus: tuple[int, ...]


@dataclass(frozen=True)
class Topology:
    """The NUMA nodes and physical cores usable by this process (only nodes that have such cores)."""

    nodes: tuple[int, ...]
    cores: tuple[Core, ...]  # ordered by node, then package, then core id
    domains: tuple[tuple[int, ...], ...] = ()  # CPUs sharing a last-level cache (cache_domains.py); (): a node each

    def cores_of(self, node: int) -> tuple[Core, ...]:
        return tuple(c for c in self.cores if c.node == node)

    def n_groups(self) -> int:
        """Groups of cores a worker's threads should stay within: (node, cache domain) pairs."""
        domain = {cpu: i for i, d in enumerate(self.domains) for cpu in d}
        return len({(c.node, domain.get(c.cpus[0], -1)) for c in self.cores})

    @property
    def n_physical(self) -> int:
        return len(self.cores)

    @property
    def cpus(self) -> tuple[int, ...]:
        """Every usable logical CPU, sorted."""
        return tuple(sorted(cpu for core in self.cores for cpu in core.cpus))


@dataclass(frozen=True)
class Placement:
    """Where worker ``worker`` runs: the NUMA node holding its weights and the CPUs it is pinned to."""

    worker: int
    node: int
    cpus: tuple[int, ...]


def parse_cpulist(text: str) -> list[int]:
    """Parse a kernel cpulist ("0-3,8,10-11") into sorted, distinct CPU numbers; "" gives [].

    Raises ValueError on anything else (reversed ranges, empty items, signs, absurd numbers).
    """
    body = text.strip()
    if not body:
        return []  # memory-only nodes have an empty cpulist
    cpus: set[int] = set()
    for item in body.split(","):
        m = _CPULIST_ITEM.fullmatch(item.strip())
        if m is None:
            raise ValueError(f"bad cpulist item {item!r} in {text!r}")
        lo = int(m[1])
        hi = lo if m[2] is None else int(m[2])
        if hi < lo or hi > _MAX_CPU:
            raise ValueError(f"bad cpulist range {item!r} in {text!r}")
        cpus.update(range(lo, hi + 1))
    return sorted(cpus)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def _read_int(path: Path) -> int | None:
    """A non-negative integer file; None when missing or odd (offline CPUs may report -1)."""
    text = _read(path)
    try:
        value = int(text.strip()) if text is not None else -1
    except ValueError:
        return None
    return value if value >= 0 else None


def _read_cpulist(path: Path) -> list[int] | None:
    text = _read(path)
    if text is None:
        return None
    try:
        return parse_cpulist(text)
    except ValueError:
        log.info("ignoring unparseable cpulist %s: %r", path, text.strip()[:80])
        return None


def _numbered_dirs(parent: Path, pattern: re.Pattern[str]) -> dict[int, Path]:
    try:
        entries = list(parent.iterdir())
    except OSError:
        return {}
    found: dict[int, Path] = {}
    for entry in entries:
        m = pattern.fullmatch(entry.name)
        if m is not None and entry.is_dir():
            found[int(m[1])] = entry
    return found


def _allowed_cpus() -> set[int]:
    """The CPUs this process may run on (cgroup / taskset restrictions included)."""
    if hasattr(os, "sched_getaffinity"):
        try:
            return set(os.sched_getaffinity(0))
        except OSError as e:
            log.debug("sched_getaffinity failed: %s", e)
    try:
        affinity = psutil.Process().cpu_affinity()  # absent on macOS -> AttributeError
        if affinity:
            return set(affinity)
    except (AttributeError, OSError, psutil.Error) as e:
        log.debug("psutil cpu_affinity unavailable: %s", e)
    return set(range(os.cpu_count() or 1))


def node_numbers(sysfs: str | Path | None = None) -> list[int]:
    """The NUMA node numbers a sysfs tree lists (default: :func:`sysfs_root`), sorted."""
    return sorted(_numbered_dirs(Path(sysfs if sysfs is not None else sysfs_root()) / "devices" / "system" / "node", _NODE_DIR))


def _node_map(node_root: Path) -> dict[int, int]:
    """cpu -> node from <node_root>/node*/cpulist; {} when the kernel exposes no NUMA info."""
    mapping: dict[int, int] = {}
    for node, path in sorted(_numbered_dirs(node_root, _NODE_DIR).items()):
        for cpu in _read_cpulist(path / "cpulist") or []:
            mapping.setdefault(cpu, node)
    return mapping


def read_topology(sysfs: str | Path | None = None, allowed: Iterable[int] | None = None) -> Topology:
    """Physical cores and NUMA nodes of the CPUs in ``allowed`` (default: this process's affinity),
    from ``sysfs`` (default: :func:`sysfs_root`).

    Reads <sysfs>/devices/system/node/node*/cpulist and
    <sysfs>/devices/system/cpu/cpu*/{online,topology/{core_id,physical_package_id,thread_siblings_list}}.
    Offline CPUs and CPUs outside ``allowed`` are dropped; a core keeps only its usable siblings.
    """
    root = Path(sysfs) if sysfs is not None else sysfs_root()
    if sysfs is None and os.environ.get(SYSFS_ENV) and not root.is_dir():
        log.warning("$%s names %s, which is not a directory: every CPU counts as a core of node 0", SYSFS_ENV, root)
    allowed_set = _allowed_cpus() if allowed is None else {int(c) for c in allowed}
    if not allowed_set:
        raise InvalidArgumentError("the allowed CPU set is empty")
    system = root / "devices" / "system"
    cpu_root = system / "cpu"
    node_of = _node_map(system / "node")
    cpu_dirs = _numbered_dirs(cpu_root, _CPU_DIR)

    if cpu_dirs:
        known = set(cpu_dirs)
    elif node_of:
        known = set(node_of)
    else:
        log.info("no CPU information under %s; using the %d allowed CPUs as single cores", cpu_root, len(allowed_set))
        known = set(allowed_set)
    online = _read_cpulist(cpu_root / "online")
    offline = {c for c in known if (online is not None and c not in online) or _read_int(cpu_root / f"cpu{c}" / "online") == 0}
    if offline:
        log.info("skipping offline CPUs %s", sorted(offline))
    usable = sorted((known - offline) & allowed_set)
    if len(usable) < len(known - offline):
        log.debug("dropping CPUs outside this process's affinity: %s", sorted(known - offline - allowed_set))
    if not usable:
        # sysfs and the affinity mask disagree entirely (odd container); trust the affinity mask.
        log.warning("no allowed CPU appears in %s; treating the %d allowed CPUs as single cores on node 0", system.parent, len(allowed_set))
        usable, node_of, cpu_dirs = sorted(allowed_set), {}, {}

    if not node_of:
        log.info("no NUMA node information under %s; treating all CPUs as node 0", system / "node")
    default_node = min(node_of.values(), default=0)
    nodes: dict[int, int] = {}
    for cpu in usable:
        node = node_of.get(cpu)
        if node is None and cpu in cpu_dirs:
            # The per-CPU nodeN link covers CPUs a broken node cpulist left out.
            links = sorted(_numbered_dirs(cpu_dirs[cpu], _NODE_DIR))
            node = links[0] if links else None
        if node is None:
            if node_of:
                log.info("CPU %d is in no NUMA node's cpulist; assuming node %d", cpu, default_node)
            node = default_node
        nodes[cpu] = node

    usable_set = set(usable)
    assigned: set[int] = set()
    no_topology: list[int] = []
    cores: list[Core] = []
    for cpu in usable:
        if cpu in assigned:
            continue
        topo_dir = cpu_root / f"cpu{cpu}" / "topology"
        siblings = _read_cpulist(topo_dir / "thread_siblings_list") if cpu in cpu_dirs else None
        core_id = _read_int(topo_dir / "core_id") if cpu in cpu_dirs else None
        package = _read_int(topo_dir / "physical_package_id") if cpu in cpu_dirs else None
        if siblings is None or core_id is None:
            no_topology.append(cpu)
        # First come, first served: a sibling already claimed (inconsistent sysfs) is never shared.
        members = {cpu} | {s for s in siblings or [] if s in usable_set and s not in assigned and nodes[s] == nodes[cpu]}
        assigned |= members
        cores.append(Core(id=cpu if core_id is None else core_id, node=nodes[cpu], package=package or 0, cpus=tuple(sorted(members))))
    if no_topology:
        log.info("CPUs %s have incomplete topology files; each missing one counts as its own core", no_topology)

    cores.sort(key=lambda c: (c.node, c.package, c.id, c.cpus))
    topo = Topology(nodes=tuple(sorted({c.node for c in cores})), cores=tuple(cores), domains=cache_domains(root, (c.cpus for c in cores)))
    log.debug("topology: %d node(s), %d physical core(s), %d logical CPU(s)", len(topo.nodes), topo.n_physical, len(usable))
    return topo


def _apportion(n: int, weights: dict[int, int]) -> dict[int, int]:
    """Split n items in proportion to weights (largest remainder; ties go to the lower key)."""
    total = sum(weights.values())
    counts = {k: n * w // total for k, w in weights.items()}
    order = sorted(weights, key=lambda k: (-(n * weights[k] % total), k))
    for k in order[: n - sum(counts.values())]:
        counts[k] += 1
    return counts


def plan_placement(topo: Topology, n_workers: int, threads_per_worker: int = 1) -> list[Placement]:
    """Place workers on nodes in proportion to their physical cores, consecutive workers per node.

    Each worker gets ``threads_per_worker`` whole physical cores (all their hyperthread siblings)
    of its node. Worker i's node is ``result[i].node``, so shard i's weights belong on that node.
    When some node is too small for its workers but the machine is not, each node first takes as
    many whole workers as it holds and the rest span nodes over the cores left (idle cores beat
    doubled-up threads). When the machine has too few cores, a node's are shared round-robin and a
    warning says it is oversubscribed; if a node would then stay idle, the workers share all the
    machine's cores round-robin instead.
    """
    if n_workers < 1:
        raise InvalidArgumentError(f"the number of CPU workers must be >= 1, got {n_workers}")
    if threads_per_worker < 1:
        raise InvalidArgumentError(f"threads per CPU worker must be >= 1, got {threads_per_worker}")
    per_node = {node: cores for node in topo.nodes if (cores := topo.cores_of(node))}
    if not per_node:
        raise InvalidArgumentError("the CPU topology has no usable cores")
    t = threads_per_worker
    counts = _apportion(n_workers, {node: len(cores) for node, cores in per_node.items()})
    if n_workers * t <= topo.n_physical:
        # Rounding can give a node more workers than its cores hold when t > 1 although the box as
        # a whole has room; move such workers to the node with the most spare cores.
        for node in per_node:
            while counts[node] * t > len(per_node[node]):
                spare = [m for m in per_node if (counts[m] + 1) * t <= len(per_node[m])]
                if not spare:
                    break
                target = max(spare, key=lambda m: (len(per_node[m]) - counts[m] * t, -m))
                counts[node] -= 1
                counts[target] += 1
        if any(counts[node] * t > len(cores) for node, cores in per_node.items()):
            return _spanning(per_node, n_workers, t)
    elif any(counts[node] == 0 for node in per_node):
        log.warning("oversubscribed: %d CPU worker(s) x %d thread(s) on %d physical core(s); cores are shared", n_workers, t,
                    topo.n_physical)
        return _spanning(per_node, n_workers, t)

    placements: list[Placement] = []
    oversubscribed = False
    for node, cores in per_node.items():
        oversubscribed |= counts[node] * t > len(cores)
        for j in range(counts[node]):
            # Without oversubscription these windows are disjoint; with it they wrap round-robin.
            picked = dict.fromkeys(cores[(j * t + m) % len(cores)] for m in range(t))
            cpus = tuple(sorted(cpu for core in picked for cpu in core.cpus))
            placements.append(Placement(worker=len(placements), node=node, cpus=cpus))
    if oversubscribed:
        log.warning(
            "oversubscribed: %d CPU worker(s) x %d thread(s) on %d physical core(s) across %d node(s); cores are shared",
            n_workers, t, topo.n_physical, len(per_node),
        )
    return placements


def _spanning(per_node: dict[int, tuple[Core, ...]], n_workers: int, t: int) -> list[Placement]:
    """Each node's whole workers first (as many as its cores hold, in node order), then the rest over
    the cores left in node order, spanning nodes, wrapping round-robin when the machine is too small.
    A worker's node is the one holding most of its cores (ties: the lower node)."""
    groups: list[list[Core]] = []
    left: list[Core] = []
    for cores in per_node.values():
        k = min(len(cores) // t, n_workers - len(groups))
        groups += [list(cores[j * t : (j + 1) * t]) for j in range(k)]
        left += cores[k * t :]
    pool = left or [core for cores in per_node.values() for core in cores]
    for j in range(n_workers - len(groups)):
        groups.append([pool[(j * t + m) % len(pool)] for m in range(min(t, len(pool)))])
    placements: list[Placement] = []
    for w, picked in enumerate(groups):
        by_node = Counter(core.node for core in picked)
        node = max(by_node, key=lambda n: (by_node[n], -n))
        cpus = tuple(sorted({cpu for core in picked for cpu in core.cpus}))
        if len(by_node) > 1:
            log.info("worker %d: %d threads exceed a node's free cores; it spans nodes %s (its memory on node %d)", w, t,
                     sorted(by_node), node)
        placements.append(Placement(worker=w, node=node, cpus=cpus))
    return placements


def default_workers(topo: Topology | None = None) -> int:
    """Default CPU worker count: the physical cores available to this process (at least 1)."""
    if topo is None:
        topo = read_topology()
    return max(1, topo.n_physical)


def split_threads(topo: Topology, n_threads: int, worker_threads: int | None = None) -> tuple[int, int]:
    """(worker processes, threads each) that run ``n_threads`` CPU threads.

    ``worker_threads`` None: one worker per group of cores that share a NUMA node and a last-level
    cache (Topology.n_groups; in a VM each core: cache_domains.py), as many as divide ``n_threads``
    evenly, at most one per thread, each with its group's share of the threads. Threads of one
    process share each layer through OpenMP's barriers, while worker processes merge their
    partials in shared memory after every layer's parts: under one L3 of a 2-core Zen 4 one worker
    of 2 threads decoded 0.97-1.15x two single-thread workers, across two it decoded 0.76x
    (docs/architecture.md), and separate processes keep each node's weights in its own memory.
    ``worker_threads`` K: ``n_threads / K`` workers of K threads (K must divide ``n_threads``).
    """
    if n_threads < 1:
        raise InvalidArgumentError(f"threads must be >= 1, got {n_threads}")
    if worker_threads is not None:
        if worker_threads < 1:
            raise InvalidArgumentError(f"threads per CPU worker must be >= 1, got {worker_threads}")
        if n_threads % worker_threads:
            raise InvalidArgumentError(f"{n_threads} threads do not split into workers of {worker_threads} threads each "
                                       "(--threads must be a multiple of --worker-threads)")
        return n_threads // worker_threads, worker_threads
    workers = max(1, min(n_threads, topo.n_groups()))
    while n_threads % workers:
        workers -= 1
    return workers, n_threads // workers
