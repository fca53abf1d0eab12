"""Multiprocess executor: each layer's shards run in CPU worker processes; the coordinator merges.

Runs in: the coordinator process.

Same interface as :class:`powerinfer.coordinator.executor.InProcessExecutor` (the test oracle):
``attention`` and ``ffn`` send the layer's normed activations to every worker that holds a shard
of it and return the sum of their partial outputs, added in worker order like the oracle does.
Per-layer timings (round trip vs the workers' own compute time) feed the benchmark.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from powerinfer.config import ModelConfig
from powerinfer.coordinator.pool import PoolConfig, WorkerPool
from powerinfer.cpu_workers.topology import plan_placement, read_topology
from powerinfer.model.sharding import plan_shards
from powerinfer.protocol import AttnMsg, FfnMsg, Message, PartialMsg, as_torch

log = logging.getLogger(__name__)


@dataclass
class LayerTimings:
    """Accumulated microseconds: wall time of each round trip, and the slowest worker's compute."""

    calls: int = 0
    round_trip_us: float = 0.0
    compute_us: float = 0.0

    @property
    def ipc_us(self) -> float:
        return max(0.0, self.round_trip_us - self.compute_us)


@dataclass
class ExecutorStats:
    attention: LayerTimings = field(default_factory=LayerTimings)
    ffn: LayerTimings = field(default_factory=LayerTimings)

    def reset(self) -> None:
        self.attention, self.ffn = LayerTimings(), LayerTimings()


class ProcessExecutor:
    def __init__(self, model: str, cfg: ModelConfig, n_ctx: int, n_workers: int, threads_per_worker: int = 1,
                 pin: bool = True, log_level: str = "WARNING") -> None:
        self.plan = plan_shards(cfg, n_workers)
        self.attn_workers = [i for i, h in enumerate(self.plan.heads) if h is not None]
        self.ffn_workers = [i for i, n in enumerate(self.plan.neurons) if len(n)]
        placements = tuple(plan_placement(read_topology(), n_workers, threads_per_worker)) if pin else ()
        self.pool = WorkerPool(PoolConfig(model, n_workers, n_ctx, threads_per_worker, placements, log_level))
        self.stats = ExecutorStats()
        self.step = 0

    @property
    def weight_bytes(self) -> int:
        return sum(r.weight_bytes for r in self.pool.ready)

    @property
    def pids(self) -> list[int]:
        return self.pool.pids

    def _run(self, workers: list[int], make: "type[AttnMsg] | type[FfnMsg]", layer: int, tensors: tuple[np.ndarray, ...],
             timings: LayerTimings) -> torch.Tensor:
        req = self.pool.next_req()
        msgs: dict[int, Message] = {i: make(req=req, step=self.step, layer=layer, tensors=tensors) for i in workers}
        t0 = time.perf_counter()
        replies: dict[int, PartialMsg] = self.pool.call(msgs, req, f"computing layer {layer}")
        timings.calls += 1
        timings.round_trip_us += (time.perf_counter() - t0) * 1e6
        timings.compute_us += max(r.compute_us for r in replies.values())
        out = as_torch(replies[workers[0]].tensors[0]).clone()
        for i in workers[1:]:
            out += as_torch(replies[i].tensors[0])
        return out

    def attention(self, layer: int, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, d] normed, positions [T] -> summed attention partials [T, d]."""
        if layer == 0:
            self.step += 1
        tensors = (np.ascontiguousarray(x.numpy(), dtype=np.float32), positions.numpy().astype(np.int64, copy=False))
        return self._run(self.attn_workers, AttnMsg, layer, tensors, self.stats.attention)

    def ffn(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        return self._run(self.ffn_workers, FfnMsg, layer, (np.ascontiguousarray(x.numpy(), dtype=np.float32),), self.stats.ffn)

    def restart(self) -> None:
        self.pool.restart()

    def close(self) -> None:
        self.pool.close()
