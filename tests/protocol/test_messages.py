"""Tests of the coordinator <-> worker wire protocol: round trips, sockets, validation, fuzzing.

Runs in: the pytest process (plus small echo/probe subprocesses for the cross-process tests).
"""

from __future__ import annotations

import random
import shutil
import signal
import subprocess
import sys
import tempfile
import tracemalloc
from pathlib import Path
from typing import Any, Iterator

import msgpack
import numpy as np
import pytest
import torch
import zmq

from powerinfer.errors import PowerInferError
from powerinfer.protocol import (
    MAX_BODY,
    MAX_STR,
    PROTOCOL_VERSION,
    ZERO_COPY_MIN,
    AttnMsg,
    LayersMsg,
    ErrorMsg,
    FfnMsg,
    HeartbeatMsg,
    HelloMsg,
    LoadMsg,
    Message,
    MsgType,
    PartialMsg,
    ProtocolError,
    ProtocolVersionError,
    ReadyMsg,
    ResultMsg,
    ShutdownMsg,
    StepMsg,
    WorkerDiedError,
    WorkerError,
    as_torch,
    decode,
    encode,
    recv,
    recv_routed,
    send,
    send_routed,
    socket_limits,
    worker_identity,
)

REPO = Path(__file__).resolve().parents[2]
X = np.arange(2 * 8, dtype=np.float32).reshape(2, 8) - 3.5
POS = np.array([3, 4], dtype=np.int64)
MESSAGE_CLASSES = (HelloMsg, LoadMsg, ReadyMsg, AttnMsg, LayersMsg, FfnMsg, PartialMsg, StepMsg, ResultMsg, ErrorMsg, HeartbeatMsg, ShutdownMsg)


def samples() -> list[Message]:
    return [
        HelloMsg(PROTOCOL_VERSION, 1, 1234),
        LoadMsg("/models/smollm2.gguf", 1, 2, 512, 4, (0, 1, 2), -1, "/models/smollm2.predictor"),
        ReadyMsg(1, 123_456_789, 1.5),
        AttnMsg(7, 3, 11, (X, POS, np.zeros_like(POS))),
        LayersMsg(7, 3, 11, 14, (X, POS, np.zeros_like(POS))),
        FfnMsg(7, 3, 11, (X,)),
        PartialMsg(7, 3, 11, 1, 250, (X * 2,)),
        LoadMsg("/models/smollm2.gguf", 0, 2, 512, 1, (), -1, "", 4, "shm", "/dev/shm/powerinfer-1-x", 512),
        LoadMsg("/models/smollm2.gguf", 1, 2, 512, 1, (), -1, "", 1, "shm", "/dev/shm/powerinfer-1-x", 512, (0, 1), (2, 3), "/tmp/d/gpu_hot.json"),
        LoadMsg("/models/smollm2.gguf", 0, 2, 512, 1, (), -1, "", 1, "shm", "/dev/shm/powerinfer-1-x", 16, layers=(10, 20)),
        StepMsg(7, 3, 2, (POS, POS, np.zeros_like(POS))),
        ResultMsg(7, 3, 1, 4200, 150, 60),
        ErrorMsg(7, 3, 11, 1, "RuntimeError", "boom"),
        ErrorMsg(-1, -1, -1, 0, "ModelFileError", "ünïcode ✓"),
        HeartbeatMsg(1, 1234, True),
        ShutdownMsg(),
    ]


def fields_of(msg: Message) -> dict[str, Any]:
    return {k: getattr(msg, k) for k in msg.__dataclass_fields__ if k != "tensors"}  # type: ignore[union-attr]


def assert_same(got: Message, want: Message) -> None:
    assert type(got) is type(want)
    assert fields_of(got) == fields_of(want)
    for g, w in zip(getattr(got, "tensors", ()), getattr(want, "tensors", ())):
        w = np.asarray(w)
        assert g.dtype == w.dtype and g.shape == w.shape and np.array_equal(g, w)
        assert not g.flags.writeable


