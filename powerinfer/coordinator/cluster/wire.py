"""The messages between pipeline stages: a msgpack header and raw frames over ZeroMQ, no pickle.

Runs in: the coordinator and every stage actor.

A step's micro-batch goes coordinator -> stage 0 -> ... -> stage N-1 -> coordinator, each hop one
multipart message on a PUSH/PULL pair:

  frame 0  header (msgpack map): v (WIRE_VERSION), step, mb (micro-batch index), n_mb, want
           (Want's value), kind ("ids": token ids for stage 0; "hidden": the residual stream;
           "out": the last stage's answer; "error": a stage refused, text in "error", and "fatal"
           true when the stage itself broke), shape,
           dtype ("int64" | "float32")
  frame 1  positions int64 [T]
  frame 2  slots int64 [T]
  frame 3  payload: ids int64 [T], hidden float32 [T, d], or the answer (logits [1|T, vocab],
           hidden [T, d], or empty for Want.CACHE)

A heartbeat is one frame, the msgpack map {v, stage}, on its own PUSH/PULL pair to the coordinator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack  # type: ignore[import-untyped]
import numpy as np

from powerinfer.protocol import ProtocolError

WIRE_VERSION = 1
KINDS = ("ids", "hidden", "out", "error")
DTYPES = {"int64": np.int64, "float32": np.float32}
MAX_DIMS = 2


@dataclass(frozen=True)
class StageMsg:
    """One hop's message (see the module docstring); payload and the int vectors are owned arrays."""

    step: int
    mb: int
    n_mb: int
    want: str
    kind: str
    positions: np.ndarray  # int64 [T]
    slots: np.ndarray  # int64 [T]
    payload: np.ndarray
    error: str = ""
    fatal: bool = False  # an error that broke the stage (its pool's ranks failed): the pipeline must restart


    def frames(self) -> list[bytes | memoryview]:
        head = {"v": WIRE_VERSION, "step": self.step, "mb": self.mb, "n_mb": self.n_mb, "want": self.want, "kind": self.kind,
                "shape": list(self.payload.shape), "dtype": str(self.payload.dtype), "error": self.error, "fatal": self.fatal}
        return [msgpack.packb(head), _bytes(self.positions, np.int64), _bytes(self.slots, np.int64),
                _raw(np.ascontiguousarray(self.payload))]

    def reply(self, kind: str, payload: np.ndarray, error: str = "", fatal: bool = False) -> "StageMsg":
        """The next hop's message for the same micro-batch."""
        return StageMsg(self.step, self.mb, self.n_mb, self.want, kind, self.positions, self.slots, payload, error, fatal)


def _bytes(a: np.ndarray, dtype: type) -> bytes | memoryview:
    return _raw(np.ascontiguousarray(a, dtype=dtype))


def _raw(a: np.ndarray) -> bytes | memoryview:
    """a's bytes without a copy (an empty array: b"", which a memoryview cannot be cast to)."""
    return a.data.cast("B") if a.size else b""


def decode(frames: list[Any]) -> StageMsg:
    """frames (bytes or zmq frames) -> StageMsg; ProtocolError names what is wrong."""
    if len(frames) != 4:
        raise ProtocolError(f"a stage message has 4 frames, got {len(frames)}")
    raw = [bytes(f) for f in frames]
    try:
        head = msgpack.unpackb(raw[0])
    except (ValueError, msgpack.UnpackException) as e:
        raise ProtocolError(f"a stage message's header is not msgpack: {e}") from None
    if not isinstance(head, dict) or head.get("v") != WIRE_VERSION:
        raise ProtocolError(f"a stage message of wire version {head.get('v') if isinstance(head, dict) else '?'}, "
                            f"this side speaks {WIRE_VERSION}")
    kind, dtype, shape = head.get("kind"), head.get("dtype"), head.get("shape")
    if kind not in KINDS or dtype not in DTYPES or not isinstance(shape, list) or len(shape) > MAX_DIMS:
        raise ProtocolError(f"a stage message with kind {kind!r}, dtype {dtype!r}, shape {shape!r}")
    if any(not isinstance(n, int) or n < 0 for n in shape):
        raise ProtocolError(f"a stage message's shape {shape!r}")
    dt = np.dtype(DTYPES[dtype])
    if len(raw[3]) != int(np.prod(shape)) * dt.itemsize or len(raw[1]) % 8 or len(raw[1]) != len(raw[2]):
        raise ProtocolError("a stage message's frames do not match its header")
    for key in ("step", "mb", "n_mb"):
        if not isinstance(head.get(key), int):
            raise ProtocolError(f"a stage message's {key} is not an integer")
    payload = np.frombuffer(raw[3], dtype=dt).reshape(shape).copy()
    return StageMsg(head["step"], head["mb"], head["n_mb"], str(head.get("want", "")), kind, np.frombuffer(raw[1], dtype=np.int64).copy(),
                    np.frombuffer(raw[2], dtype=np.int64).copy(), payload, str(head.get("error", "")), bool(head.get("fatal", False)))


def heartbeat(stage: int) -> bytes:
    frame: bytes = msgpack.packb({"v": WIRE_VERSION, "stage": stage})
    return frame


def heartbeat_stage(frame: bytes) -> int:
    """The stage a heartbeat names; ProtocolError for anything else."""
    try:
        head = msgpack.unpackb(frame)
    except (ValueError, msgpack.UnpackException) as e:
        raise ProtocolError(f"a heartbeat is not msgpack: {e}") from None
    if not isinstance(head, dict) or head.get("v") != WIRE_VERSION or not isinstance(head.get("stage"), int):
        raise ProtocolError(f"not a stage heartbeat: {head!r}")
    return int(head["stage"])
