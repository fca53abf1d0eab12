"""The native executor: every layer of a forward pass in one call into the native decoder.

Runs in: the coordinator process (the in-process executor's fast path; numpy and ctypes only).

Where the in-process executor makes ~40 torch calls per layer and the engine adds norms and
residuals between them in numpy, this one hands the whole step (embeddings in, final-normed
hidden state out) to kernels/decoder.c, and the output head to the same dot products. It has no
shards and no predictor: sparse FFNs and the GPU stay on the torch executors, which remain the
oracle the tests hold this one to.
"""

from __future__ import annotations

import ctypes
from typing import Sequence

import numpy as np

from powerinfer.config import ModelConfig
from powerinfer.cpu_workers.native_model import NativeDecoder
from powerinfer.gguf_file import GGUFFile
from powerinfer.model.sharding import ShardPlan, plan_shards


class NativeExecutor:
    """Whole forward passes in native code (see :meth:`forward`); ``logits`` runs the head."""

    def __init__(self, lib: ctypes.CDLL, f: GGUFFile, cfg: ModelConfig, n_ctx: int, n_threads: int, n_slots: int = 1,
                 max_tokens: int = 512) -> None:
        self.plan: ShardPlan = plan_shards(cfg, 1)
        self.n_threads = n_threads
        self.decoder = NativeDecoder(lib, f, cfg, n_ctx, n_slots, n_threads, max_tokens)

    @property
    def weight_bytes(self) -> int:
        return self.decoder.weight_bytes

    def forward(self, x: np.ndarray, positions: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """x [T, d] f32 scaled embeddings (updated in place), positions [T], slots [T] -> final-normed hidden [T, d] f32."""
        return self.decoder.forward(x, positions, slots)

    def logits(self, x: np.ndarray) -> np.ndarray:
        """x [T, d] f32 final-normed -> logits [T, vocab] f32."""
        return self.decoder.logits(x)

    def decode_logits(self, x: np.ndarray, margin: float, k: int) -> np.ndarray:
        """x [T, d] -> logits [T, vocab] f32 with each row's best candidates refined in float32."""
        return self.decoder.decode_logits(x, margin, k)

    def native_step(self, ids: Sequence[int], positions: Sequence[int], slots: Sequence[int], each: bool, margin: float, k: int) -> np.ndarray:
        """Embedding, every layer and the decode logits (last row, or each row) in one call."""
        return self.decoder.step(ids, positions, slots, each, margin, k)

    @property
    def max_tokens(self) -> int:
        return self.decoder.max_t

    def embed(self, ids: np.ndarray) -> np.ndarray:
        """Token ids [T] -> embedding rows [T, d] f32 (unscaled), dequantized natively."""
        return self.decoder.embed(ids)

    def refine(self, logits: np.ndarray, hidden: np.ndarray, idx: np.ndarray) -> None:
        """Recompute logits [T, V] at idx [T, R] in float32 from hidden [T, d] (in place)."""
        self.decoder.refine(logits, hidden, idx)

    def close(self) -> None:
        self.decoder.k_cache.clear()
        self.decoder.v_cache.clear()
