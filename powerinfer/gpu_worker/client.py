"""The coordinator's handles on the GPU worker: in this process, or a process over ZeroMQ.

Runs in: the coordinator process.

Both handles have one interface (:class:`GpuHandle`): ``attention_begin`` / ``ffn_begin`` start a
layer's GPU work and return a pending result, so the hybrid executor computes the CPU shards
before it waits. :class:`GpuWorkerProcess` speaks the existing protocol (docs/protocol.md):
HELLO -> LOAD (model, context, predictor, KV slots) -> READY, then ATTN/FFN -> PARTIAL, with the
heartbeat supervision of the CPU pool (a dead or hung worker is a WorkerDiedError). What LOAD
cannot carry (backend, budget, the hot neurons of each layer) is the :class:`GpuSetup` JSON file
the worker is started with, written in the private socket directory (mode 0700).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import zmq

from powerinfer.config import ModelConfig
from powerinfer.errors import InvalidArgumentError
from powerinfer.gguf_file import GGUFFile
from powerinfer.gpu_worker.backend import Backend, CpuBackend
from powerinfer.gpu_worker.errors import GpuMemoryError, GpuUnavailableError
from powerinfer.gpu_worker.model import GpuModel, GpuPlan
from powerinfer.protocol import (
    HEARTBEAT_TIMEOUT_S,
    AttnMsg,
    ErrorMsg,
    FfnMsg,
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
from powerinfer.predictors.predictor_file import PredictorFile

log = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # kernels compile (first run) and gigabytes upload before READY
POLL_MS = 50
BACKENDS = ("cpu", "cuda")
_TYPED = {"GpuMemoryError": GpuMemoryError, "GpuUnavailableError": GpuUnavailableError}


@dataclass(frozen=True)
class GpuSetup:
    backend: str  # "cpu" | "cuda"
    budget: int  # bytes of device memory the worker may allocate
    plan: GpuPlan
    capacity: int | None = None  # CPU backend: the simulated card's free memory (None: host RAM)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise InvalidArgumentError(f"GPU backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")

    def to_json(self) -> str:
        return json.dumps({"backend": self.backend, "budget": self.budget, "capacity": self.capacity, "plan": self.plan.to_json()})

    @classmethod
    def from_json(cls, text: str) -> GpuSetup:
        d = json.loads(text)
        return cls(d["backend"], int(d["budget"]), GpuPlan.from_json(d["plan"]), d["capacity"])


def make_backend(setup: GpuSetup) -> Backend:
    if setup.backend == "cuda":
        from powerinfer.gpu_worker.cuda_backend import CudaBackend

        return CudaBackend(setup.budget)
    return CpuBackend(setup.budget, setup.capacity)


class Pending(Protocol):
    def result(self) -> np.ndarray:
        """Wait for the partial output [T, d] (float32)."""
        ...


class GpuHandle(Protocol):
    @property
    def weight_bytes(self) -> int:
        """Device bytes the worker holds (its ledger)."""
        ...

    def attention_begin(self, layer: int, x: np.ndarray, positions: np.ndarray, slots: np.ndarray | None) -> Pending: ...
    def ffn_begin(self, layer: int, x: np.ndarray) -> Pending: ...
    def close(self) -> None: ...


class LocalGpuWorker:
    """The GPU runtime in the coordinator's own process (tests, notebooks, a single process)."""

    def __init__(self, f: GGUFFile, cfg: ModelConfig, setup: GpuSetup, n_ctx: int, n_slots: int = 1,
                 predictor: PredictorFile | None = None) -> None:
        backend = make_backend(setup)
        try:
            self.model = GpuModel(f, cfg, backend, setup.plan, n_ctx, n_slots, predictor)
        except BaseException:
            backend.close()
            raise

    @property
    def weight_bytes(self) -> int:
        return self.model.nbytes

    def attention_begin(self, layer: int, x: np.ndarray, positions: np.ndarray, slots: np.ndarray | None) -> Pending:
        return self.model.attention_begin(layer, x, positions, slots)

    def ffn_begin(self, layer: int, x: np.ndarray) -> Pending:
        return self.model.ffn_begin(layer, x)

    def close(self) -> None:
        self.model.close()