def raw(type_byte: int, body: object, *tensors: bytes) -> list[bytes]:
    return [bytes([type_byte]) + msgpack.packb(body), *tensors]


def step_body(t: object, **over: object) -> dict[str, object]:
    return {"req": 1, "step": 2, "layer": 3, "t": t, **over}


# ------------------------------------------------------------------------------------ round trips


@pytest.mark.parametrize("msg", samples(), ids=lambda m: type(m).__name__)
def test_round_trip_bytes_and_frames(msg: Message) -> None:
    frames = encode(msg)
    assert frames[0][0] == msg.TYPE
    assert_same(decode([bytes(f) for f in frames]), msg)
    assert_same(decode([zmq.Frame(bytes(f)) for f in frames]), msg)


def test_wire_bytes_are_stable() -> None:
    """Golden header of docs/protocol.md: changing it breaks peers in other languages."""
    assert {t.name: int(t) for t in MsgType} == {
        "HELLO": 1, "LOAD": 2, "READY": 3, "ATTN": 4, "FFN": 5, "PARTIAL": 6, "ERROR": 7, "HEARTBEAT": 8, "SHUTDOWN": 9, "LOGITS": 10,
        "STEP": 11, "RESULT": 12, "LAYERS": 13, "KV": 14,
    }  # fmt: skip
    frames = encode(AttnMsg(1, 2, 3, (np.zeros((1, 576), np.float32), np.array([5], np.int64), np.array([0], np.int64))))
    # 04 | map(4) "req":1 "step":2 "layer":3 "t":[["f32",[1,576]],["i64",[1]],["i64",[1]]]
    assert bytes(frames[0]).hex() == (
        "04" "84" "a3726571" "01" "a473746570" "02" "a56c61796572" "03" "a174"
        "93" "92a3663332" "9201cd0240" "92a3693634" "9101" "92a3693634" "9101"
    )  # fmt: skip
    assert [len(f) for f in frames] == [47, 2304, 8, 8]


def test_torch_inputs_and_as_torch() -> None:
    x = torch.randn(3, 8)
    y16 = torch.randn(3, 8, dtype=torch.bfloat16)
    m = decode([bytes(f) for f in encode(AttnMsg(0, 0, 0, (x, torch.arange(3), torch.zeros(3, dtype=torch.int64))))])
    assert torch.equal(as_torch(m.x), x) and torch.equal(as_torch(m.positions), torch.arange(3))
    p = decode([bytes(f) for f in encode(PartialMsg(0, 0, 0, 0, 0, (y16,)))])
    assert p.y.dtype == np.uint16  # bf16 travels as raw bits
    t = as_torch(p.y)
    assert t.dtype == torch.bfloat16 and torch.equal(t, y16)
    c = as_torch(p.y, copy=True)
    assert torch.equal(c, y16) and not np.shares_memory(c.view(torch.int16).numpy(), p.y)
    # non-contiguous and big-endian inputs are made contiguous little-endian
    f = decode(encode(FfnMsg(0, 0, 0, (x.t(),))))
    assert torch.equal(as_torch(f.x), x.t())
    be = np.asarray(X, dtype=">f4")
    assert np.array_equal(decode(encode(FfnMsg(0, 0, 0, (be,)))).x, X)


def test_as_torch_unaligned_copies() -> None:
    buf = bytearray(4 * 8 + 1)
    arr = np.frombuffer(memoryview(buf)[1:], np.float32).reshape(2, 4)
    assert not arr.flags.aligned
    t = as_torch(arr)
    assert t.shape == (2, 4) and not np.shares_memory(t.numpy(), arr)


