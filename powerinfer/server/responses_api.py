"""A basic ``POST /v1/responses`` (OpenAI's Responses API): text or messages in, one output message
out, streamed as ``response.*`` events.

Runs in: the server process (HTTP side, on the event loop).

What it takes: ``input`` (a string, or a list of messages ``{"role", "content"}`` whose content is a
string or ``input_text`` / ``output_text`` parts), ``instructions`` (a system message),
``max_output_tokens``, ``temperature``, ``top_p``, ``stream``, and the chat parameters the
chat endpoint takes (``seed``, ``stop``, ``logit_bias``...). It is stateless: ``previous_response_id``,
``store``, built-in tools and function tools are refused with a 400 naming the field (the chat
endpoint has tool calling). Streaming sends ``response.created``, ``response.in_progress``,
``response.output_item.added``, ``response.content_part.added``, ``response.output_text.delta``
(one per piece of text), then the matching ``.done`` events and ``response.completed`` (or
``response.incomplete`` when ``max_output_tokens`` cut it), each with a ``sequence_number``.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from typing import Any, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from powerinfer.server import reasoning
from powerinfer.server.requests import APIError, ChatRequest, bad, parse_chat
from powerinfer.coordinator.sequence import Event, Sequence
from powerinfer.server.scheduler import Scheduler
from powerinfer.server.streaming import collect, failure, watch_disconnect

REFUSED = ("previous_response_id", "tools", "conversation", "background", "prompt")


def to_chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """A Responses request as the chat endpoint's body (validated there)."""
    body = {k: v for k, v in body.items() if not (k == "tools" and v == [])}  # no tools: nothing to refuse
    for key in REFUSED:
        if body.get(key) not in (None, [], False):
            raise bad(f"'{key}' is not supported by this server's /v1/responses (stateless, no tools; "
                      "use /v1/chat/completions for tool calling)", key)
    inp = body.get("input")
    msgs: list[dict[str, Any]] = []
    if isinstance(body.get("instructions"), str):
        msgs.append({"role": "system", "content": body["instructions"]})
    elif body.get("instructions") is not None:
        raise bad("'instructions' must be a string", "instructions", "invalid_type")
    if isinstance(inp, str):
        msgs.append({"role": "user", "content": inp})
    elif isinstance(inp, list) and inp:
        for i, m in enumerate(inp):
            if not isinstance(m, dict) or m.get("type", "message") != "message" or m.get("role") not in ("user", "assistant", "system", "developer"):
                raise bad(f"input[{i}] must be a message with role user, assistant, system or developer", f"input[{i}]")
            content = m.get("content")
            if isinstance(content, list):
                texts = []
                for k, part in enumerate(content):
                    if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") \
                            or not isinstance(part.get("text"), str):
                        raise bad(f"input[{i}].content[{k}]: only text parts are supported", f"input[{i}].content[{k}]")
                    texts.append(part["text"])
                content = "".join(texts)
            msgs.append({"role": m["role"], "content": content})
    else:
        raise bad("'input' must be a string or a non-empty list of messages", "input",
                  "missing_required_parameter" if inp is None else "invalid_type")
    chat = {k: v for k, v in body.items() if k not in ("input", "instructions", "max_output_tokens", "store", "text", "reasoning",
                                                         "metadata", "user", "truncation", "include", "parallel_tool_calls",
                                                         "tool_choice", "stream_options")}
    chat["messages"] = msgs
    effort = body.get("reasoning")
    if isinstance(effort, dict) and effort.get("effort") is not None:  # Responses' {"effort": ...} -> the chat's reasoning_effort
        chat["reasoning_effort"] = effort["effort"]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":  # Responses' flat form of the chat one
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema")}}
    elif isinstance(fmt, dict) and fmt.get("type") == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise bad("'text.format.type' must be 'text', 'json_object' or 'json_schema'", "text.format.type")
    return chat


