"""A CPU worker of the native pool (LOAD transport "shm"): one rank of every layer, one native call per step.

Runs in: a CPU worker process, after worker.py's handshake, pinning and LOAD. Imports no torch.

The rank holds its :class:`powerinfer.model.sharding.RankShard` of every layer in the native
decoder (query heads with their KV cache, FFN neurons, output-head rows; weights read in place
from the memory-mapped GGUF, the eight-row types repacked for its slice only) and a replica of
the residual stream. A STEP runs the whole forward pass in ``pi_rank_step``: the ranks sum their
slices of the attention output, its projection, the FFN's hidden and its projection through the
shared-memory all-gather (native/kernels/comm.h) four times per layer,
with no Python and no message per layer. Rank 0 writes the final hidden states into the
segment, every rank its columns of the logits; RESULT tells the coordinator the step is done.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import threading
import time

import numpy as np
import zmq

from powerinfer.config import config_from_gguf
from powerinfer.cpu_workers.kv_file import KvGeometry, load_caches, save_caches
from powerinfer.native.decoder_lib import STEP_STREAM, PiRankCtx, decoder_lib
from powerinfer.native.decoder import NativeDecoder, supports
from powerinfer.native.sparse_layers import MAX_SPARSE_SHARE, NativeSparseFFNs
from powerinfer.native.comm import SPIN_US, RankComm, comm_error
from powerinfer.errors import UnsupportedModelError
from powerinfer.gguf_file import GGUFFile
from powerinfer.native.segment import Segment, SegmentLayout
from powerinfer.model.sharding import plan_ranks
from powerinfer.predictors.predictor_file import read_predictor
from powerinfer.protocol import (
    ErrorMsg,
    KvMsg,
    LoadMsg,
    LogitsMsg,
    ProtocolError,
    ResultMsg,
    ShutdownMsg,
    StepMsg,
    recv,
    send,
)

log = logging.getLogger(__name__)

STEP_SPIN_US = int(os.environ.get("POWERINFER_STEP_SPIN_US", "30"))  # spin for the next step before sleeping on the doorbell
IDLE_MS = 1000  # an idle rank wakes this often (to return to Python; costs nothing measurable)
CONTROL_WAIT_MS = 2000  # how long a rung rank waits for the ZeroMQ message


def read_hot(path: str, n_layers: int) -> tuple[np.ndarray, ...]:
    """LOAD.gpu_hot's file: a JSON list of each layer's hot neurons (int32 arrays, [n_layers])."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the GPU rank's hot neurons from {path}: {e}") from e
    if (not isinstance(data, list) or len(data) != n_layers or not all(isinstance(h, list) for h in data)
            or not all(type(j) is int for h in data for j in h)):
        raise ValueError(f"{path}: expected a list of {n_layers} lists of neuron indices (ints)")
    return tuple(np.asarray(h, dtype=np.int64) for h in data)


