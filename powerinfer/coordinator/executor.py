"""Executors: who runs each layer's shards. The in-process one is the test oracle.

Runs in: the coordinator process.

An executor receives one layer's normed activations and returns the summed partial outputs of
every shard of that layer. The in-process executor holds all shards itself and runs them one
after another; the multiprocess executor (same interface) sends them to worker processes. Keeping
the interface this narrow is what lets every test run without processes or sockets.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

import torch

from powerinfer.config import ModelConfig
from powerinfer.cpu_workers.shards import AttentionShard, FFNShard
from powerinfer.gguf_file import GGUFFile
from powerinfer.model.ops import RopeTable
from powerinfer.model.sharding import ShardPlan, plan_shards

log = logging.getLogger(__name__)


class Executor(Protocol):
    plan: ShardPlan

    def attention(self, layer: int, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, d] normed -> attention output [T, d] (before the residual add)."""
        ...

    def ffn(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """x [T, d] normed -> FFN output [T, d] (before the residual add)."""
        ...

    @property
    def weight_bytes(self) -> int: ...

    def close(self) -> None: ...


class InProcessExecutor:
    """All shards of all layers in this process; `n_shards` > 1 splits layers exactly as workers would."""

    def __init__(self, f: GGUFFile, cfg: ModelConfig, n_ctx: int, n_shards: int = 1, progress: bool = False) -> None:
        self.plan = plan_shards(cfg, n_shards)
        ropes: dict[tuple[float, float], RopeTable] = {}
        self.attn: list[list[AttentionShard]] = []
        self.ffns: list[list[FFNShard]] = []
        t0 = time.perf_counter()
        layers = range(cfg.n_layers)
        if progress:
            from tqdm import tqdm

            layers = tqdm(layers, desc="loading layers", unit="layer", leave=False)
        for layer in layers:
            self.attn.append([AttentionShard(f, cfg, layer, h, n_ctx, ropes) for h in self.plan.heads if h is not None])
            self.ffns.append([FFNShard(f, cfg, layer, n) for n in self.plan.neurons if len(n)])
        log.debug("built %d layers x %d shards in %.2fs", cfg.n_layers, n_shards, time.perf_counter() - t0)

    @property
    def weight_bytes(self) -> int:
        return sum(s.nbytes for layer in self.attn for s in layer) + sum(s.nbytes for layer in self.ffns for s in layer)

    def attention(self, layer: int, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        shards = self.attn[layer]
        out = shards[0].forward(x, positions)
        for shard in shards[1:]:
            out = out + shard.forward(x, positions)
        return out

    def ffn(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        shards = self.ffns[layer]
        out = shards[0].forward(x)
        for shard in shards[1:]:
            out = out + shard.forward(x)
        return out

    def close(self) -> None:
        self.attn.clear()
        self.ffns.clear()
