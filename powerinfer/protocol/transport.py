"""Sending and receiving protocol messages on ZeroMQ sockets (framing is in codec.py).

Runs in: the coordinator and every worker process. Small tensor frames are copied (cheaper than
zmq's zero-copy setup below ~1 MiB), large ones go zero-copy with a tracker; received tensors are
read-only numpy views over the zmq frames, turned into torch tensors without a copy by as_torch.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

import numpy as np
import zmq

from powerinfer.protocol.errors import ProtocolError
from powerinfer.protocol.codec import decode, encode
from powerinfer.protocol.messages import DEFAULT_MAX_MSG, MAX_BODY, ZERO_COPY_MIN, Message


def _send_frames(socket: zmq.Socket[Any], frames: list[bytes | memoryview], flags: int, zero_copy_min: int) -> zmq.MessageTracker | None:
    trackers: list[zmq.MessageTracker] = []
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        more = flags | zmq.SNDMORE if i < last else flags
        if i and len(frame) >= zero_copy_min:
            # An explicit Frame, so that pyzmq's own copy_threshold cannot silently copy it.
            zframe = zmq.Frame(frame, track=True, copy=False)
            socket.send(zframe, more, copy=False)
            trackers.append(zframe.tracker)
        else:
            socket.send(frame, more)
    return zmq.MessageTracker(*trackers) if trackers else None


def send(socket: zmq.Socket[Any], msg: Message, *, flags: int = 0, zero_copy_min: int = ZERO_COPY_MIN) -> zmq.MessageTracker | None:
    """Encodes and sends ``msg`` (``flags`` e.g. zmq.NOBLOCK). Tensor frames of >= zero_copy_min
    bytes go zero-copy: the caller must not modify their buffers until the returned tracker is
    ``done`` (the frames keep the buffers alive). None when every frame was copied."""
    return _send_frames(socket, encode(msg), flags, zero_copy_min)


def send_routed(
    socket: zmq.Socket[Any], identity: bytes, msg: Message, *, flags: int = 0, zero_copy_min: int = ZERO_COPY_MIN
) -> zmq.MessageTracker | None:
    """Like :func:`send`, on a ROUTER socket, to the peer ``identity`` (e.g. ``b"w1"``)."""
    frames = encode(msg)  # before the identity frame: an invalid msg must not leave a half-sent message
    socket.send(identity, flags | zmq.SNDMORE)
    return _send_frames(socket, frames, flags, zero_copy_min)


# ---------------------------------------------------------------------------------------- decode


def recv(socket: zmq.Socket[Any], flags: int = 0) -> Message:
    """Receives and decodes one message (zero-copy frames). Raises ProtocolError if it is bad."""
    return decode(socket.recv_multipart(flags, copy=False))


def recv_routed(socket: zmq.Socket[Any], flags: int = 0) -> tuple[bytes, Message]:
    """(sender identity, message) from a ROUTER socket; a ProtocolError names the sender in ``peer``."""
    frames = socket.recv_multipart(flags, copy=False)
    identity = frames[0].bytes
    try:
        if len(frames) < 2:
            raise ProtocolError("routed message without a body")
        return identity, decode(frames[1:])
    except ProtocolError as exc:
        exc.peer = identity
        exc.args = (f"from {identity.decode('ascii', 'replace')}: {exc.args[0]}",)
        raise


# ------------------------------------------------------------------------------------- utilities


def worker_identity(index: int) -> bytes:
    """The ZMQ_ROUTING_ID of worker ``index``'s DEALER socket."""
    return b"w%d" % index


def socket_limits(socket: zmq.Socket[Any], max_bytes: int = DEFAULT_MAX_MSG) -> None:
    """Sets ZMQ_MAXMSGSIZE: libzmq drops the connection of a peer that announces a *frame* larger
    than ``max_bytes``, before the frame is buffered or reaches Python. Set it before bind/connect
    (each connection copies the options when it is made). It bounds each frame, not the multipart
    message, and it does not apply to inproc:// (no wire decoder there)."""
    if max_bytes.__class__ is not int or max_bytes < MAX_BODY:
        raise ValueError(f"max_bytes must be an int >= {MAX_BODY}, got {max_bytes!r}")
    socket.setsockopt(zmq.MAXMSGSIZE, max_bytes)


_readonly_warning_absorbed = False


def as_torch(arr: np.ndarray, *, copy: bool = False) -> "torch.Tensor":
    """A torch tensor over a decoded array, without copying (uint16 arrays are bf16 bits -> bf16).

    The result shares the received frame's memory: consumers must not write to it. It is copied
    when ``copy`` is set or when the frame is not aligned to the element size (zmq may place a
    small received frame at any offset of its receive buffer; torch kernels assume alignment).
    """
    import torch  # lazily: the coordinator never imports torch when workers do the math

    global _readonly_warning_absorbed

    if copy or not arr.flags.aligned:
        t = torch.from_numpy(np.array(arr, copy=True))
    elif arr.flags.writeable or _readonly_warning_absorbed:
        t = torch.from_numpy(arr)
    else:
        # torch warns once per process (TORCH_WARN_ONCE) about read-only arrays: absorb that one
        # warning here, so that later calls need no (slow, thread-unsafe) catch_warnings.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)
            t = torch.from_numpy(arr)
        _readonly_warning_absorbed = True
    return t.view(torch.bfloat16) if arr.dtype == np.uint16 else t
