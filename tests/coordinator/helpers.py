"""Helpers shared by the coordinator tests (worker processes and their fate)."""

from __future__ import annotations

import time

import psutil


def gone(pids: list[int], timeout: float = 5.0) -> bool:
    """True once none of pids is running (zombies count as gone: their parent reaps them)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
            return True
        time.sleep(0.05)
    return False
