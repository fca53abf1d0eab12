"""Prompt lookup decoding: the n-gram drafter, and the engine core's checked drafts giving exactly
the tokens of plain decoding (20 prompts on SmolLM2, greedy and seeded sampling; Gemma too).

Runs in: the pytest process (the native decoder in process).
"""

from __future__ import annotations

import argparse
import logging
import random
from pathlib import Path
from typing import Callable

import pytest
from gguf import GGMLQuantizationType as QT

from powerinfer.api import LLM
from powerinfer.coordinator.lookup import NgramDrafter
from powerinfer.flags import add_lookup_arg, set_lookup


def test_drafts_what_followed_the_last_occurrence() -> None:
    d = NgramDrafter()
    h = [1, 2, 3, 4, 5, 9, 9, 2, 3]
    assert d.draft(h, 3) == [4, 5, 9]  # "2 3" occurred before, followed by 4 5 9
    h += [7]
    assert d.draft(h, 3) == []  # "3 7" never did
    h += [1, 2, 3]
    assert d.draft(h, 2) == [4, 5]  # the longest n-gram that occurred before: "1 2 3", at the start
    assert d.draft(h, 0) == []


def test_the_longest_ngram_wins() -> None:
    h = [5, 1, 2, 8, 6, 1, 2, 9, 0, 6, 1, 2]  # "1 2" last followed by 9, but "6 1 2" by 9 too; "5 1 2" by 8
    assert NgramDrafter().draft(h, 1) == [9]
    h2 = [6, 1, 2, 8, 0, 1, 2, 9, 3, 6, 1, 2]  # "6 1 2" -> 8 beats the later "1 2" -> 9
    assert NgramDrafter().draft(h2, 1) == [8]


def test_incremental_index_equals_a_fresh_one() -> None:
    rng = random.Random(0)
    h: list[int] = []
    inc = NgramDrafter()
    for _ in range(400):
        h.append(rng.randrange(6))
        assert inc.draft(h, 4) == NgramDrafter().draft(h, 4)


def _tokens(llm: LLM, prompt: list[int], lookup: int, **kw: object) -> list[int]:
    llm.core.lookup = lookup
    return [c.token for c in llm.generate(prompt, 40, **kw) if c.token >= 0]  # type: ignore[arg-type]


PROMPTS = [
    "Copy this list exactly: apples, pears, plums, apples, pears, plums, apples,",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):",
    "Repeat after me: the quick brown fox jumps over the lazy dog. the quick brown fox",
    "The capital of France is",
    "Once upon a time, in a village by the sea,",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    "Q: What is two plus two?\nA: Four.\nQ: What is three plus three?\nA:",
    "<ul><li>one</li><li>two</li><li>three</li>",
    "Write a haiku about rain.",
    "SELECT name FROM users WHERE id = 1; SELECT name FROM users WHERE id = 2; SELECT",
    "Translate to French: good morning, good evening, good night, good",
    "The mitochondria is the powerhouse of the cell. The mitochondria",
    "import numpy as np\nimport numpy as np\nimport",
    "Dear John, thank you for your letter. Dear Mary, thank you for your",
    "Alice said hello. Bob said hello. Carol said",
    "A B C D E F G A B C D E F G A B",
    "Explain photosynthesis in one sentence.",
    "for i in range(10):\n    print(i)\nfor j in range(10):\n",
    "red green blue red green blue red green",
    "To be or not to be, that is the question. To be or not",
]


def test_twenty_prompts_give_the_same_greedy_tokens(smollm2_path: Path) -> None:
    llm = LLM(smollm2_path, n_ctx=512, executor="inprocess")
    try:
        accepted = 0
        for text in PROMPTS:
            ids = llm.tokenize(text)
            plain = _tokens(llm, ids, 0, temperature=0)
            before = llm.core.accepted
            assert _tokens(llm, ids, 6, temperature=0) == plain, text
            accepted += llm.core.accepted - before
        assert accepted > 100  # the drafts were used, not just all rejected
        # seeded sampling too: every row's logits are those of a plain step, and the sampler's draws go in the same order
        ids = llm.tokenize(PROMPTS[0])
        assert _tokens(llm, ids, 6, temperature=0.8, seed=7) == _tokens(llm, ids, 0, temperature=0.8, seed=7)
    finally:
        llm.close()


def test_gemma_in_the_worker_pool(gemma3_path: Path) -> None:
    llm = LLM(gemma3_path, n_ctx=512, n_threads=2)
    try:
        for text in PROMPTS[:3]:
            ids = llm.tokenize(text)
            assert _tokens(llm, ids, 6, temperature=0) == _tokens(llm, ids, 0, temperature=0), text
    finally:
        llm.close()


def test_lookup_stays_off_where_rows_would_differ(make_model: Callable[..., Path], caplog: pytest.LogCaptureFixture) -> None:
    llm = LLM(make_model(arch="llama", qtype=QT.Q4_0, n_layers=2), n_ctx=64, executor="inprocess", native=False)
    try:
        with caplog.at_level(logging.WARNING):
            set_lookup(llm, 4)
        assert llm.core.lookup == 0 and "--lookup is off" in caplog.text
    finally:
        llm.close()
    p = argparse.ArgumentParser()
    add_lookup_arg(p)
    assert p.parse_args(["--lookup", "8"]).lookup == 8
    for bad in ("65", "-1", "x"):
        with pytest.raises(SystemExit):
            p.parse_args(["--lookup", bad])
