"""Continuous batching on a synthetic model in process: results, cancellation, queue bound, worker failure."""

from __future__ import annotations

import random
import threading
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from powerinfer.api import LLM
from powerinfer.coordinator.sequence import Event, Sequence
from powerinfer.generation import GenerationChunk
from powerinfer.protocol import WorkerDiedError
from powerinfer.sampling import SamplingParams
from powerinfer.server.metrics import ServerMetrics
from powerinfer.server.scheduler import QueueFullError, Scheduler, ShuttingDownError

GREEDY = SamplingParams(temperature=0)
PROMPTS = [[256, 72, 101, 108], [256, 119, 111, 114, 108, 100, 33], [256, 65, 66], [256, 1, 2, 3, 4, 5, 6, 7, 8, 9], [256, 10]]


@pytest.fixture(scope="module")
def llm(make_model: Callable[..., Path]) -> Iterator[LLM]:
    m = LLM(make_model(arch="llama", qtype=QT.Q4_0, n_layers=2), n_ctx=48, executor="inprocess", n_slots=3, n_batch=4)
    yield m
    m.close()


class Collector:
    def __init__(self) -> None:
        self.events: dict[Sequence, list[Event]] = {}  # by the sequence itself: an id() is reused once one is freed
        self.done = threading.Event()
        self.expected = 0
        self.lock = threading.Lock()

    def sink(self, job: Sequence, ev: Event) -> None:
        with self.lock:
            self.events.setdefault(job, []).append(ev)
            if isinstance(ev, BaseException) or (isinstance(ev, GenerationChunk) and ev.finish_reason is not None):
                self.expected -= 1
                if self.expected == 0:
                    self.done.set()

    def jobs(self, llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[Sequence]:
        self.expected += len(prompts)
        return [Sequence(llm.tokenizer, p, max_tokens, GREEDY, sink=self.sink, index=i) for i, p in enumerate(prompts)]

    def tokens(self, job: Sequence) -> list[int]:
        return [e.token for e in self.events[job] if isinstance(e, GenerationChunk) and e.token >= 0]


def run(llm: LLM, max_queue: int = 16) -> Scheduler:
    s = Scheduler(llm, ServerMetrics(llm.engine.n_slots), max_queue)
    s.start()
    return s


def test_batched_jobs_equal_lone_generation(llm: LLM) -> None:
    """5 jobs over 3 slots (so some wait and join later), prompts longer than n_batch (chunked prefill)."""
    alone = [[c.token for c in llm.generate(p, 12, temperature=0) if c.token >= 0] for p in PROMPTS]
    col = Collector()
    sched = run(llm)
    try:
        jobs = col.jobs(llm, PROMPTS, 12)
        sched.submit(jobs)
        assert col.done.wait(60)
        assert [col.tokens(j) for j in jobs] == alone
        reg = sched.metrics.registry
        assert reg.get_sample_value("powerinfer_decode_batch_size_sum") > reg.get_sample_value("powerinfer_decode_batch_size_count")
        assert not sched.active and not sched.waiting
    finally:
        sched.stop()


def test_scored_prompts_match_the_full_logits(llm: LLM) -> None:
    """Prompt logprobs (completions' echo with logprobs) equal log-softmax of LLM.logits, over
    chunked prefill and with the prompt already in a slot's cache; max_tokens 0 generates nothing."""
    prompt = PROMPTS[3]  # 10 tokens: three prefill chunks of n_batch 4
    full = llm.logits(prompt).astype(np.float64)
    want = full - np.log(np.exp(full - full.max(1, keepdims=True)).sum(1, keepdims=True)) - full.max(1, keepdims=True)
    col = Collector()
    sched = run(llm)
    try:
        for max_tokens in (0, 2, 0):  # the second and third find the prompt cached: it is computed again
            col.expected += 1
            job = Sequence(llm.tokenizer, prompt, max_tokens, GREEDY, logprobs=2, score_prompt=True, sink=col.sink)
            sched.submit([job])
            assert col.done.wait(60)
            col.done.clear()
            lps = job.prompt_logprobs
            assert [lp.token for lp in lps] == prompt and lps[0].logprob is None
            got = np.array([lp.logprob for lp in lps[1:]])
            assert np.abs(got - want[np.arange(len(prompt) - 1), prompt[1:]]).max() < 1e-4
            assert all(len(lp.top) == 2 and lp.top[0][2] >= lp.top[1][2] for lp in lps[1:])
            assert len(col.tokens(job)) == max_tokens and job.finish_reason == "length"
    finally:
        sched.stop()


def test_cancel_frees_the_slot_within_one_step_and_queue_is_bounded(llm: LLM) -> None:
    col = Collector()
    sched = run(llm, max_queue=1)
    try:
        jobs = col.jobs(llm, PROMPTS[:3], 40)
        seen: dict[int, int] = {}
        plain = col.sink

        def cancelling(job: Sequence, ev: Event) -> None:  # the client "disconnects" after its 2nd token
            plain(job, ev)
            seen[job.index] = seen.get(job.index, 0) + 1
            if seen[job.index] == 2:
                sched.cancel([job])
                col.expected -= 1
                if col.expected == 0:
                    col.done.set()

        for j in jobs:
            j.sink = cancelling
        sched.submit(jobs)
        with pytest.raises(QueueFullError, match="--parallel 3, --queue 1"):
            sched.submit(col.jobs(llm, PROMPTS[:2], 4))
        col.expected -= 2
        assert col.done.wait(60)
        for _ in range(500):
            if not sched.active:
                break
            threading.Event().wait(0.01)
        assert not sched.active
        assert all(len(col.tokens(j)) <= 3 for j in jobs)  # gone within one decode step
        assert sched.metrics.registry.get_sample_value("powerinfer_sequences_total", {"outcome": "cancelled"}) == 3
        col.done.clear()
        more = col.jobs(llm, [PROMPTS[0]], 3)
        sched.submit(more)
        assert col.done.wait(60)
        assert len(col.tokens(more[0])) == 3
    finally:
        sched.stop()
    with pytest.raises(ShuttingDownError):
        sched.submit(col.jobs(llm, [PROMPTS[0]], 3))


def test_worker_failure_fails_jobs_in_flight_and_recovers(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    real = llm.engine.decode
    calls = {"n": 0, "restarts": 0}

    def flaky(ids: list[int], slots: list[int]):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 2:
            raise WorkerDiedError("worker 0 (pid 1) killed by SIGKILL while computing layer 1")
        return real(ids, slots)

    def restart() -> None:  # the engine core restarts its executor (and forgets every slot's tokens)
        calls["restarts"] += 1

    monkeypatch.setattr(llm.engine, "decode", flaky)
    monkeypatch.setattr(llm.engine.executor, "restart", restart)
    col = Collector()
    sched = run(llm)
    try:
        first = col.jobs(llm, PROMPTS[:2], 8)
        sched.submit(first)
        assert col.done.wait(60)
        assert all(isinstance(col.events[j][-1], WorkerDiedError) for j in first)
        assert calls["restarts"] == 1 and sched.healthy
        col.done.clear()
        after = col.jobs(llm, PROMPTS[2:3], 4)
        sched.submit(after)
        assert col.done.wait(60)
        assert len(col.tokens(after[0])) == 4
    finally:
        sched.stop()


def test_random_overlapping_sequences_equal_lone_generation(make_model: Callable[..., Path]) -> None:
    """Sequences of random prompt and output lengths arrive at random steps and overlap; every
    result equals the same request alone (temperature 0), and the batches cross each of the
    rotary table's growth points (256, 512, 1024) with an older, longer sequence ahead of a
    newer, shorter one: the order that used to index past the table."""
    rng = random.Random(20261203)
    n_ctx = 1100
    path = make_model(arch="llama", qtype=QT.Q4_0, n_layers=2, context_length=2048)
    llm = LLM(path, n_ctx=n_ctx, executor="inprocess", n_slots=4, n_batch=64)
    try:
        p0 = rng.randint(1, 150)
        specs = [(p0, n_ctx - p0 - 10)]  # a long first sequence crosses every boundary
        arrivals = []  # after this many tokens of job 0
        for b in (256, 512, 1024):  # one short job surely decoding behind job 0 as it reaches b ...
            arrivals.append(b - p0 - rng.randint(10, 30))
            specs.append((rng.randint(1, 64), rng.randint(40, 120)))
        for _ in range(7):  # ... and others at random
            arrivals.append(rng.randint(1, specs[0][1] - 20))
            specs.append((rng.randint(1, 300), rng.randint(1, 120)))
        prompts = [[256] + [rng.randrange(256) for _ in range(n - 1)] for n, _ in specs]
        # alone on a model of its own: this one's rotary tables must start small, as a server's do
        with LLM(path, n_ctx=n_ctx, executor="inprocess", n_batch=64) as solo:
            alone = [[c.token for c in solo.generate(p, m, temperature=0) if c.token >= 0] for p, (_, m) in zip(prompts, specs)]
        assert len(alone[0]) == specs[0][1], "the long sequence ended early: nothing crosses the boundaries"
        order = sorted(range(1, len(specs)), key=lambda i: arrivals[i - 1])

        col = Collector()
        col.expected += len(prompts)
        jobs = [Sequence(llm.tokenizer, p, m, GREEDY, sink=col.sink, index=i) for i, (p, (_, m)) in enumerate(zip(prompts, specs))]
        crossed: set[int] = set()
        real = llm.engine.decode

        def recording(ids: list[int], slots: list[int]):  # type: ignore[no-untyped-def]
            pos = [len(llm.engine.slot_tokens[s]) for s in slots]
            crossed.update(b for b in (256, 512, 1024) if b in pos and pos[-1] < b)  # a sequence reaches b, a shorter one is last
            return real(ids, slots)

        sched = run(llm)
        llm.engine.decode = recording  # type: ignore[method-assign]
        plain = col.sink
        pending = [(arrivals[i - 1], jobs[i]) for i in order]

        def arriving(job: Sequence, ev: Event) -> None:  # later jobs arrive as job 0 reaches its arrival points
            plain(job, ev)
            if isinstance(ev, BaseException):  # a failed step: the jobs not yet arrived never will
                col.done.set()
            while job is jobs[0] and pending and len(col.tokens(jobs[0])) >= pending[0][0]:
                sched.submit([pending.pop(0)[1]])

        for j in jobs:
            j.sink = arriving
        try:
            sched.submit(jobs[:1])
            assert col.done.wait(300)
        finally:
            sched.stop()
            llm.engine.decode = real  # type: ignore[method-assign]
        errors = [e for j in jobs for e in col.events.get(j, []) if isinstance(e, BaseException)]
        assert not errors
        assert [col.tokens(j) for j in jobs] == alone
        assert crossed == {256, 512, 1024}
    finally:
        llm.close()


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@pytest.mark.parametrize("n_slots", [2, 4])
def test_cached_tokens_follow_llama_servers_rule(make_model: Callable[..., Path], n_slots: int) -> None:
    """Three conversations interleaved over 2 or 4 slots, one turn at a time and two turns at once:
    each request lands in the free slot whose cache shares the longest prefix with its prompt (the
    least recently used on a tie) and reuses all of that prefix but its last prompt token, as
    llama-server counts ``cached_tokens``. A slot caches its prompt and every generated token but the
    last (which is never evaluated)."""
    m = LLM(make_model(arch="llama", qtype=QT.Q4_0, n_layers=2), n_ctx=96, executor="inprocess", n_slots=n_slots, n_batch=8)
    caches: list[list[int]] = [[] for _ in range(n_slots)]
    used = [0] * n_slots  # order of last use (0: never)
    clock = 0
    history: dict[str, list[int]] = {}
    col = Collector()
    sched = run(m)
    rng = random.Random(n_slots)
    try:
        # "a=": conversation a's last prompt sent again (all of it cached but its last token)
        turns = [["a"], ["b"], ["c"], ["a"], ["a="], ["b"], ["a", "c"], ["b", "a"], ["c="], ["b"], ["b="]]
        last: dict[str, list[int]] = {}
        for group in turns:
            prompts = [last[c[0]] if c.endswith("=") else history.get(c, [256]) + [rng.randrange(60, 250) for _ in range(rng.randrange(3, 9))]
                       for c in group]
            last.update((c[0], p) for c, p in zip(group, prompts))
            want, chosen, free = [], [], set(range(n_slots))
            for p in prompts:  # admission in submission order, each taking the best of the slots still free
                s = max(sorted(free), key=lambda s: (_lcp(p, caches[s]), -used[s]))
                free.discard(s)
                chosen.append(s)
                want.append(min(_lcp(p, caches[s]), len(p) - 1))
            jobs = col.jobs(m, prompts, 3)
            sched.submit(jobs)
            assert col.done.wait(60)
            col.done.clear()
            assert [j.cached for j in jobs] == want, (group, want)
            assert [j.slot for j in jobs] == chosen
            for c, p, s, j in zip(group, prompts, chosen, jobs):
                gen = col.tokens(j)
                history[c[0]] = p + gen
                caches[s] = p + gen[:-1]
                clock += 1
                used[s] = clock
            assert [m.engine.slot_tokens[s] for s in chosen] == [caches[s] for s in chosen]
        assert sum(want) > 0
    finally:
        sched.stop()
        m.close()


def test_lookup_decoding_in_the_scheduler(make_model: Callable[..., Path]) -> None:
    """With lookup on, a lone job's tokens are those of plain decoding, streamed in order, and the
    generation-token counter counts every token of an accepted draft."""
    m = LLM(make_model(arch="llama", qtype=QT.Q4_0, n_layers=2), n_ctx=96, executor="inprocess", n_slots=2, n_batch=8)
    try:
        prompt = [256] + [70, 71, 72, 73] * 6
        plain = [c.token for c in m.generate(prompt, 40, temperature=0) if c.token >= 0]
        m.core.lookup = 4
        col = Collector()
        sched = run(m)
        try:
            jobs = col.jobs(m, [prompt], 40)
            sched.submit(jobs)
            assert col.done.wait(60)
            assert col.tokens(jobs[0]) == plain
            assert m.core.accepted > 0
            assert sched.metrics.registry.get_sample_value("powerinfer_generation_tokens_total") == len(plain)
        finally:
            sched.stop()
    finally:
        m.close()
