"""The coordinator's handles on the GPU worker: in this process, or a process over ZeroMQ.

Runs in: the coordinator process.

Both handles have one interface (:class:`GpuHandle`): ``attention_begin`` / ``ffn_begin`` start a
layer's GPU work and return a pending result, so the hybrid executor computes the CPU shards
before it waits. :class:`GpuWorkerProcess` speaks the existing protocol (docs/protocol.md):
HELLO -> LOAD (model, context, predictor, KV slots) -> READY, then ATTN/FFN -> PARTIAL, started
and watched by the CPU pool's own supervisor (processes/supervisor.py: a dead or hung worker is a
WorkerDiedError). What LOAD cannot carry (backend, budget, the hot neurons of each layer) is the
:class:`GpuSetup` JSON file the worker is started with, written in the private socket directory
(mode 0700).
"""

from __future__ import annotations

import json
import logging
import subprocess
from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np

from powerinfer.config import ModelConfig
from powerinfer.errors import InvalidArgumentError
from powerinfer.gguf_file import GGUFFile
from powerinfer.gpu_worker.backend import Backend, CpuBackend
from powerinfer.gpu_worker.errors import GpuMemoryError, GpuUnavailableError
from powerinfer.gpu_worker.layout import GpuPlan
from powerinfer.gpu_worker.model import GpuModel
from powerinfer.protocol import (
    AttnMsg,
    ErrorMsg,
    FfnMsg,
    HelloMsg,
    LayersMsg,
    LoadMsg,
    PartialMsg,
    ProtocolError,
    ReadyMsg,
    WorkerError,
)
from powerinfer.predictors.predictor_file import PredictorFile
from powerinfer.processes.supervisor import Supervisor

log = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # kernels compile (first run) and gigabytes upload before READY
REQUEST_TIMEOUT_S = 600.0  # one request; heartbeats catch a dead or stopped worker within seconds
LAYER_TIMEOUT_S = 120.0  # added per further layer of a LAYERS run
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


@dataclass(frozen=True)
class RankSeat:
    """Where a GPU worker serving as a rank of a native pool sits: the segment, its CPU ranks, the
    tokens per step and the layers it computes (LOAD's transport "shm" fields)."""

    shm: str
    n_ranks: int
    max_t: int
    gpu_layers: tuple[int, ...]


def make_backend(setup: GpuSetup) -> Backend:
    if setup.backend == "cuda":
        from powerinfer.gpu_worker.cuda_backend import CudaBackend

        return CudaBackend(setup.budget)
    return CpuBackend(setup.budget, setup.capacity)


class Pending(Protocol):
    def result(self) -> np.ndarray:
        """Wait for the partial output [T, d] (float32)."""
        ...

    def abandon(self) -> None:
        """Give up on the result without waiting (the next request may start)."""
        ...


class GpuHandle(Protocol):
    @property
    def weight_bytes(self) -> int:
        """Device bytes the worker holds (its ledger)."""
        ...

    def attention_begin(self, layer: int, x: np.ndarray, positions: np.ndarray, slots: np.ndarray | None) -> Pending: ...
    def ffn_begin(self, layer: int, x: np.ndarray) -> Pending: ...
    def layers_begin(self, first: int, stop: int, x: np.ndarray, positions: np.ndarray, slots: np.ndarray | None) -> Pending: ...

    @property
    def pids(self) -> list[int]:
        """The worker's process, when it runs in one."""
        ...

    def check_health(self, what: str = "idle") -> None:
        """Raise WorkerDiedError if the worker's process is gone or silent (no-op in process)."""
        ...

    def restarted(self) -> "GpuHandle":
        """A fresh worker after a failure (its KV caches empty); the same one when it has no process."""
        ...

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

    def layers_begin(self, first: int, stop: int, x: np.ndarray, positions: np.ndarray, slots: np.ndarray | None) -> Pending:
        return _Done(self.model.layers(first, stop, x, positions, slots))

    @property
    def pids(self) -> list[int]:
        return []

    def check_health(self, what: str = "idle") -> None:
        """In this process: nothing to lose."""

    def restarted(self) -> "LocalGpuWorker":
        return self

    def close(self) -> None:
        self.model.close()


