"""Coordinator <-> worker wire messages: typed bodies, encode/decode, send/recv over ZeroMQ.

Runs in: the coordinator and every worker process (both ends import the same code).

A message is a ZeroMQ multipart message. Frame 0 is one type byte followed by a msgpack map (the
typed body); for messages that carry tensors the body's ``"t"`` entry lists one descriptor
``[dtype, shape]`` per following frame, each frame holding raw little-endian contiguous bytes.
docs/protocol.md is the normative spec; this module is its reference implementation.

Decoding never trusts the peer: every size is checked against the bytes actually received before
anything is viewed, so a bad message costs a ProtocolError, never a crash or a large allocation.
Decoded tensors are read-only numpy views over the received zmq frames (zero-copy); bf16 tensors
appear in numpy as uint16 raw bits (numpy has no bf16) and become bf16 again in :func:`as_torch`.

Hot path: a T=1 decode step exchanges ~60 small ATTN/FFN/PARTIAL messages per token, so the
message classes validate nothing themselves (except ErrorMsg, which truncates its texts);
encode/decode check fields against precomputed per-type specs with plain tuple/dict work.
"""

from __future__ import annotations

import enum

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar, Union

import numpy as np

from powerinfer.protocol.errors import WorkerError

if TYPE_CHECKING:
    import torch

    Tensor = Union[np.ndarray, torch.Tensor]

PROTOCOL_VERSION: int = 10  # 10: LOAD layers, STEP's stream flag (a pipeline stage's pool); 9: KV (a slot's KV cache saved to or restored from a file); 2: LOGITS (the head sharded); 3: ATTN slots, LOAD n_slots; 4: STEP/RESULT, LOAD transport/shm/max_t;
# 5: LAYERS (a run of whole layers in one request); 6: the shm segment's banks per rank; 7: LOAD gpu_layers, the GPU worker
# as a rank of the segment (its hand-off around runs of GPU layers); 8: LOAD gpu_attn/gpu_hot, the GPU rank in neuron split
# (hand-offs of a layer's attention and hot neurons)
MAX_BODY = 64 * 1024  # bytes of frame 0 (type byte + msgpack body)
MAX_STR = 4096  # characters of a str field (two of them at 4 B/char stay well under MAX_BODY)
MAX_LIST = 4096  # elements of a list field (LOAD.cpus)
MAX_DIMS = 4
DEFAULT_MAX_MSG = 256 * 1024 * 1024  # per-frame ZMQ_MAXMSGSIZE, see socket_limits()
# Tensor frames at least this large are sent zero-copy. Measured here (pyzmq 27, libzmq 4.3.5):
# a tracked zero-copy send costs ~15-25 us of setup (Frame + MessageTracker + the gc thread that
# releases the buffer), while copying a 2.3 KB T=1 activation costs ~1.5 us per send in total and
# a 295 KB [128, 576] f32 chunk ~10 us. Copying stops paying off between 0.5 and 1 MiB.
ZERO_COPY_MIN = 1024 * 1024
HEARTBEAT_INTERVAL_S = 0.2  # a worker beats this often, from a thread (also while busy)
HEARTBEAT_TIMEOUT_S = 3.0  # silence longer than this marks a worker as dead (acceptance: detected within 5 s)
I64_MAX = 2**63 - 1


class MsgType(enum.IntEnum):
    """The first byte of frame 0."""

    HELLO = 1  # worker -> coordinator
    LOAD = 2  # coordinator -> worker
    READY = 3  # worker -> coordinator
    ATTN = 4  # coordinator -> worker
    FFN = 5  # coordinator -> worker
    PARTIAL = 6  # worker -> coordinator
    ERROR = 7  # worker -> coordinator
    HEARTBEAT = 8  # worker -> coordinator, on the separate PUSH -> PULL socket
    SHUTDOWN = 9  # coordinator -> worker
    LOGITS = 10  # coordinator -> worker (protocol 2): the worker's vocabulary rows of the output head
    STEP = 11  # coordinator -> worker (protocol 4, transport "shm"): a whole forward pass
    RESULT = 12  # worker -> coordinator (protocol 4): a STEP (or, under "shm", a LOGITS) is done
    LAYERS = 13  # coordinator -> GPU worker (protocol 5): a run of layers that live wholly on the GPU
    KV = 14  # coordinator -> worker (protocol 9, transport "shm"): save or restore a slot's KV cache


