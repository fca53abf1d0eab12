"""The one sequence object: from the server's request (or ``LLM.generate``) to the engine's step.

Runs in: the coordinator process (``LLM.generate``; the server's HTTP side makes it, its scheduler
thread steps it).

A :class:`Sequence` is one choice of one request, start to end. It carries
- what was asked: the prompt, sampling parameters, stop strings, logprobs, a grammar, pooling for
  an embedding;
- the generation state: sampling, incremental detokenizing, stop strings, finish reason
  (:meth:`Sequence.step` turns each logits row into text chunks and says which token to
  evaluate next);
- the engine core's bookkeeping (coordinator/engine_core.py): its KV slot, how much of the prompt
  is computed or was found cached, an embedding's pooled state, prompt lookup's drafter;
- the request's life: where its events go (``sink``), its choice index, cancellation, and the
  times the server's metrics read.

The engine core owns the forward passes; the sequence only turns logits into text. That split is
what lets the server advance many sequences in one batched decode step while each keeps exactly
the behaviour of a lone ``LLM.generate``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Union

import numpy as np

from powerinfer.coordinator.lookup import NgramDrafter
from powerinfer.generation import MAX_TOP_LOGPROBS, GenerationChunk, TokenLogprob
from powerinfer.sampling import Sampler, SamplingParams, top_indices
from powerinfer.tokenizer import GGUFTokenizer, StreamDecoder

if TYPE_CHECKING:
    from powerinfer.constrained import TokenConstraint


@dataclass(frozen=True)
class Embedded:
    """An embedding sequence's one event: its pooled final hidden state, float32 [d], not normalized."""

    vector: np.ndarray


Event = Union[GenerationChunk, Embedded, BaseException]  # an exception is a sequence's last event
Sink = Callable[["Sequence", Event], None]


