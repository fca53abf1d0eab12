"""Prompt lookup decoding: draft tokens from n-grams already in a sequence's context.

Runs in: the coordinator (the engine core's step loop).

When the text being written repeats what the context holds (code being edited, a document being
quoted, a list being re-read), the tokens that followed the last occurrence of the current n-gram
are a good guess for what comes next. The engine core checks such a draft in one forward pass
(``Engine.verify``: a pass over T tokens reads the weights once, as one decode step does) and keeps
the longest prefix the sampler agrees with, as llama.cpp's lookup decoding does. Each verified row's
logits are bit-identical to a plain decode step's on the native executors, so the output is
exactly what decoding one token at a time gives (greedy or seeded sampling alike); only the number
of forward passes changes.
"""

from __future__ import annotations

from typing import Sequence

NGRAM_MAX = 4  # longest n-gram matched first: fewer, surer drafts
NGRAM_MIN = 2  # a single repeated token is too weak a cue to pay for a wider pass


class NgramDrafter:
    """An index of one sequence's n-grams (n = NGRAM_MIN..NGRAM_MAX) to where each last ended,
    kept up to date incrementally as the history grows (each step indexes only its new tokens)."""

    def __init__(self) -> None:
        self.index: dict[tuple[int, ...], int] = {}  # n-gram -> position of the token after its latest occurrence
        self.indexed = 0  # history[:indexed] has had every n-gram ending inside it indexed

    def _update(self, history: Sequence[int]) -> None:
        # an n-gram ending at position e (exclusive) is indexed once the token at e exists
        for end in range(max(self.indexed, 1), len(history)):
            for n in range(NGRAM_MIN, NGRAM_MAX + 1):
                if end >= n:
                    self.index[tuple(history[end - n : end])] = end
        self.indexed = max(self.indexed, len(history) - 1) if history else 0

    def draft(self, history: Sequence[int], n_draft: int) -> list[int]:
        """Up to n_draft tokens that followed the longest n-gram the history ends with, the last
        time it occurred; [] when none did."""
        if n_draft < 1 or len(history) < NGRAM_MIN + 1:
            return []
        self._update(history)
        for n in range(min(NGRAM_MAX, len(history) - 1), NGRAM_MIN - 1, -1):
            at = self.index.get(tuple(history[len(history) - n :]))
            if at is not None:
                return list(history[at : at + n_draft])
        return []
