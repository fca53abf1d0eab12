"""The default multiprocess executor: native worker ranks, one STEP per forward pass, partials merged in shared memory.

Runs in: the coordinator process (numpy and ctypes; no torch).

Every worker is a rank that runs every layer on its shard (query heads with their KV cache, FFN
neurons, rows of the output and down projections and of the head) in the native decoder and
holds a replica of the residual stream; the ranks gather each other's slices through the
shared-memory all-gather (native/kernels/comm.h) four times per layer, so every number equals the
in-process decoder's bit for bit. A forward pass is one ring of the segment's doorbell
(native/comm.py; a STEP message over ZeroMQ with step_channel "zmq"), answered by
every rank in the segment, where the outputs are too: rank 0's final hidden states and every
rank's columns of the 8-bit logits. The coordinator then refines each row's
best candidates in float32 from the file's head rows, the same rule and code as the in-process
native executor (pi_refine_best), so both give the same tokens.

Failure: a rank that dies, errs or stops beating fails the call (WorkerDiedError / WorkerError);
first the segment's abort flag wakes every rank still waiting in a merge, so none hangs. restart()
makes a fresh segment and pool.
"""

from __future__ import annotations

import ctypes
import logging
import time
from dataclasses import replace
from typing import Callable, Sequence

import numpy as np

from powerinfer.config import ModelConfig
from powerinfer.coordinator.executor import Batch, Description, Ints, Want
from powerinfer.coordinator.gpu_rank import GpuRankSpec
from powerinfer.coordinator.logits import REFINE, REFINE_MARGIN, answer
from powerinfer.coordinator.pool import PoolConfig, WorkerPool
from powerinfer.coordinator.stats import PoolStats, layer_runs_text, mib, pinning_text
from powerinfer.native.decoder import weight
from powerinfer.native.comm import comm_error, create_segment, merge_latencies_ns
from powerinfer.cpu_workers.topology import Placement
from powerinfer.errors import InvalidArgumentError
from powerinfer.gguf_file import GGUFFile
from powerinfer.gpu_worker.client import GpuWorkerProcess
from powerinfer.model.sharding import RankShard, ShardPlan, plan_ranks, plan_shards
from powerinfer.native.segment import Segment
from powerinfer.protocol import KvMsg, LogitsMsg, Message, ResultMsg, StepMsg, WorkerDiedError, WorkerError

log = logging.getLogger(__name__)

WAIT_SLICE_MS = 50  # the coordinator checks the ranks' health this often while a step runs
STEP = "running a step"  # the phase a rank that fails inside a step is said to have failed in


