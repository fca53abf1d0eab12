"""The generation endpoints' common path: a parsed request's prompts to token ids, its jobs to the
scheduler, and its answer back (whole or streamed), with a reasoning model's thought split out.

Runs in: the server process (HTTP side: the handlers and a worker thread for tokenizing).
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import Request

from powerinfer.api import LLM
from powerinfer.constrained import TokenConstraint
from powerinfer.errors import InvalidArgumentError, PowerInferError
from powerinfer.sampling import SamplingParams
from powerinfer.server import reasoning, tools
from powerinfer.server.compat import cached_tokens, job_timings
from powerinfer.server.requests import APIError, ChatRequest, CompletionRequest, GenerationRequest, bad, check_logit_bias
from powerinfer.server.responses import Shapes
from powerinfer.coordinator.sequence import Event, Sequence
from powerinfer.server.scheduler import Scheduler
from powerinfer.server.settings import ServerConfig
from powerinfer.server.streaming import collect, event_queue, stream, submit, watch_disconnect

THINK_TAIL_TOKENS = 8  # prompt tokens read back to see whether the template left a thought open


def prompt_ids(llm: LLM, req: ChatRequest | CompletionRequest) -> list[list[int]]:
    """Tokenize the request's prompts (one for chat; in a worker thread: a long prompt takes a moment)."""
    check_logit_bias(req.common.sampling, llm.config.vocab_size)
    param = "messages" if isinstance(req, ChatRequest) else "prompt"
    out = []
    for i, prompt in enumerate([None] if isinstance(req, ChatRequest) else req.prompts):
        where = param if isinstance(req, ChatRequest) or len(req.prompts) == 1 else f"prompt[{i}]"
        try:
            if isinstance(req, ChatRequest):
                ids = llm.chat_ids(list(req.messages), req.template_kwargs)
            elif isinstance(prompt, str):
                ids = llm.tokenize(prompt, add_bos=True, special=True)  # as llama-server: "<|im_start|>" is that token
            else:
                ids = list(prompt or ())
                vocab = llm.config.vocab_size
                if any(not 0 <= t < vocab for t in ids):
                    raise bad(f"token ids must be in [0, {vocab})", where)
        except PowerInferError as e:
            raise bad(str(e), where) from None
        if not ids:
            raise bad("the prompt is empty", where)
        if len(ids) >= llm.n_ctx:
            raise APIError(400, f"the prompt has {len(ids)} tokens; this server's context is {llm.n_ctx} (one is needed for the reply; "
                                f"the server's -c/--ctx-size sets it, up to the model's {llm.config.context_length})",
                           param=where, code="context_length_exceeded")
        out.append(ids)
    return out


def submit_jobs(llm: LLM, sched: Scheduler, common: GenerationRequest, prompts: list[list[int]],
                config: ServerConfig, score_prompt: bool = False,
                spec: tools.ToolSpec | None = None) -> tuple[list[Sequence], "asyncio.Queue[tuple[int, Event]]"]:
    """Queue a request's sequences (choice i answers prompt i // n, sampled as choice i % n); their
    events arrive on the returned queue (on this event loop) as (choice index, chunk or error).
    score_prompt: the prompts' logprobs too (completions with echo and logprobs). spec: the chat's
    tools; with several calls allowed, a reply ends where it repeats a call (tools.RepeatGuard)."""
    max_tokens = config.n_predict if common.max_tokens == -1 else common.max_tokens
    queue, sink = event_queue()

    vocab = llm.config.vocab_size

    def constraint() -> TokenConstraint | None:
        if common.grammar is None:
            return None
        try:
            return TokenConstraint(llm.tokenizer, vocab, common.grammar)
        except InvalidArgumentError as e:  # e.g. it names tokens this vocabulary lacks
            raise bad(str(e), "grammar") from None

    jobs = [Sequence(llm.tokenizer, ids, max_tokens, choice_sampling(common.sampling, j), common.stop, common.logprobs,
                     constraint(), score_prompt, tools.RepeatGuard() if spec is not None and spec.parallel else None,
                     sink=sink, index=p * common.n + j)
            for p, ids in enumerate(prompts) for j in range(common.n)]
    submit(sched, jobs)
    return jobs, queue


def thinking(llm: LLM, req: ChatRequest | CompletionRequest, prompts: list[list[int]], config: ServerConfig) -> list[bool] | None:
    """Per prompt, whether its reply starts inside a thought; None: no reasoning split (completions,
    or --reasoning-format / the request's reasoning_format none)."""
    if not isinstance(req, ChatRequest) or (req.reasoning_format or config.reasoning_format) == "none":
        return None
    return [reasoning.opens_thinking(llm.tokenizer.decode(ids[-THINK_TAIL_TOKENS:], skip_special=False)) for ids in prompts]


async def run_jobs(request: Request, llm: LLM, sched: Scheduler, req: ChatRequest | CompletionRequest, prompts: list[list[int]],
                   config: ServerConfig) -> Response:
    common: GenerationRequest = req.common
    scored = isinstance(req, CompletionRequest) and req.echo and common.logprobs is not None
    spec = req.tools if isinstance(req, ChatRequest) else None
    jobs, queue = submit_jobs(llm, sched, common, prompts, config, scored, spec)
    shapes = Shapes("chat" if isinstance(req, ChatRequest) else "completion", config.model_id)
    # the prompt as written: its special tokens' text too, not a BOS the server added
    echo = [llm.tokenizer.decode(ids, skip_special=False, strip_bos=True) if isinstance(req, CompletionRequest) and req.echo else ""
            for ids in prompts for _ in range(common.n)]
    n_prompt = sum(len(ids) for ids in prompts)
    opens = thinking(llm, req, prompts, config)
    think = [opens[i // common.n] for i in range(len(jobs))] if opens is not None else None  # by choice index
    if common.stream:
        return StreamingResponse(stream(shapes, sched, jobs, queue, common, n_prompt, echo, spec, think), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    # The client may hang up while tokens are flowing: a watcher waits for uvicorn's disconnect
    # message (the body is read, so receive() returns nothing else) and cancels the jobs at once,
    # so the slot is free within one decode step and the job counts as cancelled, not ok.
    watcher = asyncio.ensure_future(watch_disconnect(request, sched, jobs, queue))
    try:
        results = await collect(queue, len(jobs))
    finally:
        watcher.cancel()
        sched.cancel([j for j in jobs if not j.finished])
    for job in jobs:
        results[job.index].prompt_logprobs = job.prompt_logprobs
    body = shapes.final(results, n_prompt, common.logprobs is not None, echo, cached=cached_tokens(jobs, common.n))
    if think is not None:
        for choice in body["choices"]:
            thought, choice["message"]["content"] = reasoning.split(choice["message"]["content"], think[choice["index"]])
            if thought:
                choice["message"]["reasoning_content"] = thought
    if spec is not None:
        tools.apply_to_final(body, spec)
    body["timings"] = job_timings(jobs, sum(r.tokens for r in results))
    return JSONResponse(body)


def choice_sampling(params: SamplingParams, index: int) -> SamplingParams:
    """Choice i of a seeded request samples with seed + i: reproducible, yet the n choices differ."""
    return params if params.seed < 0 or index == 0 else replace(params, seed=(params.seed + index) % 2**32)
