"""How one layer is split across workers: kv-head ranges for attention, neuron ranges for the FFN.

Runs in: the coordinator (to plan) and workers (to know their share).

A worker's attention share is a range of kv heads together with the query heads that read them
(grouped-query attention keeps a group on one worker, so no kv head is stored twice). Its FFN
share is a set of neurons; ranges are cut on multiples of 32 so that the down projection's
columns split on quantization-group boundaries. Its output-head share is a range of vocabulary
rows, so the biggest matmul of a decode step is split too.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from powerinfer.config import ModelConfig
from powerinfer.errors import InvalidArgumentError

NEURON_ALIGN = 32


@dataclass(frozen=True)
class HeadRange:
    kv_start: int
    kv_stop: int
    group: int  # query heads per kv head

    @property
    def n_kv(self) -> int:
        return self.kv_stop - self.kv_start

    @property
    def q_start(self) -> int:
        return self.kv_start * self.group

    @property
    def q_stop(self) -> int:
        return self.kv_stop * self.group


@dataclass(frozen=True)
class ShardPlan:
    """Per worker: its kv-head range (None when it serves no attention) and FFN neuron indices."""

    heads: tuple[HeadRange | None, ...]
    neurons: tuple[np.ndarray, ...]  # sorted int64 indices into [0, n_ff)
    vocab: tuple[tuple[int, int], ...]  # output-head rows [start, stop) per worker

    @property
    def n_workers(self) -> int:
        return len(self.neurons)


def _split(n: int, parts: int, align: int = 1) -> list[tuple[int, int]]:
    """Split [0, n) into `parts` contiguous ranges as even as `align` allows (some may be empty)."""
    units = -(-n // align)
    bounds = [min(n, (units * i // parts) * align) for i in range(parts + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(parts)]


def plan_shards(cfg: ModelConfig, n_workers: int) -> ShardPlan:
    if n_workers < 1:
        raise InvalidArgumentError(f"need at least one worker, got {n_workers}")
    head_parts = min(n_workers, cfg.n_kv_heads)
    heads: list[HeadRange | None] = [HeadRange(a, b, cfg.gqa_group) for a, b in _split(cfg.n_kv_heads, head_parts)]
    heads += [None] * (n_workers - head_parts)
    align = NEURON_ALIGN if cfg.n_ff % NEURON_ALIGN == 0 else 1
    neurons = tuple(np.arange(a, b, dtype=np.int64) for a, b in _split(cfg.n_ff, n_workers, align))
    vocab = tuple(_split(cfg.vocab_size, n_workers))
    return ShardPlan(tuple(heads), neurons, vocab)