def test_as_torch_read_only_does_not_warn() -> None:
    """In a fresh process (torch warns once per process) with warnings as errors."""
    code = (
        "import numpy as np\n"
        "from powerinfer.protocol import FfnMsg, as_torch, decode, encode\n"
        "m = decode(encode(FfnMsg(0, 0, 0, (np.ones((2, 4), np.float32),))))\n"
        "assert not m.x.flags.writeable\n"
        "a, b = as_torch(m.x), as_torch(m.x)\n"
        "assert a.data_ptr() == b.data_ptr() == m.x.ctypes.data\n"
    )
    subprocess.run([sys.executable, "-W", "error", "-c", code], cwd=REPO, check=True, timeout=60)


def test_repr_shows_shapes_not_data() -> None:
    assert repr(AttnMsg(1, 2, 3, (X, POS, POS))) == "AttnMsg(req=1, step=2, layer=3, tensors=(f32[2, 8], i64[2], i64[2]))"


def test_empty_tensors_round_trip() -> None:
    m = decode(encode(FfnMsg(0, 0, 0, (np.zeros((0, 8), np.float32),))))
    assert m.x.shape == (0, 8)


# ---------------------------------------------------------------------------------------- sockets


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    c: zmq.Context[Any] = zmq.Context()
    yield c
    c.destroy(linger=0)


@pytest.fixture
def ipc_url(tmp_path: Path) -> Iterator[str]:
    """ipc:// in a private 0700 directory (a short one: sun_path holds ~107 bytes)."""
    d = tmp_path if len(str(tmp_path)) < 80 else Path(tempfile.mkdtemp(prefix="pi-"))
    d.chmod(0o700)
    yield f"ipc://{d}/coord"
    if d != tmp_path:
        shutil.rmtree(d, ignore_errors=True)


def pair(ctx: zmq.Context[Any], url: str, limit: int | None = None) -> tuple[zmq.Socket[Any], zmq.Socket[Any]]:
    router = ctx.socket(zmq.ROUTER)
    if limit is not None:
        socket_limits(router, limit)
    router.bind(url)
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, worker_identity(0))
    dealer.connect(url)
    return router, dealer


@pytest.mark.parametrize("transport", ["ipc", "inproc"])
def test_router_dealer_round_trip(ctx: zmq.Context[Any], ipc_url: str, transport: str) -> None:
    router, dealer = pair(ctx, ipc_url if transport == "ipc" else "inproc://coord")
    for msg in samples():
        if isinstance(msg, (HelloMsg, ReadyMsg, PartialMsg, ErrorMsg, HeartbeatMsg)):  # worker -> coordinator
            assert send(dealer, msg) is None
            assert router.poll(5000)
            ident, got = recv_routed(router)
            assert ident == b"w0"
        else:
            assert send_routed(router, b"w0", msg) is None
            assert dealer.poll(5000)
            got = recv(dealer)
        assert_same(got, msg)


@pytest.mark.parametrize("transport", ["ipc", "inproc"])
def test_zero_copy_receive(ctx: zmq.Context[Any], ipc_url: str, transport: str) -> None:
    router, dealer = pair(ctx, ipc_url if transport == "ipc" else "inproc://coord")
    send(dealer, PartialMsg(1, 2, 3, 0, 9, (X,)))
    assert router.poll(5000)
    frames = router.recv_multipart(copy=False)
    msg = decode(frames[1:])
    assert isinstance(msg, PartialMsg)
    assert not msg.y.flags.owndata and not msg.y.flags.writeable
    assert np.shares_memory(msg.y, np.frombuffer(frames[2], np.uint8))  # a view over the zmq frame


