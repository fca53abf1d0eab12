"""Parsing and validating OpenAI request bodies into typed requests; errors in OpenAI's shape.

Runs in: the server process (HTTP side, on the event loop).

Everything a client can send is checked here, so that bad input is a 4xx naming the parameter
and never reaches the model: JSON itself (NaN/Infinity literals, nesting depth), field types
(a bool is not a number), ranges, and sizes (stop strings, messages, n).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from powerinfer.chat import RESERVED_VARIABLES
from powerinfer.errors import InvalidArgumentError
from powerinfer.sampling import SamplingParams
from powerinfer.server import reasoning, tools
from powerinfer.server.api_errors import APIError, bad
from powerinfer.server.structured import compile_grammar, parse_grammar

MAX_N = 16  # choices per request
MAX_STOP = 16  # OpenAI allows 4; llama.cpp clients send a few more
MAX_STOP_LEN = 1024
MAX_MESSAGES = 4096
MAX_DEPTH = 64  # JSON nesting the server is willing to parse
MAX_TOKENS_CAP = 1 << 20


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def _depth(text: str) -> int:
    """Deepest bracket nesting of a JSON text (outside strings), counted without recursion."""
    depth = best = 0
    in_str = esc = False
    for ch in text:
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            best = max(best, depth)
        elif ch in "]}":
            depth -= 1
    return best


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the body is not valid UTF-8 ({e.reason} at byte {e.start})", code="invalid_json") from None
    if _depth(text) > MAX_DEPTH:
        raise APIError(400, f"JSON nested deeper than {MAX_DEPTH} levels", code="invalid_json")
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        raise APIError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object", code="invalid_json")
    return body


# -- field readers: each checks the JSON type strictly (bool is not an int) ------------------------


def _num(body: Mapping[str, Any], key: str, default: float, lo: float, hi: float, *, lo_open: bool = False) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(float(v)):
        raise bad(f"'{key}' must be a number", key, "invalid_type")
    if not (lo < v if lo_open else lo <= v) or v > hi:
        raise bad(f"'{key}' must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}", key)
    return float(v)


def _int(body: Mapping[str, Any], key: str, default: int | None, lo: int, hi: int) -> int | None:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(f"'{key}' must be an integer", key, "invalid_type")
    if not lo <= v <= hi:
        raise bad(f"'{key}' must be in [{lo}, {hi}], got {v}", key)
    return v


def _bool(body: Mapping[str, Any], key: str, default: bool) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"'{key}' must be true or false", key, "invalid_type")
    return v


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise bad("'stop' must be a string or a list of strings", "stop", "invalid_type")
    if len(items) > MAX_STOP:
        raise bad(f"at most {MAX_STOP} stop sequences are allowed, got {len(items)}", "stop")
    if any(not s or len(s) > MAX_STOP_LEN for s in items):
        raise bad(f"stop sequences must be 1..{MAX_STOP_LEN} characters", "stop")
    return tuple(items)


@dataclass(frozen=True)
class GenerationRequest:
    """What both endpoints share once parsed."""

    model: str | None
    max_tokens: int  # -1: until end-of-generation or the context is full; 0: the prompt only scored (echo)
    sampling: SamplingParams
    stop: tuple[str, ...]
    n: int
    stream: bool
    include_usage: bool
    logprobs: int | None  # None: off; k: the token's logprob and k alternatives
    grammar: str | None = None  # a compiled llguidance grammar the output must follow (server/structured.py)


@dataclass(frozen=True)
class ChatRequest:
    common: GenerationRequest
    messages: tuple[dict[str, str], ...]  # plain turns for the chat template (tool calls and results rendered: server/tools.py)
    tools: Any = None  # server.tools.ToolSpec, or None: the reply is text
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)  # more chat-template variables (server/reasoning.py)
    reasoning_format: str | None = None  # this request's --reasoning-format (None: the server's)


@dataclass(frozen=True)
class CompletionRequest:
    common: GenerationRequest
    prompts: tuple[str | tuple[int, ...], ...]  # one or more; choice i answers prompt i // n
    echo: bool


MAX_LOGIT_BIAS = 1024  # entries


def _logit_bias(v: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} (bias in [-100, 100]) or llama.cpp's [[id, bias or false], ...]
    (false bans the token) -> sorted (id, bias) pairs; a ban is -inf. Ids are checked against the
    vocabulary by the server (:func:`check_logit_bias`)."""
    if v is None:
        return ()
    if isinstance(v, dict):
        items = list(v.items())
    elif isinstance(v, list) and all(isinstance(p, list) and len(p) == 2 for p in v):
        items = [(p[0], p[1]) for p in v]
    else:
        raise bad("'logit_bias' must be an object of token id -> bias, or a list of [token id, bias] pairs", "logit_bias", "invalid_type")
    if len(items) > MAX_LOGIT_BIAS:
        raise bad(f"'logit_bias' has {len(items)} entries; at most {MAX_LOGIT_BIAS}", "logit_bias")
    out: dict[int, float] = {}
    for k, b in items:
        try:
            tok = int(k) if isinstance(k, str) and k.strip().lstrip("-").isdigit() else k
        except ValueError:
            tok = k
        if not isinstance(tok, int) or isinstance(tok, bool) or tok < 0:
            raise bad(f"'logit_bias' keys must be token ids (non-negative integers), got {k!r}", "logit_bias")
        if b is False:
            out[tok] = -math.inf
            continue
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b) or not -100 <= b <= 100:
            raise bad(f"'logit_bias' values must be numbers in [-100, 100] (or false to ban), got {b!r} for token {tok}", "logit_bias")
        out[tok] = float(b)
    return tuple(sorted(out.items()))


