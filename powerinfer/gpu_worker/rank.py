"""The GPU worker as a rank of the native pool's segment: runs of GPU layers, and a layer's attention or hot neurons, handed over in shared memory.

Runs in: the GPU worker process (LOAD with transport "shm"), or the coordinator for tests
(``process=False`` in :class:`powerinfer.coordinator.gpu_rank.GpuRank`). numpy and ctypes (its waits: native/kernels/handoff.h); no torch.

The CPU ranks of the pool run every other layer and hand rows over (kernels/handoff.h): around
each run of the GPU's whole layers, the residual stream x [T, d] (this rank runs
:meth:`GpuModel.layers` over it, the stream on the device for the whole run, and writes it back);
in neuron split, a layer's normed input for its attention (the output projection comes back) or
for its hot neurons (their partial of the down projection comes back, while the CPU ranks compute
the cold ones). CPU rank 0 writes the rows and the task into the segment and rings; this rank
answers; every CPU rank reads the answer. Its wait for the next
run is native code (``pi_gpu_next``: spin, then a futex), so no Python loop polls; between runs,
when the coordinator rings the control word, it reads its ZeroMQ socket (SHUTDOWN). A run that
raises is answered with rc 1, which fails the step on every CPU rank; the error is logged here.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time

import numpy as np
import zmq

from powerinfer.config import ModelConfig
from powerinfer.errors import InvalidArgumentError
from powerinfer.gpu_worker.model import GpuModel
from powerinfer.native.comm_lib import comm_lib
from powerinfer.native.segment import Segment, SegmentLayout
from powerinfer.protocol import ErrorMsg, LoadMsg, ProtocolError, ShutdownMsg, recv, send

log = logging.getLogger(__name__)

IDLE_MS = 1000  # an idle GPU rank wakes this often to read its socket
CONTROL_WAIT_MS = 2000  # how long a rung rank waits for the ZeroMQ message
RUN, ATTN, FFN = 0, 1, 2  # handoff.h's PI_GPU_* task kinds
KINDS = {RUN: "a run", ATTN: "the attention", FFN: "the hot neurons"}
SPIN_US = int(os.environ.get("POWERINFER_GPU_SPIN_US", "0"))  # spin for the next run before sleeping (0: the CPU ranks need the cores)


class GpuRank:
    """This process's hand-off endpoint: the segment, the model and the next hand-off awaited."""

    def __init__(self, load: LoadMsg, cfg: ModelConfig, model: GpuModel, spin_us: int = SPIN_US) -> None:
        lib = comm_lib()  # its waits in native code (kernels/handoff.h); BuildError without a C compiler
        gpu = sorted(set(load.gpu_layers))
        if not gpu and not any(a is not None for a in model.attn) and not any(f is not None for f in model.ffns):
            raise InvalidArgumentError("a GPU rank was loaded with no part of any layer")
        missing = [i for i in gpu if not (0 <= i < cfg.n_layers and model.whole(i))]
        if missing:
            raise InvalidArgumentError(f"layers {missing[:8]} of LOAD's GPU layers do not live wholly on this GPU")
        self.lib, self.model, self.spin_us = lib, model, spin_us
        self.gpu_layers = frozenset(gpu)
        layout = SegmentLayout.for_model(cfg, load.n_workers, load.max_t, int(lib.pi_comm_hdr_bytes()), gpu=True)
        self.seg = Segment(load.shm, layout, create=False)
        self.want = int(lib.pi_gpu_attach(self.seg.base, os.getpid())) + 1
        self.control = ctypes.c_uint32(0)
        self._task = np.zeros(4, dtype=np.int64)
        self.runs, self.busy_s = 0, 0.0

    def next(self, idle_ms: int = IDLE_MS, busy: threading.Event | None = None) -> int:
        """Wait for the next hand-off and answer it: 0 when one was served, else pi_gpu_next's code
        (1 idle, 2 control, 10 aborted: comm.h's PI_COMM_ABORT). busy is set while a run computes (the heartbeat reports it)."""
        rc = int(self.lib.pi_gpu_next(self.seg.base, self.want, ctypes.byref(self.control), self.spin_us, idle_ms))
        if rc:
            return rc
        if busy is not None:
            busy.set()
        try:
            self.serve_one()
        finally:
            if busy is not None:
                busy.clear()
        return 0

    def serve_one(self) -> None:
        """Hand-off `want` is posted: compute its task over the area's rows and answer."""
        t0 = time.perf_counter()
        self.lib.pi_gpu_task(self.seg.base, self._task.ctypes.data)
        T, first, stop, kind = (int(v) for v in self._task)
        code = 0
        try:
            if not (1 <= T <= self.seg.layout.max_t and self._mine(kind, first, stop)):
                raise InvalidArgumentError(f"a hand-off of {KINDS.get(kind, kind)} [{first}, {stop}) over {T} tokens is not this rank's")
            io = self.seg.io
            x = self.seg.handoff[:T]
            # x [T, d] f32 in the segment; positions and slots of the step's tokens from its io area
            if kind == RUN:  # the stream through whole layers
                y = self.model.layers(first, stop, x, io[1, :T], io[2, :T])
            elif kind == ATTN:  # a layer's normed input -> its attention's output projection
                y = self.model.attention(first, x, io[1, :T], io[2, :T])
            else:  # the FFN's normed input -> the hot neurons' partial of the down projection
                y = self.model.ffn(first, x)
            x[...] = y
        except Exception:  # noqa: BLE001 - answered as a failed run (every CPU rank fails the step); logged here
            log.exception("GPU rank: %s of layers %d..%d over %d tokens failed", KINDS.get(kind, kind), first, stop - 1, T)
            code = 1
        self.lib.pi_gpu_answer(self.seg.base, self.want, code)
        self.want += 1
        self.runs += 1
        self.busy_s += time.perf_counter() - t0

    def _mine(self, kind: int, first: int, stop: int) -> bool:
        """Whether this rank holds what the task needs (the CPU ranks and this plan come from one placement)."""
        if kind == RUN:
            return first < stop and all(i in self.gpu_layers for i in range(first, stop))
        if stop != first + 1 or not 0 <= first < self.model.cfg.n_layers:
            return False
        if kind == ATTN:
            return self.model.attn[first] is not None
        return kind == FFN and self.model.ffns[first] is not None

    def close(self) -> None:
        self.seg.close()


