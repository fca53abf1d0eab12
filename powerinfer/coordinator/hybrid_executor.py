"""Hybrid executor: hot neurons and offloaded layers on the GPU worker, cold neurons on the CPU.

Runs in: the coordinator process (the CPU shards run here, with torch's intra-op threads; the GPU
worker runs in its own process or, for tests, in this one).

A layer-by-layer executor (coordinator/layerwise.py) like the in-process one. From a
:class:`powerinfer.coordinator.placement.Placement`:

* attention of a GPU layer (``gpu_layers[i]``) is computed by the GPU worker with its KV cache;
  of any other layer by an :class:`AttentionShard` here;
* a run of layers with no GPU part runs in the native decoder (one call, the in-process
  executor's kernels), where it can run the model; else on torch shards as below;
* a run of layers wholly on the GPU (attention and every neuron: layer split's GPU layers) goes
  to the GPU worker as one request (LAYERS), which runs the engine's recipe (model/layer_loop.py)
  over them with the residual stream on the device: one round trip instead of two per layer;
* the FFN of every other layer is split: the GPU worker computes the hot neurons (``hot[i]``), a
  :class:`FFNShard` / :class:`SparseFFNShard` here the cold ones (the complement, any set). The
  GPU request is sent first and the CPU shard computed while the GPU works; the merge is the sum
  of the two partials (each a partial sum in model space), so it only changes the order of float
  additions. Layer split (llama.cpp's -ngl) is the placement whose GPU layers have every neuron hot.

The output head stays on the CPU. :func:`build_hybrid_executor` turns user options (budget,
-ngl, split mode, backend) into a placement, starts the GPU worker and builds the executor.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from powerinfer.config import ModelConfig
from powerinfer.coordinator.executor import Description
from powerinfer.coordinator.layerwise import LayerwiseExecutor
from powerinfer.coordinator.stats import HybridStats, mib
from powerinfer.cpu_workers.sparse_ffn import SparseFFNShard
from powerinfer.errors import InvalidArgumentError
from powerinfer.gguf_file import GGUFFile
from powerinfer.gpu_worker.client import GpuHandle, GpuSetup, GpuWorkerProcess, LocalGpuWorker, NoGpu
from powerinfer.gpu_worker.errors import GIB, gib, over_card
from powerinfer.gpu_worker.layout import DEFAULT_MAX_TOKENS
from powerinfer.gpu_worker.layout import GpuPlan
from powerinfer.model.sharding import HeadRange, ShardPlan, cold_neurons, plan_shards
from powerinfer.coordinator.placement import Placement, cached_neuron_split, layer_costs, solve_layer_split, solve_neuron_split
from powerinfer.predictors.predictor_file import PredictorFile
from powerinfer.predictors.predictor_types import refuse_residual_input

if TYPE_CHECKING:
    from powerinfer.native.decoder import NativeDecoder

log = logging.getLogger(__name__)

SPLITS = ("neuron", "layer")
NATIVE_MAX_T = 128  # tokens per native call for the CPU-only layers (longer chunks are split)


class HybridExecutor(LayerwiseExecutor):
    def __init__(self, f: GGUFFile, cfg: ModelConfig, n_ctx: int, placement: Placement, gpu: GpuHandle, *,
                 predictor: PredictorFile | None = None, n_slots: int = 1, progress: bool = False, native: bool = True) -> None:
        from powerinfer.cpu_workers.shards import AttentionShard, FFNShard, HeadShard
        from powerinfer.model.ops import RopeTable

        if len(placement.hot) != cfg.n_layers or len(placement.gpu_layers) != cfg.n_layers:
            raise InvalidArgumentError(f"placement has {len(placement.hot)} layers, the model {cfg.n_layers}")
        super().__init__(f, cfg)
        self.placement, self.gpu = placement, gpu
        self.plan: ShardPlan = plan_shards(cfg, 1)  # the CPU side runs as one shard per layer, here
        self.n_hot = [len(h) for h in placement.hot]
        ropes: dict[tuple[float, float], RopeTable] = {}
        self.attn: list[AttentionShard | None] = []
        self.ffns: list[FFNShard | SparseFFNShard | None] = []
        layers = range(cfg.n_layers)
        if progress:
            from tqdm import tqdm  # type: ignore[import-untyped]

            layers = tqdm(layers, desc="loading CPU layers", unit="layer", leave=False)
        heads = HeadRange(0, cfg.n_kv_heads, cfg.gqa_group)
        # layers with no GPU part (layer split's CPU layers, neuron split's beyond -ngl) run in the
        # native decoder, a run of them per call, as the in-process executor runs every layer
        cpu_only = frozenset(i for i in range(cfg.n_layers) if not placement.gpu_layers[i] and not len(placement.hot[i]))
        self.native = _native_layers(f, cfg, n_ctx, n_slots, predictor, cpu_only) if native and cpu_only else None
        for i in layers:
            if self.native is not None and i in cpu_only:
                self.attn.append(None)
                self.ffns.append(None)
                continue
            self.attn.append(None if placement.gpu_layers[i] else AttentionShard(f, cfg, i, heads, n_ctx, ropes, n_slots))
            cold = cold_neurons(placement.hot[i], cfg.n_ff)
            if not len(cold):
                self.ffns.append(None)
            elif predictor is None:
                self.ffns.append(FFNShard(f, cfg, i, cold))
            else:
                self.ffns.append(SparseFFNShard(f, cfg, i, cold, predictor.layers[i], predictor.mode))
        self.head: HeadShard = HeadShard(f, cfg, 0, cfg.vocab_size)
        self.stats = HybridStats()
        # maximal runs [first, stop) of layers wholly on the GPU (attention and every neuron), which
        # the engine sends as one request (LAYERS) instead of two per layer, and of layers in the
        # native decoder (one call each)
        on_cpu = self.native.only if self.native is not None and self.native.only is not None else frozenset()
        whole = [self.attn[i] is None and self.ffns[i] is None and i not in on_cpu for i in range(cfg.n_layers)]
        native_runs = _runs([i in on_cpu for i in range(cfg.n_layers)])
        self._native_runs = frozenset(a for a, _ in native_runs)
        self.layer_runs = tuple(sorted(_runs(whole) + native_runs))

    @property
    def cpu_bytes(self) -> int:
        shards = [s for s in (*self.attn, *self.ffns) if s is not None]
        native = self.native.weight_bytes + self.native.cache_bytes if self.native is not None else 0
        return sum(s.nbytes for s in shards) + self.head.nbytes + native

    @property
    def gpu_bytes(self) -> int:
        return self.gpu.weight_bytes

    @property
    def weight_bytes(self) -> int:
        return self.cpu_bytes + self.gpu_bytes

    def attention(self, layer: int, x: np.ndarray, positions: np.ndarray, slots: np.ndarray | None = None) -> np.ndarray:
        """x [T, d] normed, positions [T], slots [T] (None: slot 0) -> attention output [T, d]."""
        import torch

        self._not_native(layer)
        t0 = time.perf_counter()
        self.stats.attention_calls += 1
        shard = self.attn[layer]
        if shard is None:
            out = self.gpu.attention_begin(layer, x, positions, slots).result()
            self.stats.gpu_attention_s += time.perf_counter() - t0
            return out
        st = None if slots is None else torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64))
        y = shard.forward(torch.from_numpy(x), torch.from_numpy(np.ascontiguousarray(positions, dtype=np.int64)), st).numpy()
        self.stats.cpu_attention_s += time.perf_counter() - t0
        return y

    def ffn(self, layer: int, x: np.ndarray, resid: np.ndarray | None = None) -> np.ndarray:
        """x [T, d] normed -> hot partial (GPU) + cold partial (CPU) [T, d]. (resid unused: a
        predictor reading the residual is refused at load.)"""
        import torch

        self._not_native(layer)
        pending = self.gpu.ffn_begin(layer, x) if self.n_hot[layer] else None
        out: np.ndarray | None = None
        shard = self.ffns[layer]
        t0 = time.perf_counter()
        try:
            if shard is not None:
                out = shard.forward(torch.from_numpy(x)).numpy()
        except BaseException:
            if pending is not None:
                try:
                    pending.abandon()  # else every later GPU request would be refused as "one at a time"
                except Exception:  # noqa: BLE001 - the CPU side's exception is the one to raise
                    log.warning("layer %d: the abandoned GPU request failed too", layer, exc_info=True)
            raise
        t1 = time.perf_counter()
        if pending is not None:
            y = pending.result()
            out = y if out is None else out + y
        self.stats.cpu_ffn_s += t1 - t0
        self.stats.gpu_ffn_wait_s += time.perf_counter() - t1
        self.stats.ffn_calls += 1
        assert out is not None  # every neuron is on one side
        return out

    def _not_native(self, layer: int) -> None:
        if self.native is not None and self.native.only is not None and layer in self.native.only:
            raise InvalidArgumentError(f"layer {layer} runs in the native decoder, a run of layers per call: use layers()")

    def layers(self, first: int, stop: int, x: np.ndarray, positions: np.ndarray, slots: np.ndarray | None = None) -> np.ndarray:
        """x [T, d] the residual stream entering layer `first` -> leaving stop - 1 (a run of `layer_runs`)."""
        t0 = time.perf_counter()
        if first in self._native_runs:
            assert self.native is not None
            sl = np.zeros(len(positions), dtype=np.int64) if slots is None else slots
            out = self.native.forward_range(first, stop, np.array(x, dtype=np.float32), positions, sl)  # a copy: updated in place
            self.stats.cpu_layers_s += time.perf_counter() - t0
            self.stats.native_layer_calls += stop - first
            return out
        out = self.gpu.layers_begin(first, stop, x, positions, slots).result()
        self.stats.gpu_layers_s += time.perf_counter() - t0
        self.stats.layer_runs += 1
        self.stats.whole_layer_calls += stop - first
        return out

    def head_logits(self, x: np.ndarray) -> np.ndarray:
        import torch

        return self.head.forward(torch.from_numpy(x)).numpy()

    def set_sparse(self, *, dense: bool | None = None, oracle: bool | None = None) -> None:
        """CPU shards only: the GPU worker's sparsity is fixed when it loads."""
        sparse = self.native.sparse if self.native is not None else None
        if sparse is not None:  # the native decoder's layers, as NativeExecutor.set_sparse
            sparse.set_flags(dense, oracle)
        for shard in self.ffns:
            if isinstance(shard, SparseFFNShard):
                shard.set_mode(dense, oracle)

    @property
    def pids(self) -> list[int]:
        """The GPU worker's process, when it runs in one."""
        return list(self.gpu.pids)

    def describe(self) -> Description:
        cfg, pl, pids = self.cfg, self.placement, self.pids
        hot = sum(len(h) for h in pl.hot)
        none = isinstance(self.gpu, NoGpu)
        worker = " not started: the budget holds no part of any layer" if none else f" (pid {pids[0]})" if pids else " (in process)"
        native = (self.native.only if self.native is not None else None) or ()
        where = f"; {len(native)} layers with no GPU part: the native decoder, this process" if native else ""
        placement = (f"placement  GPU worker{worker}, {pl.mode} split: attention of {sum(pl.gpu_layers)}/{cfg.n_layers} layers, "
                     f"{hot}/{cfg.n_ff * cfg.n_layers} FFN neurons hot ({100 * pl.mass_on_gpu:.0f}% of the activation mass), "
                     f"{mib(pl.used)} of a {mib(pl.budget)} budget",
                     f"           cold neurons and the other layers' attention: this process{where}; coordinator: embeddings, norms, head, "
                     "sampling")
        return Description(kind="a GPU worker and shards in this process", pids=tuple(pids), placement=placement,
                           figures=self.stats.figures(hot / (cfg.n_ff * cfg.n_layers), pl.mass_on_gpu))

    def reset_stats(self) -> None:
        self.stats.reset()

    def check_health(self) -> None:
        """Raise WorkerDiedError if the GPU worker process is gone or silent (between requests)."""
        self.gpu.check_health()

    def restart(self) -> None:
        """A fresh GPU worker after a failure (its KV caches start empty, as the engine's slots do)."""
        self.gpu = self.gpu.restarted()

    def close(self) -> None:
        self.gpu.close()
        self.attn.clear()
        self.ffns.clear()
        if self.native is not None:
            self.native.k_cache.clear()
            self.native.v_cache.clear()


