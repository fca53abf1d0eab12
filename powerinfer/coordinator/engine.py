"""The coordinator's model loop: embeddings, norms, residuals, output head, and the token cache.

Runs in: the coordinator process.

The engine owns everything that is per-token and small (embedding rows, RMSNorm weights, the
residual stream [T, d]) plus the output head; everything per-shard (attention heads with their
KV cache, FFN neurons) goes through an :class:`Executor`. ``tokens`` mirrors what the KV cache
holds, so a new prompt that shares a prefix with the previous one only computes the rest.
"""

from __future__ import annotations

import logging
from typing import Sequence

import numpy as np

from powerinfer.config import ModelConfig, check_context
from powerinfer.coordinator.executor import Executor
from powerinfer.errors import ContextOverflowError, InvalidArgumentError
from powerinfer.gguf_file import GGUFFile
from powerinfer.model.layer_loop import load_layer_norms, norm, run_layers
from powerinfer.model.weights import embed_rows, load_vector

log = logging.getLogger(__name__)

REFINE = 32  # logits per position recomputed in float32 (see Engine.logits_of)
REFINE_MARGIN = 1.0  # decode: refine every logit within this of the best (head error is ~0.1)


def softcap(logits: np.ndarray, cap: float) -> np.ndarray:
    return np.tanh(logits / np.float32(cap)) * np.float32(cap) if cap else logits