@pytest.mark.parametrize("transport", ["ipc", "inproc"])
def test_tracked_zero_copy_send(ctx: zmq.Context[Any], ipc_url: str, transport: str) -> None:
    router, dealer = pair(ctx, ipc_url if transport == "ipc" else "inproc://coord")
    big = np.random.default_rng(0).standard_normal((512, ZERO_COPY_MIN // 4 // 512 * 2), dtype=np.float32)  # 2 MiB
    tracker = send(dealer, PartialMsg(1, 2, 3, 0, 9, (big,)))
    assert tracker is not None
    assert router.poll(5000)
    _, msg = recv_routed(router)
    assert isinstance(msg, PartialMsg) and np.array_equal(msg.y, big)
    if transport == "inproc":  # no wire: the receiver sees the sender's very buffer...
        assert np.shares_memory(msg.y, big)
        assert not tracker.done  # ...so the send is not done while the receiver holds views on it
    del msg
    tracker.wait(5)
    assert tracker.done
    # small frames are copied (no tracker) unless zero_copy_min says otherwise
    assert send(dealer, FfnMsg(0, 0, 0, (X,))) is None
    assert send(dealer, FfnMsg(0, 0, 0, (X,)), zero_copy_min=0) is not None


def test_maxmsgsize_drops_oversize_frames(ctx: zmq.Context[Any], ipc_url: str) -> None:
    limit = 1 << 20
    router, dealer = pair(ctx, ipc_url, limit=limit)
    send(dealer, HelloMsg(PROTOCOL_VERSION, 0, 1))
    assert router.poll(5000) and isinstance(recv_routed(router)[1], HelloMsg)
    ok = np.zeros((1, (limit - 64) // 4), np.float32)  # a frame under the limit passes
    send(dealer, PartialMsg(0, 0, 0, 0, 0, (ok,)))
    assert router.poll(5000) and isinstance(recv_routed(router)[1], PartialMsg)
    too_big = np.zeros((1, 2 * limit // 4), np.float32)
    send(dealer, PartialMsg(0, 0, 1, 0, 0, (too_big,)))
    assert router.poll(500) == 0  # libzmq dropped the connection; Python never saw the message
    send(dealer, HeartbeatMsg(0, 1, False))  # the DEALER reconnects by itself
    assert router.poll(5000)
    assert isinstance(recv_routed(router)[1], HeartbeatMsg)
    with pytest.raises(ValueError):
        socket_limits(router, 10)


ECHO_WORKER = """
import os, sys
import zmq
from powerinfer.protocol import PROTOCOL_VERSION, ErrorMsg, HelloMsg, PartialMsg, ProtocolError, ShutdownMsg, recv, send, worker_identity
s = zmq.Context().socket(zmq.DEALER)
s.setsockopt(zmq.IDENTITY, worker_identity(0))
s.connect(sys.argv[1])
send(s, HelloMsg(PROTOCOL_VERSION, 0, os.getpid()))
while True:
    try:
        m = recv(s)
    except ProtocolError as e:
        send(s, ErrorMsg.from_exception(e, worker=0))
        continue
    if isinstance(m, ShutdownMsg):
        break
    send(s, PartialMsg(m.req, m.step, m.layer, 0, 1, (m.x,)))
s.close(linger=2000)
"""


def test_cross_process_echo(ctx: zmq.Context[Any], ipc_url: str) -> None:
    router = ctx.socket(zmq.ROUTER)
    socket_limits(router)
    router.bind(ipc_url)
    proc = subprocess.Popen([sys.executable, "-c", ECHO_WORKER, ipc_url], cwd=REPO)
    try:
        assert router.poll(30_000)
        ident, hello = recv_routed(router)
        assert isinstance(hello, HelloMsg) and hello.pid == proc.pid and ident == b"w0"
        for i, x in enumerate([X, np.ones((128, 576), np.float32), torch.randn(4, 8, dtype=torch.bfloat16)]):
            msg: Message = AttnMsg(9, i, 5, (x, np.arange(x.shape[0]), np.zeros(x.shape[0], np.int64))) if i % 2 == 0 else FfnMsg(9, i, 5, (x,))
            send_routed(router, ident, msg)
            assert router.poll(10_000)
            _, reply = recv_routed(router)
            assert isinstance(reply, PartialMsg) and (reply.req, reply.step, reply.layer) == (9, i, 5)
            assert torch.equal(as_torch(reply.y), torch.as_tensor(x) if isinstance(x, np.ndarray) else x)
        router.send_multipart([ident, b"\x04garbage"])
        assert router.poll(10_000)
        _, err = recv_routed(router)
        assert isinstance(err, ErrorMsg) and err.kind == "ProtocolError"
        with pytest.raises(WorkerError, match="worker 0 failed: ProtocolError: ATTN: body is not valid msgpack"):
            raise err.to_exception()
        send_routed(router, ident, ShutdownMsg())
        assert proc.wait(timeout=20) == 0
    finally:
        proc.kill()
        proc.wait()


def test_recv_routed_names_the_bad_peer(ctx: zmq.Context[Any]) -> None:
    router, dealer = pair(ctx, "inproc://coord")
    dealer.send(b"\x63")
    assert router.poll(5000)
    with pytest.raises(ProtocolError, match="from w0: unknown message type byte 99") as info:
        recv_routed(router)
    assert info.value.peer == b"w0"


# ------------------------------------------------------------------------------------- validation

BAD: dict[str, tuple[list[Any], str]] = {
    "no frames": ([], "empty message"),
    "empty header": ([b""], "header frame of 0 bytes"),
    "not a buffer": ([5], "frame 0 is not a buffer"),
    "unknown type byte": (raw(99, {}), "unknown message type byte 99"),
    "type byte zero": (raw(0, {}), "unknown message type byte 0"),
    "garbage body": ([b"\x04\xc1\xff\x00"], "not valid msgpack"),
    "trailing bytes": ([b"\x09\x80\x80"], "not valid msgpack"),
    "non-map body": (raw(4, [1, 2, 3]), "body must be a msgpack map"),
    "body over limit": (raw(7, {"pad": "x" * MAX_BODY}), "must be 1 to 65536"),
    "missing field": (raw(1, {"version": PROTOCOL_VERSION, "worker": 0}), "missing 'pid'"),
    "extra field": (raw(9, {"x": 1}), "unexpected 'x'"),
    "t on a tensorless type": (raw(8, {"worker": 0, "pid": 1, "busy": False, "t": []}), "unexpected 't'"),
    "str for int": (raw(8, {"worker": "0", "pid": 1, "busy": False}), "field 'worker' must be an int"),
    "float for int": (raw(8, {"worker": 0.0, "pid": 1, "busy": False}), "field 'worker' must be an int"),
    "bool for int": (raw(8, {"worker": True, "pid": 1, "busy": False}), "field 'worker' must be an int"),
    "int for bool": (raw(8, {"worker": 0, "pid": 1, "busy": 1}), "field 'busy' must be a bool"),
    "negative int": (raw(8, {"worker": -1, "pid": 1, "busy": False}), "field 'worker' must be an int in"),
    "int above int64": (raw(8, {"worker": 2**63, "pid": 1, "busy": False}), "field 'worker' must be an int in"),
    "negative req": (raw(5, step_body([["f32", [1, 1]]], req=-1), bytes(4)), "field 'req' must be an int in \\[0, 2\\*\\*63-1\\]"),
    "layer above int64": (raw(5, step_body([["f32", [1, 1]]], layer=2**64 - 1), bytes(4)), "field 'layer' must be an int in"),
    "float step": (raw(5, step_body([["f32", [1, 1]]], step=1.0), bytes(4)), "field 'step' must be an int in"),
    "NaN float": (raw(3, {"worker": 0, "weight_bytes": 1, "load_s": float("nan")}), "field 'load_s' must be a finite float"),
    "inf float": (raw(3, {"worker": 0, "weight_bytes": 1, "load_s": float("inf")}), "field 'load_s' must be a finite float"),
    "bad cpus": (raw(2, {"model": "m", "worker": 0, "n_workers": 1, "n_ctx": 8, "threads": 1, "cpus": [0, -2], "node": -1, "predictor": "", "n_slots": 1, "transport": "zmq", "shm": "", "max_t": 1, "gpu_layers": [], "gpu_attn": [], "gpu_hot": "", "layers": []}), "field 'cpus'"),
    "zero n_ctx": (raw(2, {"model": "m", "worker": 0, "n_workers": 1, "n_ctx": 0, "threads": 1, "cpus": [], "node": -1, "predictor": "", "n_slots": 1, "transport": "zmq", "shm": "", "max_t": 1, "gpu_layers": [], "gpu_attn": [], "gpu_hot": "", "layers": []}), "field 'n_ctx'"),
    "zero n_slots": (raw(2, {"model": "m", "worker": 0, "n_workers": 1, "n_ctx": 8, "threads": 1, "cpus": [], "node": -1, "predictor": "", "n_slots": 0, "transport": "zmq", "shm": "", "max_t": 1, "gpu_layers": [], "gpu_attn": [], "gpu_hot": "", "layers": []}), "field 'n_slots'"),
    "bad gpu layers": (raw(2, {"model": "m", "worker": 0, "n_workers": 1, "n_ctx": 8, "threads": 1, "cpus": [], "node": -1, "predictor": "", "n_slots": 1, "transport": "shm", "shm": "", "max_t": 1, "gpu_layers": [3, -1], "gpu_attn": [], "gpu_hot": "", "layers": []}), "field 'gpu_layers'"),
    "bad gpu attn": (raw(2, {"model": "m", "worker": 0, "n_workers": 1, "n_ctx": 8, "threads": 1, "cpus": [], "node": -1, "predictor": "", "n_slots": 1, "transport": "shm", "shm": "", "max_t": 1, "gpu_layers": [], "gpu_attn": [-1], "gpu_hot": "", "layers": []}), "field 'gpu_attn'"),
    "bad stage layers": (raw(2, {"model": "m", "worker": 0, "n_workers": 1, "n_ctx": 8, "threads": 1, "cpus": [], "node": -1, "predictor": "", "n_slots": 1, "transport": "shm", "shm": "", "max_t": 1, "gpu_layers": [], "gpu_attn": [], "gpu_hot": "", "layers": [2, -1]}), "field 'layers'"),
    "bad step mode": (raw(11, {"req": 1, "step": 1, "mode": 7, "t": [["i64", [1]], ["i64", [1]], ["i64", [1]]]}, bytes(8), bytes(8), bytes(8)), "field 'mode'"),
    "long str": (raw(7, {"req": 1, "step": 1, "layer": 1, "worker": 0, "kind": "k", "message": "m" * (MAX_STR + 1)}), "field 'message'"),
    "bin for str": (raw(7, {"req": 1, "step": 1, "layer": 1, "worker": 0, "kind": b"k", "message": "m"}), "not valid msgpack"),
    "unknown dtype": (raw(5, step_body([["f64", [1, 2]]]), bytes(16)), "unknown dtype 'f64'"),
    "dtype not allowed for x": (raw(5, step_body([["i64", [1, 2]]]), bytes(16)), "tensor 'x' must be f32 or bf16, got i64"),
    "f32 positions": (raw(4, step_body([["f32", [1, 2]], ["f32", [1]], ["i64", [1]]]), bytes(8), bytes(4), bytes(8)), "'positions' must be i64"),
    "truncated tensor": (raw(5, step_body([["f32", [2, 2]]]), bytes(12)), "needs 16 bytes, its frame has 12"),
    "missing tensor frame": (raw(5, step_body([["f32", [2, 2]]])), "expected 1 tensor frames, got 0"),
    "extra tensor frame": (raw(5, step_body([["f32", [1, 1]]]), bytes(4), bytes(4)), "expected 1 tensor frames, got 2"),
    "extra frame on tensorless type": (raw(9, {}, b"x"), "expected no tensor frames, got 1"),
    "too few descriptors": (raw(4, step_body([["f32", [1, 1]]]), bytes(4)), "'t' must list 3 tensor descriptors"),
    "descriptor not a pair": (raw(5, step_body([["f32"]]), bytes(4)), "must be \\[dtype, shape\\]"),
    "negative dim": (raw(5, step_body([["f32", [-1, 4]]]), bytes(0)), "invalid dimension -1"),
    "bool dim": (raw(5, step_body([["f32", [True, 1]]]), bytes(4)), "invalid dimension True"),
    "too many dims": (raw(5, step_body([["f32", [1, 1, 1, 1, 1]]]), bytes(4)), "shape must be a list of 2 ints"),
    "wrong rank": (raw(5, step_body([["f32", [4]]]), bytes(16)), "shape must be a list of 2 ints"),
    "shape not a list": (raw(5, step_body([["f32", 4]]), bytes(16)), "shape must be a list"),
    "rows mismatch": (raw(4, step_body([["f32", [2, 1]], ["i64", [3]], ["i64", [2]]]), bytes(8), bytes(24), bytes(16)), "positions/slots have 3 entries but x has 2 rows"),
    "slots rows mismatch": (raw(4, step_body([["f32", [2, 1]], ["i64", [2]], ["i64", [1]]]), bytes(8), bytes(16), bytes(8)), "positions/slots have 1 entries but x has 2 rows"),
    "zero-size absurd shape": (raw(5, step_body([["f32", [0, 2**62]]]), b""), "too large"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_messages_raise_protocol_error(name: str) -> None:
    frames, match = BAD[name]
    with pytest.raises(ProtocolError, match=match) as info:
        decode(frames)
    assert isinstance(info.value, PowerInferError) and "\n" not in str(info.value)


def test_huge_declared_shape_allocates_nothing() -> None:
    frames = raw(6, {**step_body([["f32", [2**40, 2**40]]]), "worker": 0, "compute_us": 0}, bytes(16))
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError, match="needs 4835703278458516698824704 bytes, its frame has 16"):
            decode(frames)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_version_mismatch_names_both_versions() -> None:
    with pytest.raises(ProtocolVersionError, match=f"peer speaks version 11, this side speaks version {PROTOCOL_VERSION}") as info:
        decode(raw(1, {"version": 11, "worker": 0, "pid": 1, "features": ["x"]}))  # a v11 HELLO may differ
    assert (info.value.peer_version, info.value.local_version) == (11, PROTOCOL_VERSION)


def test_encode_rejects_what_decode_would() -> None:
    with pytest.raises(ProtocolError, match="positions/slots have 3 entries but x has 2 rows"):
        encode(AttnMsg(0, 0, 0, (X, np.arange(3), np.zeros(3, np.int64))))
    with pytest.raises(ProtocolError, match="LAYERS: positions/slots have 3 entries but x has 2 rows"):
        encode(LayersMsg(0, 0, 0, 1, (X, np.arange(3), np.zeros(3, np.int64))))
    with pytest.raises(ProtocolError, match=r"LAYERS: stop \(3\) must exceed layer \(3\)"):
        encode(LayersMsg(0, 0, 3, 3, (X, POS, POS)))
    body = {"req": 0, "step": 0, "layer": 5, "stop": 2, "t": [["f32", [2, 8]], ["i64", [2]], ["i64", [2]]]}
    with pytest.raises(ProtocolError, match=r"LAYERS: stop \(2\) must exceed layer \(5\)"):
        decode(raw(13, body, X.tobytes(), POS.tobytes(), POS.tobytes()))
    with pytest.raises(ProtocolError, match="'positions' must be i64, got f32"):
        encode(AttnMsg(0, 0, 0, (X, POS.astype(np.float32), POS)))
    with pytest.raises(ProtocolError, match="must have rank 2"):
        encode(FfnMsg(0, 0, 0, (X.ravel(),)))
    with pytest.raises(ProtocolError, match="field 'req'"):
        encode(FfnMsg(-1, 0, 0, (X,)))
    with pytest.raises(ProtocolError, match="field 'model'"):
        encode(LoadMsg("m" * (MAX_STR + 1), 0, 1, 8, 1, (), -1, ""))
    with pytest.raises(ProtocolError, match="tensors must be a tuple of 1"):
        encode(FfnMsg(0, 0, 0, [X]))  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="numpy arrays or torch tensors"):
        encode(FfnMsg(0, 0, 0, ([[1.0]],)))  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="not a protocol message"):
        encode("HELLO")  # type: ignore[arg-type]
    # an ErrorMsg always encodes: its texts are truncated
    e = ErrorMsg.from_exception(ValueError("x" * 100_000), worker=3)
    assert len(e.message) == MAX_STR and isinstance(decode(encode(e)), ErrorMsg)


def test_fuzz_mutations_decode_or_raise_protocol_error() -> None:
    rng = random.Random(20240611)
    bases = [[bytes(f) for f in encode(m)] for m in samples()]
    interesting = [0x00, 0x01, 0x7F, 0x80, 0x90, 0xA0, 0xC0, 0xC1, 0xC2, 0xCB, 0xCF, 0xD3, 0xDC, 0xDD, 0xDE, 0xDF, 0xFF]
    outcomes = {"ok": 0, "error": 0}
    for _ in range(3000):  # every message type decoded or refused; > 50 survivors (the LOAD samples are long)
        frames = [bytearray(f) for f in rng.choice(bases)]
        for _ in range(rng.randint(1, 3)):
            op = rng.randrange(7)
            i = 0 if rng.random() < 0.8 or len(frames) == 1 else rng.randrange(1, len(frames))
            f = frames[i]
            pos = rng.randrange(len(f)) if f else 0
            if op == 0 and f:
                f[pos] ^= 1 << rng.randrange(8)
            elif op == 1 and f:
                f[pos] = rng.choice(interesting)
            elif op == 2:
                f.insert(pos, rng.randrange(256))
            elif op == 3:
                del f[pos:]
            elif op == 4:
                frames.append(bytearray(rng.randbytes(rng.randrange(16))))
            elif op == 5 and len(frames) > 1:
                frames.pop(rng.randrange(1, len(frames)))
            else:
                f[pos:pos] = f[pos : pos + rng.randrange(1, 8)]  # duplicate a run
        try:
            msg = decode([bytes(f) for f in frames])
        except ProtocolError:
            outcomes["error"] += 1
            continue
        assert isinstance(msg, MESSAGE_CLASSES)
        encode(msg)  # whatever decodes is a valid message
        outcomes["ok"] += 1
    assert outcomes["ok"] > 50 and outcomes["error"] > 500, outcomes


# ---------------------------------------------------------------------------------------- errors


def test_worker_died_error_messages() -> None:
    proc = subprocess.Popen(["sleep", "30"])
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    err = WorkerDiedError.exited(1, proc.pid, proc.returncode)
    assert str(err) == f"worker 1 (pid {proc.pid}) died: killed by SIGKILL"
    assert (err.worker, err.pid) == (1, proc.pid) and isinstance(err, PowerInferError)
    assert str(WorkerDiedError.exited(2, 7, 3)) == "worker 2 (pid 7) died: exited with status 3"
    assert str(WorkerDiedError.silent(0, 9, 10)) == "worker 0 (pid 9) stopped answering: no heartbeat for 10.0s"
    assert str(WorkerDiedError("plain")) == "plain"


def test_worker_error_from_report() -> None:
    err = ErrorMsg(4, 5, 6, 2, "ContextOverflowError", "needs 600 positions\ntraceback...").to_exception()
    assert isinstance(err, WorkerError) and err.worker == 2 and err.kind == "ContextOverflowError"
    assert str(err) == "worker 2 failed at layer 6 (req 4, step 5): ContextOverflowError: needs 600 positions"