def _native_layers(f: GGUFFile, cfg: ModelConfig, n_ctx: int, n_slots: int, predictor: PredictorFile | None,
                   layers: frozenset[int]) -> NativeDecoder | None:
    """The native decoder over just `layers` (with their sparse rules), or None where it cannot run
    this model (no C compiler, POWERINFER_NATIVE=0, a weight type it has no kernel for)."""
    import torch

    from powerinfer.native.decoder_lib import decoder_lib
    from powerinfer.native.decoder import NativeDecoder, supports
    from powerinfer.native.sparse_layers import NativeSparseFFNs

    lib = decoder_lib()
    why = "the native decoder is unavailable" if lib is None else supports(f, cfg)
    if why is not None or lib is None:
        log.info("CPU-only layers run on torch shards: %s", why)
        return None
    # every layer applies the predictor's rule, as the GPU side and the torch shards do: the in-process
    # decoder's "too dense to pay, run dense" cut would make the text depend on where a layer lives
    sparse = NativeSparseFFNs(lib, f, cfg, predictor, only=layers, max_share=1.0, hot_block=False) if predictor is not None else None
    return NativeDecoder(lib, f, cfg, n_ctx, n_slots, torch.get_num_threads(), NATIVE_MAX_T, sparse=sparse, only=layers)


