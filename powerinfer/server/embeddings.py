"""Embeddings: OpenAI's ``/v1/embeddings`` and llama-server's ``/embedding``, pooled from the
model's final hidden state.

Runs in: the server process (HTTP side); the hidden states are computed by the scheduler thread
(an embedding job is a sequence that is prefilled and pooled, never sampled: coordinator/engine_core.py).

Each input is one job in its own KV slot, so a request of many inputs is computed as the slots
allow, between the decode steps of the chats being served. The vector is the mean of the final
(normed) hidden states over the input's tokens (``--pooling mean``, the default) or the last one's
(``--pooling last``, for models trained to put the summary there), scaled to unit length as
OpenAI's are, so cosine similarity is a dot product. ``encoding_format: "base64"`` (the openai
client's default) sends little-endian float32 bytes.
"""

from __future__ import annotations

import asyncio
import base64
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from powerinfer.api import LLM
from powerinfer.coordinator.sequence import Embedded, Sequence
from powerinfer.errors import PowerInferError
from powerinfer.sampling import SamplingParams
from powerinfer.server.requests import APIError, bad
from powerinfer.server.scheduler import Scheduler
from powerinfer.server.streaming import ClientGone, event_queue, failure, submit, watch_disconnect

MAX_INPUTS = 2048  # OpenAI's limit per request
POOLINGS = ("mean", "last")


@dataclass(frozen=True)
class EmbeddingRequest:
    model: str | None
    inputs: tuple[str | tuple[int, ...], ...]
    base64: bool  # encoding_format "base64"
    dimensions: int | None
    oai: bool  # /v1/embeddings' body, else llama-server's /embedding ([{index, embedding: [[...]]}])


def _one(v: Any, where: str) -> str | tuple[int, ...]:
    if isinstance(v, str):
        if not v:
            raise bad(f"{where} is empty", where)
        return v
    if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        return tuple(v)
    raise bad(f"{where} must be a non-empty string or a non-empty list of token ids", where, "invalid_type")


def parse(body: Mapping[str, Any], oai: bool) -> EmbeddingRequest:
    key = "input" if oai or "input" in body else "content"
    raw = body.get(key)
    if raw is None:
        raise bad(f"'{key}' is required", key, "missing_required_parameter")
    # one input: a string or a list of token ids; several: a list of those
    if isinstance(raw, list) and raw and all(isinstance(x, (str, list)) for x in raw):
        items = [_one(x, f"{key}[{i}]") for i, x in enumerate(raw)]
    else:
        items = [_one(raw, key)]
    if len(items) > MAX_INPUTS:
        raise bad(f"at most {MAX_INPUTS} inputs per request", key)
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise bad("'encoding_format' must be 'float' or 'base64'", "encoding_format")
    dims = body.get("dimensions")
    if dims is not None and (not isinstance(dims, int) or isinstance(dims, bool) or dims < 1):
        raise bad("'dimensions' must be a positive integer", "dimensions", "invalid_type")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("'model' must be a string", "model", "invalid_type")
    return EmbeddingRequest(model, tuple(items), fmt == "base64", dims, oai)


def token_ids(llm: LLM, req: EmbeddingRequest) -> list[list[int]]:
    """Each input's tokens (BOS as the model wants it), each within the context (in a worker thread)."""
    vocab, out = llm.config.vocab_size, []
    for i, item in enumerate(req.inputs):
        where = "input" if len(req.inputs) == 1 else f"input[{i}]"
        try:
            ids = llm.tokenize(item, add_bos=True, special=True) if isinstance(item, str) else list(item)
        except PowerInferError as e:
            raise bad(str(e), where) from None
        if any(not 0 <= t < vocab for t in ids):
            raise bad(f"token ids must be in [0, {vocab})", where)
        if len(ids) > llm.n_ctx:
            raise APIError(400, f"{where} has {len(ids)} tokens; this server's context is {llm.n_ctx} (-c/--ctx-size)",
                           param=where, code="context_length_exceeded")
        out.append(ids)
    return out


def unit(v: np.ndarray) -> np.ndarray:
    norm = float(np.linalg.norm(v))
    return v / np.float32(norm) if norm > 0 else v


async def respond(request: Request, req: EmbeddingRequest, llm: LLM, sched: Scheduler, model_id: str, pooling: str) -> Response:
    if req.dimensions is not None and req.dimensions != llm.config.d_model:
        raise bad(f"this model's embeddings have {llm.config.d_model} dimensions; 'dimensions' cannot change that", "dimensions")
    prompts = await run_in_threadpool(token_ids, llm, req)
    queue, sink = event_queue()
    greedy = SamplingParams(temperature=0)
    jobs = [Sequence(llm.tokenizer, ids, 0, greedy, pooling=pooling, sink=sink, index=i) for i, ids in enumerate(prompts)]
    submit(sched, jobs)
    watcher = asyncio.ensure_future(watch_disconnect(request, sched, jobs, queue))
    vectors: dict[int, np.ndarray] = {}
    try:
        while len(vectors) < len(jobs):
            idx, ev = await queue.get()
            if isinstance(ev, ClientGone):
                raise APIError(499, "client disconnected")
            if isinstance(ev, BaseException):
                raise failure(ev)
            if isinstance(ev, Embedded):
                vectors[idx] = unit(ev.vector.astype(np.float32))
    finally:
        watcher.cancel()
        sched.cancel([j for j in jobs if not j.finished])
    n_tokens = sum(len(p) for p in prompts)

    def encode(v: np.ndarray) -> list[float] | str:
        return base64.b64encode(v.astype("<f4").tobytes()).decode() if req.base64 else [float(x) for x in v]

    if not req.oai:  # llama-server's /embedding: one pooled vector per input, inside a list
        return JSONResponse([{"index": i, "embedding": [encode(vectors[i])]} for i in range(len(jobs))])
    return JSONResponse({"object": "list", "model": model_id,
                         "data": [{"object": "embedding", "index": i, "embedding": encode(vectors[i])} for i in range(len(jobs))],
                         "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}})
