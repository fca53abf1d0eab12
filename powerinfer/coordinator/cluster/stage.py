"""One pipeline stage: layers [first, stop) of the model on the native decoder, in a Ray actor.

Runs in: the stage's actor process on its node (Ray starts it; this module imports no Ray).

The stage reads the model file at the same path as the coordinator (every node needs the file
there), builds only its layers (``NativeDecoder(only=...)``: the other layers' pages are never
touched), and serves micro-batches in arrival order: stage 0 embeds token ids, every stage runs
its layers over the residual stream with its own KV cache per slot, the last applies the final
norm and the head (the decode rule's refinement included: coordinator/logits.py) and sends the
answer to the coordinator. A heartbeat goes to the coordinator every HEARTBEAT_S.
"""

from __future__ import annotations

import importlib
import logging
import socket
import threading
from dataclasses import dataclass

import numpy as np
import zmq

from powerinfer.config import config_from_gguf
from powerinfer.coordinator.cluster.wire import StageMsg, decode, heartbeat
from powerinfer.coordinator.embedding import Embedding
from powerinfer.coordinator.cluster.stage_pool import StagePool
from powerinfer.coordinator.executor import Batch, Want
from powerinfer.coordinator.logits import answer
from powerinfer.cpu_workers.topology import default_workers, plan_placement, read_topology, split_threads
from powerinfer.errors import InvalidArgumentError, PowerInferError
from powerinfer.gguf_file import GGUFFile
from powerinfer.native.decoder import NativeDecoder, supports
from powerinfer.native.decoder_lib import decoder_lib
from powerinfer.native.sparse_layers import NativeSparseFFNs
from powerinfer.predictors.predictor_file import read_predictor
from powerinfer.protocol import ProtocolError, WorkerDiedError, WorkerError

log = logging.getLogger(__name__)

HEARTBEAT_S = 0.5
POLL_MS = 100


@dataclass(frozen=True)
class StageSpec:
    """What a stage loads: the file, its layers, and the decoder's sizes."""

    index: int
    n_stages: int
    path: str
    first: int
    stop: int
    n_ctx: int
    n_slots: int
    n_batch: int
    n_threads: int  # 0: the node's physical cores
    replica: int = 0  # which full copy of the model this stage belongs to (--replicas)
    predictor: str = ""  # a .predictor file at the same path on every node: this stage's FFNs run sparsely
    pool: bool = True  # a native pool of n_threads threads (a rank per NUMA node and L3); False: the decoder in the actor's process
    pin: bool = True  # the pool's ranks pinned to cores and NUMA nodes (cpu_workers/topology.py)

    @property
    def beat_id(self) -> int:
        """Its heartbeat's number at the coordinator: replica-major, as the coordinator lists its actors."""
        return self.replica * self.n_stages + self.index

    @property
    def last(self) -> bool:
        return self.index == self.n_stages - 1