def _runs(flags: list[bool]) -> list[tuple[int, int]]:
    """Maximal runs [a, b) of True."""
    out, start = [], None
    for i, v in enumerate([*flags, False]):
        if v and start is None:
            start = i
        elif not v and start is not None:
            out.append((start, i))
            start = None
    return out


@dataclass(frozen=True)
class GpuOptions:
    """The GPU flags: backend, split mode, --vram-budget (GiB), -ngl, --reset-gpu-index."""

    backend: str = "cuda"  # "cuda" | "cpu" (numpy stand-in: CI, or checking a placement without a GPU)
    split: str = "neuron"  # "neuron" (PowerInfer) | "layer" (llama.cpp -ngl)
    vram_budget_gib: float | None = None  # None: the card's free memory minus a margin
    n_gpu_layers: int = -1  # layers that may take part, from the first; -1: all
    reset_index: bool = False  # re-solve the neuron split even when the cache beside the model matches
    process: bool = True  # the GPU worker in its own process (False: in the coordinator's)
    max_tokens: int = DEFAULT_MAX_TOKENS  # tokens per GPU call (bounds its scratch buffers)
    capacity_gib: float | None = None  # cpu backend: the simulated card's memory (None: host RAM)

    def __post_init__(self) -> None:
        if self.split not in SPLITS:
            raise InvalidArgumentError(f"split must be one of {', '.join(SPLITS)}, got {self.split!r}")
        if self.vram_budget_gib is not None and not 0 < self.vram_budget_gib < float("inf"):
            raise InvalidArgumentError(f"--vram-budget must be a positive, finite number of GiB, got {self.vram_budget_gib}")
        if self.max_tokens < 1:
            raise InvalidArgumentError(f"max_tokens must be positive, got {self.max_tokens}")