def check_logit_bias(params: SamplingParams, vocab: int) -> None:
    """400 when a biased token id is outside the model's vocabulary."""
    for tok, _ in params.logit_bias:
        if tok >= vocab:
            raise bad(f"'logit_bias' names token {tok}; the vocabulary has {vocab} tokens", "logit_bias")


def _common(body: Mapping[str, Any], default_max_tokens: int, logprobs: int | None, zero_ok: bool = False) -> GenerationRequest:
    """zero_ok: max_tokens 0 is allowed (completions with echo: the prompt scored, nothing generated)."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("'model' must be a string", "model", "invalid_type")
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, key, default_max_tokens, -1, MAX_TOKENS_CAP)
    if max_tokens == 0 and not zero_ok:
        raise bad(f"'{key}' must be at least 1 (0 only on /v1/completions with echo: the prompt is scored, nothing generated)", key)
    seed = _int(body, "seed", -1, -(2**63), 2**64 - 1)
    stream = _bool(body, "stream", False)
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise bad("'stream_options' must be an object", "stream_options", "invalid_type")
    include_usage = _bool(opts or {}, "include_usage", False)
    if opts is not None and not stream:
        raise bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
    bias = _logit_bias(body.get("logit_bias"))
    try:
        sampling = SamplingParams(
            temperature=_num(body, "temperature", 1.0, 0.0, 2.0),
            top_p=_num(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
            top_k=int(_int(body, "top_k", 0, 0, 1 << 30) or 0),
            min_p=_num(body, "min_p", 0.0, 0.0, 1.0),
            repeat_penalty=_num(body, "repeat_penalty", 1.0, 0.0, 10.0, lo_open=True),
            repeat_last_n=int(_int(body, "repeat_last_n", 64, -1, 1 << 30) or 0),
            frequency_penalty=_num(body, "frequency_penalty", 0.0, -2.0, 2.0),
            presence_penalty=_num(body, "presence_penalty", 0.0, -2.0, 2.0),
            seed=int(seed or 0) % (2**32) if seed is not None and seed >= 0 else -1,
            logit_bias=bias,
        )
    except InvalidArgumentError as e:
        raise bad(str(e)) from None

    return GenerationRequest(model, -1 if max_tokens is None else int(max_tokens), sampling, _stop(body), int(_int(body, "n", 1, 1, MAX_N) or 1),
                             stream, include_usage, logprobs, parse_grammar(body))


def _content(v: Any, i: int) -> str:
    """A message's content: a string, or OpenAI's list of parts (text parts only)."""
    if isinstance(v, str):
        return v
    if v is None:
        return ""
    if isinstance(v, list):
        out = []
        for part in v:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"messages[{i}].content: only text parts are supported", f"messages[{i}].content")
            out.append(part["text"])
        return "".join(out)
    raise bad(f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content", "invalid_type")


def parse_chat(body: Mapping[str, Any]) -> ChatRequest:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty list", "messages", "invalid_type" if msgs is not None else "missing_required_parameter")
    if len(msgs) > MAX_MESSAGES:
        raise bad(f"at most {MAX_MESSAGES} messages are allowed", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object", f"messages[{i}]", "invalid_type")
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise bad(f"messages[{i}].role must be system, developer, user, assistant or tool", f"messages[{i}].role")
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": _content(m.get("content"), i)}
        if role == "assistant" and m.get("tool_calls") is not None:
            msg["tool_calls"] = _tool_calls(m["tool_calls"], i)
        if role == "tool":
            for key in ("tool_call_id", "name"):
                if m.get(key) is not None and not isinstance(m[key], str):
                    raise bad(f"messages[{i}].{key} must be a string", f"messages[{i}].{key}", "invalid_type")
                msg[key] = m.get(key)
        out.append(msg)
    logprobs = None
    if _bool(body, "logprobs", False):
        logprobs = int(_int(body, "top_logprobs", 0, 0, 20) or 0)
    elif body.get("top_logprobs") is not None:
        raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    spec = tools.parse_tools(body)
    common = _common(body, -1, logprobs)
    call_grammar = tools.grammar(spec) if spec is not None else None
    if call_grammar is not None:
        if common.grammar is not None:
            raise bad("a required tool call and a response format cannot both constrain the reply", "tool_choice")
        common = replace(common, grammar=compile_grammar("lark", call_grammar, "tools"))
    try:
        kwargs = reasoning.template_kwargs(body, RESERVED_VARIABLES)
    except ValueError as e:
        raise bad(str(e), "chat_template_kwargs" if "chat_template_kwargs" in str(e) else "reasoning_effort") from None
    fmt = body.get("reasoning_format")
    if fmt is not None and fmt not in reasoning.FORMATS:
        raise bad(f"'reasoning_format' must be one of {', '.join(reasoning.FORMATS)}", "reasoning_format")
    return ChatRequest(common, tuple(tools.render(out, spec)), spec, kwargs, fmt)


def _tool_calls(v: Any, i: int) -> list[dict[str, Any]]:
    """An assistant message's tool_calls -> [{"name", "arguments" (parsed JSON, or the text), "id" (or None)}]."""
    if not isinstance(v, list):
        raise bad(f"messages[{i}].tool_calls must be a list", f"messages[{i}].tool_calls", "invalid_type")
    calls = []
    for k, c in enumerate(v):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments", ""), str):
            raise bad(f"messages[{i}].tool_calls[{k}] must be {{'function': {{'name': str, 'arguments': str}}}}",
                      f"messages[{i}].tool_calls[{k}]")
        try:
            args: Any = json.loads(fn.get("arguments") or "{}")
        except json.JSONDecodeError:
            args = fn.get("arguments")
        calls.append({"name": fn["name"], "arguments": args, "id": c.get("id") if isinstance(c.get("id"), str) else None})
    return calls


