"""Applying a placement in a CPU worker process: pin it to its cores, prefer its node's memory.

Runs in: each CPU worker process, first thing after it starts, in its main thread, before it
creates compute threads or allocates and fills its weight buffers (so first touch places them on
its node). The placement itself is planned by topology.py in the coordinator.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
from pathlib import Path

import psutil

from powerinfer.cpu_workers.topology import SYSFS_ENV, Placement, node_numbers

log = logging.getLogger(__name__)

# set_mempolicy(2) syscall numbers; aarch64 uses the asm-generic table.
_SYS_SET_MEMPOLICY = {"x86_64": 238, "amd64": 238, "aarch64": 237, "arm64": 237}
_MPOL_PREFERRED = 1


def pin_current_process(placement: Placement) -> None:
    """Restrict the calling process to ``placement.cpus``; on failure, warn and run unpinned.

    Linux applies affinity to the calling thread, and threads started later inherit it: call this
    in the worker's main thread before torch / OpenMP create their thread pools.
    """
    cpus = sorted(set(placement.cpus))
    if not cpus:
        log.warning("worker %d: placement has no CPUs; running unpinned", placement.worker)
        return
    try:
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, cpus)
        else:
            psutil.Process().cpu_affinity(cpus)  # AttributeError where psutil cannot (macOS)
    except (OSError, ValueError, AttributeError, psutil.Error) as e:
        log.warning("worker %d: could not pin to CPUs %s (%s); running unpinned", placement.worker, cpus, e)
        return
    log.debug("worker %d pinned to CPUs %s (node %d)", placement.worker, cpus, placement.node)


def bind_memory_to_node(node: int, *, sysfs: str | Path | None = None) -> bool:
    """Prefer ``node`` for this thread's future page allocations (set_mempolicy MPOL_PREFERRED).

    Best effort and usually redundant: after ``pin_current_process`` first-touch already puts pages
    on the local node under the default policy; this makes it explicit and survives the scheduler
    briefly running us elsewhere. The policy is per thread and inherited by threads created later,
    so call it in the main thread before starting compute threads. Returns False (logged at debug)
    on non-Linux, unknown architectures, single-node machines, unknown nodes, when the syscall
    is refused (containers often block it with EPERM), and under a fake tree ($POWERINFER_SYSFS).
    """
    if sysfs is None and os.environ.get(SYSFS_ENV):
        # a fake tree's node numbers are not the kernel's: binding would pick the wrong real node
        log.debug("not binding memory to node %d: $%s names a fake topology", node, SYSFS_ENV)
        return False
    nodes = node_numbers(sysfs)
    nr = _SYS_SET_MEMPOLICY.get(platform.machine().lower())
    reason = None
    if platform.system() != "Linux" or nr is None:
        reason = f"unsupported platform {platform.system()}/{platform.machine()}"
    elif len(nodes) <= 1:
        reason = "single NUMA node"
    elif node not in nodes:
        reason = f"no such node (nodes: {nodes})"
    if reason is not None:
        log.debug("not binding memory to node %d: %s", node, reason)
        return False
    bits = ctypes.sizeof(ctypes.c_ulong) * 8
    mask = (ctypes.c_ulong * (node // bits + 1))()
    mask[node // bits] = 1 << (node % bits)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        # maxnode is one more than the mask's bits: the kernel reads maxnode - 1 bits (as libnuma does).
        rc = libc.syscall(ctypes.c_long(nr), ctypes.c_long(_MPOL_PREFERRED), mask, ctypes.c_ulong(len(mask) * bits + 1))
    except (OSError, AttributeError) as e:
        log.debug("not binding memory to node %d: %s", node, e)
        return False
    if rc != 0:
        err = ctypes.get_errno()
        log.debug("set_mempolicy(MPOL_PREFERRED, node %d) failed: %s", node, os.strerror(err))
        return False
    log.debug("memory policy: prefer node %d", node)
    return True
