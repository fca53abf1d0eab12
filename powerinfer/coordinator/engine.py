"""The coordinator's sequences: which tokens each KV slot holds, and forward steps over them.

Runs in: the coordinator process.

The engine owns what is per sequence: the tokens each KV slot caches (so a new prompt that shares a
prefix with the previous one only computes the rest), a prompt's chunks of at most n_batch tokens,
the context limit, the final logit softcap. Everything else of a step (embedding, layers, head and
its refinement) is the executor's: one ``execute`` call per chunk (coordinator/executor.py).
"""

from __future__ import annotations

import logging
from typing import Sequence

import numpy as np

from powerinfer.config import ModelConfig, check_context
from powerinfer.coordinator.executor import Batch, Executor, Want
from powerinfer.errors import ContextOverflowError, InvalidArgumentError
from powerinfer.gguf_file import GGUFFile

log = logging.getLogger(__name__)


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

    def _run(self, ids: np.ndarray | Sequence[int], positions: np.ndarray | Sequence[int], slots: np.ndarray | Sequence[int],
             want: Want) -> np.ndarray:
        out = self.executor.execute(Batch(ids, positions, slots, want))
        return out if want is Want.HIDDEN or want is Want.CACHE else softcap(out, self.cfg.final_logit_softcap)

    def eval(self, ids: Sequence[int], all_logits: bool = False, slot: int = 0) -> np.ndarray:
        """Append ids to slot's cache; logits float32 [len(ids), vocab] if all_logits else [1, vocab] of the last."""
        arr = self._check_ids(ids)
        tokens = self._slot(slot)
        if arr.size == 1 and not all_logits and len(tokens) + 1 <= self.n_ctx:
            # a decode step: tuples, no arrays built here (every array op is a cache miss after a
            # pass over the weights; the native executors take them as they are)
            logits = self._run(arr, (len(tokens),), (slot,), Want.LAST)
            tokens.append(int(arr[0]))
            return logits
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
            want = Want.ALL if all_logits else Want.LAST if i + self.n_batch >= arr.size else Want.CACHE
            out = self._run(chunk, positions, np.full(len(chunk), slot, dtype=np.int64), want)
            tokens.extend(int(t) for t in chunk)
            if want is not Want.CACHE:
                outs.append(out)
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
            outs.append(np.array(self._run(chunk, positions, np.full(len(chunk), slot, dtype=np.int64), Want.HIDDEN), dtype=np.float32))
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
        logits = self._run(arr, positions, sl, Want.EACH)
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
        logits = self._run(arr, positions, np.full(arr.size, slot, dtype=np.int64), Want.EACH)
        tokens.extend(int(t) for t in arr)
        return logits