def gpu_budget(opts: GpuOptions) -> int:
    """Bytes of device memory to place weights in: --vram-budget, or the card's default; raises
    GpuMemoryError when the budget exceeds the device's free memory."""
    name, free, default = _device_room(opts)
    budget = default if opts.vram_budget_gib is None else int(opts.vram_budget_gib * GIB)
    if budget > free:
        raise over_card(budget, free, name)
    return budget


def _device_room(opts: GpuOptions) -> tuple[str, int, int]:
    """(device name, free bytes, default budget) of the chosen backend."""
    from powerinfer.gpu_worker.device import DeviceMemory, device_memory

    if opts.backend == "cuda":
        mem = device_memory()
    else:
        from powerinfer.gpu_worker.backend import host_memory

        cap = host_memory() if opts.capacity_gib is None else int(opts.capacity_gib * GIB)
        mem = DeviceMemory("the CPU backend's simulated device", cap, cap)
    return mem.name, mem.free, mem.default_budget()


def solve_placement(model_path: str | Path, f: GGUFFile, cfg: ModelConfig, n_ctx: int, opts: GpuOptions, budget: int, *,
                    predictor: PredictorFile | None = None, sparse: bool = True, n_slots: int = 1) -> Placement:
    """The neuron split (cached beside the model when a predictor gives activation statistics) or
    the layer split for this budget, priced with the GPU worker's own byte counts."""
    refuse_residual_input(predictor if sparse else None, "the GPU worker")
    costs = layer_costs(f, cfg, n_ctx, n_slots=n_slots, predictor=predictor, sparse=sparse, max_tokens=opts.max_tokens)
    ngl = cfg.n_layers if opts.n_gpu_layers < 0 else opts.n_gpu_layers
    if opts.split == "layer":
        return solve_layer_split(cfg.n_ff, costs, budget, ngl)
    if predictor is not None:
        return cached_neuron_split(Path(model_path), f, cfg, predictor, budget, ngl, n_ctx, reset=opts.reset_index, costs=costs)
    return solve_neuron_split(None, costs, budget, ngl, n_ff=cfg.n_ff)  # no statistics: every neuron alike


