"""Reasoning models: the text a model thinks in ``<think>...</think>`` split from its answer.

Runs in: the server process (HTTP side). Pure functions and a small incremental splitter, so the
streamed and the whole answer split the same text the same way.

Models such as the DeepSeek-R1 distills and Qwen3 write their reasoning between ``<think>`` and
``</think>`` before the answer. With ``--reasoning-format deepseek`` (the default, as
llama-server's) that part goes to ``message.reasoning_content`` (streamed: ``delta.reasoning_content``)
and ``content`` holds the rest; ``none`` leaves the text as the model wrote it. Templates that open
the thought themselves (the R1 distills end the generation prompt with ``<think>\\n``) make the reply
start inside it: :func:`opens_thinking` reads that off the end of the prompt.
"""

from __future__ import annotations

from typing import Any, Mapping

OPEN, CLOSE = "<think>", "</think>"
FORMATS = ("none", "deepseek")
EFFORTS = ("none", "minimal", "low", "medium", "high")


def opens_thinking(prompt_tail: str) -> bool:
    """Whether a prompt ending in prompt_tail (its last few tokens, special ones as text) leaves a
    thought open, so the reply starts as reasoning."""
    start = prompt_tail.rfind(OPEN)
    return start >= 0 and prompt_tail.find(CLOSE, start) < 0 and not prompt_tail[start + len(OPEN):].strip()


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag (held back: more may come)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ThinkSplitter:
    """Splits a reply arriving piece by piece into (reasoning, content) pieces.

    A thought begins at the reply's start (``<think>``, leading whitespace allowed, or already open
    from the prompt) and ends at the first ``</think>``; the whitespace right after it is dropped,
    as llama-server does. Text that may be the start of a tag is held until the next piece says.
    """

    def __init__(self, open_: bool = False) -> None:
        self.state = "thinking" if open_ else "start"  # start -> thinking -> content, or start -> content
        self.held = ""
        self.after_close = False  # drop the whitespace that follows </think>

    def push(self, piece: str) -> tuple[str, str]:
        """The reasoning and content text that piece releases (either may be empty)."""
        text = self.held + piece
        self.held = ""
        reasoning = content = ""
        if self.state == "start":
            stripped = text.lstrip()
            if stripped.startswith(OPEN):
                self.state, text = "thinking", stripped[len(OPEN):]
            elif OPEN.startswith(stripped):  # nothing yet, or a prefix of "<think>": wait
                self.held = text
                return "", ""
            else:
                self.state = "content"
        if self.state == "thinking":
            end = text.find(CLOSE)
            if end < 0:
                keep = _partial_tag(text, CLOSE)
                self.held = text[len(text) - keep:] if keep else ""
                return text[: len(text) - keep], ""
            reasoning, text = text[:end], text[end + len(CLOSE):]
            self.state, self.after_close = "content", True
        if self.after_close:
            text = text.lstrip()
            if not text:
                return reasoning, ""
            self.after_close = False
        content = text
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is still held when the reply ends (an unfinished tag is plain text after all)."""
        held, self.held = self.held, ""
        if self.state == "thinking":
            return held, ""
        return "", held.lstrip() if self.after_close else held


def split(text: str, open_: bool = False) -> tuple[str, str]:
    """(reasoning, content) of a whole reply; the same split as feeding it to a ThinkSplitter."""
    s = ThinkSplitter(open_)
    r1, c1 = s.push(text)
    r2, c2 = s.finish()
    return r1 + r2, c1 + c2


def template_kwargs(body: Mapping[str, Any], reserved: frozenset[str]) -> dict[str, Any]:
    """The request's ``chat_template_kwargs`` (llama-server's: e.g. ``{"enable_thinking": false}``
    for Qwen3) and ``reasoning_effort``, as variables for the chat template. Raises ValueError with
    the message for a 400."""
    raw = body.get("chat_template_kwargs")
    out: dict[str, Any] = {}
    if raw is not None:
        if not isinstance(raw, dict):
            raise ValueError("'chat_template_kwargs' must be an object")
        if len(raw) > 32:
            raise ValueError("'chat_template_kwargs' may hold at most 32 entries")
        for k, v in raw.items():
            if not k.isidentifier():
                raise ValueError(f"chat_template_kwargs: {k!r} is not a template variable name")
            if k in reserved:
                raise ValueError(f"chat_template_kwargs: {k!r} is set by the server")
            if not isinstance(v, (bool, int, float, str)) and v is not None:
                raise ValueError(f"chat_template_kwargs.{k} must be a string, number, boolean or null")
            out[k] = v
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in EFFORTS:
            raise ValueError(f"'reasoning_effort' must be one of {', '.join(EFFORTS)}")
        out.setdefault("reasoning_effort", effort)
        if effort == "none":  # Qwen3's switch; a template without it ignores it
            out.setdefault("enable_thinking", False)
    return out
