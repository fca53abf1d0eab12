"""The native executor: every layer of a forward pass in one call into the native decoder.

Runs in: the coordinator process (the in-process executor's fast path; numpy and ctypes only).

Where the in-process executor makes ~40 torch calls per layer and the engine adds norms and
residuals between them in numpy, this one hands the whole step (embeddings in, final-normed
hidden state out) to kernels/decoder.c, and the output head to the same dot products. With a
predictor file its FFNs run sparsely inside the same call (native/sparse_layers.py). It has
no shards: several shards and the GPU stay on the torch executors, which remain the oracle the
tests hold this one to.
"""

from __future__ import annotations

import ctypes

import numpy as np

from powerinfer.config import ModelConfig
from powerinfer.coordinator.embedding import Embedding
from powerinfer.coordinator.executor import Batch, Description, Ints, Want
from powerinfer.coordinator.logits import REFINE, REFINE_MARGIN, answer
from powerinfer.cpu_workers.kv_file import Holder, KvGeometry, load_caches, save_caches
from powerinfer.native.decoder import NativeDecoder
from powerinfer.native.sparse_layers import NativeSparseFFNs
from powerinfer.gguf_file import GGUFFile
from powerinfer.model.sharding import ShardPlan, plan_shards
from powerinfer.predictors.predictor_file import PredictorFile


class NativeExecutor:
    """Whole forward passes in native code (see :meth:`execute`)."""

    def __init__(self, lib: ctypes.CDLL, f: GGUFFile, cfg: ModelConfig, n_ctx: int, n_threads: int, n_slots: int = 1,
                 max_tokens: int = 512, predictor: PredictorFile | None = None) -> None:
        self.plan: ShardPlan = plan_shards(cfg, 1)
        self.n_threads = n_threads
        self.sparse = NativeSparseFFNs(lib, f, cfg, predictor) if predictor is not None else None
        self.decoder = NativeDecoder(lib, f, cfg, n_ctx, n_slots, n_threads, max_tokens, sparse=self.sparse)
        self.embedding = Embedding(f, cfg, self.decoder.embed)  # rows dequantized natively
        self.vocab = cfg.vocab_size
        self._tokens = 0  # tokens through the layers since the sparse counters were reset

    def execute(self, batch: Batch) -> np.ndarray:
        """A decode step or a last chunk that fits: embedding, every layer and the refined logits in
        one native call (no arrays built here: after a pass over the weights each is a cache miss);
        else the final hidden states, then the head by the shared rule (coordinator/logits.py)."""
        want = batch.want
        if (want is Want.LAST or want is Want.EACH) and len(batch) <= self.max_tokens:
            return self.native_step(batch.ids, batch.positions, batch.slots, want is Want.EACH, REFINE_MARGIN, REFINE)
        ids, positions, slots = batch.arrays()
        hidden = self.forward(self.embedding(ids, positions), positions, slots)
        return answer(want, hidden, self.vocab, self.decoder.logits, self.decoder.refine, self.decoder.decode_logits)

    def describe(self) -> Description:
        return Description(kind="the native decoder in this process", placement=("placement  everything in this process (in-process executor)",),
                           figures=("per-layer figures: in-process executor (no IPC); see `powerinfer bench` for speed",),
                           computed_share=self.decode_share() if self.sparse is not None else None, steps_match_decode=True,
                           kv_layout=self.kv_layout)

    def reset_stats(self) -> None:
        self.reset_sparse_counts()

    def check_health(self) -> None:
        """No worker processes."""

    def restart(self) -> None:
        """No worker processes."""

    def set_sparse(self, *, dense: bool | None = None, oracle: bool | None = None) -> None:
        """Sparse FFNs: every neuron (dense=True), the true active set (oracle=True), or the file's rule."""
        if self.sparse is not None:
            self.sparse.set_flags(dense, oracle)

    def decode_share(self) -> float:
        """Share of FFN neurons computed per token so far (the rule is per token: prefill and decode
        alike); 1.0 when dense."""
        if self.sparse is None or not self._tokens:
            return 1.0
        return self.sparse.share(self._tokens)

    def sparse_bytes(self) -> tuple[float, float]:
        """(FFN weight bytes read per token so far, the dense FFNs' bytes): see NativeSparseFFNs."""
        if self.sparse is None or not self._tokens:
            raise ValueError("no sparse FFN tokens counted yet")
        return self.sparse.bytes_per_token(self._tokens)

    def reset_sparse_counts(self) -> None:
        if self.sparse is not None:
            self.sparse.active[:] = 0
            self.sparse.computed[:] = 0
            self.sparse.quality[:] = 0
            self.sparse.pred_s[:] = 0.0
        self._tokens = 0

    @property
    def weight_bytes(self) -> int:
        return self.decoder.weight_bytes

    kv_layout = "native"  # the KV cache as the native decoder keeps it (cpu_workers/kv_file.py)

    def save_kv(self, slot: int, n: int, path: str, offset: int) -> None:
        """slot's first n positions of every layer's KV cache into path (its header written)."""
        save_caches(path, offset, self._kv_geometry, slot, n, self._kv_holders())

    def load_kv(self, slot: int, n: int, path: str, offset: int) -> None:
        load_caches(path, offset, self._kv_geometry, slot, n, self._kv_holders())

    def _kv_holders(self) -> list[Holder]:
        return [(layer, 0, k, v) for layer, (k, v) in enumerate(zip(self.decoder.k_cache, self.decoder.v_cache))]

    @property
    def _kv_geometry(self) -> KvGeometry:
        cfg = self.decoder.cfg
        return KvGeometry(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, cfg.v_head_dim)

    def forward(self, x: np.ndarray, positions: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """x [T, d] f32 scaled embeddings (updated in place), positions [T], slots [T] -> final-normed hidden [T, d] f32."""
        self._tokens += x.shape[0]
        return self.decoder.forward(x, positions, slots)

    def native_step(self, ids: Ints, positions: Ints, slots: Ints, each: bool, margin: float, k: int) -> np.ndarray:
        """Embedding, every layer and the decode logits (last row, or each row) in one call."""
        self._tokens += len(ids)
        return self.decoder.step(ids, positions, slots, each, margin, k)

    @property
    def max_tokens(self) -> int:
        return self.decoder.max_t

    def close(self) -> None:
        self.decoder.k_cache.clear()
        self.decoder.v_cache.clear()
