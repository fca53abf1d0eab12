"""Token sampling: penalties, top-k, top-p, min-p, temperature, seeded draws (llama.cpp's order).

Runs in: the coordinator process.

The chain follows llama.cpp's default sampler: repetition/frequency/presence penalties over the
last ``repeat_last_n`` tokens, the request's logit biases, then top-k, top-p, min-p, temperature
and a seeded draw.
``temperature <= 0`` is greedy (argmax after penalties), which is what the reference fixtures use.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from powerinfer.errors import InvalidArgumentError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 40  # <= 0: disabled
    top_p: float = 0.95  # 1.0: disabled
    min_p: float = 0.05  # 0.0: disabled
    repeat_penalty: float = 1.0  # 1.0: disabled
    repeat_last_n: int = 64  # 0: disabled, -1: whole context
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int = -1  # -1: random
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit); -inf bans the token

    def __post_init__(self) -> None:
        def real(v: object) -> bool:
            return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)

        def whole(v: object) -> bool:
            return isinstance(v, (int, np.integer)) and not isinstance(v, bool)

        # types first: a float top_k or a string temperature would otherwise fail inside numpy at the first sample
        for name in ("temperature", "top_p", "min_p", "repeat_penalty", "frequency_penalty", "presence_penalty"):
            if not real(getattr(self, name)):
                raise InvalidArgumentError(f"{name} must be a number, got {getattr(self, name)!r}")
        for name in ("top_k", "repeat_last_n", "seed"):
            if not whole(getattr(self, name)):
                raise InvalidArgumentError(f"{name} must be an integer, got {getattr(self, name)!r}")
        if isinstance(self.logit_bias, Mapping):  # {token id: bias}, as the OpenAI API and llama-cpp-python take it
            object.__setattr__(self, "logit_bias", tuple(self.logit_bias.items()))
        try:
            pairs = tuple((t, b) for t, b in self.logit_bias)
        except (TypeError, ValueError):
            raise InvalidArgumentError("logit_bias takes (token id, bias) pairs or a {token id: bias} mapping") from None
        if any(not whole(t) or not real(b) for t, b in pairs):
            raise InvalidArgumentError("logit_bias takes integer token ids and numeric biases")
        object.__setattr__(self, "logit_bias", pairs)
        checks = [
            (math.isfinite(self.temperature) and self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            (math.isfinite(self.repeat_penalty) and self.repeat_penalty > 0, f"repeat_penalty must be > 0, got {self.repeat_penalty}"),
            (self.repeat_last_n >= -1, f"repeat_last_n must be >= -1, got {self.repeat_last_n}"),
            (math.isfinite(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (math.isfinite(self.presence_penalty) and -2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (self.seed >= -1, f"seed must be >= -1, got {self.seed}"),
            (all(t >= 0 and not math.isnan(b) and b != math.inf for t, b in self.logit_bias),
             "logit_bias takes token ids >= 0 and finite biases (or -inf to ban)"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidArgumentError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


class Sampler:
    """Stateful only in its random generator, so a seeded request is reproducible."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        seed = params.seed if params.seed >= 0 else random.SystemRandom().randrange(2**32)
        self.rng = np.random.default_rng(seed)

    def apply_penalties(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        p = self.params
        if p.repeat_last_n == 0 or (p.repeat_penalty == 1.0 and p.frequency_penalty == 0 and p.presence_penalty == 0):
            return logits
        window = history if p.repeat_last_n == -1 else history[-p.repeat_last_n :]
        if not window:
            return logits
        counts = Counter(window)
        ids = np.fromiter(counts.keys(), dtype=np.int64)
        n = np.fromiter(counts.values(), dtype=np.float32)
        out = logits.copy()
        sel = out[ids]
        # llama.cpp: divide positive logits, multiply negative ones, then OpenAI-style penalties.
        sel = np.where(sel > 0, sel / p.repeat_penalty, sel * p.repeat_penalty)
        out[ids] = sel - n * p.frequency_penalty - p.presence_penalty
        return out

    def allows_any(self, logits: np.ndarray) -> bool:
        """Whether some token keeps a finite logit once the request's bans apply (a grammar's mask
        and a logit_bias ban together can leave none)."""
        ok = np.isfinite(logits)
        for t, b in self.params.logit_bias:
            if b == -math.inf and t < ok.size:
                ok[t] = False
        return bool(ok.any())

    def __call__(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        """logits float32 [vocab] -> chosen token id."""
        p = self.params
        logits = self.apply_penalties(np.asarray(logits, dtype=np.float32), history)
        if p.logit_bias:
            logits = logits.copy()  # never the caller's array
            for t, b in p.logit_bias:
                if t < logits.size:
                    logits[t] += np.float32(b)
        if p.greedy:
            return int(np.argmax(logits))
        # Candidates sorted by logit, descending, and their probabilities. Only the top of the
        # vocabulary that a rule can keep is sorted: a full sort of Gemma-3's 262k logits took
        # ~47 ms a token, top-k by argpartition ~5 ms, against a decode step of ~10 ms.
        k = p.top_k if 0 < p.top_k < logits.size else logits.size
        if k < logits.size:
            idx = top_indices(logits, k)
            cand = logits[idx].astype(np.float64)
            probs = np.exp(cand - cand[0])
            probs /= probs.sum()
        elif p.top_p < 1.0 or p.min_p > 0.0:
            full = np.exp(logits.astype(np.float64) - float(logits.max()))  # probabilities over the vocabulary, unnormalised
            idx = head_indices(logits, full, p.top_p, p.min_p)
            cand = logits[idx].astype(np.float64)
            probs = full[idx] / full.sum()
        else:  # nothing truncates: every token, in vocabulary order
            idx = np.arange(logits.size)
            cand = logits.astype(np.float64)
            probs = None
        keep = idx.size
        if probs is not None and p.top_p < 1.0:
            # smallest prefix whose mass reaches top_p (at least one token)
            keep = min(keep, int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1)
        if probs is not None and p.min_p > 0.0:
            keep = min(keep, max(1, int(np.count_nonzero(probs >= p.min_p * probs[0]))))
        idx, cand = idx[:keep], cand[:keep]
        scaled = (cand - cand.max()) / p.temperature
        w = np.exp(scaled)
        w /= w.sum()
        return int(idx[self.rng.choice(keep, p=w)])


BLOCK = 256  # logits per block when bounding the top k by block maxima


def top_indices(logits: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest logits, largest first (ties: lower index first; k >= 1). The k-th largest of the block maxima is
    a lower bound of the k-th largest logit (k blocks reach it), so only the logits at or above it
    (a few k) are partitioned, not the whole vocabulary."""
    nb = logits.size // BLOCK
    if nb >= k:
        bound = np.partition(logits[: nb * BLOCK].reshape(nb, BLOCK).max(axis=1), nb - k)[nb - k]
        sub = np.flatnonzero(logits >= bound)
        idx = sub[np.argpartition(-logits[sub], k - 1)[:k]] if sub.size > k else sub
    else:
        idx = np.argpartition(-logits, k - 1)[:k]
    idx = np.sort(idx)  # argpartition leaves ties in any order: index order first, then a stable sort by value
    return idx[np.argsort(-logits[idx], kind="stable")]


def head_indices(logits: np.ndarray, full: np.ndarray, top_p: float, min_p: float) -> np.ndarray:
    """The top of the vocabulary, sorted, that holds every token top_p or min_p can keep: those
    within log(1/min_p) of the best (min_p > 0), else the smallest band below the best whose
    mass reaches top_p. full: exp(logits - max) over the vocabulary."""
    best = float(logits.max())
    if min_p > 0.0:
        mask = logits >= best + math.log(min_p) - 1e-6  # a hair wide: the exact rule runs on these
    else:
        total, mask = float(full.sum()), None
        for band in (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0):
            m = logits >= best - band
            if float(full[m].sum()) >= top_p * total * (1.0 + 1e-9):
                mask = m
                break
        if mask is None:  # the mass is spread wider than any band: the whole vocabulary
            mask = np.ones(logits.size, dtype=bool)
    sub = np.flatnonzero(mask)
    return sub[np.argsort(-logits[sub], kind="stable")]