# Wire dtype code -> numpy dtype, explicitly little-endian so the views are right on any host.
DTYPES: dict[str, np.dtype[Any]] = {"f32": np.dtype("<f4"), "i64": np.dtype("<i8"), "bf16": np.dtype("<u2"), "f16": np.dtype("<f2")}
CODE_OF: dict[Any, str] = {dt: code for code, dt in DTYPES.items()}


def _describe(t: Any) -> str:
    shape, dtype = getattr(t, "shape", None), getattr(t, "dtype", None)
    return f"{CODE_OF.get(dtype) or dtype}{list(shape)}" if shape is not None else type(t).__name__


def _tensor_repr(self: Any) -> str:
    """dtype and shape instead of the (possibly huge) tensor contents."""
    head = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if f.name != "tensors")
    return f"{type(self).__name__}({head}, tensors=({', '.join(map(_describe, self.tensors))}))"


# Tensor-carrying messages use eq=False: comparing tuples of arrays element-wise is meaningless.


@dataclass(frozen=True, slots=True)
class HelloMsg:
    """First message of a worker; the coordinator checks ``version`` before anything else."""

    version: int
    worker: int
    pid: int
    TYPE: ClassVar[MsgType] = MsgType.HELLO


@dataclass(frozen=True, slots=True)
class LoadMsg:
    """Tells worker ``worker`` of ``n_workers`` to load its shards of ``model`` (a GGUF path)."""

    model: str
    worker: int
    n_workers: int
    n_ctx: int
    threads: int  # torch intra-op threads; 0 = leave torch's default
    cpus: tuple[int, ...]  # CPU ids to pin to; empty = no pinning
    node: int  # NUMA node to bind memory to; -1 = none
    predictor: str = ""  # .predictor file for sparse FFN shards; "" = dense
    n_slots: int = 1  # KV-cache slots (concurrent sequences), each of n_ctx positions
    transport: str = "zmq"  # "zmq": per-layer ATTN/FFN/LOGITS with PARTIAL replies; "shm": STEP/RESULT, partials merged in shm
    shm: str = ""  # transport "shm": path of the pool's shared-memory segment
    max_t: int = 1  # transport "shm": most tokens in one STEP (the segment is sized for them)
    gpu_layers: tuple[int, ...] = ()  # transport "shm": layers the pool's GPU rank computes (the CPU ranks hand the stream over)
    gpu_attn: tuple[int, ...] = ()  # transport "shm": layers whose attention the GPU rank computes (neuron split)
    gpu_hot: str = ""  # transport "shm": a JSON file of the GPU rank's hot neurons per layer (neuron split; "" none)
    layers: tuple[int, ...] = ()  # transport "shm": a pipeline stage's layers (first, stop); () the whole model
    TYPE: ClassVar[MsgType] = MsgType.LOAD


@dataclass(frozen=True, slots=True)
class ReadyMsg:
    worker: int
    weight_bytes: int
    load_s: float
    TYPE: ClassVar[MsgType] = MsgType.READY


@dataclass(frozen=True, slots=True, eq=False, repr=False)
class AttnMsg:
    """tensors = (x [T, d] f32|bf16 normed activations, positions [T] i64, slots [T] i64).

    slots[i] is the KV-cache slot (sequence) token i belongs to: one slot with consecutive
    positions for a prompt chunk, one token per slot for a batched decode step.
    """

    req: int
    step: int
    layer: int
    tensors: tuple[Tensor, Tensor, Tensor]
    TYPE: ClassVar[MsgType] = MsgType.ATTN
    __repr__ = _tensor_repr

    @property
    def x(self) -> Tensor:
        return self.tensors[0]

    @property
    def positions(self) -> Tensor:
        return self.tensors[1]

    @property
    def slots(self) -> Tensor:
        return self.tensors[2]


@dataclass(frozen=True, slots=True, eq=False, repr=False)
class LayersMsg:
    """Layers [layer, stop) computed whole by the GPU worker: tensors = (x [T, d] f32 the residual
    stream entering `layer` (not normed), positions [T] i64, slots [T] i64, as ATTN's); the reply
    is PARTIAL with the stream leaving layer stop - 1."""

    req: int
    step: int
    layer: int
    stop: int
    tensors: tuple[Tensor, Tensor, Tensor]
    TYPE: ClassVar[MsgType] = MsgType.LAYERS
    __repr__ = _tensor_repr

    @property
    def x(self) -> Tensor:
        return self.tensors[0]


@dataclass(frozen=True, slots=True, eq=False, repr=False)
class FfnMsg:
    """tensors = (x [T, d] f32|bf16 normed activations,)."""

    req: int
    step: int
    layer: int
    tensors: tuple[Tensor]
    TYPE: ClassVar[MsgType] = MsgType.FFN
    __repr__ = _tensor_repr

    @property
    def x(self) -> Tensor:
        return self.tensors[0]