class NativeRank:
    """This worker's rank: the decoder over its shard, the segment and its merge handle."""

    def __init__(self, load: LoadMsg, rank: int, n_cpus: int = 0) -> None:
        """n_cpus: the CPUs this worker could use before it was pinned (0: unknown). With more
        threads in the pool than that, waiting ranks sleep at once instead of spinning: a spinning
        rank would hold a core that a rank still computing needs."""
        lib = decoder_lib()
        if lib is None:
            raise UnsupportedModelError("the native decoder is unavailable in this worker (POWERINFER_NATIVE=0 or no C compiler)")
        self.lib = lib
        f = GGUFFile(load.model)
        cfg = config_from_gguf(f)
        why = supports(f, cfg)
        if why is not None:
            raise UnsupportedModelError(f"the native decoder cannot run this model: {why}")
        self.shard = plan_ranks(cfg, load.n_workers, sparse=bool(load.predictor))[rank]
        gpu = frozenset(load.gpu_layers)
        gpu_attn = frozenset(load.gpu_attn)
        if any(not 0 <= i < cfg.n_layers for i in gpu | gpu_attn):
            raise ValueError(f"LOAD names GPU layers outside the model's {cfg.n_layers}: {sorted(gpu | gpu_attn)}")
        hot = read_hot(load.gpu_hot, cfg.n_layers) if load.gpu_hot else ()
        has_gpu = bool(gpu or gpu_attn or any(len(h) for h in hot))
        # the GPU rank's layers are not built here: the stream is handed over around them (kernels/handoff.h)
        only = frozenset(range(cfg.n_layers)) - gpu if gpu else None
        first, stop = load.layers if load.layers else (0, cfg.n_layers)  # a pipeline stage's pool: its layers only
        if load.layers:
            if len(load.layers) != 2 or not 0 <= first < stop <= cfg.n_layers or has_gpu:
                raise ValueError(f"LOAD's layers {list(load.layers)}: a range [first, stop) of the model's {cfg.n_layers}, without a GPU rank")
            only = frozenset(range(first, stop))
        sparse = None
        if load.predictor:  # this rank's neurons of every layer, computed sparsely (native/sparse_layers.py)
            # with a GPU rank every layer applies the predictor's rule, as the GPU's layers do (and the
            # hybrid executor): the "too dense to pay, run dense" cut would make the text depend on
            # where a layer lives
            sparse = NativeSparseFFNs(lib, f, cfg, read_predictor(load.predictor, model=f), (self.shard.n0, self.shard.n1),
                                      (self.shard.d0, self.shard.d1), only=only, max_share=1.0 if has_gpu else MAX_SPARSE_SHARE,
                                      hot_block=not has_gpu)
        self.sparse = sparse
        self.dec = NativeDecoder(lib, f, cfg, load.n_ctx, load.n_slots, max(1, load.threads), load.max_t, self.shard, sparse, only,
                                 gpu_attn, hot, with_head=stop == cfg.n_layers)
        if gpu:
            self.on_gpu = np.array([i in gpu for i in range(cfg.n_layers)], dtype=np.int8)
            self.dec.model.on_gpu = self.on_gpu.ctypes.data
        layout = SegmentLayout.for_model(cfg, load.n_workers, load.max_t, int(lib.pi_comm_hdr_bytes()), has_gpu)
        self.seg = Segment(load.shm, layout, create=False)
        # the GPU rank's process needs a core too (to answer its hand-offs)
        oversubscribed = n_cpus > 0 and load.n_workers * max(1, load.threads) + (1 if has_gpu else 0) > n_cpus
        if oversubscribed:
            log.info("worker %d: %d ranks x %d threads on %d CPUs: merges and steps sleep without spinning", rank, load.n_workers,
                     max(1, load.threads), n_cpus)
        self.step_spin_us = 0 if oversubscribed else STEP_SPIN_US
        self.comm = RankComm(lib, self.seg, rank, spin_us=0 if oversubscribed else SPIN_US)
        self.dec.model.comm = self.comm.ptr
        self.rank, self.d, self.max_t = rank, cfg.d_model, load.max_t
        self.n_slots, self.n_ctx = load.n_slots, load.n_ctx
        self.io = np.zeros((3, load.max_t), dtype=np.int64)
        self.x = np.empty((load.max_t, cfg.d_model), dtype=np.float32)  # the residual stream replica
        self.weight_bytes = self.dec.weight_bytes
        L = self.seg.layout
        if load.layers:  # the stream enters through the segment's hidden area, which rank 0 then overwrites with its answer
            self.dec.model.first, self.dec.model.stop, self.dec.model.stream_in = first, stop, self.seg.base + L.hidden_off
        # logits: this rank's first column of the segment's [rows, vocab]; hidden: rank 0 writes it
        self.ctx = PiRankCtx(ctypes.addressof(self.dec.model), ctypes.addressof(self.dec.embeddings), self.x.ctypes.data,
                             self.seg.base + L.logits_off + self.shard.v0 * 4, self.seg.base + L.hidden_off if rank == 0 else None,
                             self.dec.scratch.ctypes.data, L.vocab, L.logit_rows, float(cfg.embed_scale))

    def run(self, mode: int, T: int) -> int:
        """The native call for a STEP message (mode 0-2, + STEP_STREAM for a pipeline stage's stream;
        ids etc. in self.io) or a head pass (mode 3, self.x), with the same outputs as a doorbell step (self.ctx)."""
        if (mode & ~STEP_STREAM) in (2, 3) and T > self.ctx.logit_rows or mode == 3 | STEP_STREAM:
            return 1
        io, c = self.io, self.ctx
        return int(self.lib.pi_rank_step(ctypes.byref(self.dec.model), ctypes.byref(self.dec.embeddings), c.embed_scale,
                                         io[0].ctypes.data, io[1].ctypes.data, io[2].ctypes.data, T, mode, c.x, c.logits, c.ld, c.hidden,
                                         c.scratch))


def serve_native(sock: zmq.Socket, rank: NativeRank, index: int, busy: threading.Event) -> None:
    """Steps from the doorbell in native code (pi_rank_serve); between them, when the coordinator
    rings for it, one ZeroMQ message: LOGITS or STEP -> RESULT (or ERROR), SHUTDOWN -> return."""
    while True:
        rc = rank.lib.pi_rank_serve(ctypes.byref(rank.ctx), rank.step_spin_us, IDLE_MS)
        # 1 (idle): a message rung for earlier may have arrived after its wait below ran out.
        # 2: a message waits (sent before the doorbell rang, so it is at most in flight); an
        # abort code: the pool is being torn down and SHUTDOWN follows
        if sock.poll(0 if rc == 1 else CONTROL_WAIT_MS) and not _serve_message(sock, rank, index, busy):
            return
        while sock.poll(0):
            if not _serve_message(sock, rank, index, busy):
                return