class NoGpu:
    """The GPU handle of a placement that puts nothing on the GPU: no worker is started, and no
    request may reach it (every layer then lives on the CPU)."""

    weight_bytes = 0
    pids: list[int] = []

    def _refuse(self, *args: object) -> Pending:
        raise RuntimeError("nothing of this model lives on the GPU: the budget holds no layer")

    attention_begin = ffn_begin = layers_begin = _refuse

    def check_health(self, what: str = "idle") -> None:
        """No worker."""

    def restarted(self) -> "NoGpu":
        return self

    def close(self) -> None:
        pass


class _Done:
    """A result computed already (the in-process runtime's run of layers)."""

    def __init__(self, y: np.ndarray) -> None:
        self.y = y

    def result(self) -> np.ndarray:
        return self.y

    def abandon(self) -> None:
        pass


class _Reply:
    def __init__(self, proc: "GpuWorkerProcess", req: int, what: str, timeout: float) -> None:
        self.proc, self.req, self.what, self.timeout = proc, req, what, timeout

    def result(self) -> np.ndarray:
        if self.proc._pending != self.req:
            raise RuntimeError("this GPU result was already taken or abandoned")
        return self.proc._wait(self.req, self.what, self.timeout)

    def abandon(self) -> None:
        """Give up on the result (the caller failed before taking it); its late reply is skipped as stale."""
        if self.proc._pending == self.req:
            self.proc._pending = -1