def build_hybrid_executor(model_path: str | Path, f: GGUFFile, cfg: ModelConfig, n_ctx: int, opts: GpuOptions, *,
                          predictor: PredictorFile | None = None, predictor_path: str | Path | None = None, sparse: bool = True,
                          n_slots: int = 1, log_level: str = "WARNING", progress: bool = False, native: bool = True) -> HybridExecutor:
    """Placement for the budget, GPU worker started and loaded, CPU shards built.

    ``predictor`` (read from ``predictor_path``) gives the activation statistics of the neuron
    split and, when ``sparse``, makes both sides compute sparsely. Raises GpuMemoryError when the
    budget exceeds the device's free memory, GpuUnavailableError without a usable GPU (cuda).
    ``native`` False keeps the CPU-only layers on torch shards (the oracle) instead of the native decoder.
    """
    budget = gpu_budget(opts)
    use = predictor if sparse else None
    pl = solve_placement(model_path, f, cfg, n_ctx, opts, budget, predictor=predictor, sparse=sparse, n_slots=n_slots)
    empty = not any(pl.gpu_layers) and not any(len(h) for h in pl.hot)
    if empty:
        log.warning("a VRAM budget of %s holds no part of any layer (-ngl %d): everything runs on the CPU, and no GPU worker "
                    "is started", gib(budget), opts.n_gpu_layers)
    elif not any(pl.gpu_layers):
        log.info("a VRAM budget of %s holds no layer's attention (-ngl %d): only hot neurons go to the GPU", gib(budget),
                 opts.n_gpu_layers)
    log.info("%s split: %d GPU layers, %d hot neurons, %s of %s, %.0f%% of the activation mass", pl.mode, sum(pl.gpu_layers),
             sum(len(h) for h in pl.hot), gib(pl.used), gib(budget), 100 * pl.mass_on_gpu)
    setup = GpuSetup(opts.backend, budget, GpuPlan(pl.hot, pl.gpu_layers, sparse, opts.max_tokens),
                     None if opts.capacity_gib is None else int(opts.capacity_gib * GIB))
    gpu: GpuHandle
    if empty:
        gpu = NoGpu()
    elif opts.process:
        ppath = str(predictor_path) if use is not None and predictor_path is not None else ""
        if use is not None and not ppath:
            raise InvalidArgumentError("a GPU worker process needs the predictor's path (predictor_path)")
        gpu = GpuWorkerProcess(str(model_path), setup, n_ctx, n_slots, ppath, log_level)
    else:
        gpu = LocalGpuWorker(f, cfg, setup, n_ctx, n_slots, use)
    try:
        return HybridExecutor(f, cfg, n_ctx, pl, gpu, predictor=use, n_slots=n_slots, progress=progress, native=native)
    except BaseException:
        gpu.close()
        raise
