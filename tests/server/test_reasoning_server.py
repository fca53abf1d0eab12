"""A reasoning model's thought through the server on SmolLM2 with a <think> chat template
(--chat-template-file, as the DeepSeek-R1 distills' template: the reply starts inside the thought):
reasoning_content beside content through the openai client, streamed and not; the request's
chat_template_kwargs, reasoning_effort and reasoning_format.

Runs in: the pytest process; the server runs in its own process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest

from tests.server.conftest import RunningServer, serving

pytestmark = pytest.mark.real_model

# SmolLM2's ChatML with the R1 distills' opening of the thought; Qwen3's enable_thinking closes it at once
THINK_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\\n\\n</think>\\n\\n' }}{% else %}{{ '<think>\\n' }}{% endif %}"
    "{% endif %}"
)
# SmolLM2 never closes a thought on its own: a grammar makes it write one, close it and answer
GRAMMAR = 'root ::= [a-z]+ " " [a-z]+ "</think>" " " [A-Z] [a-z]+ "."'
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    tmpl = tmp_path_factory.mktemp("think") / "think.jinja"
    tmpl.write_text(THINK_TEMPLATE)
    yield from serving(smollm2_path, tmp_path_factory, "reasoning", "-c", "512", "--parallel", "2", "-t", "2",
                       "--chat-template-file", str(tmpl), "--alias", "smollm2")


def _client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def _extra(**kw: Any) -> dict[str, Any]:
    return {"grammar": GRAMMAR, **kw}


def test_reasoning_content_whole_and_streamed(server: RunningServer) -> None:
    client = _client(server)
    r = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=40, temperature=0,  # type: ignore[arg-type]
                                       extra_body=_extra())
    msg = r.choices[0].message
    thought = getattr(msg, "reasoning_content", None)
    assert isinstance(thought, str) and thought and "<think>" not in thought and "</think>" not in thought, msg
    assert msg.content and msg.content[0].isupper() and msg.content.endswith(".") and "</think>" not in msg.content, msg
    stream = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=40, temperature=0,  # type: ignore[arg-type]
                                            stream=True, extra_body=_extra())
    parts: dict[str, list[str]] = {"reasoning": [], "content": []}
    for chunk in stream:
        for c in chunk.choices:
            r_piece = getattr(c.delta, "reasoning_content", None)
            if r_piece:
                assert not c.delta.content  # a thought and an answer never share a delta
                parts["reasoning"].append(r_piece)
            if c.delta.content:
                parts["content"].append(c.delta.content)
    assert "".join(parts["reasoning"]) == thought and "".join(parts["content"]) == msg.content
    assert len(parts["reasoning"]) > 1  # streamed as it came, not held to the end


def test_reasoning_format_none_keeps_the_text(server: RunningServer) -> None:
    body = {"model": "smollm2", "messages": MESSAGES, "max_tokens": 40, "temperature": 0, **_extra(reasoning_format="none")}
    msg = httpx.post(server.base_url + "/chat/completions", json=body, timeout=120).json()["choices"][0]["message"]
    assert "reasoning_content" not in msg and "</think>" in msg["content"]


def test_enable_thinking_false_gives_no_thought(server: RunningServer) -> None:
    for extra in ({"chat_template_kwargs": {"enable_thinking": False}}, {"reasoning_effort": "none"}):
        body = {"model": "smollm2", "messages": MESSAGES, "max_tokens": 12, "temperature": 0, **extra}
        out = httpx.post(server.base_url + "/chat/completions", json=body, timeout=120).json()
        msg = out["choices"][0]["message"]
        assert "reasoning_content" not in msg and msg["content"].strip(), out
        assert out["usage"]["prompt_tokens"] > 20  # the closed thought is in the prompt


def test_bad_template_kwargs_are_400(server: RunningServer) -> None:
    for extra, param in (({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
                         ({"reasoning_effort": "max"}, "reasoning_effort"),
                         ({"reasoning_format": "auto-ish"}, "reasoning_format")):
        r = httpx.post(server.base_url + "/chat/completions", json={"model": "smollm2", "messages": MESSAGES, **extra}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_responses_api_has_a_reasoning_item(server: RunningServer) -> None:
    """/v1/responses through the openai client: the thought is the output's first item (a reasoning
    item with reasoning_text), streamed as its own deltas; the message holds only the answer."""
    client = _client(server)
    whole = client.responses.create(model="smollm2", input="What is the capital of France?", max_output_tokens=40, temperature=0,
                                    extra_body=_extra())
    kinds = [item.type for item in whole.output]
    assert kinds == ["reasoning", "message"], kinds
    thought = whole.output[0].content[0].text  # type: ignore[union-attr,index]
    assert thought and "</think>" not in thought and "</think>" not in whole.output_text and whole.output_text.endswith(".")
    deltas: dict[str, list[str]] = {"reasoning": [], "text": []}
    done = None
    for ev in client.responses.create(model="smollm2", input="What is the capital of France?", max_output_tokens=40, temperature=0,
                                      stream=True, extra_body=_extra()):
        if ev.type == "response.reasoning_text.delta":
            deltas["reasoning"].append(ev.delta)
        elif ev.type == "response.output_text.delta":
            deltas["text"].append(ev.delta)
        elif ev.type == "response.completed":
            done = ev.response
    assert "".join(deltas["reasoning"]) == thought and "".join(deltas["text"]) == whole.output_text
    assert done is not None and [i.type for i in done.output] == ["reasoning", "message"]
    plain = client.responses.create(model="smollm2", input="Hi", max_output_tokens=8, reasoning={"effort": "none"})  # type: ignore[arg-type]
    assert [i.type for i in plain.output] == ["message"]  # the template closed the thought: no reasoning item
