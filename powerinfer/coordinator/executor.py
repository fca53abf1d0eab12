"""The one interface every executor implements: a forward step in, logits out.

Runs in: the coordinator process.

The engine (coordinator/engine.py) owns the sequences: which tokens each KV slot holds, chunking a
prompt by the batch size, the context limit. An executor owns everything else of a forward pass:
embedding the tokens, every layer with its KV cache, the final norm and the output head with the
refinement of the best logits (coordinator/logits.py). So the engine calls one method per step,
``execute(batch)``, and never asks an executor what it can do; which executor runs is decided once,
by coordinator/factory.py. The executors:

* ``NativeExecutor`` (native_executor.py): every layer in one call into the native decoder, here;
* ``NativePoolExecutor`` (native_pool.py): native worker ranks merging in shared memory, a GPU
  worker optionally one more rank (the default);
* ``InProcessExecutor`` (inprocess.py): torch shards here, the test oracle; ``ProfilingExecutor``
  (sparsity/profile.py) records its FFNs;
* ``ProcessExecutor`` (process_executor.py): torch shards in worker processes over ZeroMQ;
* ``HybridExecutor`` (hybrid_executor.py): a GPU worker's hot neurons and layers, the rest here;
* ``PipelineExecutor`` (cluster/pipeline.py): the layers in stages on Ray nodes, micro-batches
  hopping stage to stage (docs/distributed.md).

The last three share the per-layer recipe in layerwise.py.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Mapping, NoReturn, Protocol, Sequence, Union

import numpy as np

# token ids, positions, slots: a numpy int64 vector [T], or a short tuple for a decode step (building
# arrays after a pass over the weights costs cache misses: the native executors take tuples as they are)
Ints = Union[np.ndarray, Sequence[int]]


class Want(enum.Enum):
    """What one step returns."""

    CACHE = "cache"  # nothing: the tokens only enter the KV cache (a prompt's chunks before the last)
    LAST = "last"  # logits [1, vocab] of the last token, its candidates near the best refined (decode rule)
    EACH = "each"  # logits [T, vocab], every row refined by the decode rule (decode of many slots, verify)
    ALL = "all"  # logits [T, vocab], each row's REFINE best refined (perplexity, scoring)
    HIDDEN = "hidden"  # final-normed hidden states [T, d] (embeddings), no head


@dataclass(frozen=True)
class Batch:
    """One forward pass: token ids [T] at positions [T] of KV slots [T] (one slot per token)."""

    ids: Ints
    positions: Ints
    slots: Ints
    want: Want

    def __len__(self) -> int:
        return len(self.ids)

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """ids, positions, slots as contiguous int64 vectors [T]."""
        return (np.ascontiguousarray(self.ids, dtype=np.int64), np.ascontiguousarray(self.positions, dtype=np.int64),
                np.ascontiguousarray(self.slots, dtype=np.int64))


@dataclass(frozen=True)
class Description:
    """What an executor says about itself (``powerinfer`` prints it; ``bench`` records ``numbers``)."""

    kind: str  # one phrase: "native decoder in this process", ...
    pids: tuple[int, ...] = ()  # its worker processes (this one not included)
    placement: tuple[str, ...] = ()  # the load summary's lines: where each part of the model runs
    figures: tuple[str, ...] = ()  # --verbose: where a step's time went since reset_stats
    numbers: Mapping[str, float | list[float]] = field(default_factory=dict)  # the same figures for bench's JSON
    computed_share: float | None = None  # share of FFN neurons computed per token since reset_stats (None: not counted)
    steps_match_decode: bool = False  # a pass over several tokens gives each row the logits a decode step would
    kv_layout: str | None = None  # the KV cache's layout for slot files (cpu_workers/kv_file.py); None: cannot save


class Executor(Protocol):
    """Runs forward passes of one loaded model; owns its weights, KV caches and workers."""

    @property
    def weight_bytes(self) -> int:
        """Bytes of packed weights and KV cache it holds (CPU side)."""
        ...

    def execute(self, batch: Batch) -> np.ndarray:
        """Run batch through the model (its tokens enter the KV cache) -> what batch.want asks for
        (float32; an empty array for Want.CACHE). Logits are before the model's final softcap."""
        ...

    def describe(self) -> Description: ...

    def reset_stats(self) -> None:
        """Zero the step timings and sparse counters that describe() reports."""
        ...

    def set_sparse(self, *, dense: bool | None = None, oracle: bool | None = None) -> None:
        """Sparse FFNs compute every neuron (dense=True), the true active set (oracle=True), or
        their predictor's (both False); no effect on a dense executor."""
        ...

    def save_kv(self, slot: int, n: int, path: str, offset: int) -> None:
        """slot's first n positions of every layer's KV cache into path at offset (its header
        written); InvalidArgumentError where the cache cannot be reached (describe().kv_layout None)."""
        ...

    def load_kv(self, slot: int, n: int, path: str, offset: int) -> None: ...

    def check_health(self) -> None:
        """Raise WorkerDiedError when a worker process is gone or silent (no-op without workers)."""
        ...

    def restart(self) -> None:
        """Fresh workers after a failure (their KV caches start empty); no-op without workers."""
        ...

    def close(self) -> None: ...


def no_kv(what: str) -> NoReturn:
    """The error of save_kv/load_kv where the KV cache cannot be reached from the coordinator."""
    from powerinfer.errors import InvalidArgumentError

    raise InvalidArgumentError("slot save and restore need the native executors (the default) or --executor inprocess; "
                               f"{what} keeps its KV cache where they cannot reach it")
