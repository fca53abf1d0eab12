"""CPU worker process: owns one shard of every layer and answers the coordinator's requests.

Runs in: a CPU worker process (started by :class:`powerinfer.coordinator.pool.WorkerPool`).

Life cycle: HELLO (protocol version) -> LOAD (which shard, which CPUs, which transport) -> pin to
its CPUs and NUMA node, build its shards from the memory-mapped GGUF (first touch after pinning
puts the packed weights on the worker's node) -> READY -> serve until SHUTDOWN:
transport "shm" (the default): one STEP per forward pass on the native kernels, partials merged
with the other ranks in shared memory (native_worker.py; no torch is imported);
transport "zmq": ATTN/FFN/LOGITS per layer on torch shards, PARTIAL sums to the coordinator.
The life cycle itself (sockets, heartbeat thread, HELLO/LOAD/READY, the per-layer loop) is
processes/worker_runtime.py's, shared with the GPU worker; this module says what a CPU worker
loads and computes.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING

from powerinfer.config import config_from_gguf
from powerinfer.cpu_workers.pinning import bind_memory_to_node, pin_current_process
from powerinfer.cpu_workers.topology import Placement
from powerinfer.gguf_file import GGUFFile
from powerinfer.memory import release_freed_memory
from powerinfer.model.sharding import plan_shards
from powerinfer.protocol import (
    AttnMsg,
    FfnMsg,
    LoadMsg,
    LogitsMsg,
    Message,
    ProtocolError,
    as_torch,
)
from powerinfer.processes.worker_runtime import Loaded, WorkerArgs, run_worker, serve_layers

if TYPE_CHECKING:
    import torch

    from powerinfer.cpu_workers.native_worker import NativeRank
    from powerinfer.cpu_workers.shards import AttentionShard, FFNShard, HeadShard
    from powerinfer.cpu_workers.sparse_ffn import SparseFFNShard

log = logging.getLogger(__name__)

TRIM_ROWS = 32  # prefill chunks at least this long end with a malloc_trim (~1 ms)


class _Shards:
    """This worker's shard of every layer (None where it serves no attention heads / neurons)."""

    def __init__(self, load: LoadMsg) -> None:
        from powerinfer.cpu_workers.shards import AttentionShard, FFNShard, HeadShard
        from powerinfer.cpu_workers.sparse_ffn import SparseFFNShard
        from powerinfer.model.ops import RopeTable
        from powerinfer.predictors.predictor_file import read_predictor
        from powerinfer.predictors.predictor_types import refuse_residual_input

        f = GGUFFile(load.model)
        cfg = config_from_gguf(f)
        plan = plan_shards(cfg, load.n_workers)
        self.n_layers = cfg.n_layers
        heads, neurons = plan.heads[load.worker], plan.neurons[load.worker]
        ropes: dict[tuple[float, float], RopeTable] = {}
        self.attn = [AttentionShard(f, cfg, i, heads, load.n_ctx, ropes, load.n_slots) for i in range(cfg.n_layers)] if heads else None
        self.ffn: list[FFNShard | SparseFFNShard] | None = None
        if len(neurons) and load.predictor:
            pf = read_predictor(load.predictor, model=f)
            refuse_residual_input(pf, "the ZeroMQ torch workers")
            self.ffn = [SparseFFNShard(f, cfg, i, neurons, pf.layers[i], pf.mode) for i in range(cfg.n_layers)]
        elif len(neurons):
            self.ffn = [FFNShard(f, cfg, i, neurons) for i in range(cfg.n_layers)]
        start, stop = plan.vocab[load.worker]
        self.head = HeadShard(f, cfg, start, stop) if stop > start else None
        shards: list[AttentionShard | FFNShard | HeadShard] = [*(self.attn or []), *(self.ffn or []), *([self.head] if self.head else [])]
        self.weight_bytes = sum(s.nbytes for s in shards)
        # Everything is packed: the file's pages and the decoding scratch are no longer needed here.
        f.drop_pages()
        release_freed_memory()


def _load(load: LoadMsg, index: int, n_cpus: int) -> _Shards | NativeRank:
    """This worker's part of the model for the LOAD's transport."""
    if load.transport == "shm":
        os.environ["OMP_NUM_THREADS"] = str(max(1, load.threads))
        from powerinfer.cpu_workers.native_worker import NativeRank

        return NativeRank(load, index, n_cpus)
    if load.transport != "zmq":
        raise ProtocolError(f"unknown transport {load.transport!r} (expected 'shm' or 'zmq')")
    import torch

    torch.set_num_threads(max(1, load.threads))
    return _Shards(load)


def _compute(shards: _Shards, index: int, msg: Message) -> torch.Tensor:
    x = as_torch(msg.tensors[0])  # type: ignore[attr-defined]
    if isinstance(msg, AttnMsg):
        if shards.attn is None:
            raise RuntimeError(f"worker {index} holds no attention heads")
        return shards.attn[msg.layer].forward(x, as_torch(msg.tensors[1]), as_torch(msg.tensors[2]))
    if isinstance(msg, FfnMsg):
        if shards.ffn is None:
            raise RuntimeError(f"worker {index} holds no FFN neurons")
        return shards.ffn[msg.layer].forward(x)
    if shards.head is None:
        raise RuntimeError(f"worker {index} holds no output-head rows")
    return shards.head.forward(x)


def _trim(shards: _Shards, msg: Message) -> None:
    if isinstance(msg, FfnMsg) and msg.layer == shards.n_layers - 1 and msg.tensors[0].shape[0] >= TRIM_ROWS:
        # after a prefill chunk: give its [T, n_ff]-sized temporaries back (glibc keeps them)
        release_freed_memory()


def _prepare(load: LoadMsg, index: int) -> Loaded:
    """Pin to the LOAD's CPUs and node first (first touch then places the packed weights there), then load."""
    n_cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 0)
    if load.cpus:
        pin_current_process(Placement(worker=index, node=load.node, cpus=tuple(load.cpus)))
    if load.node >= 0:
        bind_memory_to_node(load.node)
    shards = _load(load, index, n_cpus)
    if isinstance(shards, _Shards):
        return Loaded(shards.weight_bytes, lambda sock, busy: serve_layers(
            sock, index, busy, (AttnMsg, FfnMsg, LogitsMsg), lambda m: _compute(shards, index, m).numpy(), lambda m: _trim(shards, m)))
    from powerinfer.cpu_workers.native_worker import serve_native

    rank = shards
    return Loaded(rank.weight_bytes, lambda sock, busy: serve_native(sock, rank, index, busy))


def worker_main(args: WorkerArgs) -> None:
    """Entry point of a worker process."""
    run_worker(args, "worker", lambda load: _prepare(load, args.index))


if __name__ == "__main__":
    # argv: index endpoint heartbeat-endpoint coordinator-pid log-level (processes/supervisor.py writes it)
    worker_main(WorkerArgs.parse(sys.argv[1:]))
