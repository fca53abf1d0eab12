"""The life cycle every worker process shares, CPU or GPU: connect, HELLO, LOAD, READY, serve, stop.

Runs in: worker processes (cpu_workers/worker.py and gpu_worker/worker.py call run_worker; the
coordinator side of the same life cycle is processes/supervisor.py).

A worker is started as ``python -m MODULE INDEX CTL HB COORDINATOR_PID LOG_LEVEL [EXTRA...]``
(WorkerArgs). run_worker asks the kernel to kill it with its parent, ignores the terminal's
SIGINT (the coordinator handles Ctrl+C and sends SHUTDOWN), connects its DEALER, starts the
heartbeat thread, says HELLO, waits for LOAD, calls the worker's own ``load`` (an exception there
becomes an ERROR the coordinator reports as a load failure), answers READY with the weight bytes,
then hands the socket to the loaded part's ``serve`` until SHUTDOWN. serve_layers is the
per-layer request loop of the "zmq" transport (ATTN/FFN/LOGITS -> PARTIAL or ERROR).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import zmq

from powerinfer.protocol.errors import ProtocolError
from powerinfer.processes.lifecycle import die_with_parent, heartbeat
from powerinfer.protocol.messages import PROTOCOL_VERSION, ErrorMsg, HelloMsg, LoadMsg, Message, PartialMsg, ReadyMsg, ShutdownMsg
from powerinfer.protocol.transport import recv, send, socket_limits, worker_identity

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerArgs:
    """A worker's command line (written by processes/supervisor.py)."""

    index: int
    endpoint: str
    hb_endpoint: str
    coordinator: int
    log_level: str = "WARNING"
    extra: tuple[str, ...] = ()

    @classmethod
    def parse(cls, argv: Sequence[str]) -> WorkerArgs:
        if len(argv) < 4:
            raise SystemExit("usage: python -m <worker module> INDEX CTL HB COORDINATOR_PID [LOG_LEVEL EXTRA...] "
                             "(workers are started by the coordinator)")
        return cls(int(argv[0]), argv[1], argv[2], int(argv[3]), argv[4] if len(argv) > 4 else "WARNING", tuple(argv[5:]))


@dataclass
class Loaded:
    """What a worker's load step returns: its device or host weight bytes (for READY), the serve
    loop that takes the socket until SHUTDOWN, and what to release when it ends."""

    weight_bytes: int
    serve: Callable[[zmq.Socket, threading.Event], None]
    close: Callable[[], None] = field(default=lambda: None)


def run_worker(args: WorkerArgs, kind: str, load: Callable[[LoadMsg], Loaded]) -> None:
    """The whole life of a worker process (see the module docstring); kind ("worker", "GPU worker")
    names it in logs, with its index."""
    die_with_parent()
    label = f"{kind.lower().replace(' ', '-')}{args.index}"
    logging.basicConfig(level=args.log_level, format=f"%(levelname)s {label} %(name)s: %(message)s", stream=sys.stderr)
    # The coordinator handles Ctrl+C and tells us to stop; a terminal's SIGINT must not kill us mid-reply.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, worker_identity(args.index))
    sock.setsockopt(zmq.LINGER, 0)
    socket_limits(sock)
    sock.connect(args.endpoint)
    busy, stop = threading.Event(), threading.Event()
    beat = threading.Thread(target=heartbeat, args=(ctx, args.hb_endpoint, args.index, args.coordinator, busy, stop, kind), daemon=True)
    beat.start()
    loaded: Loaded | None = None
    try:
        send(sock, HelloMsg(version=PROTOCOL_VERSION, worker=args.index, pid=os.getpid()))
        msg = recv(sock)
        if isinstance(msg, ShutdownMsg):
            return
        if not isinstance(msg, LoadMsg):
            raise ProtocolError(f"expected LOAD, got {type(msg).__name__}")
        t0 = time.perf_counter()
        busy.set()
        try:
            loaded = load(msg)
        except Exception as e:  # noqa: BLE001 - the coordinator reports it as a load failure
            log.debug("load failed", exc_info=True)
            send(sock, ErrorMsg(req=-1, step=-1, layer=-1, worker=args.index, kind=type(e).__name__, message=str(e)))
            return
        finally:
            busy.clear()
        send(sock, ReadyMsg(worker=args.index, weight_bytes=loaded.weight_bytes, load_s=time.perf_counter() - t0))
        loaded.serve(sock, busy)
    finally:
        if loaded is not None:
            loaded.close()
        stop.set()
        beat.join(1.0)
        sock.close()
        ctx.term()


def serve_layers(sock: zmq.Socket, worker: int, busy: threading.Event, kinds: tuple[type[Message], ...],
                 compute: Callable[[Message], np.ndarray], after: Callable[[Message], None] | None = None) -> None:
    """Answer each request of one of kinds with PARTIAL(compute(msg)) or, when compute raises, a
    typed ERROR, and keep serving; return on SHUTDOWN. after(msg) runs once the reply is sent
    (housekeeping off the critical path)."""
    while True:
        try:
            msg = recv(sock)
        except ProtocolError as e:
            log.error("worker %d: dropped a malformed message: %s", worker, e)
            send(sock, ErrorMsg(req=-1, step=-1, layer=-1, worker=worker, kind="ProtocolError", message=str(e)))
            continue
        if isinstance(msg, ShutdownMsg):
            return
        if not isinstance(msg, kinds):
            send(sock, ErrorMsg(req=-1, step=-1, layer=-1, worker=worker, kind="ProtocolError", message=f"unexpected {type(msg).__name__}"))
            continue
        busy.set()
        t0 = time.perf_counter()
        layer = int(getattr(msg, "layer", -1))
        try:
            out = np.ascontiguousarray(compute(msg), dtype=np.float32)
            us = int((time.perf_counter() - t0) * 1e6)
            send(sock, PartialMsg(req=msg.req, step=msg.step, layer=layer, worker=worker, compute_us=us, tensors=(out,)))  # type: ignore[attr-defined]
        except Exception as e:  # noqa: BLE001 - reported to the coordinator as a typed ERROR; the worker keeps serving
            layer = int(getattr(e, "failed_layer", layer))  # inside a run of layers (LAYERS): the one that failed
            log.exception("worker %d: layer %d failed", worker, layer)
            send(sock, ErrorMsg(req=msg.req, step=msg.step, layer=layer, worker=worker, kind=type(e).__name__, message=str(e)))  # type: ignore[attr-defined]
            continue
        finally:
            busy.clear()
        if after is not None:  # the reply is out: a failure here is logged, not a second answer
            try:
                after(msg)
            except Exception:  # noqa: BLE001 - housekeeping only
                log.exception("worker %d: after layer %d", worker, layer)