# the chat parameters a Responses body's fields became, back to the names the client sent
_RENAMED = (("max_tokens", "max_output_tokens"), ("reasoning_effort", "reasoning.effort"), ("messages", "input"), ("response_format.json_schema.schema", "text.format.schema"),
            ("response_format.json_schema.name", "text.format.name"), ("response_format", "text.format"))


class Shape:
    """The bodies of one response (its ids and creation time shared)."""

    def __init__(self, model: str, body: dict[str, Any]) -> None:
        self.id, self.msg_id, self.rs_id = "resp_" + secrets.token_hex(12), "msg_" + secrets.token_hex(12), "rs_" + secrets.token_hex(12)
        self.created, self.model = time.time(), model
        self.params = {k: body.get(k) for k in ("temperature", "top_p", "max_output_tokens", "instructions")}

    def response(self, status: str, text: str | None, usage: dict[str, Any] | None = None, incomplete: str | None = None,
                 thought: str = "") -> dict[str, Any]:
        """thought: a reasoning model's, the output's first item (server/reasoning.py)."""
        out = [] if text is None else [self.message(text, "completed" if status == "completed" else "incomplete")]
        if thought and text is not None:
            out.insert(0, self.reasoning(thought, "completed"))
        return {"id": self.id, "object": "response", "created_at": self.created, "model": self.model, "status": status,
                "output": out, "parallel_tool_calls": False, "tool_choice": "none", "tools": [], "error": None,
                "incomplete_details": {"reason": incomplete} if incomplete else None, "usage": usage, **self.params}

    def reasoning(self, thought: str, status: str) -> dict[str, Any]:
        return {"type": "reasoning", "id": self.rs_id, "status": status, "summary": [],
                "content": [{"type": "reasoning_text", "text": thought}] if thought else []}

    def message(self, text: str, status: str) -> dict[str, Any]:
        return {"type": "message", "id": self.msg_id, "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _usage(prompt: int, output: int, cached: int) -> dict[str, Any]:
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0}, "output_tokens": output,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + output}


def _sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()


