"""Continuous batching: many sequences share the workers, one batched decode step at a time.

Runs in: the server process (the coordinator), in one thread that alone touches the model.

Each choice of each request is one :class:`~powerinfer.coordinator.sequence.Sequence` (the same
object from the HTTP handler that makes it to the engine core that steps it; "job" below). Up to
``n_slots`` jobs are active, each in its own KV-cache slot; the rest wait in a bounded FIFO. Every loop iteration (a "step"):

1. cancelled jobs (client gone) leave, freeing their slot;
2. waiting jobs take free slots (the slot whose cached tokens share the longest prefix with the
   prompt, so a chat's next turn reuses its history);
3. the engine core (coordinator/engine_core.py, the same loop ``LLM.generate`` runs) advances one
   job in prefill by one chunk of ``n_batch`` prompt tokens and every job in decode by one token
   in a single batched forward pass.

Jobs join and leave only between steps. A batched row is bit-identical to the same sequence
decoded alone (attention is per slot; norms, projections and the head refinement are per row),
so temperature-0 output does not depend on who else is being served.

Results go to each job's ``sink`` (called from this thread; the HTTP side makes it thread-safe).
A worker failure fails the jobs in flight with the error, has the engine core (which owns
supervision) restart its executor and carries on with the waiting jobs; ``healthy`` is False until
the restart is done.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from typing import Callable, TypeVar

from powerinfer.api import LLM
from powerinfer.coordinator.sequence import Embedded, Sequence
from powerinfer.errors import PowerInferError
from powerinfer.generation import GenerationChunk
from powerinfer.protocol import WorkerDiedError, WorkerError
from powerinfer.server.metrics import ServerMetrics

log = logging.getLogger(__name__)

T = TypeVar("T")
HEALTH_CHECK_S = 0.5  # how often an idle scheduler checks its workers


class QueueFullError(PowerInferError):
    """More jobs are waiting than --queue allows; the client should retry later."""


class ShuttingDownError(PowerInferError):
    """The server is stopping and takes no new work."""


class Scheduler:
    def __init__(self, llm: LLM, metrics: ServerMetrics, max_queue: int) -> None:
        self.llm = llm
        self.core = llm.core
        self.metrics = metrics
        self.max_queue = max_queue
        self.n_slots = llm.engine.n_slots
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.active: list[Sequence] = []
        self.cond = threading.Condition()
        self.stopping = False
        self.draining = False  # shutting down: no new jobs; those running may finish
        self.healthy = True
        self.thread: threading.Thread | None = None
        self.calls: collections.deque[tuple[Callable[[], object], concurrent.futures.Future[object]]] = collections.deque()

    # -- called from the HTTP side -------------------------------------------------------------

    def start(self) -> None:
        """Run the loop in a new thread (the server runs it in the thread that loaded the model:
        worker processes get PR_SET_PDEATHSIG, which fires when the thread that started them ends)."""
        self.thread = threading.Thread(target=self.run, name="powerinfer-scheduler", daemon=True)
        self.thread.start()

    def submit(self, jobs: list[Sequence]) -> None:
        """Queue all jobs of one request, or none (QueueFullError / ShuttingDownError)."""
        with self.cond:
            if self.stopping or self.draining:
                raise ShuttingDownError("the server is shutting down")
            # room = free slots + the queue beyond them
            if len(self.active) + len(self.waiting) + len(jobs) > self.n_slots + self.max_queue:
                raise QueueFullError(f"the server is full: {len(self.active)} sequences running, {len(self.waiting)} waiting "
                                     f"(--parallel {self.n_slots}, --queue {self.max_queue})")
            self.waiting.extend(jobs)
            self.metrics.waiting.set(len(self.waiting))
            self.cond.notify()

    def between_steps(self, fn: Callable[[], T], timeout: float = 600.0) -> T:
        """Run fn in the scheduler thread between two steps (it alone touches the model) and
        return its result or raise its error; call from any other thread."""
        fut: concurrent.futures.Future[object] = concurrent.futures.Future()
        with self.cond:
            if self.stopping or self.draining:
                raise ShuttingDownError("the server is shutting down")
            self.calls.append((fn, fut))
            self.cond.notify()
        return fut.result(timeout)  # type: ignore[return-value]

    def _run_calls(self) -> None:
        while True:
            with self.cond:
                if not self.calls:
                    return
                fn, fut = self.calls.popleft()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                with self.core.guard():  # a worker that dies meanwhile fails the running jobs as a step would
                    fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - the caller gets the error
                fut.set_exception(e)
                if isinstance(e, (WorkerDiedError, WorkerError)):
                    self._fail_active(e)
                    self._restart()

    def cancel(self, jobs: list[Sequence]) -> None:
        for job in jobs:
            job.cancelled.set()
        with self.cond:
            self.cond.notify()

    def drain(self) -> None:
        """Shutdown begins: refuse new jobs and fail the queued ones now (ShuttingDownError, so
        their clients hear it at once instead of at the deadline); running jobs go on."""
        with self.cond:
            self.draining = True
            jobs, self.waiting = list(self.waiting), collections.deque()
            self.metrics.waiting.set(0)
        err = ShuttingDownError("the server is shutting down")
        for job in jobs:
            self._end(job, err)

    def stop(self, timeout: float = 5.0) -> None:
        """Abort every job and end the thread."""
        with self.cond:
            self.stopping = True
            self.cond.notify()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout)

    # -- the loop (scheduler thread) -----------------------------------------------------------

    def run(self) -> None:
        """The loop; returns after stop()."""
        last_check = time.monotonic()
        while True:
            with self.cond:
                if self.stopping:
                    break
                if not self.active and not self.waiting and not self.calls:
                    self.cond.wait(HEALTH_CHECK_S)
                    if time.monotonic() - last_check >= HEALTH_CHECK_S:
                        last_check = time.monotonic()
                        self._check_workers()
                    continue
            self._run_calls()
            if not self.active and not self.waiting:
                continue
            try:
                self._step()
            except (WorkerDiedError, WorkerError) as e:
                log.error("worker failure: %s", e)
                self._fail_active(e)
                self._restart()
            except Exception as e:  # noqa: BLE001 - a bug must fail the requests in flight, not kill the server
                log.exception("scheduler step failed")
                self._fail_active(e)
        err = ShuttingDownError("the server is shutting down")
        with self.cond:
            jobs, self.waiting = [*self.active, *self.waiting], collections.deque()
            self.active = []
            calls, self.calls = list(self.calls), collections.deque()
        for _, fut in calls:
            fut.set_exception(err)
        for job in jobs:
            self.core.remove(job)
            self._end(job, err)

    def _step(self) -> None:
        self._drop_cancelled()
        if not self.active:
            # the pool was idle: a worker that died since the last idle check (every
            # HEALTH_CHECK_S) is replaced now, not discovered by the new request's first step
            self._check_workers()
        self._admit()
        outs = self.core.step()
        if self.core.last_batch:
            self.metrics.batch_size.observe(self.core.last_batch)
        for out in outs:
            job = out.seq
            if out.prompt_tokens:
                self.metrics.prompt_tokens.inc(out.prompt_tokens)
            if out.embedding is not None:
                job.t_first = job.t_end = time.monotonic()
                self.metrics.requests.labels("ok").inc()
                job.finished = True
                self._release(job)
                job.send(Embedded(out.embedding))
            elif out.chunks or out.first or not out.prompt_tokens:
                self._emit(job, out.chunks, max(1, out.sampled))

    def _drop_cancelled(self) -> None:
        with self.cond:
            gone = [j for j in self.waiting if j.cancelled.is_set()]
            for j in gone:
                self.waiting.remove(j)
                j.finished = True
                self.metrics.requests.labels("cancelled").inc()
            self.metrics.waiting.set(len(self.waiting))
        for j in [j for j in self.active if j.cancelled.is_set()]:
            j.finished = True
            self._release(j)
            self.metrics.requests.labels("cancelled").inc()

    def _admit(self) -> None:
        with self.cond:
            while self.waiting and len(self.active) < self.n_slots:
                job = self.waiting.popleft()
                self.core.add(job)
                if job.cached:
                    self.metrics.prompt_tokens_cache.inc(job.cached)
                self.active.append(job)
            self.metrics.waiting.set(len(self.waiting))
            self.metrics.running.set(len(self.active))

    def _emit(self, job: Sequence, chunks: list[GenerationChunk], sampled: int = 1) -> None:
        """sampled tokens (one, or more from a lookup draft) were sampled for job: their chunks,
        possibly none while a stop string may start."""
        now = time.monotonic()
        if not job.t_first:
            job.t_first = now
            self.metrics.ttft.observe(now - job.t_submit)
        self.metrics.generation_tokens.inc(sampled)
        if job.done:
            job.t_end = now
        for c in chunks:
            job.send(c)
        if job.done:
            n = job.completion_tokens
            if n > 1:
                self.metrics.tpot.observe((now - job.t_first) / (n - 1))
            self.metrics.requests.labels("ok").inc()
            job.finished = True
            self._release(job)

    def _release(self, job: Sequence) -> None:
        self.core.remove(job)
        if job in self.active:
            self.active.remove(job)
        self.metrics.running.set(len(self.active))

    def _end(self, job: Sequence, error: BaseException) -> None:
        if not job.finished:
            job.finished = True
            self.metrics.requests.labels("error").inc()
            job.send(error)

    def _fail_active(self, error: BaseException) -> None:
        jobs, self.active = self.active, []
        for job in jobs:
            self.core.remove(job)
        self.metrics.running.set(0)
        for job in jobs:
            self._end(job, error)

    def _check_workers(self) -> None:
        try:
            self.core.check_health()
        except (WorkerDiedError, WorkerError) as e:
            log.error("worker check failed: %s", e)
            self._fail_active(e)
            self._restart()

    def _restart(self) -> None:
        """The engine core restarts its executor (new workers hold no KV cache: every slot starts empty)."""
        self.healthy = False
        self.metrics.healthy.set(0)
        try:
            self.core.restart()
        except Exception:  # noqa: BLE001 - stay unhealthy; the next health check tries again
            log.exception("restarting the workers failed")
            return
        self.healthy = True
        self.metrics.healthy.set(1)