class Engine:
    def __init__(self, f: GGUFFile, cfg: ModelConfig, executor: Executor, n_ctx: int, n_batch: int, n_slots: int = 1) -> None:
        if n_ctx < 1:
            raise InvalidArgumentError(f"context size must be positive, got {n_ctx}")
        if n_batch < 1:
            raise InvalidArgumentError(f"batch size must be positive, got {n_batch}")
        if n_slots < 1:
            raise InvalidArgumentError(f"the number of sequence slots must be positive, got {n_slots}")
        if cfg.learned_pos:  # a learned position table has no rows past it: refused here for every tool, not only the API
            check_context(cfg, n_ctx)
        self.f, self.cfg, self.executor = f, cfg, executor
        self.n_ctx, self.n_batch = n_ctx, n_batch
        d = cfg.d_model
        self.norms = load_layer_norms(f, cfg)
        self.output_norm = load_vector(f, "output_norm.weight", d)
        self.output_norm_b = load_vector(f, "output_norm.bias", d) if cfg.norm == "layer" else None
        # OPT's learned positions, float32 [rows, d] (a few MiB; row pos + cfg.pos_offset is position pos)
        self.pos_embd = load_vector(f, "position_embd.weight").reshape(-1, d) if cfg.learned_pos else None
        # The output head [T, d] -> [T, vocab] is computed by the executor (split across workers);
        # the engine only re-reads a few of its rows to refine the best logits.
        self.head_name = "token_embd.weight" if cfg.tied_embeddings else "output.weight"
        self.slot_tokens: list[list[int]] = [[] for _ in range(n_slots)]

    @property
    def weight_bytes(self) -> int:
        return self.executor.weight_bytes

    @property
    def tokens(self) -> list[int]:
        """Tokens cached in slot 0 (the only slot outside the server)."""
        return self.slot_tokens[0]

    @property
    def n_slots(self) -> int:
        return len(self.slot_tokens)

    def _slot(self, slot: int) -> list[int]:
        if not 0 <= slot < len(self.slot_tokens):
            raise InvalidArgumentError(f"slot {slot} out of range (0..{len(self.slot_tokens) - 1})")
        return self.slot_tokens[slot]

    def rewind(self, n: int, slot: int = 0) -> None:
        """Forget slot's cached tokens past the first n (their KV entries are simply overwritten later)."""
        del self._slot(slot)[n:]

    def rewind_all(self) -> None:
        for toks in self.slot_tokens:
            toks.clear()

    def common_prefix(self, ids: Sequence[int], slot: int = 0) -> int:
        n = 0
        for a, b in zip(self._slot(slot), ids):
            if a != b:
                break
            n += 1
        return n

    def reusable_prefix(self, ids: Sequence[int], slot: int = 0) -> int:
        """How many of ids to keep from slot's cache before evaluating the rest: all that it shares
        with the cache but the last prompt token, whose logits are needed (llama-server's rule, so
        ``cached_tokens`` counts the same).

        On the native executors (the defaults) a one-token pass gives bit-identical logits to the
        same row of a longer pass (tests/coordinator/test_engine.py), so a cached prefix never
        changes what a prompt generates. The torch executors (test oracles) take another attention
        path for one query; there a cached prefix moves the unrefined logits by bf16 rounding.
        """
        return max(0, min(self.common_prefix(ids, slot), len(ids) - 1))

    def _check_ids(self, ids: Sequence[int]) -> np.ndarray:
        if isinstance(ids, list) and len(ids) <= 8:  # a decode step: plain Python beats three numpy calls
            vocab = self.cfg.vocab_size
            for t in ids:
                if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < vocab:
                    raise InvalidArgumentError(f"token id {t!r} is outside the vocabulary (0..{vocab - 1})")
            return np.array(ids, dtype=np.int64)
        arr = np.asarray(ids, dtype=np.int64)
        if arr.ndim != 1:
            raise InvalidArgumentError("token ids must be a flat sequence")
        if arr.size and (arr.min() < 0 or arr.max() >= self.cfg.vocab_size):
            bad = int(arr[(arr < 0) | (arr >= self.cfg.vocab_size)][0])
            raise InvalidArgumentError(f"token id {bad} is outside the vocabulary (0..{self.cfg.vocab_size - 1})")
        return arr

    def _forward(self, ids: np.ndarray, positions: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Run tokens ids [T] at positions [T] of KV slots [T] through every layer -> final hidden [T, d] f32."""
        cfg = self.cfg
        by_ids = getattr(self.executor, "forward_ids", None)
        if by_ids is not None:  # the native pool's ranks embed the tokens themselves
            return by_ids(ids, positions, slots)
        native_embed = getattr(self.executor, "embed", None)  # the native executor dequantizes rows itself
        x = native_embed(ids) if native_embed is not None else embed_rows(self.f, ids)
        if cfg.embed_scale != 1.0:
            x = x * np.float32(cfg.embed_scale)
        if self.pos_embd is not None:
            x = x + self.pos_embd[positions + cfg.pos_offset]
        whole_step = getattr(self.executor, "forward", None)
        if whole_step is not None:  # the native executor runs every layer and the final norm in one call
            return whole_step(x, positions, slots)
        # runs of layers the executor computes whole (a GPU worker's fully offloaded layers: one
        # request each); every other layer goes attention, then FFN, through the executor
        runs = getattr(self.executor, "layer_runs", ())
        layer = 0
        while layer < cfg.n_layers:
            stop = next((b for a, b in runs if a == layer), None)
            if stop is not None:
                x = self.executor.layers(layer, stop, x, positions, slots)  # type: ignore[attr-defined]
            else:
                stop = next((a for a, _ in runs if a > layer), cfg.n_layers)
                x = run_layers(cfg, self.norms, layer, stop, x, positions, slots, self.executor.attention, self.executor.ffn)
            layer = stop
        return norm(x, self.output_norm, self.output_norm_b, cfg.norm_eps)

    def logits_of(self, hidden: np.ndarray, decode: bool = False) -> np.ndarray:
        """hidden [T, d] -> logits float32 [T, vocab].

        The packed head returns bf16-rounded logits (a step of 0.125 around 20), which can flip
        near-ties. The REFINE best candidates of each row (in decode, those within REFINE_MARGIN of
        the best) are recomputed in float32 from their dequantized head rows, so the values that
        decide sampling are exact. Decode rows (one per sequence) are refined one by one, so a
        sequence's logits do not depend on which other sequences share its batch.
        """
        k = min(REFINE, self.cfg.vocab_size)
        native = getattr(self.executor, "decode_logits", None)
        if native is not None and (decode or hidden.shape[0] == 1):  # the same rule, in one native call
            return softcap(native(hidden, REFINE_MARGIN, k), self.cfg.final_logit_softcap)
        logits = np.array(self.executor.logits(hidden), dtype=np.float32)  # owned: refined in place
        if decode or logits.shape[0] == 1:
            for r in range(logits.shape[0]):
                # the candidates near the best are few; a threshold scan is ~10x cheaper than
                # argpartition over the whole vocabulary
                near = np.flatnonzero(logits[r] >= logits[r].max() - REFINE_MARGIN)
                if len(near) > k:
                    near = near[np.argpartition(-logits[r, near], k - 1)[:k]]
                self._refine(logits[r : r + 1], hidden[r : r + 1], near[None, :])
        else:
            self._refine(logits, hidden, np.argpartition(-logits, k - 1, axis=1)[:, :k])  # [T, R]
        return softcap(logits, self.cfg.final_logit_softcap)

    def _refine(self, logits: np.ndarray, hidden: np.ndarray, idx: np.ndarray) -> None:
        """Overwrite logits [T, V] at idx [T, R] with float32 products of hidden [T, d] and those head rows."""
        native_refine = getattr(self.executor, "refine", None)
        if native_refine is not None:
            native_refine(logits, hidden, idx)
            return
        rows, inverse = np.unique(idx, return_inverse=True)  # [U], [T * R]
        w = embed_rows(self.f, rows, self.head_name)  # [U, d]
        exact = hidden @ w.T  # [T, U]
        np.put_along_axis(logits, idx, np.take_along_axis(exact, inverse.reshape(idx.shape), axis=1), axis=1)

    def eval(self, ids: Sequence[int], all_logits: bool = False, slot: int = 0) -> np.ndarray:
        """Append ids to slot's cache; logits float32 [len(ids), vocab] if all_logits else [1, vocab] of the last."""
        arr = self._check_ids(ids)
        tokens = self._slot(slot)
        step = getattr(self.executor, "native_step", None)
        if step is not None and arr.size == 1 and not all_logits and len(tokens) + 1 <= self.n_ctx:
            # a decode step: one native call, and no arrays built here (every array op is a cache
            # miss after a pass over the weights)
            logits = step(arr, (len(tokens),), (slot,), False, REFINE_MARGIN, REFINE)
            tokens.append(int(arr[0]))
            return softcap(logits, self.cfg.final_logit_softcap)
        if arr.size == 0:
            raise InvalidArgumentError("nothing to evaluate: empty token list")
        if len(tokens) + arr.size > self.n_ctx:
            raise ContextOverflowError(
                f"{len(tokens) + arr.size} tokens do not fit the context of {self.n_ctx} (raise -c/--ctx-size)"
            )
        outs: list[np.ndarray] = []
        for i in range(0, arr.size, self.n_batch):
            chunk = arr[i : i + self.n_batch]
            positions = np.arange(len(tokens), len(tokens) + len(chunk), dtype=np.int64)
            if step is not None and not all_logits and i + self.n_batch >= arr.size and len(chunk) <= self.executor.max_tokens:  # type: ignore[attr-defined]
                # the last chunk: embedding, layers and the last row's logits in one native call
                logits = step(chunk, positions, np.full(len(chunk), slot, dtype=np.int64), False, REFINE_MARGIN, REFINE)
                tokens.extend(int(t) for t in chunk)
                return softcap(logits, self.cfg.final_logit_softcap)
            hidden = self._forward(chunk, positions, np.full(len(chunk), slot, dtype=np.int64))
            tokens.extend(int(t) for t in chunk)
            if all_logits:
                outs.append(self.logits_of(hidden))
        if not all_logits:
            outs.append(self.logits_of(hidden[-1:]))
        return np.concatenate(outs) if len(outs) > 1 else outs[0]

    def hidden(self, ids: Sequence[int], slot: int = 0) -> np.ndarray:
        """Append ids to slot's cache -> their final-normed hidden states float32 [len(ids), d]
        (what an embedding pools)."""
        arr = self._check_ids(ids)
        tokens = self._slot(slot)
        if arr.size == 0:
            raise InvalidArgumentError("nothing to evaluate: empty token list")
        if len(tokens) + arr.size > self.n_ctx:
            raise ContextOverflowError(f"{len(tokens) + arr.size} tokens do not fit the context of {self.n_ctx} (raise -c/--ctx-size)")
        outs: list[np.ndarray] = []
        for i in range(0, arr.size, self.n_batch):
            chunk = arr[i : i + self.n_batch]
            positions = np.arange(len(tokens), len(tokens) + len(chunk), dtype=np.int64)
            outs.append(np.array(self._forward(chunk, positions, np.full(len(chunk), slot, dtype=np.int64)), dtype=np.float32))
            tokens.extend(int(t) for t in chunk)
        return np.concatenate(outs) if len(outs) > 1 else outs[0]

    def decode(self, ids: Sequence[int], slots: Sequence[int]) -> np.ndarray:
        """One token for each of several distinct slots, in one forward pass -> logits float32 [B, vocab]."""
        arr = self._check_ids(ids)
        sl = np.asarray(slots, dtype=np.int64)
        if arr.size == 0 or sl.shape != arr.shape:
            raise InvalidArgumentError("decode needs one token per slot")
        if len(set(sl.tolist())) != sl.size:
            raise InvalidArgumentError("decode slots must be distinct")
        lists = [self._slot(int(s)) for s in sl]
        for s, toks in zip(sl, lists):
            if len(toks) + 1 > self.n_ctx:
                raise ContextOverflowError(f"slot {int(s)} is full: {self.n_ctx} tokens (raise -c/--ctx-size)")
        positions = np.array([len(t) for t in lists], dtype=np.int64)
        logits = self._decode_rows(arr, positions, sl)
        for t, toks in zip(arr, lists):
            toks.append(int(t))
        return logits

    def verify(self, ids: Sequence[int], slot: int) -> np.ndarray:
        """Append ids (a sampled token and the tokens drafted after it) to slot's cache in one pass
        -> logits float32 [len(ids), vocab], row i refined as a decode step's: the logits that
        decoding ids[: i + 1] one token at a time would give (speculative decoding's check)."""
        arr = self._check_ids(ids)
        tokens = self._slot(slot)
        if arr.size == 0 or len(tokens) + arr.size > self.n_ctx:
            raise ContextOverflowError(f"{len(tokens) + arr.size} tokens do not fit the context of {self.n_ctx} (raise -c/--ctx-size)")
        positions = np.arange(len(tokens), len(tokens) + arr.size, dtype=np.int64)
        logits = self._decode_rows(arr, positions, np.full(arr.size, slot, dtype=np.int64))
        tokens.extend(int(t) for t in arr)
        return logits

    def _decode_rows(self, arr: np.ndarray, positions: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Every row's logits, each refined by the decode rule (one native call where it fits)."""
        step = getattr(self.executor, "native_step", None)
        if step is not None and arr.size <= self.executor.max_tokens:  # type: ignore[attr-defined]
            return softcap(step(arr, positions, slots, True, REFINE_MARGIN, REFINE), self.cfg.final_logit_softcap)
        return self.logits_of(self._forward(arr, positions, slots), decode=True)
