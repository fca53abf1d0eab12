"""Structured output on the server: response_format json_schema / json_object and llama.cpp's
json_schema and grammar, enforced while sampling (llguidance), with the official openai client.

Runs in: the pytest process, against a `powerinfer-server` subprocess (SmolLM2).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import httpx
import jsonschema
import openai
import pytest

from tests.server.conftest import RunningServer, serving

MODEL = "SmolLM2-135M-Instruct.Q4_1"
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "city": {"type": "string", "maxLength": 20}},
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
TOPICS = ["a pilot", "a chef", "a child", "a painter", "a doctor", "a farmer", "a poet", "a sailor", "a teacher", "a nurse",
          "a miner", "a baker", "a judge", "a singer", "a soldier", "a student", "a tailor", "a writer", "a dancer", "a monk"]


@pytest.fixture(scope="module")
def server(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    yield from serving(smollm2_path, tmp_path_factory, "structured", "-c", "512", "--parallel", "4", "-t", "2", "-n", "96")


def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120, _strict_response_validation=True)


def test_json_schema_output_validates_on_20_prompts(server: RunningServer) -> None:
    c = client(server)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for i, topic in enumerate(TOPICS):
        r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"Describe {topic} as JSON."}],
                                      response_format=fmt, max_tokens=96, temperature=0.7, seed=i)  # type: ignore[arg-type]
        text = r.choices[0].message.content or ""
        assert r.choices[0].finish_reason == "stop", text  # the grammar ended it, not the token limit
        jsonschema.validate(json.loads(text), PERSON)


def test_json_object_and_llama_cpp_fields(server: RunningServer) -> None:
    c = client(server)
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Give me a small JSON object about cats."}],
                                  response_format={"type": "json_object"}, max_tokens=96, temperature=0)  # type: ignore[arg-type]
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content or ""), dict)
    else:  # a long object cut by max_tokens: still a prefix of one
        assert (r.choices[0].message.content or "").lstrip().startswith("{")
    body = {"model": MODEL, "prompt": "Is the sky blue? Answer:", "max_tokens": 8, "temperature": 0, "grammar": 'root ::= " yes" | " no"'}
    out = httpx.post(server.base_url + "/completions", json=body, timeout=120).json()
    assert out["choices"][0]["text"] in (" yes", " no") and out["choices"][0]["finish_reason"] == "stop"
    body = {"model": MODEL, "prompt": "A number:", "max_tokens": 8, "temperature": 0, "json_schema": {"type": "integer", "maximum": 99}}
    out = httpx.post(server.base_url + "/completions", json=body, timeout=120).json()
    assert 0 <= int(out["choices"][0]["text"]) <= 99  # type: ignore[call-overload]
    # no free whitespace: given it, the model padded this object with newlines until max_tokens
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}}, "required": ["n", "ok"],
              "additionalProperties": False}
    body = {"model": MODEL, "prompt": "JSON:", "max_tokens": 30, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    out = httpx.post(server.base_url + "/completions", json=body, timeout=120).json()
    assert out["choices"][0]["finish_reason"] == "stop", out
    jsonschema.validate(json.loads(out["choices"][0]["text"]), schema)


def test_grammar_and_bans_that_leave_nothing_end_the_reply(server: RunningServer) -> None:
    """A grammar whose only token the request bans: that reply ends at once, the server keeps serving."""
    x = httpx.post(server.url + "/tokenize", json={"content": "x"}).json()["tokens"][0]
    body = {"model": MODEL, "prompt": "Say x:", "max_tokens": 4, "temperature": 0, "grammar": 'root ::= "x"', "logit_bias": [[x, False]]}
    out = httpx.post(server.base_url + "/completions", json=body, timeout=60).json()
    assert out["choices"][0]["text"] == "" and out["choices"][0]["finish_reason"] == "stop"
    ok = httpx.post(server.base_url + "/completions", json={**body, "logit_bias": None}, timeout=60).json()
    assert ok["choices"][0]["text"] == "x"


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema"),
    ({"grammar": "root ::= (("}, "grammar"),
    ({"grammar": 'root ::= "a"', "json_schema": {"type": "integer"}}, "grammar"),
])
def test_invalid_formats_are_400_naming_the_parameter(server: RunningServer, extra: dict[str, object], param: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
    r = httpx.post(server.base_url + "/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