@dataclass(frozen=True, slots=True, eq=False, repr=False)
class LogitsMsg:
    """tensors = (x [T, d] f32|bf16 final-normed hidden states,); layer is the layer count.

    Each worker answers with a PARTIAL holding logits [T, V_w] for its own vocabulary rows; the
    coordinator concatenates them in worker order."""

    req: int
    step: int
    layer: int
    tensors: tuple[Tensor]
    TYPE: ClassVar[MsgType] = MsgType.LOGITS
    __repr__ = _tensor_repr

    @property
    def x(self) -> Tensor:
        return self.tensors[0]


@dataclass(frozen=True, slots=True, eq=False, repr=False)
class PartialMsg:
    """tensors = (y [T, d] f32|bf16 this worker's partial sum,); compute_us = time in its shard."""

    req: int
    step: int
    layer: int
    worker: int
    compute_us: int
    tensors: tuple[Tensor]
    TYPE: ClassVar[MsgType] = MsgType.PARTIAL
    __repr__ = _tensor_repr

    @property
    def y(self) -> Tensor:
        return self.tensors[0]


@dataclass(frozen=True, slots=True, eq=False, repr=False)
class StepMsg:
    """tensors = (ids [T] i64, positions [T] i64, slots [T] i64): one forward pass on every rank.

    mode 0: hidden states only (rank 0 writes them to the segment); 1: plus the last row's
    logits; 2: plus every row's logits (each rank writes its vocabulary columns); + 4
    (STEP_STREAM): the residual stream comes in through the segment's hidden area instead of the
    ids (a pipeline stage's pool)."""

    req: int
    step: int
    mode: int
    tensors: tuple[Tensor, Tensor, Tensor]
    TYPE: ClassVar[MsgType] = MsgType.STEP
    __repr__ = _tensor_repr


@dataclass(frozen=True, slots=True)
class ResultMsg:
    """A rank finished a STEP (or a LOGITS under transport "shm"): its outputs are in the segment.

    compute_us: time in the native call; wait_us: of it, time waiting for peers in the merges;
    syncs: merges in the call."""

    req: int
    step: int
    worker: int
    compute_us: int
    wait_us: int
    syncs: int
    TYPE: ClassVar[MsgType] = MsgType.RESULT


@dataclass(frozen=True, slots=True)
class KvMsg:
    """Save (op 0) or restore (op 1) the first n positions of KV slot ``slot``: each rank writes or
    reads its kv heads at their place in ``path`` (layout: cpu_workers/kv_file.py), whose data
    start at byte ``offset``. Answered by RESULT."""

    req: int
    op: int
    slot: int
    n: int
    path: str
    offset: int
    TYPE: ClassVar[MsgType] = MsgType.KV


@dataclass(frozen=True, slots=True)
class ErrorMsg:
    """A failure inside a worker; req/step/layer are -1 when not tied to a request (e.g. LOAD).

    ``kind`` and ``message`` are truncated to MAX_STR characters so a report always encodes."""

    req: int
    step: int
    layer: int
    worker: int
    kind: str  # exception class name, e.g. "ContextOverflowError"
    message: str
    TYPE: ClassVar[MsgType] = MsgType.ERROR

    def __post_init__(self) -> None:
        for name in ("kind", "message"):
            v = getattr(self, name)
            if isinstance(v, str) and len(v) > MAX_STR:
                object.__setattr__(self, name, v[:MAX_STR])

    @classmethod
    def from_exception(cls, exc: BaseException, worker: int, req: int = -1, step: int = -1, layer: int = -1) -> ErrorMsg:
        return cls(req, step, layer, worker, type(exc).__name__, str(exc))

    def to_exception(self) -> WorkerError:
        return WorkerError.from_report(self.worker, self.kind, self.message, self.req, self.step, self.layer)


@dataclass(frozen=True, slots=True)
class HeartbeatMsg:
    worker: int
    pid: int
    busy: bool  # inside a request right now (a long prefill is busy, not hung)
    TYPE: ClassVar[MsgType] = MsgType.HEARTBEAT


@dataclass(frozen=True, slots=True)
class ShutdownMsg:
    TYPE: ClassVar[MsgType] = MsgType.SHUTDOWN


Message = Union[HelloMsg, LoadMsg, ReadyMsg, AttnMsg, LayersMsg, FfnMsg, LogitsMsg, PartialMsg, StepMsg, ResultMsg, KvMsg, ErrorMsg, HeartbeatMsg,
                ShutdownMsg]
