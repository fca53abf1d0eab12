"""Layer split with the GPU worker as a rank of the native pool: which layers go to it, and starting it on the pool's segment.

Runs in: the coordinator process (no torch).

With ``-ngl`` / a VRAM budget in layer split (llama.cpp's placement: whole layers from the first),
the default multiprocess executor is the native pool (native_pool.py) plus the GPU worker as one
more rank: the CPU ranks run every other layer, merging in shared memory as without a GPU, and
hand the residual stream to the GPU rank around each run of its layers (kernels/handoff.h). A
forward pass is still one ring of the doorbell; the GPU's layers cost two copies of [T, d] and
a futex wake each way, no ZeroMQ message (the hybrid executor sends one LAYERS request per run
and runs the CPU layers in the coordinator). Neuron split stays with the hybrid executor.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from pathlib import Path

from powerinfer.config import ModelConfig
from powerinfer.coordinator.hybrid_executor import GpuOptions, gpu_budget, solve_placement
from powerinfer.errors import InvalidArgumentError
from powerinfer.gguf_file import GGUFFile
from powerinfer.gpu_worker.client import GpuSetup, GpuWorkerProcess, RankSeat
from powerinfer.gpu_worker.errors import GIB, gib
from powerinfer.gpu_worker.layout import GpuPlan
from powerinfer.native.segment import Segment
from powerinfer.predictors.predictor_file import PredictorFile

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuRankSpec:
    """What the native pool needs to start (and restart) its GPU rank."""

    model: str
    setup: GpuSetup
    n_ctx: int
    n_slots: int = 1
    predictor: str = ""  # the .predictor path when the GPU's layers compute sparsely
    log_level: str = "WARNING"

    def __post_init__(self) -> None:
        plan = self.setup.plan
        if not any(plan.gpu_layers):
            raise InvalidArgumentError("a GPU rank needs at least one GPU layer")
        n_ff = max(len(h) for h in plan.hot)  # every neuron of a GPU layer (the GPU rank checks it against the model too)
        for i, on in enumerate(plan.gpu_layers):
            if len(plan.hot[i]) != (n_ff if on else 0):
                raise InvalidArgumentError(f"layer {i} is split between the GPU and the CPU: a GPU rank takes whole layers (layer split)")

    @property
    def layers(self) -> tuple[int, ...]:
        """The layers the GPU rank computes."""
        return tuple(i for i, on in enumerate(self.setup.plan.gpu_layers) if on)

    def start(self, lib: ctypes.CDLL, seg: Segment, n_ranks: int, max_t: int) -> GpuWorkerProcess:
        """The GPU worker process, loaded and attached to seg as the rank after n_ranks CPU ranks."""
        gpu = GpuWorkerProcess(self.model, self.setup, self.n_ctx, self.n_slots, self.predictor, self.log_level,
                               rank=RankSeat(seg.path, n_ranks, max_t, self.layers))
        base = seg.base
        gpu.after_send = lambda: lib.pi_gpu_control(base)  # SHUTDOWN: the rank waits in native code
        return gpu


def layer_split_rank(model_path: str | Path, f: GGUFFile, cfg: ModelConfig, n_ctx: int, opts: GpuOptions, *,
                     predictor: PredictorFile | None = None, predictor_path: str | Path | None = None, sparse: bool = True,
                     n_slots: int = 1, log_level: str = "WARNING") -> GpuRankSpec | None:
    """The layer split for the budget as a GPU rank's spec; None when the budget holds no layer
    (everything then runs on the CPU ranks). Raises GpuMemoryError over the card's free memory."""
    if opts.split != "layer":
        raise InvalidArgumentError("a GPU rank takes whole layers: --split layer")
    budget = gpu_budget(opts)
    pl = solve_placement(model_path, f, cfg, n_ctx, opts, budget, predictor=predictor, sparse=sparse, n_slots=n_slots)
    if not any(pl.gpu_layers):
        log.warning("a VRAM budget of %s holds no whole layer (-ngl %d): everything runs on the CPU, and no GPU worker is started",
                    gib(budget), opts.n_gpu_layers)
        return None
    use = predictor is not None and sparse
    ppath = str(predictor_path) if use and predictor_path is not None else ""
    if use and not ppath:
        raise InvalidArgumentError("a GPU worker process needs the predictor's path (predictor_path)")
    log.info("layer split: %d GPU layers as a rank of the worker pool, %s of %s", sum(pl.gpu_layers), gib(pl.used), gib(budget))
    setup = GpuSetup(opts.backend, budget, GpuPlan(pl.hot, pl.gpu_layers, sparse, opts.max_tokens),
                     None if opts.capacity_gib is None else int(opts.capacity_gib * GIB))
    return GpuRankSpec(str(model_path), setup, n_ctx, n_slots, ppath, log_level)
