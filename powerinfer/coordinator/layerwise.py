"""The layer-by-layer executors' common step: embed here, each layer's attention and FFN through
the executor's shards, norms and residuals here, then the head and its refinement.

Runs in: the coordinator process.

``InProcessExecutor`` (torch shards here), ``ProcessExecutor`` (torch shards in worker processes)
and ``HybridExecutor`` (a GPU worker plus shards here) differ only in where a layer's attention and
FFN partials are computed; they subclass :class:`LayerwiseExecutor` and supply ``attention``,
``ffn`` and ``head_logits`` (and ``layers`` for runs of layers they compute whole).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from powerinfer.config import ModelConfig
from powerinfer.coordinator.embedding import Embedding
from powerinfer.coordinator.executor import Batch, Description, no_kv
from powerinfer.coordinator.logits import answer, file_refine
from powerinfer.gguf_file import GGUFFile
from powerinfer.model.layer_loop import load_layer_norms, norm, run_layers
from powerinfer.model.weights import load_vector


class LayerwiseExecutor(ABC):
    # maximal runs [first, stop) of layers the executor computes whole (one request each: a GPU
    # worker's fully offloaded layers, the native decoder's layers); every other layer goes
    # attention, then FFN
    layer_runs: tuple[tuple[int, int], ...] = ()

    def __init__(self, f: GGUFFile, cfg: ModelConfig) -> None:
        d = cfg.d_model
        self.f, self.cfg = f, cfg
        self.embedding = Embedding(f, cfg)
        self.norms = load_layer_norms(f, cfg)
        self.output_norm = load_vector(f, "output_norm.weight", d)
        self.output_norm_b = load_vector(f, "output_norm.bias", d) if cfg.norm == "layer" else None
        # the head [T, d] -> [T, vocab] is computed by the shards; refinement re-reads a few of its rows
        self.refine = file_refine(f, "token_embd.weight" if cfg.tied_embeddings else "output.weight")

    # -- what a subclass supplies --------------------------------------------------------------

    @abstractmethod
    def attention(self, layer: int, x: np.ndarray, positions: np.ndarray, slots: np.ndarray | None = None) -> np.ndarray:
        """x [T, d] f32 normed, positions [T] i64, slots [T] i64 KV-cache slot of each token (None:
        all slot 0) -> attention output [T, d] (before the residual add)."""

    @abstractmethod
    def ffn(self, layer: int, x: np.ndarray, resid: np.ndarray | None = None) -> np.ndarray:
        """x [T, d] f32 normed (resid [T, d]: the residual stream before the norm, for a predictor
        that reads it) -> FFN output [T, d] (before the residual add)."""

    @abstractmethod
    def head_logits(self, x: np.ndarray) -> np.ndarray:
        """x [T, d] f32 final-normed -> packed-head logits [T, vocab] f32 (unrefined)."""

    def layers(self, first: int, stop: int, x: np.ndarray, positions: np.ndarray, slots: np.ndarray | None = None) -> np.ndarray:
        """x [T, d] the residual stream entering layer `first` -> leaving stop - 1 (a run of layer_runs)."""
        raise NotImplementedError(f"{type(self).__name__} computes no runs of whole layers")

    @property
    @abstractmethod
    def weight_bytes(self) -> int: ...

    # -- the Executor interface ----------------------------------------------------------------

    def execute(self, batch: Batch) -> np.ndarray:
        ids, positions, slots = batch.arrays()
        hidden = self.forward(ids, positions, slots)
        return answer(batch.want, hidden, self.cfg.vocab_size, self.head_logits, self.refine)

    def forward(self, ids: np.ndarray, positions: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Tokens ids [T] at positions [T] of KV slots [T] through every layer -> final hidden [T, d] f32."""
        cfg, runs = self.cfg, self.layer_runs
        x = self.embedding(ids, positions)
        layer = 0
        while layer < cfg.n_layers:
            stop = next((b for a, b in runs if a == layer), None)
            if stop is not None:
                x = self.layers(layer, stop, x, positions, slots)
            else:
                stop = next((a for a, _ in runs if a > layer), cfg.n_layers)
                x = run_layers(cfg, self.norms, layer, stop, x, positions, slots, self.attention, self.ffn)
            layer = stop
        return norm(x, self.output_norm, self.output_norm_b, cfg.norm_eps)

    def describe(self) -> Description:
        return Description(kind="torch shards in this process", placement=("placement  everything in this process (in-process executor)",),
                           figures=("per-layer figures: in-process executor (no IPC); see `powerinfer bench` for speed",))

    def reset_stats(self) -> None:
        """No step figures kept (subclasses that keep some override this)."""

    def set_sparse(self, *, dense: bool | None = None, oracle: bool | None = None) -> None:
        """Dense shards only (subclasses with sparse shards override this)."""

    def save_kv(self, slot: int, n: int, path: str, offset: int) -> None:
        no_kv("this executor")

    def load_kv(self, slot: int, n: int, path: str, offset: int) -> None:
        no_kv("this executor")

    def check_health(self) -> None:
        """No worker processes (subclasses with some override this)."""

    def restart(self) -> None:
        """No worker processes (subclasses with some override this)."""

    @abstractmethod
    def close(self) -> None: ...
