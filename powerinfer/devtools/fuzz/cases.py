"""Fuzz cases: which class each one belongs to, and the bytes of its file, derived from a seed.

Runs in: the fuzzing parent process.

Case ``i`` of seed ``S`` is a pure function of (S, i) and the bases, so any case can be rebuilt
from the two numbers the summary prints. Classes are drawn by weight: the structured classes of
:mod:`powerinfer.devtools.fuzz.structured` (each over a suitable base) and one ``mutate.<base>`` class per
base (random byte mutations). Real models get ``real_share`` of the cases; their mutations stay in
the header (everything before the tensor data) because that is where parsing happens, and the
data is a sparse run of zeros, so a 250 MB model costs a few MB per case.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from powerinfer.devtools.fuzz.bases import Base
from powerinfer.devtools.fuzz.mutate import Mutator
from powerinfer.devtools.fuzz.structured import EXPECT_ANY, EXPECT_ERROR, EXPECT_OK, STRUCTURED

SMALL_MODELS = ("synthetic-llama", "synthetic-gemma3")
SMALL_PREDICTORS = ("predictor", "predictor-gate", "pwri", "gpuidx")
# Structured classes whose generator needs real tensor sizes or a model layout.
_MODEL_ONLY = frozenset({"align.custom", "tensor.ne0_not_block", "template.hostile", "header.empty"})
_META = frozenset({"meta.type_confusion", "meta.bad_numbers", "meta.strings", "template.hostile"})


@dataclass(frozen=True)
class Case:
    """One fuzz case: the file is ``content`` followed by ``zero_tail`` zero bytes (sparse)."""

    seed: int
    index: int
    cls: str  # e.g. "tensor.bad_type", "mutate.smollm2"
    base: str
    kind: str  # "model" | "predictor": which loading pipeline applies
    content: bytes
    zero_tail: int = 0
    ops: tuple[str, ...] = ()  # mutation operators applied (mutate.* classes)
    expect: str = EXPECT_ANY  # what opening the GGUF must do (checked for synthetic model bases)

    @property
    def size(self) -> int:
        return len(self.content) + self.zero_tail


def check_expectation(case: Case, opened: bool, message: str) -> str | None:
    """Why the open-stage outcome contradicts the case's expectation, or None when it does not."""
    if case.expect == EXPECT_ANY or case.base not in SMALL_MODELS:
        return None
    if case.expect == EXPECT_OK:
        return None if opened else f"expected the GGUF to open, got: {message}"
    if opened:
        return "expected a clean error, but the file opened"
    if case.expect != EXPECT_ERROR and not re.search(case.expect, message):
        return f"expected an error matching {case.expect!r}, got: {message}"
    return None


def _structured(rng: random.Random, seed: int, index: int, cls: str, bases: Mapping[str, Base], real: list[str]) -> Case:
    choices = list(SMALL_MODELS) if cls in _MODEL_ONLY else [*SMALL_MODELS, *SMALL_PREDICTORS]
    if cls in _META and real and rng.random() < 0.15:
        choices = real
    base = bases[rng.choice([c for c in choices if c in bases])]
    content, expect = STRUCTURED[cls](rng, base)
    small = base.tail_len == 0
    return Case(seed, index, cls, base.name, base.kind, content, 0 if small else base.tail_len, expect=expect)


def _mutated(rng: random.Random, seed: int, index: int, base: Base) -> Case:
    buf = bytearray(base.head)
    small = base.tail_len == 0
    # Real models: 70% of positions on structural fields (counts, lengths, types, dims, offsets).
    mutator = Mutator(rng, base.layout, len(buf), structural_bias=0.5 if small else 0.7)
    ops = mutator.mutate(buf, rng.choice((1, 1, 1, 2, 2, 3, 4, 8)))
    tail = 0 if small or "truncate" in ops else base.tail_len
    if not small and rng.random() < 0.03:  # now and then: the header intact, the data cut short
        tail = rng.randrange(base.tail_len)
    return Case(seed, index, f"mutate.{base.name}", base.name, base.kind, bytes(buf), tail, tuple(ops))


def class_weights(bases: Mapping[str, Base], real_share: float) -> dict[str, float]:
    """Weight of every class given the bases present (real models share ``real_share``)."""
    real = [b for b in bases if b not in SMALL_MODELS + SMALL_PREDICTORS]
    real_share = min(max(real_share, 0.0), 1.0) if real else 0.0
    # the rest: half structured classes, half mutations of the small bases
    weights = {cls: (1 - real_share) / 2 / len(STRUCTURED) for cls in STRUCTURED}
    small = [b for b in bases if b in SMALL_MODELS + SMALL_PREDICTORS]
    for b in small:
        weights[f"mutate.{b}"] = (1 - real_share) / 2 / len(small)
    for b in real:
        weights[f"mutate.{b}"] = real_share / len(real)
    return weights


def generate(seed: int, n_cases: int, bases: Mapping[str, Base], real_share: float = 0.15,
             only: str | None = None, start: int = 0) -> Iterator[Case]:
    """Cases ``start`` .. ``start + n_cases - 1`` of ``seed``; ``only``: a regex on class names."""
    weights = class_weights(bases, real_share)
    if only is not None:
        weights = {c: w for c, w in weights.items() if re.search(only, c)}
        if not weights:
            raise ValueError(f"no fuzz class matches {only!r} (classes: {', '.join(class_weights(bases, real_share))})")
    names, values = list(weights), list(weights.values())
    real = [b for b in bases if b not in SMALL_MODELS + SMALL_PREDICTORS]
    for index in range(start, start + n_cases):
        rng = random.Random(f"{seed}:{index}")
        # the first cases visit every class once, so even a short run covers them all
        cls = names[index] if index < len(names) else rng.choices(names, values)[0]
        if cls.startswith("mutate."):
            yield _mutated(rng, seed, index, bases[cls[len("mutate."):]])
        else:
            yield _structured(rng, seed, index, cls, bases, real)
