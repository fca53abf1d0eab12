"""Tool calling on the server with the official openai client: tools, tool_choice (auto, none,
required, a named function), parallel_tool_calls, the history of calls and results, streamed and
not, on SmolLM2 and Gemma-3-270M.

Runs in: the pytest process, against `powerinfer-server` subprocesses.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator

import jsonschema
import openai
import pytest

from powerinfer.server import tools
from tests.server.conftest import RunningServer, start_server

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}}, "required": ["city"],
                   "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningServer, str]]:
    path: Path = request.getfixturevalue(f"{request.param}_path")
    s = start_server(path, tmp_path_factory.mktemp("tools"), "-c", "1024", "--parallel", "2", "-t", "2", "-n", "128")
    yield s, path.stem
    s.stop()


def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=180, _strict_response_validation=True)


def _check_call(call: Any, tool: dict[str, Any]) -> dict[str, Any]:
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == tool["function"]["name"]
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, tool["function"]["parameters"])
    return args


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_required_call_round_trip(server: tuple[RunningServer, str], stream: bool) -> None:
    """A required call is well formed whatever the model (the grammar), and its result in the
    history leads to a text answer."""
    srv, model = server
    c = client(srv)
    kw: dict[str, Any] = {"model": model, "tools": [WEATHER, TIME], "max_tokens": 128, "temperature": 0}
    if stream:
        calls: dict[int, dict[str, str]] = {}
        finish = None
        for chunk in c.chat.completions.create(messages=ASK, tool_choice="required", stream=True, **kw):  # type: ignore[arg-type]
            for ch in chunk.choices:
                for tc in ch.delta.tool_calls or []:
                    cur = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                    cur["id"] += tc.id or ""
                    cur["name"] += tc.function.name or "" if tc.function else ""
                    cur["arguments"] += tc.function.arguments or "" if tc.function else ""
                finish = ch.finish_reason or finish
        assert finish == "tool_calls" and calls
        first = calls[0]
        call_id, name, arguments = first["id"], first["name"], first["arguments"]
        assert name in ("get_weather", "get_time")
        jsonschema.validate(json.loads(arguments), (WEATHER if name == "get_weather" else TIME)["function"]["parameters"])
    else:
        r = c.chat.completions.create(messages=ASK, tool_choice="required", **kw)  # type: ignore[arg-type]
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.tool_calls
        made = [(t.function.name, t.function.arguments) for t in r.choices[0].message.tool_calls]
        # both models repeat their calls when allowed several: the reply ends at the first repeat
        assert len(set(made)) == len(made) and r.usage is not None and r.usage.completion_tokens < 128
        call = r.choices[0].message.tool_calls[0]
        _check_call(call, WEATHER if call.function.name == "get_weather" else TIME)
        call_id, name, arguments = call.id, call.function.name, call.function.arguments
    history = [*ASK, {"role": "assistant", "content": None,
                      "tool_calls": [{"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]},
               {"role": "tool", "tool_call_id": call_id, "content": '{"temperature": 18, "sky": "cloudy"}'}]
    final = c.chat.completions.create(messages=history, tool_choice="none", **kw)  # type: ignore[arg-type]
    assert final.choices[0].finish_reason in ("stop", "length") and final.choices[0].message.content
    assert not final.choices[0].message.tool_calls


def test_named_function_and_parallel_calls(server: tuple[RunningServer, str]) -> None:
    srv, model = server
    c = client(srv)
    r = c.chat.completions.create(model=model, messages=ASK, tools=[WEATHER, TIME], max_tokens=128, temperature=0,  # type: ignore[arg-type]
                                  tool_choice={"type": "function", "function": {"name": "get_time"}})
    calls = r.choices[0].message.tool_calls
    assert calls is not None and len(calls) == 1 and calls[0].function.name == "get_time"
    _check_call(calls[0], TIME)
    one = c.chat.completions.create(model=model, messages=ASK, tools=[WEATHER, TIME], max_tokens=160, temperature=0,  # type: ignore[arg-type]
                                    tool_choice="required", parallel_tool_calls=False)
    assert one.choices[0].message.tool_calls is not None and len(one.choices[0].message.tool_calls) == 1


def test_auto_and_none_answer_in_text_or_calls(server: tuple[RunningServer, str]) -> None:
    srv, model = server
    c = client(srv)
    auto = c.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], max_tokens=96, temperature=0)  # type: ignore[arg-type]
    msg = auto.choices[0].message
    if msg.tool_calls:  # a small model may or may not call: either way the shape is right
        assert auto.choices[0].finish_reason == "tool_calls"
        for call in msg.tool_calls:
            assert call.function.name == "get_weather"
    else:
        assert msg.content and "<tool_call>" not in msg.content
    none = c.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=32, temperature=0)  # type: ignore[arg-type]
    assert not none.choices[0].message.tool_calls and none.choices[0].message.content


@pytest.mark.parametrize("extra, param", [
    ({"tools": "x"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0]"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": ["get_weather"]}}}, "tool_choice"),
    # a tool's schema is checked whatever tool_choice, and the error names it
    ({"tools": [TIME, {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "foo"}}}}}]},
     "tools[1].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/$defs/nope"}}}], "tool_choice": "required"},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]}, "tools[0].function.strict"),
])
def test_invalid_tool_requests(server: tuple[RunningServer, str], extra: dict[str, Any], param: str) -> None:
    srv, model = server
    with pytest.raises(openai.BadRequestError) as e:
        client(srv).chat.completions.create(model=model, messages=ASK, max_tokens=4, **extra)  # type: ignore[arg-type]
    assert e.value.body["param"] == param  # type: ignore[index]


SPEC = tools.ToolSpec(({"name": "get_time", "description": "", "parameters": {}},), "auto", None, True)


def test_calls_split_from_the_reply() -> None:
    call = '<tool_call>{"name": "get_time", "arguments": {"city": "Rome"}}</tool_call>'
    oslo = call.replace("Rome", "Oslo")
    content, calls = tools.split_calls(f"Sure.\n{call}\n{oslo}", SPEC)
    assert content == "Sure." and [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Rome"}, {"city": "Oslo"}]
    # one call allowed: the second is dropped, not left in the content as markup
    content, calls = tools.split_calls(f"{call}\n{call}", replace(SPEC, parallel=False))
    assert content == "" and len(calls) == 1
    # a call cut off by max_tokens is never content, even when no call came whole
    assert tools.split_calls('Let me see.\n<tool_call>{"name": "get', SPEC) == ("Let me see.", [])
    # an unknown function or bad JSON stays text; plain text is untouched
    bad_call = '<tool_call>{"name": "nope"}</tool_call>'
    assert tools.split_calls(bad_call, SPEC) == (bad_call, [])
    assert tools.split_calls(" hi \n", SPEC) == (" hi \n", [])


def test_tool_results_name_their_function_by_the_call_id() -> None:
    msgs = [{"role": "user", "content": "time?"},
            {"role": "assistant", "content": "", "tool_calls": [{"name": "get_time", "arguments": {}, "id": "call_1"}]},
            {"role": "tool", "content": "noon", "tool_call_id": "call_1", "name": None},
            {"role": "tool", "content": "?", "tool_call_id": "call_unknown", "name": None}]
    out = tools.render(msgs, None)
    assert json.loads(out[2]["content"].split("\n")[0].removeprefix("<tool_response>").removesuffix("</tool_response>")) == \
        {"name": "get_time", "content": "noon"}
    assert '"name": "call_unknown"' in out[2]["content"]  # no such call: the id is all there is


def test_a_repeated_call_ends_the_reply_and_is_made_once() -> None:
    call = '<tool_call>{"name": "get_time", "arguments": {"city": "Rome"}}</tool_call>'
    other = '<tool_call>{"name": "get_time", "arguments": {"city": "Oslo"}}</tool_call>'
    guard = tools.RepeatGuard()
    assert [guard(p) for p in (call[:20], call[20:], "\n", other, "\n", call[:-3])] == [False] * 6
    assert guard(call[-3:])  # the repeat is whole: the sequence ends here
    content, calls = tools.split_calls("\n".join([call, other, call]), SPEC)
    assert content == "" and [json.loads(c["function"]["arguments"])["city"] for c in calls] == ["Rome", "Oslo"]
    # the same arguments in another key order are the same call
    shuffled = '<tool_call>{"arguments": {"city": "Rome"}, "name": "get_time"}</tool_call>'
    assert len(tools.split_calls(call + shuffled, SPEC)[1]) == 1
