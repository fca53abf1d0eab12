"""From final hidden states to the logits a step returns: the output head, then the refinement of
the best candidates in float32. Shared by every executor, so all of them refine by one rule.

Runs in: the coordinator process.

The packed head returns bf16/8-bit-rounded logits (a step of 0.125 around 20), which can flip
near-ties. The REFINE best candidates of each row (in decode, those within REFINE_MARGIN of the
best) are recomputed in float32 from their dequantized head rows, so the values that decide sampling
are exact. Decode rows (one per sequence) are refined one by one, so a sequence's logits do not
depend on which other sequences share its batch. The native executors run the decode rule in C
(``decode_rule`` below is then theirs); the same rule is written here in numpy for the others.
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from powerinfer.coordinator.executor import Want
from powerinfer.gguf_file import GGUFFile
from powerinfer.model.weights import embed_rows

REFINE = 32  # logits per position recomputed in float32
REFINE_MARGIN = 1.0  # decode: refine every logit within this of the best (head error is ~0.1)

Head = Callable[[np.ndarray], np.ndarray]  # hidden [T, d] -> packed-head logits [T, V]
Refine = Callable[[np.ndarray, np.ndarray, np.ndarray], None]  # (logits [T, V], hidden [T, d], idx [T, R]): in place
DecodeRule = Callable[[np.ndarray, float, int], np.ndarray]  # (hidden [T, d], margin, k) -> refined logits [T, V]

EMPTY = np.empty((0, 0), dtype=np.float32)  # Want.CACHE's answer


def file_refine(f: GGUFFile, head_name: str) -> Refine:
    """The numpy refinement: logits [T, V] at idx [T, R] := hidden [T, d] . head rows, dequantized from the file."""

    def refine(logits: np.ndarray, hidden: np.ndarray, idx: np.ndarray) -> None:
        rows, inverse = np.unique(idx, return_inverse=True)  # [U], [T * R]
        w = embed_rows(f, rows, head_name)  # [U, d]
        exact = hidden @ w.T  # [T, U]
        np.put_along_axis(logits, idx, np.take_along_axis(exact, inverse.reshape(idx.shape), axis=1), axis=1)

    return refine


def answer(want: Want, hidden: np.ndarray, vocab: int, head: Head, refine: Refine, decode_rule: Optional[DecodeRule] = None) -> np.ndarray:
    """hidden [T, d] final-normed -> what want asks for (see Want), for a head of vocab rows."""
    if want is Want.HIDDEN:
        return hidden
    if want is Want.CACHE:
        return EMPTY
    if want is Want.LAST:
        hidden = hidden[-1:]
    k = min(REFINE, vocab)
    if want is not Want.ALL or hidden.shape[0] == 1:  # the decode rule, row by row
        if decode_rule is not None:
            return decode_rule(hidden, REFINE_MARGIN, k)
        logits = np.array(head(hidden), dtype=np.float32)  # owned: refined in place
        for r in range(logits.shape[0]):
            # the candidates near the best are few; a threshold scan is ~10x cheaper than
            # argpartition over the whole vocabulary
            near = np.flatnonzero(logits[r] >= logits[r].max() - REFINE_MARGIN)
            if len(near) > k:
                near = near[np.argpartition(-logits[r, near], k - 1)[:k]]
            refine(logits[r : r + 1], hidden[r : r + 1], near[None, :])
        return logits
    logits = np.array(head(hidden), dtype=np.float32)
    refine(logits, hidden, np.argpartition(-logits, k - 1, axis=1)[:, :k])  # [T, R]
    return logits
