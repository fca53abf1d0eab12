"""Answers on their way out: collecting a request's choices, streaming them as server-sent events
(tool calls held back and sent whole), a client that hangs up, and runtime failures as API errors.

Runs in: the server process (HTTP side, on the event loop).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator, Callable

from starlette.requests import Request

from powerinfer.generation import GenerationChunk
from powerinfer.protocol import WorkerDiedError, WorkerError
from powerinfer.server import reasoning, tools
from powerinfer.server.compat import cached_tokens, job_timings
from powerinfer.server.requests import APIError, GenerationRequest
from powerinfer.server.responses import ChoiceResult, Shapes, sse
from powerinfer.coordinator.sequence import Event, Sequence
from powerinfer.server.scheduler import QueueFullError, Scheduler, ShuttingDownError


def failure(e: BaseException) -> APIError:
    if isinstance(e, (WorkerDiedError, WorkerError)):
        return APIError(503, f"the runtime failed while serving this request: {e}", type="server_error", code="worker_failed",
                        headers={"Retry-After": "2"})
    if isinstance(e, ShuttingDownError):
        return APIError(503, str(e), type="server_error", code="shutting_down")
    return APIError(500, f"internal error: {type(e).__name__}", type="server_error", code="internal_error")


def event_queue() -> tuple["asyncio.Queue[tuple[int, Event]]", Callable[[Sequence, Event], None]]:
    """A request's queue on this event loop, and the sink the scheduler thread feeds it through:
    (choice index, chunk or error) per event."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()

    def sink(job: Sequence, ev: Event) -> None:  # scheduler thread -> event loop
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening any more
            loop.call_soon_threadsafe(queue.put_nowait, (job.index, ev))

    return queue, sink


def submit(sched: Scheduler, jobs: list[Sequence]) -> None:
    """Queue a request's jobs, or answer 429 (queue full) / 503 (shutting down)."""
    try:
        sched.submit(jobs)
    except QueueFullError as e:
        raise APIError(429, str(e), type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"}) from None
    except ShuttingDownError as e:
        raise APIError(503, str(e), type="server_error", code="shutting_down", headers={"Retry-After": "5"}) from None


class ClientGone(Exception):
    """Queued by the disconnect watcher: the client of a non-streaming request hung up."""


async def watch_disconnect(request: Request, sched: Scheduler, jobs: list[Sequence], queue: "asyncio.Queue[tuple[int, Event]]") -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
    sched.cancel([j for j in jobs if not j.finished])
    queue.put_nowait((-1, ClientGone()))


async def collect(queue: "asyncio.Queue[tuple[int, Event]]", n: int) -> list[ChoiceResult]:
    results = [ChoiceResult(i) for i in range(n)]
    open_ = n
    while open_:
        idx, ev = await queue.get()
        if isinstance(ev, ClientGone):
            raise APIError(499, "client disconnected")
        if isinstance(ev, BaseException):
            raise failure(ev)
        r = results[idx]
        r.text.append(ev.text)
        if ev.token >= 0:
            r.tokens += 1
        r.logprobs.extend(ev.logprobs)
        if ev.finish_reason is not None:
            r.finish_reason = ev.finish_reason
            open_ -= 1
    return results


async def stream(shapes: Shapes, sched: Scheduler, jobs: list[Sequence], queue: "asyncio.Queue[tuple[int, Event]]",
                 common: GenerationRequest, prompt_tokens: int, echo: list[str], spec: tools.ToolSpec | None = None,
                 think: list[bool] | None = None) -> AsyncIterator[bytes]:
    """SSE events until every choice finished; leaving early (client gone) cancels the jobs. With
    tools, text that may be a tool call is held back and the calls go out whole at the end. think:
    by choice index, whether the reply starts inside a thought (None: no reasoning split); the
    thought goes out as ``delta.reasoning_content``."""
    held = {j.index: tools.ToolStream(spec) for j in jobs} if spec is not None else {}
    thoughts = {j.index: reasoning.ThinkSplitter(think[j.index]) for j in jobs} if think is not None else {}
    try:
        for j in jobs:
            yield sse(shapes.chunk(j.index, "" if shapes.chat else echo[j.index], role=True))
        open_, tokens = len(jobs), 0
        # completions' text_offset counts from the echoed prompt, as in one answer
        offset = {j.index: 0 if shapes.chat else len(echo[j.index]) for j in jobs}
        # echo with logprobs: the prompt's logprobs, known once its prefill is done (before the
        # choice's first event), go out as one event of their own
        scored = {j.index: j for j in jobs if j.score_prompt}
        while open_:
            idx, ev = await queue.get()
            if isinstance(ev, BaseException):
                yield sse(failure(ev).body())
                return
            chunk: GenerationChunk = ev
            state = scored.pop(idx, None)
            if state is not None and state.prompt_logprobs:
                yield sse(shapes.chunk(idx, "", logprobs=list(state.prompt_logprobs)))
            tokens += chunk.token >= 0
            lps = list(chunk.logprobs) or None
            thought, text = thoughts[idx].push(chunk.text) if thoughts and chunk.text else ("", chunk.text)
            if chunk.finish_reason is not None and thoughts:
                more, rest = thoughts[idx].finish()
                thought, text = thought + more, text + rest
            text = held[idx].push(text) if held and text else text
            if thought:
                yield sse(shapes.chunk(idx, None, reasoning=thought, logprobs=None if text else lps))
            if text or (lps and not thought):
                yield sse(shapes.chunk(idx, text, logprobs=lps, offset=offset[idx]))
            if chunk.finish_reason is not None:
                reason = chunk.finish_reason
                if held:
                    rest, calls = held[idx].finish()
                    if rest:
                        yield sse(shapes.chunk(idx, rest))
                    if calls:
                        yield sse(tools.calls_delta(shapes.chunk(idx, None), calls))
                        reason = "tool_calls"
                yield sse(shapes.chunk(idx, None if shapes.chat else "", finish_reason=reason))
                open_ -= 1
        if common.include_usage:
            last = shapes.usage_chunk(prompt_tokens, tokens, cached=cached_tokens(jobs, common.n))
            last["timings"] = job_timings(jobs, tokens)
            yield sse(last)
        yield sse("[DONE]")
    finally:
        sched.cancel([j for j in jobs if not j.finished])

