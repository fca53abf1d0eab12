"""GPU worker process: owns the GPU (one CUDA context) and serves offloaded layers' requests.

Runs in: the GPU worker process, started by :class:`powerinfer.gpu_worker.client.GpuWorkerProcess`
as ``python -m powerinfer.gpu_worker.worker CTL HB COORDINATOR_PID LOG_LEVEL SETUP_JSON``.

Life cycle, as a CPU worker's (docs/protocol.md): HELLO -> LOAD (model path, context, predictor,
KV slots) -> build the backend from the setup file (``cpu`` or ``cuda``, the VRAM budget, the hot
neurons of each layer), upload -> READY (weight_bytes = device bytes in use) or ERROR (e.g.
GpuMemoryError, whose message the coordinator shows as is) -> ATTN / FFN -> PARTIAL until
SHUTDOWN. A heartbeat thread beats while the worker computes and ends the process when the
coordinator disappears. No torch here: numpy, pyzmq and (for ``cuda``) pycuda.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
import zmq

from powerinfer.config import config_from_gguf
from powerinfer.gguf_file import GGUFFile
from powerinfer.gpu_worker.client import GpuSetup, make_backend
from powerinfer.gpu_worker.model import GpuModel
from powerinfer.protocol import (
    PROTOCOL_VERSION,
    AttnMsg,
    ErrorMsg,
    FfnMsg,
    HelloMsg,
    LoadMsg,
    PartialMsg,
    ProtocolError,
    ReadyMsg,
    ShutdownMsg,
    recv,
    send,
    socket_limits,
    worker_identity,
)
from powerinfer.protocol.lifecycle import die_with_parent, heartbeat
from powerinfer.predictors.predictor_file import read_predictor

log = logging.getLogger(__name__)

INDEX = 0  # the GPU worker's identity on the control socket (w0) and in its messages


def _f32(x: np.ndarray) -> np.ndarray:
    """Activations as float32 (bf16 arrives as its raw uint16 bits)."""
    if x.dtype == np.uint16:
        return (x.astype(np.uint32) << np.uint32(16)).view(np.float32)
    return np.asarray(x, dtype=np.float32)


def _load(load: LoadMsg, setup: GpuSetup) -> GpuModel:
    f = GGUFFile(load.model)
    cfg = config_from_gguf(f)
    pf = read_predictor(load.predictor, model=f) if load.predictor else None
    backend = make_backend(setup)
    try:
        return GpuModel(f, cfg, backend, setup.plan, load.n_ctx, load.n_slots, pf)
    except BaseException:
        backend.close()
        raise


def _serve(sock: zmq.Socket, model: GpuModel, busy: threading.Event) -> None:
    while True:
        try:
            msg = recv(sock)
        except ProtocolError as e:
            send(sock, ErrorMsg(req=-1, step=-1, layer=-1, worker=INDEX, kind="ProtocolError", message=str(e)))
            continue
        if isinstance(msg, ShutdownMsg):
            return
        if not isinstance(msg, (AttnMsg, FfnMsg)):
            send(sock, ErrorMsg(req=-1, step=-1, layer=-1, worker=INDEX, kind="ProtocolError", message=f"unexpected {type(msg).__name__}"))
            continue
        busy.set()
        t0 = time.perf_counter()
        try:
            x = _f32(msg.tensors[0])
            if isinstance(msg, AttnMsg):
                y = model.attention(msg.layer, x, np.asarray(msg.tensors[1]), np.asarray(msg.tensors[2]))
            else:
                y = model.ffn(msg.layer, x)
            us = int((time.perf_counter() - t0) * 1e6)
            send(sock, PartialMsg(req=msg.req, step=msg.step, layer=msg.layer, worker=INDEX, compute_us=us,
                                  tensors=(np.ascontiguousarray(y, dtype=np.float32),)))
        except Exception as e:  # noqa: BLE001 - reported to the coordinator as a typed ERROR, worker keeps serving
            log.exception("GPU worker: layer %d failed", msg.layer)
            send(sock, ErrorMsg(req=msg.req, step=msg.step, layer=msg.layer, worker=INDEX, kind=type(e).__name__, message=str(e)))
        finally:
            busy.clear()


def worker_main(endpoint: str, hb_endpoint: str, coordinator: int, log_level: str, setup_path: str) -> None:
    die_with_parent()
    logging.basicConfig(level=log_level, format="%(levelname)s gpu-worker %(name)s: %(message)s", stream=sys.stderr)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the coordinator handles Ctrl+C and tells us to stop
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, worker_identity(INDEX))
    sock.setsockopt(zmq.LINGER, 0)
    socket_limits(sock)
    sock.connect(endpoint)
    busy, stop = threading.Event(), threading.Event()
    beat = threading.Thread(target=heartbeat, args=(ctx, hb_endpoint, INDEX, coordinator, busy, stop, "GPU worker"), daemon=True)
    beat.start()
    model: GpuModel | None = None
    try:
        send(sock, HelloMsg(version=PROTOCOL_VERSION, worker=INDEX, pid=os.getpid()))
        load = recv(sock)
        if isinstance(load, ShutdownMsg):
            return
        if not isinstance(load, LoadMsg):
            raise ProtocolError(f"expected LOAD, got {type(load).__name__}")
        t0 = time.perf_counter()
        busy.set()
        try:
            model = _load(load, GpuSetup.from_json(Path(setup_path).read_text()))
        except Exception as e:  # noqa: BLE001 - the coordinator reports it as a load failure
            send(sock, ErrorMsg(req=-1, step=-1, layer=-1, worker=INDEX, kind=type(e).__name__, message=str(e)))
            return
        finally:
            busy.clear()
        send(sock, ReadyMsg(worker=INDEX, weight_bytes=model.nbytes, load_s=time.perf_counter() - t0))
        _serve(sock, model, busy)
    finally:
        if model is not None:
            model.close()
        stop.set()
        beat.join(1.0)
        sock.close()
        ctx.term()


if __name__ == "__main__":
    worker_main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5])
