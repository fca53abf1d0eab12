"""One model of the daemon: its loading thread, which then runs its scheduler, and its state.

Runs in: the server process. The model's own thread loads it and runs its scheduler loop until
the model is closed (worker processes get PR_SET_PDEATHSIG, which fires when the thread that
started them ends: so the thread that loads a model is the one that serves it).
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Callable

from powerinfer import constrained
from powerinfer.api import LLM
from powerinfer.errors import PowerInferError
from powerinfer.memory import release_freed_memory
from powerinfer.server.metrics import ServerMetrics
from powerinfer.server.requests import APIError
from powerinfer.server.scheduler import Scheduler

if TYPE_CHECKING:
    from powerinfer.config import ModelConfig

log = logging.getLogger(__name__)


class ModelHost:
    """A model the server may serve: unloaded, loading, ready or failed (load_error)."""

    def __init__(self, model_id: str, path: str, load: Callable[[], LLM], metrics: ServerMetrics, queue: int, est_bytes: int = 0) -> None:
        self.model_id, self.path, self.load, self.metrics, self.queue = model_id, path, load, metrics, queue
        self.est_bytes = est_bytes  # what it may hold in memory once loaded (the daemon's budget counts this)
        self.measured = 0  # the most a load of it has measured (bytes, a full KV cache counted)
        self.llm: LLM | None = None
        self.scheduler: Scheduler | None = None
        self.load_error: str | None = None
        self.closing = False
        self.thread: threading.Thread | None = None
        self.ready_event = threading.Event()  # set when ready, failed or closed
        self.last_used = 0.0
        self.leases = 0  # requests holding it now (ServerState.use): it is not unloaded while held
        self.on_load_failure: Callable[[], None] = lambda: None

    @property
    def state(self) -> str:
        if self.scheduler is not None:
            return "loaded"
        if self.thread is not None and self.thread.is_alive() and self.load_error is None:
            return "loading"
        return "failed" if self.load_error is not None else "unloaded"

    @property
    def busy(self) -> bool:
        s = self.scheduler
        return s is not None and bool(s.active or s.waiting or s.calls)

    def start(self) -> None:
        """Load in a thread of its own (a no-op while loading or loaded)."""
        if self.thread is not None and self.thread.is_alive():
            return
        self.load_error, self.closing = None, False
        self.ready_event.clear()
        self.thread = threading.Thread(target=self._run, name=f"powerinfer-model-{self.model_id}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        """Load, then run the scheduler loop here until close()."""
        base = tree_pss()
        try:
            llm = self.load()
        except Exception as e:  # noqa: BLE001 - the request that asked for it (or the daemon's one error line) says it
            log.debug("loading %s failed", self.model_id, exc_info=True)
            self.load_error = str(e) or type(e).__name__
            self.ready_event.set()
            self.on_load_failure()
            return
        if self.closing:
            llm.close()
            self.ready_event.set()
            return
        try:  # one small forward pass: the first request should not pay for lazy initialisation
            llm.engine.eval([0, 0], slot=0)
            llm.engine.rewind(0, slot=0)
        except PowerInferError as e:
            log.warning("warm-up pass failed: %s", e)
        if constrained.available():  # built once here, not on the event loop at the first structured request
            constrained.grammar_tokenizer(llm.tokenizer, llm.config.vocab_size)
        # measured now (the KV cache is committed as it fills: counted whole), so the budget holds what it really takes
        grown = tree_pss() - base
        kv = kv_bytes(llm.config, llm.n_ctx, llm.engine.n_slots)
        log.info("%s takes %.0f MiB loaded, up to %.0f MiB more with every slot full (estimated %.0f MiB in all)", self.model_id,
                 grown / 2**20, kv / 2**20, self.est_bytes / 2**20)
        # A later load can read less than the first (the server's heap reuses what another model freed,
        # and gives it back when that model loads again): a model is counted at the most it has measured.
        self.measured = max(self.measured, max(0, grown) + kv)
        self.est_bytes = self.measured
        sched = Scheduler(llm, self.metrics, self.queue)
        self.llm, self.scheduler = llm, sched
        self.last_used = time.monotonic()
        self.metrics.healthy.set(1)
        self.ready_event.set()
        log.info("model ready: %s, %d slots of %d tokens", self.model_id, llm.engine.n_slots, llm.n_ctx)
        try:
            sched.run()
        finally:
            self.llm = self.scheduler = None
            llm.close()
            del llm, sched
            # the grammar tokenizers are cached by tokenizer (a 262k-token vocabulary's takes ~0.2 GB):
            # drop them, or the unloaded model's stays; a model still loaded rebuilds its own on first use
            constrained.grammar_tokenizer.cache_clear()
            gc.collect()  # the model's arrays go now, not at some later collection
            release_freed_memory()  # and the heap they leave goes back to the OS, for the next model's room

    def ready(self) -> tuple[LLM, Scheduler]:
        if self.load_error is not None:
            raise APIError(503, f"the model {self.model_id!r} failed to load: {self.load_error}", type="server_error",
                           code="model_load_failed")
        llm, sched = self.llm, self.scheduler
        if llm is None or sched is None:
            raise APIError(503, f"the model {self.model_id!r} is loading", type="server_error", code="loading", headers={"Retry-After": "5"})
        self.last_used = time.monotonic()
        return llm, sched

    def drain(self) -> None:
        self.closing = True
        if self.scheduler is not None:
            self.scheduler.drain()

    def abort(self) -> None:
        if self.scheduler is not None:
            self.scheduler.stop(timeout=0.0)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the scheduler (aborting what runs) and the workers; the model's memory is freed."""
        self.closing = True
        if self.scheduler is not None:
            self.scheduler.stop()
        if self.thread is not None and self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(timeout)
        self.llm = self.scheduler = None


def kv_bytes(cfg: "ModelConfig", n_ctx: int, n_slots: int) -> int:
    """A KV cache of every slot full (float32): what a loaded model's memory may still grow by."""
    return cfg.n_layers * cfg.n_kv_heads * (cfg.head_dim + cfg.v_head_dim) * 4 * n_ctx * n_slots


def estimate_bytes(path: str, n_ctx: int | None, n_slots: int, n_workers: int) -> int:
    """A model's memory once loaded, before it is measured (a generous guess: its file twice, as the
    workers repack some weights beside the mapped file; a full KV cache; each of the n_workers worker
    processes' interpreter)."""
    from powerinfer.config import config_from_gguf
    from powerinfer.gguf_file import GGUFFile

    cfg = config_from_gguf(GGUFFile(path))  # the metadata only: the mapping goes with the object
    ctx = min(4096 if n_ctx is None else n_ctx or cfg.context_length, cfg.context_length)  # -c as LLM reads it
    return 2 * os.path.getsize(path) + kv_bytes(cfg, ctx, n_slots) + n_workers * WORKER_BYTES + RUNTIME_BYTES


def tree_pss() -> int:
    """Proportional set size of this process and its children (the workers), bytes."""
    import psutil

    me = psutil.Process()
    total = 0
    for p in [me, *me.children(recursive=True)]:
        try:
            total += p.memory_full_info().pss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total


WORKER_BYTES = 100 << 20  # a worker process's interpreter, numpy and native library
RUNTIME_BYTES = 128 << 20  # the coordinator's own share of a model (head refinement rows, tokenizer, torch on first use)
