"""The GPU worker as a rank of the native pool: what it computes, and starting it on the pool's segment.

Runs in: the coordinator process (no torch).

With ``-ngl`` / a VRAM budget, the default multiprocess executor is the native pool
(native_pool.py) plus the GPU worker as one more rank. The CPU ranks run every layer they hold,
merging in shared memory as without a GPU, and hand rows to the GPU rank in the segment
(kernels/handoff.h), so a forward pass is still one ring of the doorbell and no ZeroMQ message:

* layer split (llama.cpp's placement: whole layers from the first), and any layer of a neuron
  split whose attention and every neuron fit: the residual stream around each run of such layers;
* neuron split: a layer's normed input to the GPU rank's attention (the output projection comes
  back), and the FFN's normed input to its hot neurons, whose partial of the down projection comes
  back while the CPU ranks compute the cold neurons (each rank adds it to its own output rows
  before they are gathered).

The hybrid executor instead sends a request per GPU run or split layer and computes the CPU's
share in the coordinator.
"""

from __future__ import annotations

import ctypes
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

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
    predictor: str = ""  # the .predictor path when the GPU's share computes sparsely
    log_level: str = "WARNING"
    n_ff: int = 0  # the model's FFN width (a layer is whole when its attention and n_ff neurons are on the GPU)

    def __post_init__(self) -> None:
        plan = self.setup.plan
        if self.n_ff < 1:
            raise InvalidArgumentError("a GPU rank's spec needs the model's FFN width (n_ff)")
        if not any(plan.gpu_layers) and not any(len(h) for h in plan.hot):
            raise InvalidArgumentError("a GPU rank needs some part of a layer: the plan places nothing on the GPU")
        for i, h in enumerate(plan.hot):
            if len(h) and (int(np.min(h)) < 0 or int(np.max(h)) >= self.n_ff or len(np.unique(h)) != len(h)):
                raise InvalidArgumentError(f"layer {i}: hot neurons must be distinct indices below {self.n_ff}")

    def whole(self, i: int) -> bool:
        plan = self.setup.plan
        return bool(plan.gpu_layers[i]) and len(plan.hot[i]) == self.n_ff

    @property
    def layers(self) -> tuple[int, ...]:
        """The layers the GPU rank computes wholly (runs of them are handed over as the stream)."""
        return tuple(i for i in range(len(self.setup.plan.hot)) if self.whole(i))

    @property
    def attn_layers(self) -> tuple[int, ...]:
        """The other layers whose attention the GPU rank computes (neuron split)."""
        return tuple(i for i, on in enumerate(self.setup.plan.gpu_layers) if on and not self.whole(i))

    @property
    def split_layers(self) -> tuple[int, ...]:
        """Layers shared between the GPU rank and the CPU ranks (attention, or some neurons, on the GPU)."""
        plan = self.setup.plan
        return tuple(i for i in range(len(plan.hot)) if not self.whole(i) and (plan.gpu_layers[i] or len(plan.hot[i])))

    def hot_json(self) -> str:
        """The CPU ranks' file of hot neurons (LOAD.gpu_hot): per layer, those a split layer leaves to the GPU ("" none)."""
        plan = self.setup.plan
        hot = [[int(j) for j in h] if len(h) and not self.whole(i) else [] for i, h in enumerate(plan.hot)]
        return json.dumps(hot) if any(hot) else ""

    def start(self, lib: ctypes.CDLL, seg: Segment, n_ranks: int, max_t: int) -> GpuWorkerProcess:
        """The GPU worker process, loaded and attached to seg as the rank after n_ranks CPU ranks."""
        gpu = GpuWorkerProcess(self.model, self.setup, self.n_ctx, self.n_slots, self.predictor, self.log_level,
                               rank=RankSeat(seg.path, n_ranks, max_t, self.layers))
        base = seg.base
        gpu.after_send = lambda: lib.pi_gpu_control(base)  # SHUTDOWN: the rank waits in native code
        return gpu


def gpu_rank_spec(model_path: str | Path, f: GGUFFile, cfg: ModelConfig, n_ctx: int, opts: GpuOptions, *,
                  predictor: PredictorFile | None = None, predictor_path: str | Path | None = None, sparse: bool = True,
                  n_slots: int = 1, log_level: str = "WARNING") -> GpuRankSpec | None:
    """The placement for the budget (opts.split: layer or neuron) as a GPU rank's spec; None when
    the budget holds no part of any layer (everything then runs on the CPU ranks). Raises
    GpuMemoryError over the card's free memory."""
    budget = gpu_budget(opts)
    pl = solve_placement(model_path, f, cfg, n_ctx, opts, budget, predictor=predictor, sparse=sparse, n_slots=n_slots)
    if not any(pl.gpu_layers) and not any(len(h) for h in pl.hot):
        log.warning("a VRAM budget of %s holds no part of any layer (-ngl %d): everything runs on the CPU, and no GPU worker is started",
                    gib(budget), opts.n_gpu_layers)
        return None
    use = predictor is not None and sparse
    ppath = str(predictor_path) if use and predictor_path is not None else ""
    if use and not ppath:
        raise InvalidArgumentError("a GPU worker process needs the predictor's path (predictor_path)")
    log.info("%s split: the GPU as a rank of the worker pool: attention of %d layers, %d hot neurons, %s of %s", pl.mode,
             sum(pl.gpu_layers), sum(len(h) for h in pl.hot), gib(pl.used), gib(budget))
    setup = GpuSetup(opts.backend, budget, GpuPlan(pl.hot, pl.gpu_layers, sparse, opts.max_tokens),
                     None if opts.capacity_gib is None else int(opts.capacity_gib * GIB))
    return GpuRankSpec(str(model_path), setup, n_ctx, n_slots, ppath, log_level, cfg.n_ff)
