"""The in-process executor: every shard of every layer in this process, on torch. The test oracle.

Runs in: the coordinator process.

Each layer's attention heads, FFN neurons and the head's vocabulary rows are split into shards as
worker processes would hold them (``n_shards``), and run one after another here; the step around
them (embedding, norms, residuals, head refinement) is layerwise.py's. Slower than the native
executors, it is what they are held to, and what the profiling and calibration tools extend.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from powerinfer.config import ModelConfig
from powerinfer.coordinator.executor import Description
from powerinfer.coordinator.layerwise import LayerwiseExecutor
from powerinfer.cpu_workers.kv_file import Holder, KvGeometry, load_caches, save_caches
from powerinfer.cpu_workers.sparse_ffn import SparseFFNShard
from powerinfer.gguf_file import GGUFFile
from powerinfer.model.sharding import ShardPlan, plan_shards

if TYPE_CHECKING:
    from powerinfer.predictors.predictor_file import PredictorFile

log = logging.getLogger(__name__)


class InProcessExecutor(LayerwiseExecutor):
    """All shards of all layers in this process; `n_shards` > 1 splits layers exactly as workers would."""

    def __init__(self, f: GGUFFile, cfg: ModelConfig, n_ctx: int, n_shards: int = 1, progress: bool = False,
                 predictor: "PredictorFile | None" = None, n_slots: int = 1) -> None:
        from powerinfer.cpu_workers.shards import AttentionShard, FFNShard, HeadShard
        from powerinfer.model.ops import RopeTable

        super().__init__(f, cfg)
        self.plan: ShardPlan = plan_shards(cfg, n_shards)
        self.kv_geometry = KvGeometry(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, cfg.v_head_dim)
        ropes: dict[tuple[float, float], RopeTable] = {}
        self.attn: list[list[AttentionShard]] = []
        self.ffns: list[list[FFNShard | SparseFFNShard]] = []
        t0 = time.perf_counter()
        layers = range(cfg.n_layers)
        if progress:
            from tqdm import tqdm  # type: ignore[import-untyped]

            layers = tqdm(layers, desc="loading layers", unit="layer", leave=False)
        for layer in layers:
            self.attn.append([AttentionShard(f, cfg, layer, h, n_ctx, ropes, n_slots) for h in self.plan.heads if h is not None])
            if predictor is None:
                self.ffns.append([FFNShard(f, cfg, layer, n) for n in self.plan.neurons if len(n)])
            else:
                lp = predictor.layers[layer]
                self.ffns.append([SparseFFNShard(f, cfg, layer, n, lp, predictor.mode, reads_residual=predictor.reads_residual)
                                  for n in self.plan.neurons if len(n)])
        self.heads = [HeadShard(f, cfg, a, b) for a, b in self.plan.vocab if b > a]
        log.debug("built %d layers x %d shards in %.2fs", cfg.n_layers, n_shards, time.perf_counter() - t0)

    @property
    def weight_bytes(self) -> int:
        shards = [s for layer in self.attn for s in layer] + [s for layer in self.ffns for s in layer] + self.heads
        return sum(s.nbytes for s in shards)

    def attention(self, layer: int, x: np.ndarray, positions: np.ndarray, slots: np.ndarray | None = None) -> np.ndarray:
        import torch

        xt, pt = torch.from_numpy(x), torch.from_numpy(positions)
        st = None if slots is None else torch.from_numpy(slots)
        shards = self.attn[layer]
        out = shards[0].forward(xt, pt, st)
        for shard in shards[1:]:
            out = out + shard.forward(xt, pt, st)
        return out.numpy()

    def ffn(self, layer: int, x: np.ndarray, resid: np.ndarray | None = None) -> np.ndarray:
        import torch

        xt = torch.from_numpy(x)
        rt = None if resid is None else torch.from_numpy(resid)
        shards = self.ffns[layer]
        out = shards[0].forward(xt, rt)
        for shard in shards[1:]:
            out = out + shard.forward(xt, rt)
        return out.numpy()

    def head_logits(self, x: np.ndarray) -> np.ndarray:
        import torch

        xt = torch.from_numpy(x)
        parts = [h.forward(xt).numpy() for h in self.heads]
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)

    def save_kv(self, slot: int, n: int, path: str, offset: int) -> None:
        """slot's first n positions of every shard's KV cache into path (its header written)."""
        save_caches(path, offset, self.kv_geometry, slot, n, self._kv_holders())

    def load_kv(self, slot: int, n: int, path: str, offset: int) -> None:
        load_caches(path, offset, self.kv_geometry, slot, n, self._kv_holders())

    def _kv_holders(self) -> list[Holder]:
        return [(layer, s.heads.kv_start, s.k_cache, s.v_cache) for layer, shards in enumerate(self.attn) for s in shards]

    def set_sparse(self, *, dense: bool | None = None, oracle: bool | None = None) -> None:
        """Switch sparse FFN shards to dense (exact) or oracle (true active set) computation."""
        for layer in self.ffns:
            for shard in layer:
                if isinstance(shard, SparseFFNShard):
                    shard.set_mode(dense, oracle)

    def decode_share(self) -> float:
        """Average share of FFN neurons computed per decode step since reset_stats (1.0 when dense)."""
        shards = [s for layer in self.ffns for s in layer if isinstance(s, SparseFFNShard)]
        calls = sum(s.decode_calls for s in shards)
        if not calls:
            return 1.0
        return sum(s.decode_active for s in shards) / calls

    def reset_stats(self) -> None:
        for layer in self.ffns:
            for s in layer:
                if isinstance(s, SparseFFNShard):
                    s.decode_calls, s.decode_active = 0, 0.0

    def describe(self) -> Description:
        base = super().describe()
        sparse = any(isinstance(s, SparseFFNShard) for layer in self.ffns for s in layer)
        # kv layout "torch": keys with the rotary rows permuted as the torch shards keep them
        return replace(base, computed_share=self.decode_share() if sparse else None, kv_layout="torch")

    def close(self) -> None:
        self.attn.clear()
        self.ffns.clear()
        self.heads.clear()
