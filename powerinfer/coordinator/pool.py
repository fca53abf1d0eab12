"""Worker pool supervision: start, handshake, route layer requests, detect death, shut down.

Runs in: the coordinator process.

Sockets live in a private directory (``mkdtemp``: mode 0700) as ``ipc://`` endpoints: a ROUTER
for requests/replies and a PULL for heartbeats. A worker that exits, is killed, or stops beating
(SIGSTOP, a hang) for HEARTBEAT_TIMEOUT_S is reported as :class:`WorkerDiedError` to the request
in flight; :meth:`WorkerPool.restart` then brings up a fresh pool. Workers die with the
coordinator (PR_SET_PDEATHSIG plus their heartbeat thread's liveness check), so none is orphaned.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

import zmq

from powerinfer.cpu_workers.topology import Placement
from powerinfer.protocol import (
    HEARTBEAT_TIMEOUT_S,
    ErrorMsg,
    HeartbeatMsg,
    HelloMsg,
    LoadMsg,
    Message,
    PartialMsg,
    ProtocolError,
    ReadyMsg,
    ShutdownMsg,
    WorkerDiedError,
    WorkerError,
    recv,
    recv_routed,
    send_routed,
    socket_limits,
    worker_identity,
)

log = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0
POLL_MS = 50
LIVENESS_EVERY_S = 0.2


@dataclass(frozen=True)
class PoolConfig:
    model: str
    n_workers: int
    n_ctx: int
    threads_per_worker: int = 1
    placements: tuple[Placement, ...] = ()  # empty: no pinning
    log_level: str = "WARNING"
    predictor: str = ""  # .predictor path for sparse FFN shards ("" = dense)
    n_slots: int = 1  # KV-cache slots (concurrent sequences) per attention shard
    transport: str = "zmq"  # "shm": native ranks, one STEP per pass (LOAD.transport); "zmq": per-layer torch shards
    shm: str = ""  # transport "shm": the segment's path (made by the executor before the pool starts)
    max_t: int = 1  # transport "shm": most tokens per STEP


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "stopped answering"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


class WorkerPool:
    def __init__(self, config: PoolConfig) -> None:
        self.config = config
        self.procs: list[subprocess.Popen[bytes]] = []
        self.ready: list[ReadyMsg] = []
        self.last_beat: list[float] = []
        self._req = 0
        self._dir = ""
        # called after each batch of sends: the native pool rings its doorbell so that ranks
        # serving steps in native code come back to read their socket
        self.after_send: Callable[[], None] | None = None
        self._ctx: zmq.Context | None = None
        self.start()

    # -- life cycle ----------------------------------------------------------------------------

    def start(self) -> None:
        cfg = self.config
        self._dir = tempfile.mkdtemp(prefix="powerinfer-")  # mode 0700: only this user can connect
        self._ctx = zmq.Context()
        self.router = self._ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a dead worker raises, not drops
        socket_limits(self.router)
        endpoint = f"ipc://{self._dir}/ctl"
        self.router.bind(endpoint)
        self.beats = self._ctx.socket(zmq.PULL)
        self.beats.setsockopt(zmq.LINGER, 0)
        socket_limits(self.beats)
        hb_endpoint = f"ipc://{self._dir}/hb"
        self.beats.bind(hb_endpoint)
        self.poller = zmq.Poller()
        self.poller.register(self.router, zmq.POLLIN)
        self.poller.register(self.beats, zmq.POLLIN)
        # A fresh interpreter per worker (`python -m powerinfer.cpu_workers.worker`): no inherited
        # torch thread pools or zmq contexts, and unlike multiprocessing's spawn it never re-imports
        # the user's __main__, so scripts without an `if __name__ == "__main__"` guard work.
        self.procs = [
            subprocess.Popen(
                [sys.executable, "-m", "powerinfer.cpu_workers.worker", str(i), endpoint, hb_endpoint, str(os.getpid()), cfg.log_level],
                stdin=subprocess.DEVNULL,
            )
            for i in range(cfg.n_workers)
        ]
        self.last_beat = [time.monotonic()] * cfg.n_workers
        self._index_of = {worker_identity(i): i for i in range(cfg.n_workers)}
        self._serving = False
        try:
            self._handshake()
            self._serving = True
        except BaseException:
            self.close()
            raise

    def _handshake(self) -> None:
        cfg = self.config
        # decode() already refuses a HELLO of another protocol version (ProtocolVersionError)
        for idx, msg in self._gather(set(range(cfg.n_workers)), START_TIMEOUT_S, "starting").items():
            if not isinstance(msg, HelloMsg):
                raise ProtocolError(f"worker {idx}: expected HELLO, got {type(msg).__name__}")
        for i in range(cfg.n_workers):
            pl = cfg.placements[i] if i < len(cfg.placements) else None
            self._send(i, LoadMsg(model=cfg.model, worker=i, n_workers=cfg.n_workers, n_ctx=cfg.n_ctx, threads=cfg.threads_per_worker,
                                  cpus=tuple(pl.cpus) if pl else (), node=pl.node if pl else -1, predictor=cfg.predictor,
                                  n_slots=cfg.n_slots, transport=cfg.transport, shm=cfg.shm, max_t=cfg.max_t))
        replies = self._gather(set(range(cfg.n_workers)), START_TIMEOUT_S, "loading")
        self.ready = []
        for i in range(cfg.n_workers):
            msg = replies[i]
            if isinstance(msg, ErrorMsg):
                raise WorkerError(f"worker {i} could not load its shard: {msg.kind}: {msg.message}")
            if not isinstance(msg, ReadyMsg):
                raise ProtocolError(f"worker {i}: expected READY, got {type(msg).__name__}")
            self.ready.append(msg)
        log.info("%d workers ready (pids %s)", cfg.n_workers, [p.pid for p in self.procs])

    def close(self, timeout: float = 3.0) -> None:
        """Ask workers to stop, then terminate and kill what is left; remove the socket directory."""
        if self._ctx is None:
            return
        for i, p in enumerate(self.procs):
            if p.poll() is None:
                try:
                    self._send(i, ShutdownMsg())
                except (zmq.ZMQError, WorkerDiedError):
                    pass
        if self.after_send is not None:
            self.after_send()
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(max(0.01, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()  # SIGKILL also ends a SIGSTOPped worker
                p.wait(5.0)
        self.router.close()
        self.beats.close()
        self._ctx.term()
        self._ctx = None
        shutil.rmtree(self._dir, ignore_errors=True)

    def restart(self) -> None:
        log.warning("restarting the worker pool")
        self.close(timeout=1.0)
        self.start()

    def check_health(self) -> None:
        """Between requests: raise WorkerDiedError if any worker exited or stopped beating."""
        self._drain_beats()
        self._check_alive(set(range(len(self.procs))), "idle")

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    # -- messaging -----------------------------------------------------------------------------

    def next_req(self) -> int:
        self._req += 1
        return self._req

    def _send(self, worker: int, msg: Message) -> None:
        try:
            send_routed(self.router, worker_identity(worker), msg)
        except zmq.ZMQError as e:  # ROUTER_MANDATORY: the peer is gone
            # The socket can see the peer gone before waitpid does: wait a moment so the error names the exit.
            p = self.procs[worker]
            try:
                p.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                raise WorkerDiedError(f"worker {worker} (pid {p.pid}) is unreachable: {e}") from None
            raise WorkerDiedError(f"worker {worker} (pid {p.pid}) {_describe_exit(p.returncode)}") from None

    def _check_alive(self, pending: set[int], what: str) -> None:
        now = time.monotonic()
        for i in sorted(pending):
            p = self.procs[i]
            if p.poll() is not None:
                raise WorkerDiedError(f"worker {i} (pid {p.pid}) {_describe_exit(p.returncode)} while {what}")
            # While starting, interpreters import torch and pack weights before their first beat;
            # only the start timeout applies then.
            if self._serving and now - self.last_beat[i] > HEARTBEAT_TIMEOUT_S:
                raise WorkerDiedError(f"worker {i} (pid {p.pid}) stopped answering for {now - self.last_beat[i]:.1f}s while {what}")

    def _drain_beats(self) -> None:
        while True:
            try:
                msg = recv(self.beats, flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            except ProtocolError as e:
                log.warning("dropped a malformed heartbeat: %s", e)
                continue
            if isinstance(msg, HeartbeatMsg) and 0 <= msg.worker < len(self.last_beat):
                self.last_beat[msg.worker] = time.monotonic()

    def _gather(self, pending: set[int], timeout: float, what: str, req: int | None = None) -> dict[int, Message]:
        """Wait for one message from each worker in pending (matching req when given)."""
        out: dict[int, Message] = {}
        deadline = time.monotonic() + timeout
        checked = time.monotonic()
        while pending:
            events = dict(self.poller.poll(POLL_MS))
            if self.beats in events:
                self._drain_beats()
            if self.router in events:
                while True:
                    try:
                        ident, msg = recv_routed(self.router, flags=zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    idx = self._index_of.get(ident, -1)
                    if idx not in pending:
                        log.debug("ignored a stray %s from %r", type(msg).__name__, ident)
                        continue
                    self.last_beat[idx] = time.monotonic()
                    if req is not None and getattr(msg, "req", req) not in (req, -1):
                        log.debug("ignored a stale reply to request %s", getattr(msg, "req", None))
                        continue
                    if isinstance(msg, ErrorMsg) and req is not None:
                        raise WorkerError(f"worker {idx} failed on layer {msg.layer}: {msg.kind}: {msg.message}")
                    out[idx] = msg
                    pending.discard(idx)
            now = time.monotonic()
            if pending and (not events or now - checked > LIVENESS_EVERY_S):
                # waitpid per worker costs a syscall: check when idle or every LIVENESS_EVERY_S
                checked = now
                self._check_alive(pending, what)
                if now > deadline:
                    raise WorkerDiedError(f"workers {sorted(pending)} did not answer within {timeout:.0f}s while {what}")
        return out

    def call(self, msgs: dict[int, Message], req: int, what: str, timeout: float = 600.0, expect: type = PartialMsg) -> dict[int, Message]:
        """Send one request per worker and return their replies of type expect (raises on any failure)."""
        for i, msg in msgs.items():
            self._send(i, msg)
        if self.after_send is not None:
            self.after_send()
        replies = self._gather(set(msgs), timeout, what, req=req)
        for i, msg in replies.items():
            if not isinstance(msg, expect):
                raise ProtocolError(f"worker {i}: expected {expect.__name__}, got {type(msg).__name__}")
        return replies
