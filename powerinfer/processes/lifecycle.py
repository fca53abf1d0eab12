"""What every worker process (CPU or GPU) does to stay tied to its coordinator.

Runs in: worker processes.

``die_with_parent`` asks the kernel to SIGKILL the worker when the thread that started it ends;
``heartbeat`` is the body of the worker's heartbeat thread: a HEARTBEAT every interval on its own
socket, and an immediate exit once the coordinator is gone, so a killed coordinator never leaves
orphan workers.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import threading

import zmq

from powerinfer.protocol.messages import HEARTBEAT_INTERVAL_S, HeartbeatMsg
from powerinfer.protocol.transport import send

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Linux: have the kernel SIGKILL us when the process that started us dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        log.debug("prctl(PR_SET_PDEATHSIG) unavailable; relying on the heartbeat thread")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def heartbeat(ctx: zmq.Context, endpoint: str, index: int, coordinator: int, busy: threading.Event, stop: threading.Event,
              name: str = "worker") -> None:
    """Beat every HEARTBEAT_INTERVAL_S until stop; exit the whole process when the coordinator disappears."""
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 10)
    sock.connect(endpoint)
    pid = os.getpid()
    while not stop.wait(HEARTBEAT_INTERVAL_S):
        if not alive(coordinator) or os.getppid() == 1:
            log.warning("%s %d: coordinator %d is gone, exiting", name, index, coordinator)
            os._exit(0)
        try:
            send(sock, HeartbeatMsg(worker=index, pid=pid, busy=busy.is_set()), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # coordinator busy; a dropped beat is fine, the next one follows
    sock.close()