class Stage:
    """The actor's body (the pipeline executor wraps it in ``ray.remote``)."""

    def __init__(self, spec: StageSpec) -> None:
        self.spec = spec
        self.f = GGUFFile(spec.path)
        self.cfg = config_from_gguf(self.f)
        lib = decoder_lib()
        why = "the native decoder is unavailable on this node (no C compiler?)" if lib is None else supports(self.f, self.cfg)
        if why is not None or lib is None:
            raise PowerInferError(f"pipeline stage {spec.index} cannot run here: {why}")
        if not 0 <= spec.first < spec.stop <= self.cfg.n_layers:
            raise PowerInferError(f"pipeline stage {spec.index}: layers {spec.first}..{spec.stop - 1} of a {self.cfg.n_layers}-layer model")
        threads = spec.n_threads or default_workers()  # 0: this node's physical cores (the pool's threads, or the decoder's)
        layers = frozenset(range(spec.first, spec.stop))
        self.pool: StagePool | None = None
        self.decoder: NativeDecoder | None = None
        self.sparse: NativeSparseFFNs | None = None
        self.embedding: Embedding | None = None
        if spec.pool:  # the default executor's native pool on this node, of this stage's layers (a rank per NUMA node and L3)
            topo = read_topology()
            ranks, each = split_threads(topo, threads)
            placements = tuple(plan_placement(topo, ranks, each)) if spec.pin else ()
            self.pool = StagePool(lib, self.f, spec.path, self.cfg, spec.n_ctx, ranks, each, placements, "WARNING", spec.n_slots, spec.n_batch,
                                  predictor=spec.predictor, layers=(spec.first, spec.stop))
        else:
            # the predictor's rule on this stage's layers, as the in-process native executor applies it
            self.sparse = (NativeSparseFFNs(lib, self.f, self.cfg, read_predictor(spec.predictor, model=self.f), only=layers)
                           if spec.predictor else None)
            self.decoder = NativeDecoder(lib, self.f, self.cfg, spec.n_ctx, spec.n_slots, threads, spec.n_batch, sparse=self.sparse,
                                         only=layers, with_head=spec.last)
            self.embedding = Embedding(self.f, self.cfg, self.decoder.embed) if spec.index == 0 else None
        self.tokens = 0  # tokens through this stage's layers since the counters were reset
        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.host = _node_ip()
        port = self.pull.bind_to_random_port(f"tcp://{self.host}")
        self.endpoint_ = f"tcp://{self.host}:{port}"
        self.push: zmq.Socket[bytes] | None = None
        self.beat: zmq.Socket[bytes] | None = None
        self.stopping = threading.Event()

    def endpoint(self) -> str:
        """Where the previous hop sends (this stage's PULL socket)."""
        return self.endpoint_

    def sparse_counts(self) -> tuple[list[int], list[bool], int]:
        """For this stage's layers: neurons computed (summed over tokens), whether the layer is
        sparse, and the tokens since the last reset_counts() (no predictor: none counted, all dense;
        a pool's ranks count their own neurons: not gathered here, empty lists)."""
        layers = range(self.spec.first, self.spec.stop)
        if self.pool is not None:
            return [], [], self.tokens
        if self.sparse is None:
            return [0 for _ in layers], [False for _ in layers], self.tokens
        return [int(self.sparse.active[i]) for i in layers], [bool(self.sparse.sparse_layers[i]) for i in layers], self.tokens

    def reset_counts(self) -> None:
        if self.sparse is not None:
            self.sparse.active[:] = 0
        self.tokens = 0

    def set_sparse(self, dense: bool | None, oracle: bool | None) -> None:
        if self.pool is not None:
            self.pool.set_sparse(dense=dense, oracle=oracle)
        elif self.sparse is not None:
            self.sparse.set_flags(dense, oracle)

    def node_id(self) -> str:
        """Ray's id of this stage's node ("" without Ray)."""
        try:
            return str(importlib.import_module("ray").get_runtime_context().get_node_id())
        except ImportError:
            return ""

    def weight_bytes(self) -> int:
        """Packed weights and KV cache this stage holds (its pool's ranks', or its decoder's)."""
        if self.pool is not None:
            return self.pool.weight_bytes
        assert self.decoder is not None
        return self.decoder.weight_bytes + self.decoder.cache_bytes

    def pids(self) -> list[int]:
        """The stage's pool's rank processes (none in process)."""
        return self.pool.pids if self.pool is not None else []

    def connect(self, next_endpoint: str, heartbeat_endpoint: str) -> None:
        """Send onward to next_endpoint (the next stage's, or the coordinator's for the last), beat to heartbeat_endpoint."""
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 0)
        self.push.connect(next_endpoint)
        self.beat = self.ctx.socket(zmq.PUSH)
        self.beat.setsockopt(zmq.LINGER, 0)
        self.beat.connect(heartbeat_endpoint)

    def serve(self) -> None:
        """Serve micro-batches until stop(); returns then (an exception ends the actor's call: the coordinator sees it)."""
        assert self.push is not None and self.beat is not None, "connect() first"
        threading.Thread(target=self._beat, name=f"stage-{self.spec.index}-heartbeat", daemon=True).start()
        poller = zmq.Poller()
        poller.register(self.pull, zmq.POLLIN)
        while not self.stopping.is_set():
            if not poller.poll(POLL_MS):
                continue
            frames = self.pull.recv_multipart(copy=True)
            try:
                msg = decode(frames)
                out = self.run(msg) if msg.kind != "error" else msg  # an earlier stage's error goes on to the coordinator
            except (WorkerDiedError, WorkerError) as e:  # the stage's pool failed: the pipeline restarts (fresh KV caches)
                log.error("pipeline stage %d broke: %s", self.spec.index, e)
                out = _error_for(frames, f"pipeline stage {self.spec.index}: {e}", fatal=True)
            except (PowerInferError, ProtocolError, ValueError) as e:
                log.error("pipeline stage %d refused a message: %s", self.spec.index, e)
                out = _error_for(frames, f"pipeline stage {self.spec.index}: {e}")
            self.push.send_multipart(out.frames(), copy=False)

    def run(self, msg: StageMsg) -> StageMsg:
        """One micro-batch through this stage's layers -> the message for the next hop."""
        pos, slots = msg.positions, msg.slots
        if self.pool is not None:
            # what the decoder in process refuses cleanly is checked here: a rank refusing it would abort the pool
            if len(pos) != len(slots) or not len(pos) or pos.min() < 0 or pos.max() >= self.spec.n_ctx or slots.min() < 0 \
                    or slots.max() >= self.spec.n_slots:
                raise InvalidArgumentError(f"positions {pos.min() if len(pos) else '-'}..{pos.max() if len(pos) else '-'} or slots outside "
                                           f"the context of {self.spec.n_ctx} and {self.spec.n_slots} slots: refused")
            if (msg.kind == "ids") != (self.spec.index == 0):
                raise ProtocolError(f"stage {self.spec.index} takes {'token ids' if self.spec.index == 0 else 'the residual stream'}, got {msg.kind!r}")
            ids = msg.payload if msg.kind == "ids" else np.zeros(len(pos), dtype=np.int64)
            x = None if msg.kind == "ids" else np.ascontiguousarray(msg.payload, dtype=np.float32)
            out = self.pool.execute_stream(x, Batch(ids, pos, slots, Want(msg.want)))
            self.tokens += len(pos)
            return msg.reply("out" if self.spec.last else "hidden", np.ascontiguousarray(out, dtype=np.float32))
        assert self.decoder is not None
        if self.embedding is not None:
            if msg.kind != "ids":
                raise ProtocolError(f"stage 0 takes token ids, got {msg.kind!r}")
            x = self.embedding(msg.payload, pos)
        else:
            if msg.kind != "hidden":
                raise ProtocolError(f"stage {self.spec.index} takes the residual stream, got {msg.kind!r}")
            x = np.ascontiguousarray(msg.payload, dtype=np.float32)
        x = self.decoder.forward_range(self.spec.first, self.spec.stop, x, pos, slots, final_norm=self.spec.last)
        self.tokens += len(pos)
        if not self.spec.last:
            return msg.reply("hidden", x)
        want = Want(msg.want)
        d = self.decoder
        return msg.reply("out", np.ascontiguousarray(answer(want, x, self.cfg.vocab_size, d.logits, d.refine, d.decode_logits), dtype=np.float32))

    def _beat(self) -> None:
        assert self.beat is not None
        frame = heartbeat(self.spec.beat_id)
        while not self.stopping.wait(HEARTBEAT_S):
            try:
                self.beat.send(frame, zmq.NOBLOCK)
            except zmq.Again:  # the coordinator is not reading: it is gone or restarting us
                pass

    def stop(self) -> None:
        self.stopping.set()
        if self.pool is not None:
            self.pool.close()


def _error_for(frames: list[bytes], text: str, fatal: bool = False) -> StageMsg:
    """An error message for whatever arrived (its step and micro-batch when its header reads)."""
    try:
        m = decode(frames)
        return m.reply("error", np.zeros(0, dtype=np.float32), text, fatal)
    except ProtocolError:
        z = np.zeros(0, dtype=np.int64)
        return StageMsg(-1, 0, 1, "", "error", z, z, np.zeros(0, dtype=np.float32), text, fatal)


def _node_ip() -> str:
    """This node's address as Ray knows it (the loopback when Ray is not there: tests of the stage alone)."""
    try:
        ray = importlib.import_module("ray")  # by name: Ray is an optional extra, not a type-checked dependency
        return str(ray.util.get_node_ip_address())
    except ImportError:
        return socket.gethostbyname("localhost")
