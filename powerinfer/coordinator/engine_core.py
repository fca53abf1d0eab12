"""The engine core: sequences stepped through the engine one forward pass at a time, and the failure path.

Runs in: the coordinator (the user's process for ``LLM.generate``; the server's scheduler thread).

``LLM.generate`` (one sequence) and the server's scheduler (many: continuous batching) drive the
same loop. A step:

1. the oldest sequence still in prefill advances by one chunk of ``n_batch`` prompt tokens (so a
   long prompt does not stall everyone's decoding); when its prompt is done, its first token is
   sampled from the chunk's last logits;
2. every sequence in decode advances by one token in a single batched forward pass.

An embedding sequence (``Sequence.pooling``) only prefills: its chunks' final hidden states are pooled
(mean or last) and it leaves with the vector when its prompt is done, never sampled.

Sequences join between steps (:meth:`EngineCore.add` gives each a free KV slot: the one whose
cached tokens share the longest prefix with its prompt, so a chat's next turn reuses its history)
and leave when done or cancelled (:meth:`EngineCore.remove`).

Supervision is the core's, and only the core's: it checks its executor's health
(:meth:`EngineCore.check_health`) and restarts it (:meth:`EngineCore.restart`). A worker that dies
or errs during a step (or during any other engine call made through :meth:`EngineCore.guard`)
fails every active sequence: the core forgets them and the cached tokens (the restarted workers
hold no KV cache) and re-raises; the next step, or :meth:`restart`, restarts the executor first.
The caller decides what the error means for its sequences (``LLM`` raises it, the scheduler sends
it to each sequence's client). How worker processes are started and watched (heartbeats, exit
codes) is ``powerinfer.processes``; the executor wraps it.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from powerinfer.coordinator.engine import Engine
from powerinfer.coordinator.lookup import NgramDrafter
from powerinfer.errors import ContextOverflowError, InvalidArgumentError
from powerinfer.coordinator.sequence import Sequence
from powerinfer.generation import GenerationChunk
from powerinfer.protocol import WorkerDiedError, WorkerError


SCORE_CHUNK = 64  # prompt tokens a step computes for a prompt being scored (Gemma-3: 64 MiB of logits)


@dataclass
class StepOutput:
    """What one step did for one sequence: prompt tokens it cached, the chunks it produced."""

    seq: Sequence
    prompt_tokens: int = 0
    chunks: list[GenerationChunk] = field(default_factory=list)
    first: bool = False  # the sequence's first token was sampled in this step
    embedding: np.ndarray | None = None  # an embedding sequence's pooled vector float32 [d] (not normalized), once done
    sampled: int = 0  # tokens sampled in this step (more than one when a lookup draft was accepted)


class EngineCore:
    def __init__(self, engine: Engine, lookup: int = 0) -> None:
        """lookup: prompt lookup decoding's longest draft (0: off; coordinator/lookup.py), used
        while one sequence decodes."""
        self.engine = engine
        self.lookup = lookup
        self.drafted = self.accepted = 0  # lookup's drafted and accepted tokens, for its statistics
        self.active: list[Sequence] = []
        self.slot_used = [0.0] * engine.n_slots  # last use (monotonic), for the least-recently-used choice
        self.broken = False
        self.last_batch = 0  # sequences in the last decode pass
        self.prefill_s = self.decode_s = 0.0  # time in the last step's forward passes (sampling excluded)

    @property
    def free_slots(self) -> int:
        return self.engine.n_slots - len(self.active)

    def add(self, seq: Sequence) -> None:
        """Give seq a free slot (longest cached common prefix, then least recently used) and keep
        what of its prompt is cached there."""
        if not seq.prompt:
            raise InvalidArgumentError("the prompt is empty")
        if len(seq.prompt) > self.engine.n_ctx:
            raise ContextOverflowError(f"{len(seq.prompt)} tokens do not fit the context of {self.engine.n_ctx} (raise -c/--ctx-size)")
        if self.free_slots < 1:
            raise InvalidArgumentError(f"all {self.engine.n_slots} sequence slots are busy")
        busy = {s.slot for s in self.active}
        free = [s for s in range(self.engine.n_slots) if s not in busy]
        seq.slot = max(free, key=lambda s: (self.engine.common_prefix(seq.prompt, s), -self.slot_used[s]))
        # a prompt to score or embed is computed whole: the cached positions' logits and hidden states are gone
        keep = 0 if seq.score_prompt or seq.pooling else self.engine.reusable_prefix(seq.prompt, seq.slot)
        self.engine.rewind(keep, seq.slot)
        seq.prefilled = seq.cached = keep
        self.active.append(seq)

    def remove(self, seq: Sequence) -> None:
        """seq leaves (done, cancelled or abandoned); its slot keeps its tokens for a later prefix."""
        if seq in self.active:
            self.active.remove(seq)
            self.slot_used[seq.slot] = time.monotonic()

    def check_health(self) -> None:
        """Raise WorkerDiedError when a worker process is gone or silent (a no-op in process);
        the active sequences then fail as in a step, and the next step restarts the executor."""
        with self.guard():
            self.engine.executor.check_health()

    def restart(self) -> None:
        """Start the executor afresh (its workers hold no KV cache: every slot starts empty)."""
        self.engine.executor.restart()
        self.engine.rewind_all()
        self.broken = False

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Engine calls inside: a worker failure fails every active sequence (see the module docstring)."""
        if self.broken:
            self.restart()
        try:
            yield
        except (WorkerDiedError, WorkerError):
            self.active.clear()
            self.engine.rewind_all()  # the restarted workers will hold no KV cache
            self.broken = True
            raise

    def step(self) -> list[StepOutput]:
        """One prefill chunk (the oldest sequence in prefill) and one batched decode pass."""
        outs: list[StepOutput] = []
        self.prefill_s = self.decode_s = 0.0
        with self.guard():
            prefilling = [s for s in self.active if s.in_prefill]
            decoding = [s for s in self.active if not s.in_prefill and s.next_token is not None]
            if prefilling and prefilling[0].pooling:
                outs.append(self._embed_chunk(prefilling[0]))
            elif prefilling:
                seq = prefilling[0]
                score = seq.score_prompt
                # scored: every row's logits come back, [chunk, vocab], so the chunk is kept small
                n = min(self.engine.n_batch, SCORE_CHUNK) if score else self.engine.n_batch
                chunk = seq.prompt[seq.prefilled : seq.prefilled + n]
                t0 = time.perf_counter()
                logits = self.engine.eval(chunk, all_logits=score, slot=seq.slot)
                self.prefill_s = time.perf_counter() - t0
                if score:
                    seq.score(seq.prefilled, logits)
                seq.prefilled += len(chunk)
                out = StepOutput(seq, prompt_tokens=len(chunk))
                if not seq.in_prefill:
                    out.chunks, out.first, out.sampled = self._sample(seq, logits[-1]), True, 1
                outs.append(out)
            self.last_batch = len(decoding)
            draft = self._draft(decoding[0]) if self.lookup and len(decoding) == 1 else []
            if draft:
                t0 = time.perf_counter()
                outs.append(self._verify(decoding[0], draft))
                self.decode_s = time.perf_counter() - t0
            elif decoding:
                tokens = [int(s.next_token) for s in decoding]  # type: ignore[arg-type]
                t0 = time.perf_counter()
                logits = self.engine.decode(tokens, [s.slot for s in decoding])
                self.decode_s = time.perf_counter() - t0
                outs.extend(StepOutput(s, chunks=self._sample(s, row), sampled=1) for s, row in zip(decoding, logits))
        return outs

    def _draft(self, seq: Sequence) -> list[int]:
        """Tokens to check after seq's next token: within the context, and no more than it may still generate."""
        room = self.engine.n_ctx - len(self.engine.slot_tokens[seq.slot]) - 1
        if seq.max_tokens > 0:
            room = min(room, seq.max_tokens - seq.generated - 1)
        if room < 1:
            return []
        if seq.drafter is None:
            seq.drafter, seq.draft_len = NgramDrafter(), self.lookup
        return seq.drafter.draft(seq.history, min(seq.draft_len, self.lookup, room))

    def _verify(self, seq: Sequence, draft: list[int]) -> StepOutput:
        """seq's next token and a draft after it in one pass; each row is sampled in turn while the
        sampler picks the drafted token, and the cache keeps only the tokens that were accepted."""
        tokens = [int(seq.next_token), *draft]  # type: ignore[arg-type]
        base = len(self.engine.slot_tokens[seq.slot])
        logits = self.engine.verify(tokens, seq.slot)  # [1 + len(draft), vocab]
        out = StepOutput(seq)
        for i, row in enumerate(logits):
            out.chunks.extend(self._sample(seq, row, cached=base + i + 1))
            out.sampled += 1
            if seq.done or i == len(draft) or seq.next_token != draft[i]:
                break
        self.drafted += len(draft)
        self.accepted += out.sampled - 1
        # a rejected draft costs a wider pass for nothing: try shorter ones until drafts are taken again
        if out.sampled == 1:
            seq.draft_len = max(1, seq.draft_len // 2)
        elif out.sampled == len(tokens):
            seq.draft_len = min(self.lookup, 2 * seq.draft_len)
        self.engine.rewind(base + out.sampled, seq.slot)  # the rejected draft's KV entries are overwritten later
        return out

    def _embed_chunk(self, seq: Sequence) -> StepOutput:
        """One chunk of an embedding's prompt; pooled when the prompt is done, and the sequence leaves."""
        chunk = seq.prompt[seq.prefilled : seq.prefilled + self.engine.n_batch]
        t0 = time.perf_counter()
        h = self.engine.hidden(chunk, slot=seq.slot)  # [T, d]
        self.prefill_s = time.perf_counter() - t0
        part = h.sum(axis=0, dtype=np.float64).astype(np.float32) if seq.pooling == "mean" else h[-1].copy()
        seq.pooled = part if seq.pooled is None or seq.pooling == "last" else seq.pooled + part
        seq.prefilled += len(chunk)
        out = StepOutput(seq, prompt_tokens=len(chunk))
        if not seq.in_prefill:
            assert seq.pooled is not None
            out.embedding = seq.pooled / np.float32(len(seq.prompt)) if seq.pooling == "mean" else seq.pooled
            self.remove(seq)
        return out

    def _sample(self, seq: Sequence, logits: object, cached: int | None = None) -> list[GenerationChunk]:
        """cached: the tokens in seq's cache up to the row of these logits (default: all of them)."""
        n = len(self.engine.slot_tokens[seq.slot]) if cached is None else cached
        full = n + 1 >= self.engine.n_ctx
        chunks = seq.step(logits, context_full=full)  # type: ignore[arg-type]
        if seq.done:
            self.remove(seq)
        return chunks