def serve_rank(sock: zmq.Socket, rank: GpuRank, index: int, busy: threading.Event) -> None:
    """Serve hand-offs until SHUTDOWN (read when the coordinator rings the control word, or when idle)."""
    while True:
        rc = rank.next(busy=busy)
        if rc == 0:
            continue
        # 1 (idle): a message rung for earlier may have come after its wait ran out. 2: one waits.
        # 10 (aborted): the pool is being torn down and SHUTDOWN follows.
        if sock.poll(0 if rc == 1 else CONTROL_WAIT_MS) and not _message(sock, index):
            return
        while sock.poll(0):
            if not _message(sock, index):
                return


def _message(sock: zmq.Socket, index: int) -> bool:
    """One ZeroMQ message; False on SHUTDOWN (a GPU rank takes no other request)."""
    try:
        msg = recv(sock)
    except ProtocolError as e:
        log.error("GPU rank: dropped a malformed message: %s", e)
        send(sock, ErrorMsg(req=-1, step=-1, layer=-1, worker=index, kind="ProtocolError", message=str(e)))
        return True
    if isinstance(msg, ShutdownMsg):
        return False
    send(sock, ErrorMsg(req=int(getattr(msg, "req", -1)), step=-1, layer=-1, worker=index, kind="ProtocolError",
                        message=f"a GPU rank takes no {type(msg).__name__}: its layers come through the segment"))
    return True