class Sequence:
    """One sequence: what was asked, its generation state, its KV slot, and where its events go."""

    def __init__(self, tokenizer: GGUFTokenizer, prompt: list[int] | tuple[int, ...], max_tokens: int, params: SamplingParams,
                 stop: tuple[str, ...] = (), logprobs: int | None = None, constraint: "TokenConstraint | None" = None,
                 score_prompt: bool = False, watch: Callable[[str], bool] | None = None, *, pooling: str = "",
                 sink: Sink | None = None, index: int = 0) -> None:
        """constraint: a grammar the output must follow (powerinfer.constrained); the sequence ends
        when the grammar is complete. score_prompt: the engine computes the prompt's logits too and
        hands them to :meth:`score` (prompt_logprobs, with logprobs alternatives each); max_tokens
        0 then scores the prompt and generates nothing. watch: called with each piece of text as
        it is released; True ends the sequence there (finish "stop"; the server's tool calls).
        pooling: "mean" or "last": an embedding (the pooled final hidden state; one Embedded
        event), nothing generated. sink: where the server's scheduler sends the events (called
        from its thread); index: the choice index within its request."""
        self.prompt = list(prompt)
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens  # -1: until end-of-generation or the context is full
        self.sampler = Sampler(params)
        self.stop = stop
        self.logprobs = logprobs  # None: off; k >= 0: the token's logprob and k alternatives
        self.history: list[int] = list(prompt)
        self.n_prompt = len(self.history)
        self.decoder = StreamDecoder(tokenizer)
        self.pending = ""  # text held back because it could be the start of a stop string
        self.released = 0  # characters of text emitted so far
        self.held: list[TokenLogprob] = []  # logprobs of tokens whose text has not all been emitted
        self.generated = 0  # tokens sampled, the end-of-generation token included
        self.finish_reason: str | None = None
        self.next_token: int | None = None  # to evaluate before the next step; None once finished
        self.constraint = constraint
        self.score_prompt = score_prompt
        self.watch = watch
        self.prompt_logprobs: list[TokenLogprob] = []  # with score_prompt: one per prompt token, in order
        self._prompt_offsets: list[int] = []
        # -- the engine core's bookkeeping (coordinator/engine_core.py)
        self.pooling = pooling
        self.slot = -1  # its KV slot while admitted (kept after it leaves: the slot's tokens stay for a later prefix)
        self.prefilled = 0  # prompt tokens in its slot's cache
        self.cached = 0  # prompt tokens found in the slot's cache at admission (not computed again)
        self.pooled: np.ndarray | None = None  # float32 [d]: the sum (mean) or last row of the hidden states so far
        self.drafter: NgramDrafter | None = None  # prompt lookup decoding's n-gram index (made at the first lookup)
        self.draft_len = 0  # the longest draft to try next: halved when one is wholly rejected, doubled when one is wholly taken
        # -- the request's life (the server's scheduler and metrics)
        self.sink = sink
        self.index = index
        self.cancelled = threading.Event()  # the client is gone
        self.t_submit = time.monotonic()
        self.t_first = 0.0  # first token emitted (monotonic), 0 before
        self.t_end = 0.0  # the last token emitted (monotonic), set before its chunks reach the sink
        self.finished = False  # its last event was sent (or it was cancelled)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def send(self, event: Event) -> None:
        """event to the sequence's sink (the server's client), if it has one."""
        if self.sink is not None:
            self.sink(self, event)

    @property
    def in_prefill(self) -> bool:
        return self.prefilled < len(self.prompt)

    @property
    def completion_tokens(self) -> int:
        return len(self.history) - self.n_prompt

    def step(self, logits: np.ndarray, context_full: bool) -> list[GenerationChunk]:
        """logits float32 [vocab] of the last evaluated position -> chunks to emit.

        context_full: the sequence's cache cannot take another token, so this is the last sample.
        """
        if self.done:
            raise RuntimeError("step() after the sequence finished")
        if self.max_tokens == 0:  # the prompt was only to be scored
            return [self._finish("length")]
        if self.constraint is not None:
            logits = self.constraint.masked(logits)  # the tokens the grammar forbids at -inf
            if not self.sampler.allows_any(logits):  # the grammar and the request's bans leave nothing
                self.generated += 1
                return [self._finish("stop")]
        token = self.sampler(logits, self.history)
        self.generated += 1
        self.next_token = None
        if token in self.tokenizer.eog_ids:
            return [self._finish("stop")]
        if self.logprobs is not None:
            self.held.append(self._logprob(logits, token, self.released + len(self.pending)))
        if self.constraint is not None:
            self.constraint.advance(token)
        self.history.append(token)
        self.pending += self.decoder.push(token)
        cut = _find_stop(self.pending, self.stop)
        if cut is not None:
            self.pending = self.pending[:cut]
            return [self._finish("stop", token)]
        safe = len(self.pending) - _held_back(self.pending, self.stop)
        chunk = GenerationChunk(token, self.pending[:safe], logprobs=self._release(safe))
        self.pending = self.pending[safe:]
        if self.generated >= self.max_tokens > 0 or context_full:
            return [chunk, self._finish("length")]
        if self.constraint is not None and self.constraint.stopped:  # the grammar is complete: nothing may follow
            return [chunk, self._finish("stop")]
        if self.watch is not None and chunk.text and self.watch(chunk.text):
            return [chunk, self._finish("stop")]
        self.next_token = token
        return [chunk]

    def _finish(self, reason: str, stop_token: int = -1) -> GenerationChunk:
        """The last chunk: the text still pending, and the logprobs of the tokens that wrote it
        (all those held, unless a stop string cut some away). stop_token: the token that completed
        a stop string (it was generated, and counts as such), else -1."""
        self.finish_reason = reason
        if reason == "length":
            self.pending += self.decoder.flush()
        text, self.pending = self.pending, ""
        lps = self._release(len(text))
        if stop_token < 0:
            lps += tuple(self.held)
        self.held = []
        return GenerationChunk(stop_token, text, reason, lps)

    def score(self, start: int, logits: np.ndarray) -> None:
        """logits [n, vocab] at prompt positions start .. start + n - 1: the logprobs of the prompt
        tokens they predict (the first prompt token gets None)."""
        prompt = self.history[: self.n_prompt]
        if not self._prompt_offsets:
            self._prompt_offsets = self.tokenizer.text_offsets(prompt, skip_special=False, strip_bos=True)  # as the echo
            t = prompt[0]
            self.prompt_logprobs.append(TokenLogprob(t, self._piece(t), None, (), self._raw(t), (), 0))
        rows = np.asarray(logits, dtype=np.float32)
        lse = _log_sum_exp(rows)  # every row's at once
        for r in range(rows.shape[0]):
            p = start + r + 1  # the prompt token row r predicts
            if p < self.n_prompt and p == len(self.prompt_logprobs):
                self.prompt_logprobs.append(self._logprob(rows[r], prompt[p], self._prompt_offsets[p], float(lse[r])))

    def _release(self, n: int) -> tuple[TokenLogprob, ...]:
        """n more characters go out: the held logprobs of tokens whose text starts before their end."""
        self.released += n
        if not self.held:
            return ()
        out = tuple(lp for lp in self.held if lp.offset < self.released)
        self.held = self.held[len(out):]  # held in order of offset, so those released are a prefix
        return out

    def _top_k(self, vocab: int) -> int:
        return min(self.logprobs or 0, MAX_TOP_LOGPROBS, vocab)

    def _logprob(self, logits: np.ndarray, token: int, offset: int, lse: float | None = None) -> TokenLogprob:
        """logits [vocab] -> the token's logprob and its top alternatives; lse: the log-sum-exp over
        the vocabulary when the caller has it already."""
        row = np.asarray(logits, dtype=np.float32)
        if lse is None:
            lse = float(_log_sum_exp(row[None, :])[0])
        k = self._top_k(row.size)
        best = top_indices(row, k).tolist() if k else []
        top = tuple((i, self._piece(i), float(row[i]) - lse) for i in best)
        return TokenLogprob(token, self._piece(token), float(row[token]) - lse, top, self._raw(token),
                            tuple(self._raw(t) for t, _, _ in top), offset)

    def _piece(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special=False)

    def _raw(self, token: int) -> bytes:
        # Control tokens have no bytes of their own in the vocabulary; their rendered text stands in.
        if self.tokenizer.is_special(token):
            return self._piece(token).encode("utf-8")
        return self.tokenizer.token_bytes(token)


def _log_sum_exp(rows: np.ndarray) -> np.ndarray:
    """rows float32 [n, vocab] -> log-sum-exp per row [n] (exp in float32 below the max, summed in float64)."""
    mx: np.ndarray = rows.max(axis=1)
    out: np.ndarray = np.log(np.exp(rows - mx[:, None]).sum(axis=1, dtype=np.float64)) + mx
    return out


def _find_stop(text: str, stop: tuple[str, ...]) -> int | None:
    hits = [i for i in (text.find(s) for s in stop) if i >= 0]
    return min(hits) if hits else None


def _held_back(text: str, stop: tuple[str, ...]) -> int:
    """Length of the longest suffix of text that is a proper prefix of some stop string."""
    best = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
