"""How one layer is split across workers: kv-head ranges for attention, neuron ranges for the FFN.

Runs in: the coordinator (to plan) and workers (to know their share).

A worker's attention share is a range of kv heads together with the query heads that read them
(grouped-query attention keeps a group on one worker, so no kv head is stored twice). Its FFN
share is a set of neurons; ranges are cut on multiples of 32 so that the down projection's
columns split on quantization-group boundaries. Its output-head share is a range of vocabulary
rows, so the biggest matmul of a decode step is split too.

With a GPU worker (coordinator/hybrid_executor.py) the CPU side of a layer holds its *cold*
neurons, the complement of the GPU's hot set: any sorted set, not a range. ``cold_neurons`` and
``split_neurons`` plan those shards; ``down_columns`` reads such a set's down-projection columns.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType

from powerinfer.config import ModelConfig
from powerinfer.errors import InvalidArgumentError
from powerinfer.gguf_file import GGUFFile
from powerinfer.model.weights import layer_tensor
from powerinfer.quants import dequantize_rows
from powerinfer.quants.formats import FLOAT_TYPES

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


@dataclass(frozen=True)
class RankShard:
    """One rank of the native pool (every rank runs every layer): query heads [q0, q1), the kv
    heads [kv0, kv1) they read (a group split between two ranks has its kv head on both), FFN
    neurons [n0, n1) (rows of gate and up), rows [d0, d1) of the model dimension (of the output
    and down projections) and output-head rows [v0, v1). The ranks gather each other's slices,
    so every output element is one rank's whole dot product (native/kernels/comm.h)."""

    q0: int
    q1: int
    kv0: int
    kv1: int
    n0: int
    n1: int
    d0: int
    d1: int
    v0: int
    v1: int


def plan_ranks(cfg: ModelConfig, n_ranks: int, sparse: bool = False) -> tuple[RankShard, ...]:
    """Split every layer over n_ranks native ranks evenly: query heads one by one (attention's cost
    follows them, so a kv head is rather computed twice than a group kept whole), neurons and
    model-dimension rows in multiples of 8 (the repacked eight-row layout), head rows likewise.
    sparse: model-dimension rows in multiples of 32 instead, so that a rank's columns of the sparse
    FFN's neuron-major Q8_0 down projection (blocks of 32 outputs) are the unsplit matrix's blocks
    and the pool stays bit-identical to the in-process decoder."""
    if n_ranks < 1:
        raise InvalidArgumentError(f"need at least one rank, got {n_ranks}")
    if n_ranks > cfg.n_heads:
        raise InvalidArgumentError(f"{n_ranks} ranks cannot each get a query head: the model has {cfg.n_heads}")
    grp = cfg.gqa_group
    heads = _split(cfg.n_heads, n_ranks)
    neurons = _split(cfg.n_ff, n_ranks, 8)
    dims = _split(cfg.d_model, n_ranks, 32 if sparse else 8)
    vocab = _split(cfg.vocab_size, n_ranks, 8)
    for what, parts in (("FFN neurons", neurons), ("model dimensions", dims)):
        if any(b <= a for a, b in parts):
            raise InvalidArgumentError(f"{n_ranks} ranks cannot each get {what} in groups of {32 if sparse and what == 'model dimensions' else 8}")
    return tuple(RankShard(q0, q1, q0 // grp, (q1 - 1) // grp + 1, n0, n1, d0, d1, v0, v1)
                 for (q0, q1), (n0, n1), (d0, d1), (v0, v1) in zip(heads, neurons, dims, vocab))


def cold_neurons(hot: np.ndarray, n_ff: int) -> np.ndarray:
    """Sorted int64 neurons of [0, n_ff) that are not in hot (the CPU's share of a layer)."""
    mask = np.ones(n_ff, dtype=bool)
    mask[np.asarray(hot, dtype=np.int64)] = False
    return np.flatnonzero(mask).astype(np.int64)


def split_neurons(neurons: np.ndarray, parts: int) -> tuple[np.ndarray, ...]:
    """Split a sorted neuron set into `parts` consecutive pieces (some may be empty)."""
    if parts < 1:
        raise InvalidArgumentError(f"need at least one part, got {parts}")
    return tuple(neurons[a:b] for a, b in _split(len(neurons), parts))


DOWN_CHUNK = 1024  # rows of ffn_down [d, n_ff] dequantized at a time


def packs_as_columns(f: GGUFFile, layer: int, neurons: np.ndarray) -> bool:
    """True when neurons are one range whose bounds sit on the down projection's quantization
    groups, so the packed columns of the file's blocks can be used as they are."""
    start, stop = int(neurons[0]), int(neurons[-1]) + 1
    if stop - start != len(neurons):
        return False
    qtype = f.tensor(layer_tensor(layer, "ffn_down")).qtype
    group = 1 if qtype in FLOAT_TYPES else 16 if qtype == GGMLQuantizationType.Q6_K else 32
    return start % group == 0 and stop % group == 0


def down_columns(f: GGUFFile, layer: int, neurons: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(float32 [d, len(neurons)] exact down-projection columns, float32 [d] max |w| of each full row).

    The row maxima let an int8 requantization of a column subset keep the unsharded matrix's row
    scales (as contiguous column shards do), so any neuron set is exactly those columns.
    """
    name = layer_tensor(layer, "ffn_down")
    info = f.tensor(name)
    raw = f.raw(name)
    idx = np.asarray(neurons, dtype=np.int64)
    cols = np.empty((info.n_rows, len(idx)), dtype=np.float32)
    absmax = np.empty(info.n_rows, dtype=np.float32)
    for i in range(0, info.n_rows, DOWN_CHUNK):
        full = dequantize_rows(info.qtype, raw[i : i + DOWN_CHUNK], info.n_cols)  # [m, n_ff]
        cols[i : i + DOWN_CHUNK] = full[:, idx]
        absmax[i : i + DOWN_CHUNK] = np.maximum(full.max(axis=1), -full.min(axis=1))
    return cols, absmax
