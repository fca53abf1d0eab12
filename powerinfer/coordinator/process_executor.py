"""Multiprocess executor: each layer's shards run in CPU worker processes; the coordinator merges.

Runs in: the coordinator process.

A layer-by-layer executor (coordinator/layerwise.py) like the in-process one, the test oracle:
``attention`` and ``ffn`` send the layer's normed activations to every worker that holds a shard
of it and return the sum of their partial outputs, added in worker order like the oracle does.
Per-layer timings (round trip vs the workers' own compute time) feed the benchmark.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import numpy as np

from powerinfer.config import ModelConfig
from powerinfer.coordinator.executor import Description
from powerinfer.coordinator.layerwise import LayerwiseExecutor
from powerinfer.coordinator.pool import PoolConfig, WorkerPool
from powerinfer.coordinator.stats import ExecutorStats, LayerTimings, pinning_text
from powerinfer.cpu_workers.topology import plan_placement, read_topology
from powerinfer.gguf_file import GGUFFile
from powerinfer.model.sharding import ShardPlan, plan_shards
from powerinfer.protocol import AttnMsg, FfnMsg, LogitsMsg, Message, PartialMsg

log = logging.getLogger(__name__)


class ProcessExecutor(LayerwiseExecutor):
    def __init__(self, f: GGUFFile, cfg: ModelConfig, n_ctx: int, n_workers: int, threads_per_worker: int = 1,
                 pin: bool = True, log_level: str = "WARNING", predictor: str = "", n_slots: int = 1) -> None:
        """f: the model's file, opened here for the embeddings and norms (the workers open it again by its path)."""
        super().__init__(f, cfg)
        self.plan: ShardPlan = plan_shards(cfg, n_workers)
        self.attn_workers = [i for i, h in enumerate(self.plan.heads) if h is not None]
        self.ffn_workers = [i for i, n in enumerate(self.plan.neurons) if len(n)]
        self.head_workers = [i for i, (a, b) in enumerate(self.plan.vocab) if b > a]
        self.placements = tuple(plan_placement(read_topology(), n_workers, threads_per_worker)) if pin else ()
        self.pool = WorkerPool(PoolConfig(str(f.path), n_workers, n_ctx, threads_per_worker, self.placements, log_level, predictor, n_slots))
        self.stats = ExecutorStats()
        self.step = 0
        self.n_layers = cfg.n_layers

    @property
    def weight_bytes(self) -> int:
        return sum(r.weight_bytes for r in self.pool.ready)

    @property
    def pids(self) -> list[int]:
        return self.pool.pids

    def _call(self, workers: list[int], make: Callable[[int], Message], layer: int, timings: LayerTimings) -> list[np.ndarray]:
        """One request (made for its request id) to each of workers; their result tensors in worker order."""
        req = self.pool.next_req()
        msg = make(req)
        msgs: dict[int, Message] = {i: msg for i in workers}
        t0 = time.perf_counter()
        replies = self.pool.call(msgs, req, f"computing layer {layer}")
        parts = [r for r in replies.values() if isinstance(r, PartialMsg)]
        timings.calls += 1
        timings.round_trip_us += (time.perf_counter() - t0) * 1e6
        timings.compute_us += max(r.compute_us for r in parts)
        out: list[np.ndarray] = []
        for i in workers:
            r = replies[i]
            assert isinstance(r, PartialMsg) and isinstance(r.tensors[0], np.ndarray)  # decoded frames are numpy
            out.append(r.tensors[0])
        return out

    def _summed(self, parts: list[np.ndarray]) -> np.ndarray:
        out = np.array(parts[0], dtype=np.float32)  # owned copy: the frames are read-only
        for p in parts[1:]:
            out += p
        return out

    def attention(self, layer: int, x: np.ndarray, positions: np.ndarray, slots: np.ndarray | None = None) -> np.ndarray:
        """x [T, d] normed, positions [T], slots [T] (None: slot 0) -> summed attention partials [T, d]."""
        if layer == 0:
            self.step += 1
        pos = np.ascontiguousarray(positions, dtype=np.int64)
        sl = np.zeros_like(pos) if slots is None else np.ascontiguousarray(slots, dtype=np.int64)
        xs = np.ascontiguousarray(x, dtype=np.float32)
        return self._summed(self._call(self.attn_workers, lambda req: AttnMsg(req=req, step=self.step, layer=layer, tensors=(xs, pos, sl)),
                                       layer, self.stats.attention))

    def ffn(self, layer: int, x: np.ndarray, resid: np.ndarray | None = None) -> np.ndarray:
        """x [T, d] normed -> the workers' summed partials (resid unused: a predictor reading the
        residual is refused by the workers at load)."""
        xs = np.ascontiguousarray(x, dtype=np.float32)
        return self._summed(self._call(self.ffn_workers, lambda req: FfnMsg(req=req, step=self.step, layer=layer, tensors=(xs,)), layer,
                                       self.stats.ffn))

    def head_logits(self, x: np.ndarray) -> np.ndarray:
        """x [T, d] final-normed -> logits [T, vocab]: each worker's vocabulary rows, concatenated."""
        xs = np.ascontiguousarray(x, dtype=np.float32)
        parts = self._call(self.head_workers, lambda req: LogitsMsg(req=req, step=self.step, layer=self.n_layers, tensors=(xs,)),
                           self.n_layers, self.stats.head)
        return np.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]

    def describe(self) -> Description:
        pids = self.pids
        where = pinning_text(self.placements)
        heads = ", ".join(f"w{i}: kv {h.kv_start}-{h.kv_stop - 1}" if h else f"w{i}: -" for i, h in enumerate(self.plan.heads))
        return Description(kind="torch shards in worker processes over ZeroMQ", pids=tuple(pids),
                           placement=(f"placement  {len(pids)} CPU worker processes ({where}); coordinator: embeddings, norms, sampling",
                                      f"shards     attention {heads}; FFN and output head split evenly"),
                           figures=self.stats.figures(), numbers=self.stats.numbers())

    def reset_stats(self) -> None:
        self.stats.reset()

    def check_health(self) -> None:
        """Raise WorkerDiedError if a worker exited or missed its heartbeats (between requests)."""
        self.pool.check_health()

    def restart(self) -> None:
        self.pool.restart()

    def close(self) -> None:
        self.pool.close()
