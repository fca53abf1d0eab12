"""Request parsing: every bad body is an APIError naming the parameter, never an exception of another kind."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from powerinfer.server.requests import MAX_DEPTH, APIError, parse_chat, parse_completion, parse_json

CHAT = [{"role": "user", "content": "hi"}]


def test_parse_json_rejects_what_json_rfc_does_not_allow() -> None:
    for raw, code in [(b"{", "invalid_json"), (b"[1]", "invalid_json"), (b'{"a": NaN}', "invalid_json"),
                      (b'{"a": -Infinity}', "invalid_json"), (b"\xff\xfe{}", "invalid_json"),
                      (b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1), "invalid_json"),
                      (b'{"a": ' + b"[" * 100000 + b"]" * 100000 + b"}", "invalid_json")]:
        with pytest.raises(APIError) as e:
            parse_json(raw)
        assert e.value.status == 400 and e.value.code == code
    assert parse_json(b'{"s": "[[[[", "n": 1}') == {"s": "[[[[", "n": 1}  # brackets inside strings are not nesting


def test_chat_defaults_and_fields() -> None:
    r = parse_chat({"model": "m", "messages": CHAT})
    assert r.common.max_tokens == -1 and r.common.n == 1 and not r.common.stream and r.common.logprobs is None
    assert r.common.sampling.temperature == 1.0 and r.common.sampling.top_k == 0
    r = parse_chat({"messages": [{"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
                    "max_completion_tokens": 5, "temperature": 0, "top_p": 0.5, "top_k": 3, "min_p": 0.1, "stop": "x",
                    "seed": 2**40, "n": 2, "stream": True, "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 4,
                    "repeat_penalty": 1.1, "frequency_penalty": 0.5, "presence_penalty": -0.5, "user": "ignored"})
    assert r.messages == ({"role": "system", "content": "ab"},)
    c = r.common
    assert (c.max_tokens, c.stop, c.n, c.stream, c.include_usage, c.logprobs) == (5, ("x",), 2, True, True, 4)
    assert c.sampling.seed == 2**40 % 2**32 and c.sampling.repeat_penalty == 1.1 and c.sampling.greedy


BAD: dict[str, tuple[dict[str, Any], str | None]] = {
    "no messages": ({}, "messages"),
    "messages not a list": ({"messages": "hi"}, "messages"),
    "empty messages": ({"messages": []}, "messages"),
    "message not an object": ({"messages": ["hi"]}, "messages[0]"),
    "bad role": ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    "image part": ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages[0].content"),
    "content number": ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    "temperature string": ({"messages": CHAT, "temperature": "hot"}, "temperature"),
    "temperature bool": ({"messages": CHAT, "temperature": True}, "temperature"),
    "temperature huge": ({"messages": CHAT, "temperature": 1e308}, "temperature"),
    "temperature negative": ({"messages": CHAT, "temperature": -1}, "temperature"),
    "top_p zero": ({"messages": CHAT, "top_p": 0}, "top_p"),
    "max_tokens zero": ({"messages": CHAT, "max_tokens": 0}, "max_tokens"),
    "max_tokens huge": ({"messages": CHAT, "max_tokens": 10**30}, "max_tokens"),
    "max_tokens float": ({"messages": CHAT, "max_tokens": 1.5}, "max_tokens"),
    "n zero": ({"messages": CHAT, "n": 0}, "n"),
    "n huge": ({"messages": CHAT, "n": 10**6}, "n"),
    "stop many": ({"messages": CHAT, "stop": ["x"] * 5000}, "stop"),
    "stop empty": ({"messages": CHAT, "stop": [""]}, "stop"),
    "stop number": ({"messages": CHAT, "stop": 3}, "stop"),
    "stream string": ({"messages": CHAT, "stream": "yes"}, "stream"),
    "stream_options without stream": ({"messages": CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
    "top_logprobs without logprobs": ({"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    "top_logprobs huge": ({"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    "seed negative huge": ({"messages": CHAT, "seed": -(2**70)}, "seed"),
    "model number": ({"messages": CHAT, "model": 3}, "model"),
    "penalty out of range": ({"messages": CHAT, "frequency_penalty": 3}, "frequency_penalty"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_chat_bodies_are_400_naming_the_parameter(name: str) -> None:
    body, param = BAD[name]
    with pytest.raises(APIError) as e:
        parse_chat(body)
    assert e.value.status == 400 and e.value.param == param
    assert set(e.value.body()["error"]) == {"message", "type", "param", "code"}
    json.dumps(e.value.body())


def test_logit_bias() -> None:
    assert parse_chat({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": 2.5, "3": -100}}).common.sampling.logit_bias == (
        (3, -100.0), (5, 2.5))
    ban = parse_completion({"prompt": "x", "logit_bias": [[7, False], [9, 1]]}).common.sampling.logit_bias
    assert ban == ((7, -math.inf), (9, 1.0))
    for bias in ({"a": 1}, {"-1": 1}, {"5": 101}, {"5": "1"}, {"5": True}, [[1]], 3, {str(i): 0 for i in range(1025)}):
        with pytest.raises(APIError) as e:
            parse_completion({"prompt": "x", "logit_bias": bias})
        assert e.value.status == 400 and e.value.param == "logit_bias"


def test_completion_prompts() -> None:
    assert parse_completion({"prompt": "hi"}).prompts == ("hi",)
    assert parse_completion({"prompt": ["hi"]}).prompts == ("hi",)
    assert parse_completion({"prompt": [1, 2, 3]}).prompts == ((1, 2, 3),)
    assert parse_completion({"prompt": [[1, 2]]}).prompts == ((1, 2),)
    assert parse_completion({"prompt": ["a", "b"]}).prompts == ("a", "b")  # several prompts: one choice (per n) each
    assert parse_completion({"prompt": ["a", [7, 8]], "n": 2}).prompts == ("a", (7, 8))
    assert parse_completion({"prompt": "x"}).common.max_tokens == 16  # OpenAI's default for completions
    assert parse_completion({"prompt": "x", "logprobs": 3}).common.logprobs == 3
    for body in ({}, {"prompt": 5}, {"prompt": [True]}, {"prompt": []}, {"prompt": ["a", 5]}, {"prompt": [[]]},
                 {"prompt": ["a"] * 9, "n": 2}, {"prompt": "x", "logprobs": 6}, {"prompt": "x", "echo": 1},
                 {"prompt": "x", "suffix": " end."}, {"prompt": "x", "best_of": 3}, {"prompt": "x", "best_of": 2, "n": 3}):
        with pytest.raises(APIError) as e:
            parse_completion(body)
        assert e.value.status == 400
    # what changes nothing is accepted: no suffix, best_of equal to n
    assert parse_completion({"prompt": "x", "suffix": None, "best_of": 2, "n": 2}).common.n == 2


def test_responses_errors_name_the_responses_parameters() -> None:
    from powerinfer.server.responses_api import parse

    cases = (({"input": "hi", "max_output_tokens": 0}, "max_output_tokens", "'max_output_tokens' must be at least 1"),
             ({"input": [{"role": "user", "content": 5}]}, "input[0].content", "input[0].content"),
             ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format.type", "'text', 'json_object' or 'json_schema'"),
             ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema", "'text.format.schema'"),
             ({"input": "hi", "text": {"format": {"type": "json_schema", "name": 5, "schema": {}}}}, "text.format.name", "'text.format.name'"))
    for body, param, says in cases:
        with pytest.raises(APIError) as e:
            parse(body)
        assert e.value.status == 400 and e.value.param == param and says in e.value.message, (e.value.param, e.value.message)
        assert "max_tokens" not in e.value.message and "messages" not in e.value.message and "response_format" not in e.value.message
    assert parse({"input": "hi", "text": {"format": {"type": "text"}}})[1].messages  # plain text output is the default
