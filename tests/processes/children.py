"""Test helper: the worker processes a coordinator (CLI or server subprocess) has started.

Runs in: the pytest process. A worker the test just killed is a zombie until its parent reaps it,
and psutil then refuses its command line; such a process is no longer a worker, so it is skipped.
The coordinator's other children (the socket folder's reaper shell) are not workers either.
"""

from __future__ import annotations

import psutil


def worker_children(pid: int, module: str = "cpu_workers.worker") -> list[psutil.Process]:
    """Live children of `pid` whose command line runs `module` (e.g. "gpu_worker.worker")."""
    found: list[psutil.Process] = []
    for child in psutil.Process(pid).children():
        try:
            if child.status() != psutil.STATUS_ZOMBIE and module in " ".join(child.cmdline()):
                found.append(child)
        except (psutil.ZombieProcess, psutil.NoSuchProcess):
            continue  # died between the listing and the look: not a worker any more
    return found