class NativePoolExecutor:
    """Whole forward passes on native worker ranks (see the module docstring)."""

    def __init__(self, lib: ctypes.CDLL, f: GGUFFile, model: str, cfg: ModelConfig, n_ctx: int, n_workers: int, threads_per_worker: int = 1,
                 placements: tuple[Placement, ...] = (), log_level: str = "WARNING", n_slots: int = 1, max_tokens: int = 512,
                 step_channel: str = "shm", predictor: str = "", gpu: GpuRankSpec | None = None,
                 layers: tuple[int, int] | None = None) -> None:
        """step_channel "shm": steps through the segment's doorbell (the default); "zmq": a STEP
        message per pass (the protocol's portable form; measured slower, see docs/protocol.md).
        predictor: a .predictor file; each rank then computes its neurons' gate and up rows
        sparsely (kernels/sparse_rows.h); the merge is the dense one.
        gpu: the GPU worker joins as a rank that computes that share of the layers (coordinator/gpu_rank.py).
        layers (first, stop): a pipeline stage's pool (coordinator/cluster/stage_pool.py): the ranks
        build and run only these layers, a step's stream entering them through the segment."""
        if max_tokens < 1:
            raise InvalidArgumentError(f"batch size must be positive, got {max_tokens}")
        self.lib, self.cfg = lib, cfg
        self.plan: ShardPlan = plan_shards(cfg, n_workers)
        self.ranks: tuple[RankShard, ...] = plan_ranks(cfg, n_workers, sparse=bool(predictor))
        self.f = f  # the head below points into its mapping: keep it alive as long as this executor
        self.head = weight(f, "token_embd.weight" if cfg.tied_embeddings else "output.weight")  # file rows, for refinement
        self._row = np.empty(max(cfg.d_model, self.head.cols), dtype=np.float32)
        self._cand = np.empty(self.head.rows, dtype=np.int32)
        self._config = PoolConfig(model, n_workers, n_ctx, threads_per_worker, placements, log_level, predictor, n_slots, "shm", "", max_tokens,
                                  gpu.layers if gpu is not None else (), gpu.attn_layers if gpu is not None else (),
                                  gpu.hot_json() if gpu is not None else "", tuple(layers) if layers is not None else ())
        if layers is not None and (gpu is not None or not 0 <= layers[0] < layers[1] <= cfg.n_layers):
            raise InvalidArgumentError(f"a stage's layers {layers} must be a range of the model's {cfg.n_layers}, without a GPU rank")
        self.layers = layers
        self.gpu_spec = gpu
        self.gpu: GpuWorkerProcess | None = None
        self.max_tokens = max_tokens
        self.step_channel = step_channel
        self._answers = np.zeros((n_workers, 5), dtype=np.int64)  # pi_door_wait: rc, compute ns, wait ns, syncs, GPU-wait ns per rank
        self.stats = PoolStats()
        self.step_no = 0
        self.seg: Segment | None = None
        self.pool: WorkerPool | None = None
        self._start()

    def _start(self) -> None:
        c = self._config
        self.seg = create_segment(self.lib, self.cfg, c.n_workers, c.max_t, gpu=self.gpu_spec is not None)
        try:
            self.pool = WorkerPool(replace(c, shm=self.seg.path))
            if self.gpu_spec is not None:
                self.gpu = self.gpu_spec.start(self.lib, self.seg, c.n_workers, c.max_t)
        except BaseException:
            self.close()
            raise
        self.seg.unlink()  # every rank has it mapped: from here a killed coordinator leaves no file behind
        seg = self.seg
        self.pool.after_send = lambda: self.lib.pi_door_control(seg.base)
        self._gen = 0

    # -- the Executor interface ----------------------------------------------------------------

    def execute(self, batch: Batch) -> np.ndarray:
        """One step through the doorbell: logits refined here from the segment (a decode step, the
        last chunk of a prompt), or the final hidden states and the head as a second call."""
        want = batch.want
        if (want is Want.LAST or want is Want.EACH) and len(batch) <= self.max_tokens:
            return self.native_step(batch.ids, batch.positions, batch.slots, want is Want.EACH, REFINE_MARGIN, REFINE)
        hidden = self.forward_ids(batch.ids, batch.positions, batch.slots)
        return answer(want, hidden, self.cfg.vocab_size, self.logits, self.refine, self.decode_logits)

    def describe(self) -> Description:
        cfg, pids = self.cfg, self.pids
        where = pinning_text(self._config.placements)
        n, t = len(self.ranks), self._config.threads_per_worker
        ranks = "each a native rank of every layer, merging in shared memory" if n > 1 else "a native rank of every layer"
        lines = [f"placement  {n} CPU worker process{'es' if n > 1 else ''} of {t} thread{'s' if t > 1 else ''} ({where}), {ranks}; "
                 "coordinator: steps, refinement of the best logits, sampling",
                 "shards     " + ", ".join(f"w{i}: q heads {r.q0}-{r.q1 - 1}, neurons {r.n0}-{r.n1 - 1}, rows {r.d0}-{r.d1 - 1}"
                                          for i, r in enumerate(self.ranks))]
        spec = self.gpu_spec
        if spec is not None:  # the GPU worker is one more rank (coordinator/gpu_rank.py)
            on, split = spec.layers, spec.split_layers
            hot = sum(len(spec.setup.plan.hot[i]) for i in split)
            parts = [f"{len(on)}/{cfg.n_layers} whole layers ({layer_runs_text(on)}) handed over as the residual stream"] if on else []
            if split:
                parts.append(f"in {len(split)} layers ({layer_runs_text(split)}) the attention of {len(spec.attn_layers)} and {hot} hot "
                             "neurons, the cold ones on the CPU ranks")
            lines.append(f"placement  GPU worker (pid {pids[-1]}) as a rank of the pool: {'; '.join(parts)}; "
                         f"{mib(self.gpu_bytes)} of a {mib(spec.setup.budget)} budget")
        merge = merge_latencies_ns(self._seg) if self.seg is not None else np.zeros(0)
        return Description(kind="native worker ranks" + (" and a GPU rank" if spec is not None else ""), pids=tuple(pids),
                           placement=tuple(lines), figures=self.stats.figures(len(self.ranks), merge), numbers=self.stats.numbers(merge),
                           steps_match_decode=True, kv_layout=self.kv_layout)

    def set_sparse(self, *, dense: bool | None = None, oracle: bool | None = None) -> None:
        """The ranks' sparse rule is fixed when they load: only the file's rule is available."""
        if dense or oracle:
            raise InvalidArgumentError("the worker ranks compute their predictor's rule, fixed at load; "
                                       "dense or oracle FFNs need --executor inprocess")

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights the CPU ranks compute from (the GPU rank's device bytes: gpu_bytes)."""
        return sum(r.weight_bytes for r in self._pool.ready)

    @property
    def gpu_bytes(self) -> int:
        return self.gpu.weight_bytes if self.gpu is not None else 0

    @property
    def pids(self) -> list[int]:
        """The CPU ranks' processes, then the GPU rank's when there is one."""
        return self._pool.pids + (self.gpu.pids if self.gpu is not None else [])

    @property
    def logit_rows(self) -> int:
        return self._seg.layout.logit_rows

    def native_step(self, ids: Ints, positions: Ints, slots: Ints, each: bool, margin: float, k: int) -> np.ndarray:
        """One forward pass of T tokens -> decode logits of the last row [1, V] or each row [T, V]
        (8-bit head, best candidates refined in float32), like NativeDecoder.step."""
        T = len(ids)
        if not 1 <= T <= self.max_tokens or len(positions) != T or len(slots) != T:
            raise InvalidArgumentError(f"a step takes 1..{self.max_tokens} tokens with one position and slot each")
        if each and T > self.logit_rows:
            return self.decode_logits(self.forward_ids(ids, positions, slots), margin, k)
        self._step(ids, positions, slots, 2 if each else 1)
        return self._refined(T, each, margin, k)

    def _refined(self, T: int, each: bool, margin: float, k: int) -> np.ndarray:
        """The last step's logits (each row's, or the last row's) from the segment, the best refined in float32."""
        n = T if each else 1
        out = np.array(self._seg.logits[:n])
        hidden = self._seg.hidden[:T] if each else self._seg.hidden[T - 1 : T]
        self._refine_best(out, np.ascontiguousarray(hidden), margin, k)
        return out

    def forward_ids(self, ids: Ints, positions: Ints, slots: Ints) -> np.ndarray:
        """Tokens -> final-normed hidden states [T, d] (chunks of max_tokens)."""
        ids_a = np.ascontiguousarray(ids, dtype=np.int64)
        pos_a = np.ascontiguousarray(positions, dtype=np.int64)
        sl_a = np.ascontiguousarray(slots, dtype=np.int64)
        out = np.empty((ids_a.size, self.cfg.d_model), dtype=np.float32)
        for a in range(0, ids_a.size, self.max_tokens):
            b = min(a + self.max_tokens, ids_a.size)
            self._step(ids_a[a:b], pos_a[a:b], sl_a[a:b], 0)
            out[a:b] = self._seg.hidden[: b - a]
        return out

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """hidden [T, d] final-normed -> 8-bit head logits [T, V] (every rank its columns)."""
        h = np.ascontiguousarray(hidden, dtype=np.float32)
        out = np.empty((h.shape[0], self.cfg.vocab_size), dtype=np.float32)
        rows = self.logit_rows
        for a in range(0, h.shape[0], rows):
            b = min(a + rows, h.shape[0])
            chunk = h[a:b]
            self._call(lambda req: LogitsMsg(req=req, step=self.step_no, layer=self.cfg.n_layers, tensors=(chunk,)), "computing the output head")
            out[a:b] = self._seg.logits[: b - a]
        return out

    def decode_logits(self, hidden: np.ndarray, margin: float, k: int) -> np.ndarray:
        out = self.logits(hidden)
        self._refine_best(out, np.ascontiguousarray(hidden, dtype=np.float32), margin, k)
        return out

    def refine(self, logits: np.ndarray, hidden: np.ndarray, idx: np.ndarray) -> None:
        """logits [T, V] at idx [T, R] := hidden [T, d] . those head rows in float32 (from the file)."""
        h = np.ascontiguousarray(hidden, dtype=np.float32)
        ix = np.ascontiguousarray(idx, dtype=np.int64)
        if self.lib.pi_refine(ctypes.byref(self.head), h.ctypes.data, h.shape[0], ix.ctypes.data, ix.shape[1], logits.ctypes.data,
                              logits.shape[1], self._row.ctypes.data):
            raise InvalidArgumentError("head rows to refine are outside the vocabulary")

    kv_layout = "native"  # the KV cache as the native decoder keeps it (cpu_workers/kv_file.py)

    def save_kv(self, slot: int, n: int, path: str, offset: int) -> None:
        """Every rank writes its kv heads of slot's first n positions into path (its header written)."""
        self._kv(0, slot, n, path, offset)

    def load_kv(self, slot: int, n: int, path: str, offset: int) -> None:
        self._kv(1, slot, n, path, offset)

    def _kv(self, op: int, slot: int, n: int, path: str, offset: int) -> None:
        if self.gpu_spec is not None:
            raise InvalidArgumentError("slot save and restore are not available with a GPU rank: its layers' KV cache lives on the GPU")
        pool = self._pool
        req = pool.next_req()
        msg = KvMsg(req=req, op=op, slot=slot, n=n, path=path, offset=offset)
        try:  # no merge is involved: a rank's error leaves the pool as it was
            pool.call({i: msg for i in range(len(self.ranks))}, req, "saving a slot" if op == 0 else "restoring a slot", expect=ResultMsg)
        except WorkerDiedError:
            raise
        except WorkerError as e:
            raise InvalidArgumentError(f"the slot could not be {'saved' if op == 0 else 'restored'}: {e}") from None

    def merge_latencies_ns(self) -> np.ndarray:
        """The ranks' latest merge latencies (ns, up to comm.h's ring per rank), since reset_stats."""
        return merge_latencies_ns(self._seg)

    def reset_stats(self) -> None:
        """Zero the step statistics and the ranks' latency rings (between steps: no rank writes them)."""
        self.stats.reset()
        self._seg.lat[:] = 0

    def check_health(self, what: str = "idle") -> None:
        """Raise WorkerDiedError when a rank, the GPU rank included, exited or stopped beating."""
        self._pool.check_health(what)
        if self.gpu is not None:
            self.gpu.check_health(what)

    def restart(self) -> None:
        log.warning("restarting the worker pool")
        self.close()
        self._start()

    def close(self) -> None:
        if self.gpu is not None:
            self.gpu.close(timeout=1.0)
            self.gpu = None
        if self.pool is not None:
            self.pool.close(timeout=1.0)
            self.pool = None
        if self.seg is not None:
            self.seg.close()
            self.seg = None

    # -- internals -----------------------------------------------------------------------------

    @property
    def _pool(self) -> WorkerPool:
        if self.pool is None:
            raise WorkerDiedError("the worker pool is closed")
        return self.pool

    @property
    def _seg(self) -> Segment:
        if self.seg is None:
            raise WorkerDiedError("the worker pool is closed")
        return self.seg

    def _refine_best(self, out: np.ndarray, hidden: np.ndarray, margin: float, k: int) -> None:
        if self.lib.pi_refine_best(ctypes.byref(self.head), hidden.ctypes.data, out.shape[0], out.ctypes.data, margin, k,
                                   self._cand.ctypes.data, self._row.ctypes.data):
            raise InvalidArgumentError("the head's rows could not be refined")

    def _step(self, ids: Sequence[int] | np.ndarray, positions: Sequence[int] | np.ndarray, slots: Sequence[int] | np.ndarray, mode: int) -> None:
        """One forward pass through the doorbell (or, with step_channel "zmq", a STEP message)."""
        self.step_no += 1
        seg = self._seg
        T = len(ids)
        seg.io[0, :T] = ids
        seg.io[1, :T] = positions  # also what a GPU rank reads, whichever channel the step takes
        seg.io[2, :T] = slots
        if self.step_channel == "zmq":
            t = (np.asarray(ids, dtype=np.int64), np.asarray(positions, dtype=np.int64), np.asarray(slots, dtype=np.int64))
            self._call(lambda req: StepMsg(req=req, step=self.step_no, mode=mode, tensors=t), "computing a step")
            return
        self._gen += 1
        t0 = time.perf_counter()
        out = self._answers
        deferred: KeyboardInterrupt | None = None
        try:
            while True:
                try:
                    # posting the same generation twice is harmless, so an interrupt right after
                    # the post (before this loop notes it) only makes it ring again
                    self.lib.pi_door_post(seg.base, self._gen, T, mode)
                    while (rc := self.lib.pi_door_wait(seg.base, self._gen, WAIT_SLICE_MS, out.ctypes.data)) != 0:
                        if rc != 1:  # a rank aborted the pool (its peer died): name the dead one if any
                            _name_the_dead(self)
                            raise WorkerError(f"the step was aborted ({comm_error(rc)})")
                        self.check_health(STEP)  # a slow step, or a dead / stopped rank: WorkerDiedError
                    break
                except KeyboardInterrupt as e:
                    # Ctrl+C mid-step: the ranks are inside the pass; let it finish (milliseconds)
                    # so they and this side stay in step, then stop the caller
                    deferred = e
            bad = [(i, int(out[i, 0])) for i in range(len(self.ranks)) if out[i, 0]]
            if bad:
                _name_the_dead(self)  # a rank that saw its peer die: name the dead one
                i, rc = bad[0]
                raise WorkerError(f"worker {i} failed the step: {comm_error(rc) if rc >= 10 else f'input refused (code {rc})'}")
        except BaseException:
            self.abort()  # wake every rank still waiting in a merge
            raise
        self.stats.add((time.perf_counter() - t0) * 1e6, (out[:, 1] / 1e3).tolist(), (out[:, 2] / 1e3).tolist(), int(out[:, 3].max()),
                       float(out[:, 4].max()) / 1e3)
        if deferred is not None:
            raise deferred

    def _call(self, make: Callable[[int], Message], what: str) -> None:
        """The same message (made for this request id) to every rank; wait for every RESULT."""
        pool = self._pool
        req = pool.next_req()
        msg = make(req)
        msgs = {i: msg for i in range(len(self.ranks))}
        t0 = time.perf_counter()
        try:
            replies = pool.call(msgs, req, what, expect=ResultMsg)
        except (WorkerDiedError, WorkerError) as e:
            self.abort()
            if isinstance(e, WorkerError):
                _name_the_dead(self)  # a rank that saw its peer die: name the dead one
            raise
        # an interrupted wait needs no abort: every rank got the message and finishes it, and
        # the pool ignores replies to an older request
        res = [r for _, r in sorted(replies.items()) if isinstance(r, ResultMsg)]  # in rank order
        self.stats.add((time.perf_counter() - t0) * 1e6, [r.compute_us for r in res], [r.wait_us for r in res], max(r.syncs for r in res))

    def abort(self) -> None:
        """Wake every rank waiting in a merge with an error (a rank died, or the call was abandoned)."""
        if self.seg is not None:
            self.lib.pi_comm_abort(self.seg.base)


def _name_the_dead(ex: NativePoolExecutor, grace_s: float = 0.5) -> None:
    """Raise WorkerDiedError for a worker (or the GPU rank) that is gone. A rank saw its peer die
    through /proc; the exit can reach this process's waitpid a moment later, so look for up to grace_s."""
    deadline = time.monotonic() + grace_s
    while True:
        ex.check_health(STEP)
        if time.monotonic() >= deadline:
            return
        time.sleep(0.01)


def shm_blocker(f: GGUFFile, cfg: ModelConfig, n_workers: int, sparse: bool = False) -> str | None:
    """None when native ranks can run this model (dense or sparse) on n_workers, else why not."""
    from powerinfer.native.decoder_lib import decoder_lib
    from powerinfer.native.decoder import supports

    if decoder_lib() is None:
        return "the native decoder is unavailable (POWERINFER_NATIVE=0, or no C compiler)"
    why = supports(f, cfg)
    if why is not None:
        return f"the native decoder cannot run this model ({why})"
    try:
        plan_ranks(cfg, n_workers, sparse=sparse)
    except InvalidArgumentError as e:
        return str(e)
    return None