def _serve_message(sock: zmq.Socket, rank: NativeRank, index: int, busy: threading.Event) -> bool:
    """One ZeroMQ message; False on SHUTDOWN."""
    try:
        msg = recv(sock)
    except ProtocolError as e:
        log.error("worker %d: dropped a malformed message: %s", index, e)
        send(sock, ErrorMsg(req=-1, step=-1, layer=-1, worker=index, kind="ProtocolError", message=str(e)))
        return True
    if isinstance(msg, ShutdownMsg):
        return False
    if isinstance(msg, KvMsg):
        _serve_kv(sock, rank, index, msg)
        return True
    if not isinstance(msg, (StepMsg, LogitsMsg)):
        send(sock, ErrorMsg(req=-1, step=-1, layer=-1, worker=index, kind="ProtocolError", message=f"unexpected {type(msg).__name__}"))
        return True
    busy.set()
    t0 = time.perf_counter()
    syncs0, wait0 = int(rank.comm.comm.n_syncs), int(rank.comm.comm.wait_ns)
    try:
        if isinstance(msg, StepMsg):
            ids = msg.tensors[0]
            T = int(ids.shape[0])
            if not 1 <= T <= rank.max_t or msg.tensors[1].shape[0] != T or msg.tensors[2].shape[0] != T:
                raise ValueError(f"a STEP takes 1..{rank.max_t} tokens with one position and slot each")
            if msg.mode & ~STEP_STREAM not in (0, 1, 2):  # 3 is LOGITS' head pass, not a step
                raise ValueError(f"STEP mode {msg.mode}: 0-2, plus {STEP_STREAM} for a pipeline stage's stream")
            for i in range(3):
                rank.io[i, :T] = msg.tensors[i]
            rc = rank.run(msg.mode, T)
        else:
            x = msg.tensors[0]
            T = int(x.shape[0])
            if x.dtype != np.float32 or x.shape[1:] != (rank.d,) or not 1 <= T <= rank.max_t:
                raise ValueError(f"LOGITS takes f32 [1..{rank.max_t}, {rank.d}], got {x.dtype} {list(x.shape)}")
            rank.x[:T] = x
            rc = rank.run(3, T)
        if rc:
            raise RuntimeError(comm_error(rc) if rc >= 10 else f"the native step refused its input (code {rc})")
        c = rank.comm.comm
        send(sock, ResultMsg(req=msg.req, step=msg.step, worker=index, compute_us=int((time.perf_counter() - t0) * 1e6),
                             wait_us=(int(c.wait_ns) - wait0) // 1000, syncs=int(c.n_syncs) - syncs0))
    except Exception as e:  # noqa: BLE001 - reported to the coordinator as a typed ERROR
        log.warning("worker %d: step failed: %s", index, e)
        send(sock, ErrorMsg(req=msg.req, step=msg.step, layer=-1, worker=index, kind=type(e).__name__, message=str(e)))
    finally:
        busy.clear()
    return True


def _serve_kv(sock: zmq.Socket, rank: NativeRank, index: int, msg: KvMsg) -> None:
    """KV: this rank's kv heads of the slot, to or from their place in the file."""
    t0 = time.perf_counter()
    try:
        cfg = rank.dec.cfg
        if not 0 <= msg.slot < rank.n_slots or msg.n > rank.n_ctx:
            raise ValueError(f"KV names slot {msg.slot} and {msg.n} positions; this rank has {rank.n_slots} slots of {rank.n_ctx}")
        geo = KvGeometry(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, cfg.v_head_dim)
        move = save_caches if msg.op == 0 else load_caches
        holders = [(layer, rank.shard.kv0, k, v) for layer, (k, v) in enumerate(zip(rank.dec.k_cache, rank.dec.v_cache))]
        move(msg.path, msg.offset, geo, msg.slot, msg.n, holders)
        send(sock, ResultMsg(req=msg.req, step=0, worker=index, compute_us=int((time.perf_counter() - t0) * 1e6), wait_us=0, syncs=0))
    except Exception as e:  # noqa: BLE001 - reported to the coordinator as a typed ERROR
        log.warning("worker %d: slot %s failed: %s", index, "save" if msg.op == 0 else "restore", e)
        send(sock, ErrorMsg(req=msg.req, step=-1, layer=-1, worker=index, kind=type(e).__name__, message=str(e)))