class GpuWorkerProcess:
    """``python -m powerinfer.gpu_worker.worker`` supervised like a CPU worker (identity ``w0``)."""

    def __init__(self, model: str, setup: GpuSetup, n_ctx: int, n_slots: int = 1, predictor: str = "",
                 log_level: str = "WARNING", start_timeout: float = START_TIMEOUT_S, rank: RankSeat | None = None) -> None:
        """rank: serve as a rank of that native pool segment (gpu_worker/rank.py) instead of ATTN/FFN/LAYERS."""
        self._args = (model, setup, n_ctx, n_slots, predictor, log_level, start_timeout, rank)  # for restarted()
        self._rank = rank
        self.after_send: Callable[[], None] | None = None  # a rank: rings its control word (coordinator/gpu_rank.py)
        # the setup file lands in the supervisor's private socket directory (mode 0700)
        self._sup = Supervisor("powerinfer.gpu_worker.worker", 1, log_level, lambda i: "the GPU worker", prefix="powerinfer-gpu-",
                               extra_args=lambda i: ["{dir}/setup.json"], files={"setup.json": setup.to_json()})
        # _last: (layer, phase) of the latest request (phase 0 attention, 1 FFN); a request at or
        # before it starts a new forward pass (only logs and traces read `step`)
        self._req, self._step, self._last, self._pending = 0, 0, (-1, 1), -1
        self.weight_bytes = 0
        try:
            self._handshake(model, n_ctx, n_slots, predictor, start_timeout)
            self._sup.serving = True
        except BaseException:
            self.close()
            raise

    def _handshake(self, model: str, n_ctx: int, n_slots: int, predictor: str, timeout: float) -> None:
        hello = self._sup.gather({0}, timeout, "starting")[0]
        if not isinstance(hello, HelloMsg):
            raise ProtocolError(f"GPU worker: expected HELLO, got {type(hello).__name__}")
        r = self._rank
        self._sup.send(0, LoadMsg(model=model, worker=0, n_workers=r.n_ranks if r else 1, n_ctx=n_ctx, threads=0, cpus=(), node=-1,
                                  predictor=predictor, n_slots=n_slots, transport="shm" if r else "zmq", shm=r.shm if r else "",
                                  max_t=r.max_t if r else 1, gpu_layers=r.gpu_layers if r else ()))
        ready = self._sup.gather({0}, timeout, "loading")[0]
        if isinstance(ready, ErrorMsg):
            raise _TYPED.get(ready.kind, WorkerError)(ready.message if ready.kind in _TYPED else
                                                     f"the GPU worker could not load: {ready.kind}: {ready.message}")
        if not isinstance(ready, ReadyMsg):
            raise ProtocolError(f"GPU worker: expected READY, got {type(ready).__name__}")
        self.weight_bytes = ready.weight_bytes
        log.info("GPU worker ready (pid %d, %.1f MiB on the device, %.1fs)", self._sup.pids[0], ready.weight_bytes / 2**20, ready.load_s)

    # -- messaging -----------------------------------------------------------------------------------

    def _start(self, make: type[AttnMsg] | type[FfnMsg] | type[LayersMsg], layer: int, tensors: tuple[np.ndarray, ...], what: str,
               stop: int = 0) -> _Reply:
        if self._pending >= 0:
            raise RuntimeError("one GPU request at a time: take the previous result first")
        first = (layer, 1 if make is FfnMsg else 0)
        if first <= self._last:
            self._step += 1  # a new forward pass
        self._last = (stop - 1, 1) if make is LayersMsg else first
        self._req += 1
        extra = {"stop": stop} if make is LayersMsg else {}
        self._sup.send(0, make(req=self._req, step=self._step, layer=layer, tensors=tensors, **extra))  # type: ignore[arg-type]
        self._pending = self._req
        # a run of layers gets more time (a slow backend's long prefill chunk is not a hang), but not
        # each layer's whole allowance: a worker that hangs while its heartbeat thread beats would
        # otherwise hold a request for hours (a dead or stopped one is caught by heartbeats anyway)
        timeout = REQUEST_TIMEOUT_S + (LAYER_TIMEOUT_S * (stop - layer - 1) if make is LayersMsg else 0.0)
        return _Reply(self, self._req, what, timeout)

    def _wait(self, req: int, what: str, timeout: float = 0.0) -> np.ndarray:
        try:
            msg = self._sup.gather({0}, timeout or REQUEST_TIMEOUT_S, what, req=req, error=_gpu_error)[0]
        finally:
            self._pending = -1
        if not isinstance(msg, PartialMsg):
            raise ProtocolError(f"GPU worker: expected PARTIAL, got {type(msg).__name__}")
        return np.array(msg.tensors[0], dtype=np.float32)  # owned: the frame is read-only

    def attention_begin(self, layer: int, x: np.ndarray, positions: np.ndarray, slots: np.ndarray | None) -> Pending:
        pos = np.ascontiguousarray(positions, dtype=np.int64)
        sl = np.zeros_like(pos) if slots is None else np.ascontiguousarray(slots, dtype=np.int64)
        return self._start(AttnMsg, layer, (np.ascontiguousarray(x, dtype=np.float32), pos, sl), f"computing layer {layer} attention")

    def ffn_begin(self, layer: int, x: np.ndarray) -> Pending:
        return self._start(FfnMsg, layer, (np.ascontiguousarray(x, dtype=np.float32),), f"computing layer {layer} hot neurons")

    def layers_begin(self, first: int, stop: int, x: np.ndarray, positions: np.ndarray, slots: np.ndarray | None) -> Pending:
        pos = np.ascontiguousarray(positions, dtype=np.int64)
        sl = np.zeros_like(pos) if slots is None else np.ascontiguousarray(slots, dtype=np.int64)
        return self._start(LayersMsg, first, (np.ascontiguousarray(x, dtype=np.float32), pos, sl), f"computing layers {first}..{stop - 1}",
                           stop=stop)

    def check_health(self, what: str = "idle") -> None:
        """Raise WorkerDiedError if the worker exited or stopped beating (what: the phase named)."""
        self._sup.check_health(what)

    @property
    def pids(self) -> list[int]:
        return self._sup.pids

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        """The worker's process (its exit status after close())."""
        return self._sup.procs[0]

    def restarted(self) -> "GpuWorkerProcess":
        """Stop this worker (SIGKILL if it does not answer, e.g. SIGSTOPped) and start a fresh one.
        A rank of a native pool cannot: its segment is gone; the pool restarts it with a new one."""
        if self._rank is not None:
            raise RuntimeError("a GPU rank is restarted by its pool (NativePoolExecutor.restart), with a fresh segment")
        log.warning("restarting the GPU worker")
        self.close(timeout=1.0)
        return GpuWorkerProcess(*self._args)

    def close(self, timeout: float = 5.0) -> None:
        self._sup.close(timeout, self.after_send)


def _gpu_error(name: str, msg: ErrorMsg) -> Exception:
    """An ERROR reply: the GPU's own typed errors (memory, no device) keep their type and text."""
    if msg.kind in _TYPED:
        return _TYPED[msg.kind](msg.message)
    return WorkerError(f"{name} failed on layer {msg.layer}: {msg.kind}: {msg.message}")
