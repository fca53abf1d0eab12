"""GPU worker process: owns the GPU (one CUDA context) and serves offloaded layers' requests.

Runs in: the GPU worker process, started by :class:`powerinfer.gpu_worker.client.GpuWorkerProcess`
as ``python -m powerinfer.gpu_worker.worker 0 CTL HB COORDINATOR_PID LOG_LEVEL SETUP_JSON``.

Life cycle, as a CPU worker's (docs/protocol.md): HELLO -> LOAD (model path, context, predictor,
KV slots) -> build the backend from the setup file (``cpu`` or ``cuda``, the VRAM budget, the hot
neurons of each layer), upload -> READY (weight_bytes = device bytes in use) or ERROR (e.g.
GpuMemoryError, whose message the coordinator shows as is) -> ATTN / FFN / LAYERS -> PARTIAL until
SHUTDOWN; or, with LOAD transport "shm", a rank of the native pool's segment (rank.py) that takes
its runs of layers there until SHUTDOWN. The life cycle (sockets, heartbeat thread, the per-layer loop) is
processes/worker_runtime.py's, shared with the CPU workers. No torch here: numpy, pyzmq and
(for ``cuda``) pycuda.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import numpy as np

from powerinfer.config import config_from_gguf
from powerinfer.gguf_file import GGUFFile
from powerinfer.gpu_worker.client import GpuSetup, make_backend
from powerinfer.gpu_worker.model import GpuModel
from powerinfer.gpu_worker.rank import GpuRank, serve_rank
from powerinfer.protocol import (
    AttnMsg,
    FfnMsg,
    LayersMsg,
    LoadMsg,
    Message,
)
from powerinfer.processes.worker_runtime import Loaded, WorkerArgs, run_worker, serve_layers
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


def _compute(model: GpuModel, msg: Message) -> np.ndarray:
    x = _f32(msg.tensors[0])  # type: ignore[attr-defined]
    if isinstance(msg, AttnMsg):
        return model.attention(msg.layer, x, np.asarray(msg.tensors[1]), np.asarray(msg.tensors[2]))
    if isinstance(msg, LayersMsg):
        return model.layers(msg.layer, msg.stop, x, np.asarray(msg.tensors[1]), np.asarray(msg.tensors[2]))
    assert isinstance(msg, FfnMsg)
    return model.ffn(msg.layer, x)


def _prepare(load: LoadMsg, setup_path: str) -> Loaded:
    model = _load(load, GpuSetup.from_json(Path(setup_path).read_text()))
    if load.transport == "shm":  # a rank of the native pool's segment: runs of layers handed over there (rank.py)
        try:
            rank = GpuRank(load, model.cfg, model)
        except BaseException:
            model.close()
            raise

        def close() -> None:
            rank.close()
            model.close()

        return Loaded(model.nbytes, lambda sock, busy: serve_rank(sock, rank, INDEX, busy), close)
    return Loaded(model.nbytes, lambda sock, busy: serve_layers(sock, INDEX, busy, (AttnMsg, FfnMsg, LayersMsg), lambda m: _compute(model, m)),
                  model.close)


def worker_main(args: WorkerArgs) -> None:
    if not args.extra:
        raise SystemExit("the GPU worker needs its setup file (written by powerinfer.gpu_worker.client.GpuWorkerProcess)")
    run_worker(args, "GPU worker", lambda load: _prepare(load, args.extra[0]))


if __name__ == "__main__":
    # argv: index endpoint heartbeat-endpoint coordinator-pid log-level setup-file (processes/supervisor.py writes it)
    worker_main(WorkerArgs.parse(sys.argv[1:]))
