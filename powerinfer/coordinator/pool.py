"""The CPU worker pool: start, handshake, route requests, detect death, shut down.

Runs in: the coordinator process.

The processes, sockets and heartbeats are processes/supervisor.py's (the GPU worker's handle uses
the same supervisor); this module adds the CPU workers' handshake (HELLO, then a LOAD per worker
with its shard, placement and transport) and the request/reply call. A worker that exits, is
killed, or stops beating is reported as :class:`WorkerDiedError` to the request in flight;
:meth:`WorkerPool.restart` then brings up a fresh pool.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable

from powerinfer.cpu_workers.topology import Placement
from powerinfer.protocol import (
    ErrorMsg,
    HelloMsg,
    LoadMsg,
    Message,
    PartialMsg,
    ProtocolError,
    ReadyMsg,
    WorkerError,
)
from powerinfer.processes.supervisor import Supervisor

log = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0
HOT_FILE = "gpu_hot.json"  # PoolConfig.gpu_hot, written for the workers (LOAD.gpu_hot names it)


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
    gpu_layers: tuple[int, ...] = ()  # transport "shm": layers of the pool's GPU rank (the CPU ranks skip them)
    gpu_attn: tuple[int, ...] = ()  # transport "shm": layers whose attention the GPU rank computes (neuron split)
    gpu_hot: str = ""  # transport "shm": JSON list of each layer's hot neurons on the GPU rank (neuron split; "" none)
    layers: tuple[int, ...] = ()  # transport "shm": a pipeline stage's layers (first, stop); () the whole model


class WorkerPool:
    def __init__(self, config: PoolConfig) -> None:
        self.config = config
        self.ready: list[ReadyMsg] = []
        self._req = 0
        # called after each batch of sends: the native pool rings its doorbell so that ranks
        # serving steps in native code come back to read their socket
        self.after_send: Callable[[], None] | None = None
        self._sup: Supervisor  # set by start(); once closed it answers every use with a WorkerDiedError
        self.start()

    # -- life cycle ----------------------------------------------------------------------------

    def start(self) -> None:
        cfg = self.config
        # the hot neuron lists exceed a LOAD body: they go as a file in the supervisor's private directory
        files = {HOT_FILE: cfg.gpu_hot} if cfg.gpu_hot else None
        self._sup = Supervisor("powerinfer.cpu_workers.worker", cfg.n_workers, cfg.log_level, lambda i: f"worker {i}", files=files)
        try:
            self._handshake(self._sup)
            self._sup.serving = True
        except BaseException:
            self.close()
            raise

    def _handshake(self, sup: Supervisor) -> None:
        cfg = self.config
        # decode() already refuses a HELLO of another protocol version (ProtocolVersionError)
        for idx, msg in sup.gather(set(range(cfg.n_workers)), START_TIMEOUT_S, "starting").items():
            if not isinstance(msg, HelloMsg):
                raise ProtocolError(f"worker {idx}: expected HELLO, got {type(msg).__name__}")
        for i in range(cfg.n_workers):
            pl = cfg.placements[i] if i < len(cfg.placements) else None
            sup.send(i, LoadMsg(model=cfg.model, worker=i, n_workers=cfg.n_workers, n_ctx=cfg.n_ctx, threads=cfg.threads_per_worker,
                                cpus=tuple(pl.cpus) if pl else (), node=pl.node if pl else -1, predictor=cfg.predictor,
                                n_slots=cfg.n_slots, transport=cfg.transport, shm=cfg.shm, max_t=cfg.max_t, gpu_layers=cfg.gpu_layers,
                                gpu_attn=cfg.gpu_attn, gpu_hot=os.path.join(sup.dir, HOT_FILE) if cfg.gpu_hot else "",
                                layers=cfg.layers))
        replies = sup.gather(set(range(cfg.n_workers)), START_TIMEOUT_S, "loading")
        self.ready = []
        for i in range(cfg.n_workers):
            msg = replies[i]
            if isinstance(msg, ErrorMsg):
                raise WorkerError(f"worker {i} could not load its shard: {msg.kind}: {msg.message}")
            if not isinstance(msg, ReadyMsg):
                raise ProtocolError(f"worker {i}: expected READY, got {type(msg).__name__}")
            self.ready.append(msg)
        log.info("%d workers ready (pids %s)", cfg.n_workers, sup.pids)

    def close(self, timeout: float = 3.0) -> None:
        """Ask workers to stop, then terminate and kill what is left; remove the socket directory."""
        self._sup.close(timeout, self.after_send)

    def restart(self) -> None:
        log.warning("restarting the worker pool")
        self.close(timeout=1.0)
        self.start()

    def check_health(self, what: str = "idle") -> None:
        """Raise WorkerDiedError if any worker exited or stopped beating (what: the phase named)."""
        self._sup.check_health(what)

    @property
    def pids(self) -> list[int]:
        """The workers' process ids (after close(): the last pool's)."""
        return self._sup.pids

    # -- messaging -----------------------------------------------------------------------------

    def next_req(self) -> int:
        self._req += 1
        return self._req

    def call(self, msgs: dict[int, Message], req: int, what: str, timeout: float = 600.0, expect: type = PartialMsg) -> dict[int, Message]:
        """Send one request per worker and return their replies of type expect (raises on any failure)."""
        sup = self._sup
        for i, msg in msgs.items():
            sup.send(i, msg)
        if self.after_send is not None:
            self.after_send()
        replies = sup.gather(set(msgs), timeout, what, req=req)
        for i, msg in replies.items():
            if not isinstance(msg, expect):
                raise ProtocolError(f"worker {i}: expected {expect.__name__}, got {type(msg).__name__}")
        return replies
