"""The <think> split of a reasoning model's reply: whole and streamed alike, prompts that open the
thought, and the template variables a request may pass (server/reasoning.py).

Runs in: the pytest process (pure functions; the server's use of them is tested on SmolLM2 in
test_reasoning_server.py).
"""

from __future__ import annotations

import random

import pytest

from powerinfer.chat import RESERVED_VARIABLES
from powerinfer.server.reasoning import ThinkSplitter, opens_thinking, split, template_kwargs

CASES = [
    # (reply, starts open, reasoning, content)
    ("<think>\nweigh it</think>\n\nThe answer.", False, "\nweigh it", "The answer."),
    ("  <think>a</think>b", False, "a", "b"),
    ("plain answer <think>not a thought</think>", False, "", "plain answer <think>not a thought</think>"),
    ("still thinking", True, "still thinking", ""),
    ("reason</think>answer", True, "reason", "answer"),
    ("<think>unfinished", False, "unfinished", ""),
    ("<thi", False, "", "<thi"),
    ("", False, "", ""),
    ("</think>", True, "", ""),
    ("a</thin", True, "a</thin", ""),
    ("x</think>y</think>z", True, "x", "y</think>z"),
]


@pytest.mark.parametrize("text,open_,thought,content", CASES)
def test_split(text: str, open_: bool, thought: str, content: str) -> None:
    assert split(text, open_) == (thought, content)


@pytest.mark.parametrize("text,open_,thought,content", CASES)
def test_streamed_in_any_pieces_equals_whole(text: str, open_: bool, thought: str, content: str) -> None:
    rng = random.Random(len(text))
    for _ in range(50):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randrange(1, 6))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        s = ThinkSplitter(open_)
        outs = [s.push(p) for p in pieces] + [s.finish()]
        assert ("".join(r for r, _ in outs), "".join(c for _, c in outs)) == (thought, content), pieces


def test_a_thought_is_released_as_it_comes() -> None:
    s = ThinkSplitter()
    assert s.push("<think>") == ("", "")
    assert s.push("one two") == ("one two", "")
    assert s.push(" three</") == (" three", "")  # "</" may begin </think>: held
    assert s.push("think>\n") == ("", "")
    assert s.push("Answer") == ("", "Answer")


@pytest.mark.parametrize("tail,want", [
    ("<|im_start|>assistant\n<think>\n", True),
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),  # Qwen3 with enable_thinking false
    ("<|im_start|>assistant\n", False),
    ("<think> user wrote this <|im_start|>assistant\n", False),
])
def test_opens_thinking(tail: str, want: bool) -> None:
    assert opens_thinking(tail) is want


def test_template_kwargs() -> None:
    assert template_kwargs({"chat_template_kwargs": {"enable_thinking": False}}, RESERVED_VARIABLES) == {"enable_thinking": False}
    assert template_kwargs({"reasoning_effort": "none"}, RESERVED_VARIABLES) == {"reasoning_effort": "none", "enable_thinking": False}
    assert template_kwargs({"reasoning_effort": "high"}, RESERVED_VARIABLES) == {"reasoning_effort": "high"}
    for body, msg in [({"chat_template_kwargs": []}, "must be an object"),
                      ({"chat_template_kwargs": {"messages": 1}}, "set by the server"),
                      ({"chat_template_kwargs": {"a-b": 1}}, "not a template variable"),
                      ({"chat_template_kwargs": {"x": {"y": 1}}}, "string, number, boolean or null"),
                      ({"reasoning_effort": "max"}, "must be one of")]:
        with pytest.raises(ValueError, match=msg):
            template_kwargs(body, RESERVED_VARIABLES)
