"""OpenAI response bodies (chat.completion, text_completion, their stream chunks, usage, logprobs).

Runs in: the server process (HTTP side). Pure functions of plain values, so they are unit-tested
against the shapes the official ``openai`` client validates.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from powerinfer.generation import TokenLogprob


@dataclass
class ChoiceResult:
    """One choice being collected for a non-streaming answer."""

    index: int
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # completions with echo and logprobs
    finish_reason: str | None = None
    tokens: int = 0


def usage(prompt_tokens: int, completion_tokens: int, cached: int = 0) -> dict[str, Any]:
    """OpenAI's usage, with the prompt tokens found in the KV cache (reused, not computed again)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


def sse(obj: dict[str, Any] | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def chat_logprobs(items: list[TokenLogprob]) -> dict[str, Any]:
    # "bytes" are the token's own bytes, not its text's: a token holding half of a UTF-8
    # character shows U+FFFD as text, and clients join the bytes of consecutive tokens to
    # recover the character.
    return {
        "content": [
            {
                "token": lp.text,
                "logprob": lp.logprob,
                "bytes": list(lp.raw),
                "top_logprobs": [{"token": t, "logprob": v, "bytes": list(b)} for (_, t, v), b in zip(lp.top, lp.top_raw)],
            }
            for lp in items
        ],
        "refusal": None,
    }


def completion_logprobs(items: list[TokenLogprob], start_offset: int = 0, prompt: list[TokenLogprob] | None = None) -> dict[str, Any]:
    """start_offset: the echoed prompt's length; each token's text_offset is where its text starts
    in the returned text (the pieces of a split character all point at that character). prompt:
    the echoed prompt's tokens, first (the first one's logprob and alternatives are null)."""
    both = [*(prompt or ()), *items]
    return {
        "tokens": [lp.text for lp in both],
        "token_logprobs": [lp.logprob for lp in both],
        "top_logprobs": [{t: v for _, t, v in lp.top} if lp.logprob is not None else None for lp in both],
        "text_offset": [lp.offset for lp in prompt or ()] + [start_offset + lp.offset for lp in items],
    }


class Shapes:
    """Builds the bodies of one request (its id, creation time and model name are shared)."""

    def __init__(self, kind: str, model: str) -> None:
        self.chat = kind == "chat"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + _rand_id()
        self.created = int(time.time())
        self.model = model

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "system_fingerprint": "powerinfer"}

    def final(self, choices: list[ChoiceResult], prompt_tokens: int, want_logprobs: bool, echo: list[str] | None = None,
              cached: int = 0) -> dict[str, Any]:
        """echo: each choice's echoed prompt (completions with echo), by choice index."""
        body = self._head("chat.completion" if self.chat else "text_completion")
        out = []
        for c in choices:
            text = "".join(c.text)
            if self.chat:
                lp = chat_logprobs(c.logprobs) if want_logprobs else None
                out.append({"index": c.index, "message": {"role": "assistant", "content": text, "refusal": None},
                            "logprobs": lp, "finish_reason": c.finish_reason})
            else:
                e = echo[c.index] if echo else ""
                lp = completion_logprobs(c.logprobs, len(e), c.prompt_logprobs) if want_logprobs else None
                out.append({"index": c.index, "text": e + text, "logprobs": lp, "finish_reason": c.finish_reason})
        body["choices"] = out
        body["usage"] = usage(prompt_tokens, sum(c.tokens for c in choices), cached)
        return body

    def chunk(self, index: int, text: str | None, finish_reason: str | None = None, logprobs: list[TokenLogprob] | None = None,
              role: bool = False, offset: int = 0, reasoning: str | None = None) -> dict[str, Any]:
        """One streamed event; offset: the echoed prompt's length (completions' text_offset counts from it);
        reasoning: a reasoning model's thought (chat's ``delta.reasoning_content``, server/reasoning.py)."""
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        if self.chat:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if reasoning:
                delta["reasoning_content"] = reasoning
            if text is not None:
                delta["content"] = text
            lp = chat_logprobs(logprobs) if logprobs else None
            body["choices"] = [{"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}]
        else:
            lp = completion_logprobs(logprobs, offset) if logprobs else None
            body["choices"] = [{"index": index, "text": text or "", "logprobs": lp, "finish_reason": finish_reason}]
        return body

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int, cached: int = 0) -> dict[str, Any]:
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        body["choices"] = []
        body["usage"] = usage(prompt_tokens, completion_tokens, cached)
        return body


def _rand_id() -> str:
    return secrets.token_hex(12)
