"""Encoding and decoding protocol messages: typed field specs, msgpack header, tensor frames.

Runs in: the coordinator and every worker process. Decoding trusts nothing: every field, every
tensor descriptor and every frame length is checked before a view is made (spec: docs/protocol.md).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, fields
from operator import attrgetter
from typing import Any, Callable, Union

import msgpack
import numpy as np
import zmq

from powerinfer.protocol.errors import ProtocolError, ProtocolVersionError
from powerinfer.protocol.messages import (
    AttnMsg,
    LayersMsg,
    ErrorMsg,
    FfnMsg,
    HeartbeatMsg,
    HelloMsg,
    LoadMsg,
    LogitsMsg,
    MAX_BODY,
    MAX_LIST,
    MAX_STR,
    CODE_OF,
    DTYPES,
    Message,
    MsgType,
    PROTOCOL_VERSION,
    PartialMsg,
    ReadyMsg,
    ResultMsg,
    ShutdownMsg,
    StepMsg,
    KvMsg,
    I64_MAX,
)


# ----------------------------------------------------------------------------------------- specs
# Field kinds: (lo, hi) = an int in that range (bool rejected), or one of the string kinds below.
_U, _U1, _IDX = (0, I64_MAX), (1, I64_MAX), (-1, I64_MAX)  # _IDX: -1 = "none" / "unknown"
_FLOAT, _STR, _BOOL, _ULIST = "float", "str", "bool", "list"
Kind = Union[tuple[int, int], str]
_UNPACK_KW: dict[str, Any] = dict(
    raw=False, strict_map_key=True, use_list=False, max_str_len=MAX_BODY, max_bin_len=0,
    max_array_len=MAX_LIST, max_map_len=32, max_ext_len=0,
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class _Spec:
    type: MsgType
    cls: type
    names: tuple[str, ...]  # body fields in dataclass order, without "t"
    kinds: tuple[Kind, ...]
    all_u: bool  # every field is an int in [0, 2**63-1]: the hot messages get an inline check
    roles: tuple[tuple[str, dict[str, np.dtype[Any]], int], ...]  # (role, allowed code -> dtype, rank)
    keys: frozenset[str]  # exactly the keys the body map must have, "t" included
    head: bytes  # the type byte
    get: Callable[[Any], tuple[Any, ...]]


def _spec(cls: Any, kinds: dict[str, Kind], roles: tuple[tuple[str, tuple[str, ...], int], ...] = ()) -> _Spec:
    names = tuple(f.name for f in fields(cls) if f.name != "tensors")
    assert names == tuple(kinds), f"{cls.__name__}: spec out of sync with the dataclass"
    get: Callable[[Any], tuple[Any, ...]] = attrgetter(*names) if len(names) >= 2 else lambda m: tuple(getattr(m, n) for n in names)
    keys = frozenset(names) | ({"t"} if roles else frozenset())
    all_u = all(k == _U for k in kinds.values())
    typed_roles = tuple((role, {c: DTYPES[c] for c in codes}, rank) for role, codes, rank in roles)
    return _Spec(cls.TYPE, cls, names, tuple(kinds.values()), all_u, typed_roles, keys, bytes([cls.TYPE]), get)


_STEP: dict[str, Kind] = {"req": _U, "step": _U, "layer": _U}
_ACT = ("f32", "bf16")
_SPECS = [
    _spec(HelloMsg, {"version": _U, "worker": _U, "pid": _U}),
    _spec(LoadMsg, {"model": _STR, "worker": _U, "n_workers": _U1, "n_ctx": _U1, "threads": _U, "cpus": _ULIST, "node": _IDX, "predictor": _STR, "n_slots": _U1,
                    "transport": _STR, "shm": _STR, "max_t": _U1, "gpu_layers": _ULIST,
                    "gpu_attn": _ULIST, "gpu_hot": _STR, "layers": _ULIST}),
    _spec(ReadyMsg, {"worker": _U, "weight_bytes": _U, "load_s": _FLOAT}),
    _spec(AttnMsg, _STEP, (("x", _ACT, 2), ("positions", ("i64",), 1), ("slots", ("i64",), 1))),
    _spec(LayersMsg, {**_STEP, "stop": _U1}, (("x", ("f32",), 2), ("positions", ("i64",), 1), ("slots", ("i64",), 1))),
    _spec(FfnMsg, _STEP, (("x", _ACT, 2),)),
    _spec(LogitsMsg, _STEP, (("x", _ACT, 2),)),
    _spec(PartialMsg, {**_STEP, "worker": _U, "compute_us": _U}, (("y", _ACT, 2),)),
    _spec(StepMsg, {"req": _U, "step": _U, "mode": (0, 6)}, (("ids", ("i64",), 1), ("positions", ("i64",), 1), ("slots", ("i64",), 1))),
    _spec(ResultMsg, {"req": _U, "step": _U, "worker": _U, "compute_us": _U, "wait_us": _U, "syncs": _U}),
    _spec(KvMsg, {"req": _U, "op": (0, 1), "slot": _U, "n": _U1, "path": _STR, "offset": _U}),
    _spec(ErrorMsg, {"req": _IDX, "step": _IDX, "layer": _IDX, "worker": _U, "kind": _STR, "message": _STR}),
    _spec(HeartbeatMsg, {"worker": _U, "pid": _U, "busy": _BOOL}),
    _spec(ShutdownMsg, {}),
]
_BY_BYTE: tuple[_Spec | None, ...] = tuple(next((s for s in _SPECS if s.type == b), None) for b in range(256))
BY_CLASS: dict[type, _Spec] = {s.cls: s for s in _SPECS}


def _short(v: object) -> str:
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


def _check_fields(spec: _Spec, values: tuple[Any, ...]) -> None:
    if spec.all_u:  # the hot path: a plain loop beats zip/all/min/max for 3-5 values
        for v in values:
            if v.__class__ is not int or not 0 <= v <= I64_MAX:
                break
        else:
            return
    for name, kind, v in zip(spec.names, spec.kinds, values):
        if kind.__class__ is tuple:
            if v.__class__ is int and kind[0] <= v <= kind[1]:
                continue
            want = f"an int in [{kind[0]}, {'2**63-1' if kind[1] == I64_MAX else kind[1]}]"
        elif kind is _STR:
            if v.__class__ is str and len(v) <= MAX_STR:
                continue
            want = f"a str of at most {MAX_STR} characters"
        elif kind is _FLOAT:
            if v.__class__ is float and math.isfinite(v) and v >= 0.0:
                continue
            want = "a finite float >= 0"
        elif kind is _BOOL:
            if v.__class__ is bool:
                continue
            want = "a bool"
        else:  # _ULIST
            if v.__class__ in (list, tuple) and len(v) <= MAX_LIST and all(c.__class__ is int and 0 <= c <= I64_MAX for c in v):
                continue
            want = f"a list of at most {MAX_LIST} ints in [0, 2**63-1]"
        raise ProtocolError(f"{spec.type.name}: field {name!r} must be {want}, got {_short(v)}")


def _role_error(spec: _Spec, i: int, code: object, allowed: dict[str, np.dtype[Any]]) -> ProtocolError:
    role = spec.roles[i][0]
    if code.__class__ is str and code in DTYPES:
        return ProtocolError(f"{spec.type.name}: tensor {role!r} must be {' or '.join(allowed)}, got {code}")
    return ProtocolError(f"{spec.type.name}: tensor {i} ({role!r}) has unknown dtype {_short(code)}")


def _rows_error(x_rows: int, pos_rows: int, name: str) -> ProtocolError:
    return ProtocolError(f"{name}: positions/slots have {pos_rows} entries but x has {x_rows} rows")


# ---------------------------------------------------------------------------------------- encode


def _to_array(t: Any) -> np.ndarray:
    """A C-contiguous little-endian numpy array over ``t`` (no copy when it already is one)."""
    if not isinstance(t, np.ndarray):
        torch_mod = sys.modules.get("torch")
        if torch_mod is None or not isinstance(t, torch_mod.Tensor):
            raise ProtocolError(f"tensors must be numpy arrays or torch tensors, got {type(t).__name__}")
        if t.device.type != "cpu":
            raise ProtocolError(f"tensors must be on the CPU to be sent, got one on {t.device}")
        t = t.detach().contiguous()
        if t.dtype == torch_mod.bfloat16:  # numpy has no bf16: ship the raw bits as uint16
            return t.view(torch_mod.int16).numpy().view(np.uint16)
        return t.numpy()
    if t.dtype.byteorder == ">":
        t = t.astype(t.dtype.newbyteorder("<"))
    return t if t.flags.c_contiguous else np.ascontiguousarray(t)


def encode(msg: Message) -> list[bytes | memoryview]:
    """Frames of ``msg``: [type byte + msgpack body, raw tensor bytes...]. Raises ProtocolError if
    ``msg`` breaks the spec, so that a peer never receives what it would reject."""
    spec = BY_CLASS.get(msg.__class__)
    if spec is None:
        raise ProtocolError(f"cannot encode {type(msg).__name__}: not a protocol message")
    values = spec.get(msg)
    _check_fields(spec, values)
    if spec.cls is LayersMsg and values[3] <= values[2]:
        raise ProtocolError(f"LAYERS: stop ({values[3]}) must exceed layer ({values[2]}): a run holds at least one layer")
    body: dict[str, Any] = dict(zip(spec.names, values))
    frames: list[bytes | memoryview] = [b""]  # frame 0 is filled in last
    if spec.roles:
        tensors = msg.tensors  # type: ignore[union-attr]
        if tensors.__class__ is not tuple or len(tensors) != len(spec.roles):
            raise ProtocolError(f"{spec.type.name}: tensors must be a tuple of {len(spec.roles)}")
        descs = []
        for i, (role, allowed, rank) in enumerate(spec.roles):
            t = tensors[i]
            arr = t if t.__class__ is np.ndarray and t.flags.c_contiguous else _to_array(t)
            code = CODE_OF.get(arr.dtype)
            if code not in allowed:
                if arr.dtype.byteorder == ">":  # big-endian input: convert, then look again
                    arr = _to_array(arr)
                    code = CODE_OF.get(arr.dtype)
                if code not in allowed:
                    raise _role_error(spec, i, code or str(arr.dtype), allowed)
            if arr.ndim != rank:
                raise ProtocolError(f"{spec.type.name}: tensor {role!r} must have rank {rank}, got shape {list(arr.shape)}")
            descs.append((code, arr.shape))
            frames.append(memoryview(arr).cast("B") if arr.size else b"")  # cast refuses empty shapes
        if spec.cls is AttnMsg or spec.cls is LayersMsg:
            for d in descs[1:]:
                if d[1][0] != descs[0][1][0]:
                    raise _rows_error(descs[0][1][0], d[1][0], spec.type.name)
        body["t"] = descs
    head = spec.head + msgpack.packb(body)
    if len(head) > MAX_BODY:
        raise ProtocolError(f"{spec.type.name}: body of {len(head)} bytes exceeds the {MAX_BODY}-byte limit")
    frames[0] = head
    return frames


def _buffer(frame: Any, i: int) -> memoryview:
    """A flat byte view of a frame (zmq.Frame, bytes or any contiguous buffer)."""
    try:
        mv = memoryview(frame)
    except TypeError:
        raise ProtocolError(f"frame {i} is not a buffer ({type(frame).__name__})") from None
    if mv.ndim != 1 or mv.itemsize != 1:
        if not mv.c_contiguous:
            raise ProtocolError(f"frame {i} is not contiguous")
        mv = mv.cast("B")
    return mv


def decode(frames: list[zmq.Frame] | list[bytes] | list[Any]) -> Message:
    """The message in ``frames``; tensors are read-only views over the frames. Raises ProtocolError."""
    if not frames:
        raise ProtocolError("empty message (no frames)")
    head = _buffer(frames[0], 0)
    if not 0 < len(head) <= MAX_BODY:
        raise ProtocolError(f"header frame of {len(head)} bytes (must be 1 to {MAX_BODY})")
    spec = _BY_BYTE[head[0]]
    if spec is None:
        raise ProtocolError(f"unknown message type byte {head[0]}")
    try:
        body = msgpack.unpackb(head[1:], **_UNPACK_KW)
    except Exception as exc:  # ValueError, FormatError, StackError, ExtraData, ... all mean "garbage"
        raise ProtocolError(f"{spec.type.name}: body is not valid msgpack ({type(exc).__name__})") from None
    if body.__class__ is not dict:
        raise ProtocolError(f"{spec.type.name}: body must be a msgpack map, got {type(body).__name__}")
    if spec.cls is HelloMsg:  # before the field check: another version's HELLO may have other fields
        version = body.get("version")
        if version.__class__ is int and version != PROTOCOL_VERSION:
            raise ProtocolVersionError(version, PROTOCOL_VERSION)
    if body.keys() != spec.keys:
        missing = sorted(repr(k) for k in spec.keys - body.keys())
        extra = sorted(_short(k) for k in body.keys() - spec.keys)
        what = [f"missing {', '.join(missing)}"] * bool(missing) + [f"unexpected {', '.join(extra[:4])}"] * bool(extra)
        raise ProtocolError(f"{spec.type.name}: body fields {'; '.join(what)}")
    values = tuple(map(body.__getitem__, spec.names))
    _check_fields(spec, values)
    if spec.cls is LayersMsg and values[3] <= values[2]:
        raise ProtocolError(f"LAYERS: stop ({values[3]}) must exceed layer ({values[2]}): a run holds at least one layer")
    if not spec.roles:
        if len(frames) != 1:
            raise ProtocolError(f"{spec.type.name}: expected no tensor frames, got {len(frames) - 1}")
        return spec.cls(*values)  # type: ignore[no-any-return]
    return spec.cls(*values, _decode_tensors(spec, body["t"], frames))  # type: ignore[no-any-return]


def _decode_tensors(spec: _Spec, descs: Any, frames: Any) -> tuple[np.ndarray, ...]:
    want = len(spec.roles)
    if descs.__class__ is not tuple or len(descs) != want:
        raise ProtocolError(f"{spec.type.name}: 't' must list {want} tensor descriptors, got {_short(descs)}")
    if len(frames) != want + 1:
        raise ProtocolError(f"{spec.type.name}: expected {want} tensor frames, got {len(frames) - 1}")
    out = []
    for i, (role, allowed, rank) in enumerate(spec.roles):
        desc = descs[i]
        if desc.__class__ is not tuple or len(desc) != 2:
            raise ProtocolError(f"{spec.type.name}: tensor descriptor {i} must be [dtype, shape], got {_short(desc)}")
        code, shape = desc
        dt = allowed.get(code) if code.__class__ is str else None
        if dt is None:
            raise _role_error(spec, i, code, allowed)
        if shape.__class__ is not tuple or len(shape) != rank:
            raise ProtocolError(f"{spec.type.name}: tensor {role!r} shape must be a list of {rank} ints, got {_short(shape)}")
        nbytes = dt.itemsize  # Python ints: no overflow, and nothing is allocated from it
        for d in shape:
            if d.__class__ is not int or not 0 <= d <= I64_MAX:
                raise ProtocolError(f"{spec.type.name}: tensor {role!r} has an invalid dimension {_short(d)}")
            nbytes *= d
        buf = _buffer(frames[i + 1], i + 1)
        if nbytes != len(buf):
            raise ProtocolError(f"{spec.type.name}: tensor {role!r} {code}{list(shape)} needs {nbytes} bytes, its frame has {len(buf)}")
        try:  # over a read-only view: a read-only array, no copy, keeps the frame alive
            out.append(np.ndarray(shape, dt, buf.toreadonly()))
        except ValueError:  # e.g. [0, 2**62, 8]: zero bytes, but numpy refuses the shape
            raise ProtocolError(f"{spec.type.name}: tensor {role!r} shape {list(shape)} is too large") from None
    if spec.cls is AttnMsg or spec.cls is LayersMsg:
        for t in out[1:]:
            if t.shape[0] != out[0].shape[0]:
                raise _rows_error(out[0].shape[0], t.shape[0], spec.type.name)
    return tuple(out)

