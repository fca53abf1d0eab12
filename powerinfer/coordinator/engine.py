"""The coordinator's model loop: embeddings, norms, residuals, output head, and the token cache.

Runs in: the coordinator process.

The engine owns everything that is per-token and small (embedding rows, RMSNorm weights, the
residual stream [T, d]) plus the output head; everything per-shard (attention heads with their
KV cache, FFN neurons) goes through an :class:`Executor`. ``tokens`` mirrors what the KV cache
holds, so a new prompt that shares a prefix with the previous one only computes the rest.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from powerinfer.config import ModelConfig
from powerinfer.coordinator.executor import Executor
from powerinfer.errors import ContextOverflowError, InvalidArgumentError
from powerinfer.gguf_file import GGUFFile
from powerinfer.model.weights import embed_rows, layer_tensor, load_vector

log = logging.getLogger(__name__)

REFINE = 32  # logits per position recomputed in float32 (see Engine.logits_of)
REFINE_MARGIN = 1.0  # decode: refine every logit within this of the best (head error is ~0.1)


@dataclass
class LayerNorms:
    attn: np.ndarray
    ffn: np.ndarray
    post_attn: np.ndarray | None
    post_ffn: np.ndarray | None


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x [T, n] normalised over n, times weight [n] (Gemma's +1 is baked into the file)."""
    ms = np.einsum("ij,ij->i", x, x)[:, None] / np.float32(x.shape[1])
    return x * (1.0 / np.sqrt(ms + np.float32(eps))).astype(np.float32) * weight


def softcap(logits: np.ndarray, cap: float) -> np.ndarray:
    return np.tanh(logits / np.float32(cap)) * np.float32(cap) if cap else logits


class Engine:
    def __init__(self, f: GGUFFile, cfg: ModelConfig, executor: Executor, n_ctx: int, n_batch: int) -> None:
        if n_ctx < 1:
            raise InvalidArgumentError(f"context size must be positive, got {n_ctx}")
        if n_batch < 1:
            raise InvalidArgumentError(f"batch size must be positive, got {n_batch}")
        self.f, self.cfg, self.executor = f, cfg, executor
        self.n_ctx, self.n_batch = n_ctx, n_batch
        d = cfg.d_model
        self.norms = [
            LayerNorms(
                attn=load_vector(f, layer_tensor(i, "attn_norm"), d),
                ffn=load_vector(f, layer_tensor(i, "ffn_norm"), d),
                post_attn=load_vector(f, layer_tensor(i, "post_attention_norm"), d) if cfg.post_norms else None,
                post_ffn=load_vector(f, layer_tensor(i, "post_ffw_norm"), d) if cfg.post_norms else None,
            )
            for i in range(cfg.n_layers)
        ]
        self.output_norm = load_vector(f, "output_norm.weight", d)
        # The output head [T, d] -> [T, vocab] is computed by the executor (split across workers);
        # the engine only re-reads a few of its rows to refine the best logits.
        self.head_name = "token_embd.weight" if cfg.tied_embeddings else "output.weight"
        self.tokens: list[int] = []

    @property
    def weight_bytes(self) -> int:
        return self.executor.weight_bytes

    def rewind(self, n: int) -> None:
        """Forget cached tokens past the first n (their KV entries are simply overwritten later)."""
        del self.tokens[n:]

    def common_prefix(self, ids: Sequence[int]) -> int:
        n = 0
        for a, b in zip(self.tokens, ids):
            if a != b:
                break
            n += 1
        return n

    def _check_ids(self, ids: Sequence[int]) -> np.ndarray:
        arr = np.asarray(ids, dtype=np.int64)
        if arr.ndim != 1:
            raise InvalidArgumentError("token ids must be a flat sequence")
        if arr.size and (arr.min() < 0 or arr.max() >= self.cfg.vocab_size):
            bad = int(arr[(arr < 0) | (arr >= self.cfg.vocab_size)][0])
            raise InvalidArgumentError(f"token id {bad} is outside the vocabulary (0..{self.cfg.vocab_size - 1})")
        return arr

    def _forward(self, ids: np.ndarray, start: int) -> np.ndarray:
        """Run tokens ids [T] at positions start.. through every layer -> final hidden [T, d] f32."""
        cfg = self.cfg
        positions = np.arange(start, start + len(ids), dtype=np.int64)
        x = embed_rows(self.f, ids)
        if cfg.embed_scale != 1.0:
            x = x * np.float32(cfg.embed_scale)
        for layer, norms in enumerate(self.norms):
            h = self.executor.attention(layer, rms_norm(x, norms.attn, cfg.norm_eps), positions)
            if norms.post_attn is not None:
                h = rms_norm(h, norms.post_attn, cfg.norm_eps)
            x = x + h
            h = self.executor.ffn(layer, rms_norm(x, norms.ffn, cfg.norm_eps))
            if norms.post_ffn is not None:
                h = rms_norm(h, norms.post_ffn, cfg.norm_eps)
            x = x + h
        return rms_norm(x, self.output_norm, cfg.norm_eps)

    def logits_of(self, hidden: np.ndarray) -> np.ndarray:
        """hidden [T, d] -> logits float32 [T, vocab].

        The packed head returns bf16-rounded logits (a step of 0.125 around 20), which can flip
        near-ties. The REFINE best candidates of each row (in decode, those within REFINE_MARGIN of
        the best) are recomputed in float32 from their dequantized head rows, so the values that
        decide sampling are exact.
        """
        logits = np.array(self.executor.logits(hidden), dtype=np.float32)  # owned: refined in place
        k = min(REFINE, logits.shape[1])
        if logits.shape[0] == 1:
            # decode: the candidates near the best are few; a threshold scan is ~10x cheaper than
            # argpartition over the whole vocabulary
            near = np.flatnonzero(logits[0] >= logits[0].max() - REFINE_MARGIN)
            if len(near) > k:
                near = near[np.argpartition(-logits[0, near], k - 1)[:k]]
            idx = near[None, :]
        else:
            idx = np.argpartition(-logits, k - 1, axis=1)[:, :k]  # [T, R]
        rows, inverse = np.unique(idx, return_inverse=True)  # [U], [T * R]
        w = embed_rows(self.f, rows, self.head_name)  # [U, d]
        exact = hidden @ w.T  # [T, U]
        np.put_along_axis(logits, idx, np.take_along_axis(exact, inverse.reshape(idx.shape), axis=1), axis=1)
        return softcap(logits, self.cfg.final_logit_softcap)

    def eval(self, ids: Sequence[int], all_logits: bool = False) -> np.ndarray:
        """Append ids to the cache; logits float32 [len(ids), vocab] if all_logits else [1, vocab] of the last."""
        arr = self._check_ids(ids)
        if arr.size == 0:
            raise InvalidArgumentError("nothing to evaluate: empty token list")
        if len(self.tokens) + arr.size > self.n_ctx:
            raise ContextOverflowError(
                f"{len(self.tokens) + arr.size} tokens do not fit the context of {self.n_ctx} (raise -c/--ctx-size)"
            )
        outs: list[np.ndarray] = []
        for i in range(0, arr.size, self.n_batch):
            chunk = arr[i : i + self.n_batch]
            hidden = self._forward(chunk, len(self.tokens))
            self.tokens.extend(int(t) for t in chunk)
            if all_logits:
                outs.append(self.logits_of(hidden))
        if not all_logits:
            outs.append(self.logits_of(hidden[-1:]))
        return np.concatenate(outs) if len(outs) > 1 else outs[0]