class _Reply:
    def __init__(self, proc: "GpuWorkerProcess", req: int, what: str) -> None:
        self.proc, self.req, self.what = proc, req, what

    def result(self) -> np.ndarray:
        return self.proc._wait(self.req, self.what)


class GpuWorkerProcess:
    """``python -m powerinfer.gpu_worker.worker`` supervised like a CPU worker (identity ``w0``)."""

    def __init__(self, model: str, setup: GpuSetup, n_ctx: int, n_slots: int = 1, predictor: str = "",
                 log_level: str = "WARNING", start_timeout: float = START_TIMEOUT_S) -> None:
        self._args = (model, setup, n_ctx, n_slots, predictor, log_level, start_timeout)  # for restarted()
        self._dir = tempfile.mkdtemp(prefix="powerinfer-gpu-")  # mode 0700: only this user can connect
        self._ctx: zmq.Context | None = zmq.Context()
        self.router = self._ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        socket_limits(self.router)
        self.router.bind(f"ipc://{self._dir}/ctl")
        self.beats = self._ctx.socket(zmq.PULL)
        self.beats.setsockopt(zmq.LINGER, 0)
        socket_limits(self.beats)
        self.beats.bind(f"ipc://{self._dir}/hb")
        self.poller = zmq.Poller()
        self.poller.register(self.router, zmq.POLLIN)
        self.poller.register(self.beats, zmq.POLLIN)
        setup_path = Path(self._dir) / "setup.json"
        setup_path.write_text(setup.to_json())
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "powerinfer.gpu_worker.worker", f"ipc://{self._dir}/ctl", f"ipc://{self._dir}/hb",
             str(os.getpid()), log_level, str(setup_path)],
            stdin=subprocess.DEVNULL,
        )
        self.ident = worker_identity(0)
        self.last_beat = time.monotonic()
        self._serving = False
        self._req, self._step, self._last_layer, self._pending = 0, 0, -1, -1
        self.weight_bytes = 0
        try:
            self._handshake(model, n_ctx, n_slots, predictor, start_timeout)
            self._serving = True
        except BaseException:
            self.close()
            raise

    def _handshake(self, model: str, n_ctx: int, n_slots: int, predictor: str, timeout: float) -> None:
        hello = self._recv(timeout, "starting")
        if not isinstance(hello, HelloMsg):
            raise ProtocolError(f"GPU worker: expected HELLO, got {type(hello).__name__}")
        self._send(LoadMsg(model=model, worker=0, n_workers=1, n_ctx=n_ctx, threads=0, cpus=(), node=-1, predictor=predictor,
                           n_slots=n_slots))
        ready = self._recv(timeout, "loading")
        if isinstance(ready, ErrorMsg):
            raise _TYPED.get(ready.kind, WorkerError)(ready.message if ready.kind in _TYPED else
                                                     f"the GPU worker could not load: {ready.kind}: {ready.message}")
        if not isinstance(ready, ReadyMsg):
            raise ProtocolError(f"GPU worker: expected READY, got {type(ready).__name__}")
        self.weight_bytes = ready.weight_bytes
        log.info("GPU worker ready (pid %d, %.1f MiB on the device, %.1fs)", self.proc.pid, ready.weight_bytes / 2**20, ready.load_s)

    # -- messaging -----------------------------------------------------------------------------------

    def _send(self, msg: Message) -> None:
        try:
            send_routed(self.router, self.ident, msg)
        except zmq.ZMQError as e:
            # The socket can see the peer gone before waitpid does: give the exit a moment to show, so the
            # error names what happened to the worker rather than the socket's view of it.
            try:
                code = self.proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                raise WorkerDiedError(f"the GPU worker (pid {self.proc.pid}) is unreachable: {e}") from None
            raise WorkerDiedError(f"the GPU worker (pid {self.proc.pid}) exited with status {code}") from None

    def _drain_beats(self) -> None:
        while True:
            try:
                msg = recv(self.beats, flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            except ProtocolError as e:
                log.warning("dropped a malformed heartbeat: %s", e)
                continue
            if isinstance(msg, HeartbeatMsg):
                self.last_beat = time.monotonic()

    def _recv(self, timeout: float, what: str) -> Message:
        """The next message from the worker on the control socket (heartbeats are absorbed)."""
        deadline = time.monotonic() + timeout
        while True:
            events = dict(self.poller.poll(POLL_MS))
            if self.beats in events:
                self._drain_beats()
            if self.router in events:
                ident, msg = recv_routed(self.router, flags=zmq.NOBLOCK)
                if ident == self.ident:
                    self.last_beat = time.monotonic()
                    return msg
            code = self.proc.poll()
            if code is not None:
                raise WorkerDiedError(f"the GPU worker (pid {self.proc.pid}) exited with status {code} while {what}")
            now = time.monotonic()
            if self._serving and now - self.last_beat > HEARTBEAT_TIMEOUT_S:
                raise WorkerDiedError(f"the GPU worker (pid {self.proc.pid}) stopped answering for {now - self.last_beat:.1f}s while {what}")
            if now > deadline:
                raise WorkerDiedError(f"the GPU worker did not answer within {timeout:.0f}s while {what}")

    def _start(self, make: type[AttnMsg] | type[FfnMsg], layer: int, tensors: tuple[np.ndarray, ...], what: str) -> _Reply:
        if self._pending >= 0:
            raise RuntimeError("one GPU request at a time: take the previous result first")
        if layer <= self._last_layer:
            self._step += 1  # a new forward pass
        self._last_layer = layer
        self._req += 1
        self._send(make(req=self._req, step=self._step, layer=layer, tensors=tensors))  # type: ignore[arg-type]
        self._pending = self._req
        return _Reply(self, self._req, what)

    def _wait(self, req: int, what: str) -> np.ndarray:
        while True:
            msg = self._recv(600.0, what)
            if getattr(msg, "req", req) not in (req, -1):
                log.debug("ignored a stale GPU reply to request %s", getattr(msg, "req", None))
                continue
            self._pending = -1
            if isinstance(msg, ErrorMsg):
                if msg.kind in _TYPED:
                    raise _TYPED[msg.kind](msg.message)
                raise WorkerError(f"the GPU worker failed on layer {msg.layer}: {msg.kind}: {msg.message}")
            if not isinstance(msg, PartialMsg):
                raise ProtocolError(f"GPU worker: expected PARTIAL, got {type(msg).__name__}")
            return np.array(msg.tensors[0], dtype=np.float32)  # owned: the frame is read-only

    def attention_begin(self, layer: int, x: np.ndarray, positions: np.ndarray, slots: np.ndarray | None) -> Pending:
        pos = np.ascontiguousarray(positions, dtype=np.int64)
        sl = np.zeros_like(pos) if slots is None else np.ascontiguousarray(slots, dtype=np.int64)
        return self._start(AttnMsg, layer, (np.ascontiguousarray(x, dtype=np.float32), pos, sl), f"computing layer {layer} attention")

    def ffn_begin(self, layer: int, x: np.ndarray) -> Pending:
        return self._start(FfnMsg, layer, (np.ascontiguousarray(x, dtype=np.float32),), f"computing layer {layer} hot neurons")

    def check_health(self) -> None:
        """Between requests: raise WorkerDiedError if the worker exited or stopped beating."""
        self._drain_beats()
        code = self.proc.poll()
        if code is not None:
            raise WorkerDiedError(f"the GPU worker (pid {self.proc.pid}) exited with status {code}")
        idle = time.monotonic() - self.last_beat
        if idle > HEARTBEAT_TIMEOUT_S:
            raise WorkerDiedError(f"the GPU worker (pid {self.proc.pid}) stopped answering for {idle:.1f}s")

    def restarted(self) -> "GpuWorkerProcess":
        """Stop this worker (SIGKILL if it does not answer, e.g. SIGSTOPped) and start a fresh one."""
        log.warning("restarting the GPU worker")
        self.close(timeout=1.0)
        return GpuWorkerProcess(*self._args)

    def close(self, timeout: float = 5.0) -> None:
        if self._ctx is None:
            return
        if self.proc.poll() is None:
            try:
                self._send(ShutdownMsg())
            except (zmq.ZMQError, WorkerDiedError):
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5.0)
        self.router.close()
        self.beats.close()
        self._ctx.term()
        self._ctx = None
        shutil.rmtree(self._dir, ignore_errors=True)