def parse_completion(body: Mapping[str, Any]) -> CompletionRequest:
    p = body.get("prompt")
    if p is None:
        raise bad("'prompt' is required", "prompt", "missing_required_parameter")

    def one(v: Any) -> str | tuple[int, ...] | None:
        if isinstance(v, str):
            return v
        if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
            return tuple(v)
        return None

    single = one(p)
    if single is not None:
        prompts: tuple[str | tuple[int, ...], ...] = (single,)
    elif isinstance(p, list) and p and all(one(v) is not None for v in p):
        prompts = tuple(one(v) for v in p)  # type: ignore[misc]
    else:
        raise bad("'prompt' must be a string, a list of token ids, or a list of those", "prompt", "invalid_type")
    lp = _int(body, "logprobs", None, 0, 5)
    echo = _bool(body, "echo", False)
    common = _common(body, 16, lp, zero_ok=echo)
    # OpenAI's parameters that we do not implement are refused, not silently ignored
    if body.get("suffix") not in (None, ""):
        raise bad("'suffix' (fill-in-the-middle) is not supported", "suffix")
    best_of = _int(body, "best_of", None, 1, MAX_N)
    if best_of is not None and best_of not in (1, common.n):
        raise bad("'best_of' is not supported (ask for n choices with logprobs and rank them instead)", "best_of")
    if len(prompts) * common.n > MAX_N:
        raise bad(f"{len(prompts)} prompts x n={common.n} choices exceed {MAX_N} per request", "prompt")
    return CompletionRequest(common, prompts, echo)
