"""CPU worker process: owns one shard of every layer and answers the coordinator's requests.

Runs in: a CPU worker process (started by :class:`powerinfer.coordinator.pool.WorkerPool`).

Life cycle: HELLO (protocol version) -> LOAD (which shard, which CPUs, which transport) -> pin to
its CPUs and NUMA node, build its shards from the memory-mapped GGUF (first touch after pinning
puts the packed weights on the worker's node) -> READY -> serve until SHUTDOWN:
transport "shm" (the default): one STEP per forward pass on the native kernels, partials merged
with the other ranks in shared memory (native_worker.py; no torch is imported);
transport "zmq": ATTN/FFN/LOGITS per layer on torch shards, PARTIAL sums to the coordinator.
A heartbeat thread tells the coordinator it is alive and ends the process as soon as the
coordinator is gone, so a killed coordinator never leaves orphan workers.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING

import numpy as np
import zmq

from powerinfer.config import config_from_gguf
from powerinfer.cpu_workers.topology import (
    Placement,
    bind_memory_to_node,
    pin_current_process,
)
from powerinfer.gguf_file import GGUFFile
from powerinfer.memory import release_freed_memory
from powerinfer.model.sharding import plan_shards
from powerinfer.protocol import (
    PROTOCOL_VERSION,
    AttnMsg,
    ErrorMsg,
    FfnMsg,
    HelloMsg,
    LoadMsg,
    LogitsMsg,
    PartialMsg,
    ProtocolError,
    ReadyMsg,
    ShutdownMsg,
    as_torch,
    recv,
    send,
    socket_limits,
    worker_identity,
)
from powerinfer.protocol.lifecycle import die_with_parent, heartbeat

if TYPE_CHECKING:
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


def _serve(sock: zmq.Socket, shards: _Shards, index: int, busy: threading.Event) -> None:
    while True:
        try:
            msg = recv(sock)
        except ProtocolError as e:
            log.error("worker %d: dropped a malformed message: %s", index, e)
            send(sock, ErrorMsg(req=-1, step=-1, layer=-1, worker=index, kind="ProtocolError", message=str(e)))
            continue
        if isinstance(msg, ShutdownMsg):
            return
        if not isinstance(msg, (AttnMsg, FfnMsg, LogitsMsg)):
            send(sock, ErrorMsg(req=-1, step=-1, layer=-1, worker=index, kind="ProtocolError", message=f"unexpected {type(msg).__name__}"))
            continue
        busy.set()
        t0 = time.perf_counter()
        try:
            x = as_torch(msg.tensors[0])
            if isinstance(msg, AttnMsg):
                if shards.attn is None:
                    raise RuntimeError(f"worker {index} holds no attention heads")
                y = shards.attn[msg.layer].forward(x, as_torch(msg.tensors[1]), as_torch(msg.tensors[2]))
            elif isinstance(msg, FfnMsg):
                if shards.ffn is None:
                    raise RuntimeError(f"worker {index} holds no FFN neurons")
                y = shards.ffn[msg.layer].forward(x)
            else:
                if shards.head is None:
                    raise RuntimeError(f"worker {index} holds no output-head rows")
                y = shards.head.forward(x)
            out = np.ascontiguousarray(y.numpy(), dtype=np.float32)
            us = int((time.perf_counter() - t0) * 1e6)
            send(sock, PartialMsg(req=msg.req, step=msg.step, layer=msg.layer, worker=index, compute_us=us, tensors=(out,)))
            if x.shape[0] >= TRIM_ROWS and isinstance(msg, FfnMsg) and msg.layer == shards.n_layers - 1:
                # after a prefill chunk: give its [T, n_ff]-sized temporaries back (glibc keeps them)
                release_freed_memory()
        except Exception as e:
            log.exception("worker %d: layer %d failed", index, msg.layer)
            send(sock, ErrorMsg(req=msg.req, step=msg.step, layer=msg.layer, worker=index, kind=type(e).__name__, message=str(e)))
        finally:
            busy.clear()


def worker_main(index: int, endpoint: str, hb_endpoint: str, coordinator: int, log_level: str = "WARNING") -> None:
    """Entry point of a worker process."""
    die_with_parent()
    logging.basicConfig(level=log_level, format=f"%(levelname)s worker{index} %(name)s: %(message)s", stream=sys.stderr)
    # The coordinator handles Ctrl+C and tells us to stop; a terminal's SIGINT must not kill us mid-reply.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, worker_identity(index))
    sock.setsockopt(zmq.LINGER, 0)
    socket_limits(sock)
    sock.connect(endpoint)
    busy, stop = threading.Event(), threading.Event()
    beat = threading.Thread(target=heartbeat, args=(ctx, hb_endpoint, index, coordinator, busy, stop), daemon=True)
    beat.start()
    try:
        send(sock, HelloMsg(version=PROTOCOL_VERSION, worker=index, pid=os.getpid()))
        load = recv(sock)
        if isinstance(load, ShutdownMsg):
            return
        if not isinstance(load, LoadMsg):
            raise ProtocolError(f"expected LOAD, got {type(load).__name__}")
        n_cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 0)
        if load.cpus:
            pin_current_process(Placement(worker=index, node=load.node, cpus=tuple(load.cpus)))
        if load.node >= 0:
            bind_memory_to_node(load.node)
        t0 = time.perf_counter()
        busy.set()
        try:
            shards = _load(load, index, n_cpus)
        except Exception as e:  # noqa: BLE001 - the coordinator reports it as a load failure
            send(sock, ErrorMsg(req=-1, step=-1, layer=-1, worker=index, kind=type(e).__name__, message=str(e)))
            return
        finally:
            busy.clear()
        send(sock, ReadyMsg(worker=index, weight_bytes=shards.weight_bytes, load_s=time.perf_counter() - t0))
        if isinstance(shards, _Shards):
            _serve(sock, shards, index, busy)
        else:
            from powerinfer.cpu_workers.native_worker import serve_native

            serve_native(sock, shards, index, busy)
    finally:
        stop.set()
        beat.join(1.0)
        sock.close()
        ctx.term()


if __name__ == "__main__":
    # argv: index endpoint heartbeat-endpoint coordinator-pid log-level (see coordinator/pool.py)
    worker_main(int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
