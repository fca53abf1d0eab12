"""What a generated sequence gives out: text chunks, token logprobs, and a request's checked arguments.

Runs in: the coordinator process (``LLM.generate`` and the server's scheduler); the sequence that
makes these is ``powerinfer.coordinator.sequence.Sequence``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Mapping

import numpy as np

from powerinfer.errors import InvalidArgumentError
from powerinfer.sampling import SamplingParams

MAX_TOP_LOGPROBS = 20  # OpenAI's limit


@dataclass(frozen=True)
class TokenLogprob:
    """log P(token) under the model (before penalties and sampling filters), and the top alternatives."""

    token: int
    text: str  # may hold U+FFFD where the token is part of a UTF-8 character
    logprob: float | None  # None: a prompt's first token, which nothing before it predicts
    top: tuple[tuple[int, str, float], ...] = ()  # (token, text, logprob), most likely first
    raw: bytes = b""  # the token's own bytes: the pieces of a split character reassemble it
    top_raw: tuple[bytes, ...] = ()  # the same for each entry of top
    offset: int = 0  # where the token's text starts in the generated text (a prompt token's: in
    # the prompt's text), in characters; the pieces of a split character all start where it does


@dataclass(frozen=True)
class GenerationChunk:
    token: int  # the token generated; -1 for a final chunk that only carries finish_reason
    text: str  # text completed by this token (may be "" while a UTF-8 sequence or stop string is pending)
    finish_reason: str | None = None  # "stop" | "length" on the last chunk
    # When logprobs were asked for: those of the tokens whose text this chunk releases. A token's
    # logprob waits with its text (a possible stop string's start, half a character); a token
    # that wrote any of the returned text has one (a token that straddles a stop string too,
    # whole), those wholly cut away by a stop string have none.
    logprobs: tuple[TokenLogprob, ...] = ()


def checked_request(sampling: SamplingParams | None, overrides: Mapping[str, Any], max_tokens: object, stop: object,
                    logprobs: object) -> tuple[SamplingParams, tuple[str, ...]]:
    """LLM.generate's arguments checked (InvalidArgumentError names the bad one): the sampling
    parameters with overrides applied, and the stop strings (one string is one stop, not its characters)."""
    known = [f.name for f in fields(SamplingParams)]
    unknown = sorted(set(overrides) - set(known))
    if unknown:
        raise InvalidArgumentError(f"unknown sampling parameter(s) {', '.join(unknown)}; known: {', '.join(known)}")
    params = replace(sampling or SamplingParams(), **overrides)
    if not isinstance(max_tokens, (int, np.integer)) or isinstance(max_tokens, bool) or max_tokens == 0 or max_tokens < -1:
        raise InvalidArgumentError(f"max_tokens must be a positive integer or -1, got {max_tokens!r}")
    stops = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or any(not isinstance(s, str) or not s for s in stops):
        raise InvalidArgumentError("stop sequences must be non-empty strings")
    if logprobs is not None and (not isinstance(logprobs, (int, np.integer)) or isinstance(logprobs, bool)
                                 or not 0 <= logprobs <= MAX_TOP_LOGPROBS):
        raise InvalidArgumentError(f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}] (alternatives per token), got {logprobs!r}")
    return params, tuple(stops)