async def respond(request: Request, body: dict[str, Any], req: ChatRequest, prompt: list[int], sched: Scheduler, model: str,
                  submit: Callable[..., tuple[list[Sequence], "asyncio.Queue[tuple[int, Event]]"]], think: bool | None = None) -> Response:
    """think: whether the reply starts inside a thought (None: no reasoning split; generate.thinking)."""
    if req.common.n != 1:
        raise bad("'n' is not a Responses parameter", "n")
    jobs, queue = submit(req.common, [prompt])
    shape = Shape(model, body)
    if req.common.stream:
        return StreamingResponse(_events(shape, sched, jobs, queue, len(prompt), think), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    watcher = asyncio.ensure_future(watch_disconnect(request, sched, jobs, queue))
    try:
        results = await collect(queue, 1)
    finally:
        watcher.cancel()
        sched.cancel([j for j in jobs if not j.finished])
    r = results[0]
    status, reason = ("incomplete", "max_output_tokens") if r.finish_reason == "length" else ("completed", None)
    cached = jobs[0].cached
    thought, text = reasoning.split("".join(r.text), think) if think is not None else ("", "".join(r.text))
    return JSONResponse(shape.response(status, text, _usage(len(prompt), r.tokens, cached), reason, thought))


async def _events(shape: Shape, sched: Scheduler, jobs: list[Sequence], queue: "asyncio.Queue[tuple[int, Event]]",
                  n_prompt: int, think: bool | None = None) -> AsyncIterator[bytes]:
    """The Responses stream: a reasoning item first when the model thinks (its text as
    reasoning_text deltas), then the message; each item is added when its first text comes."""
    seq = 0
    state = {"reasoning": "none", "message": "none"}  # none -> open -> done
    thought: list[str] = []
    text: list[str] = []

    def ev(kind: str, **data: Any) -> bytes:
        nonlocal seq
        seq += 1
        return _sse(kind, {"type": kind, "sequence_number": seq - 1, **data})

    def where(item: str) -> dict[str, Any]:
        if item == "reasoning":
            return {"item_id": shape.rs_id, "output_index": 0, "content_index": 0}
        return {"item_id": shape.msg_id, "output_index": 1 if state["reasoning"] != "none" else 0, "content_index": 0}

    def close_reasoning() -> list[bytes]:
        if state["reasoning"] != "open":
            return []
        state["reasoning"] = "done"
        full = "".join(thought)
        return [ev("response.reasoning_text.done", **where("reasoning"), text=full),
                ev("response.output_item.done", output_index=0, item=shape.reasoning(full, "completed"))]

    def open_message() -> list[bytes]:
        if state["message"] != "none":
            return []
        out = close_reasoning()
        state["message"] = "open"
        w = where("message")
        return [*out, ev("response.output_item.added", output_index=w["output_index"], item={**shape.message("", "in_progress"), "content": []}),
                ev("response.content_part.added", **w, part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})]

    def pieces(th: str, ct: str) -> list[bytes]:
        out: list[bytes] = []
        if th:
            if state["reasoning"] == "none":
                state["reasoning"] = "open"
                out.append(ev("response.output_item.added", output_index=0, item={**shape.reasoning("", "in_progress")}))
            thought.append(th)
            out.append(ev("response.reasoning_text.delta", **where("reasoning"), delta=th))
        if ct:
            out += open_message()
            text.append(ct)
            out.append(ev("response.output_text.delta", **where("message"), delta=ct, logprobs=[]))
        return out

    splitter = reasoning.ThinkSplitter(think) if think is not None else None
    try:
        yield ev("response.created", response=shape.response("in_progress", None))
        yield ev("response.in_progress", response=shape.response("in_progress", None))
        if splitter is None:  # no thought can come: the message opens at once, as before any text
            for b in open_message():
                yield b
        tokens, finish = 0, None
        while finish is None:
            _, e = await queue.get()
            if isinstance(e, BaseException):
                err = failure(e).body()["error"]
                yield ev("error", code=err["code"], message=err["message"], param=None)
                return
            tokens += e.token >= 0
            th, ct = splitter.push(e.text) if splitter is not None and e.text else ("", e.text)
            finish = e.finish_reason
            if finish is not None and splitter is not None:
                more, rest = splitter.finish()
                th, ct = th + more, ct + rest
            for b in pieces(th, ct):
                yield b
        for b in open_message():  # a reply that was all thought still has its (empty) message
            yield b
        full = "".join(text)
        status, reason = ("incomplete", "max_output_tokens") if finish == "length" else ("completed", None)
        w = where("message")
        yield ev("response.output_text.done", **w, text=full, logprobs=[])
        yield ev("response.content_part.done", **w, part={"type": "output_text", "text": full, "annotations": [], "logprobs": []})
        yield ev("response.output_item.done", output_index=w["output_index"],
                 item=shape.message(full, "completed" if status == "completed" else "incomplete"))
        cached = jobs[0].cached
        yield ev(f"response.{status}", response=shape.response(status, full, _usage(n_prompt, tokens, cached), reason, "".join(thought)))
    finally:
        sched.cancel([j for j in jobs if not j.finished])


def parse(body: dict[str, Any]) -> tuple[dict[str, Any], ChatRequest]:
    """The chat body a Responses body becomes and its parsed request; an error names the Responses
    parameter (max_output_tokens, input[i]), not the chat one it was checked as."""
    chat = to_chat_body(body)
    try:
        return chat, parse_chat(chat)
    except APIError as e:
        renamed = False
        for old, new in _RENAMED:  # the most specific first: the first that matches renames the parameter
            if not renamed and e.param is not None and (e.param == old or e.param.startswith((old + "[", old + "."))):
                e.param, renamed = new + e.param[len(old):], True
            e.message = e.message.replace(f"'{old}", f"'{new}").replace(f"{old}[", f"{new}[")
        raise
