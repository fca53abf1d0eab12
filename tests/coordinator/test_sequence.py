"""Sequence (coordinator/sequence.py) on forced tokens: the text it emits, and the logprobs of the tokens that wrote it
(held back with a possible stop string, dropped where a stop cuts, offsets of split characters).

Runs in: the test process (no model: a byte-level vocabulary and one-hot logits).
"""

from __future__ import annotations

import numpy as np

from powerinfer.coordinator.sequence import Sequence
from powerinfer.generation import GenerationChunk
from powerinfer.sampling import SamplingParams
from powerinfer.tokenizer import GGUFTokenizer
from tests.test_tokenizer import bpe_meta

GREEDY = SamplingParams(temperature=0)
AB = 256  # the merged token "ab"


def tokenizer() -> GGUFTokenizer:
    meta = bpe_meta(["a b"], control=["</s>"], **{"tokenizer.ggml.eos_token_id": 257})
    return GGUFTokenizer.from_metadata(meta)


def run(tokens: list[int], stop: tuple[str, ...] = (), max_tokens: int = 50) -> list[GenerationChunk]:
    """Forces tokens one by one (then the end token) through a fresh sequence with logprobs on."""
    tok = tokenizer()
    state = Sequence(tok, [0], max_tokens, GREEDY, stop, logprobs=1)
    out: list[GenerationChunk] = []
    for t in [*tokens, 257]:
        logits = np.full(tok.vocab_size, -5.0, dtype=np.float32)
        logits[t] = 5.0
        out += state.step(logits, context_full=False)
        if state.done:
            break
    assert state.done
    return out


def text_and_logprobs(chunks: list[GenerationChunk]) -> tuple[str, list[str], list[int]]:
    lps = [lp for c in chunks for lp in c.logprobs]
    return "".join(c.text for c in chunks), [lp.text for lp in lps], [lp.offset for lp in lps]


def b(text: str) -> list[int]:
    return list(text.encode())  # byte tokens: id = byte


def test_tokens_cut_by_a_stop_string_have_no_logprobs() -> None:
    chunks = run(b("Hi\n\nmore"), stop=("\n\n",))
    assert text_and_logprobs(chunks) == ("Hi", ["H", "i"], [0, 1])
    # the first newline's logprob waited with its text: it was no chunk's until the stop decided
    assert [c.logprobs for c in chunks][2] == () and chunks[-1].finish_reason == "stop"
    # the token that completed the stop string was generated: the last chunk carries it (usage counts it)
    assert [c.token for c in chunks] == b("Hi\n\n")


def test_a_token_partly_before_the_stop_keeps_its_logprob() -> None:
    chunks = run([*b("x"), AB, *b("c")], stop=("b",))
    assert text_and_logprobs(chunks) == ("xa", ["x", "ab"], [0, 1])  # whole: its "a" is in the text


def test_held_text_that_was_no_stop_goes_out_with_its_logprobs() -> None:
    # the end token: the pending newline was not a stop after all
    assert text_and_logprobs(run(b("a\n"), stop=("\n\n",))) == ("a\n", ["a", "\n"], [0, 1])
    # max_tokens: the same, finish "length"
    chunks = run(b("a\nb"), stop=("\n\n",), max_tokens=2)
    assert text_and_logprobs(chunks) == ("a\n", ["a", "\n"], [0, 1]) and chunks[-1].finish_reason == "length"
    assert chunks[-1].logprobs and chunks[-1].logprobs[0].text == "\n"


def test_pieces_of_a_split_character_start_where_it_does() -> None:
    text, pieces, offsets = text_and_logprobs(run(b("€a€")))
    assert text == "€a€" and offsets == [0, 0, 0, 1, 2, 2, 2]
    assert "".join(pieces).count("\ufffd") == 6  # each byte alone is no character


def test_without_logprobs_nothing_is_held() -> None:
    tok = tokenizer()
    state = Sequence(tok, [0], 5, GREEDY, ("\n\n",))
    logits = np.full(tok.vocab_size, -5.0, dtype=np.float32)
    logits[ord("q")] = 5.0
    assert state.step(logits, context_full=False) == [GenerationChunk(ord("q"), "q")]


def test_top_logprobs_are_the_largest_in_order_and_normalised() -> None:
    tok = tokenizer()
    state = Sequence(tok, [0], 5, GREEDY, logprobs=3)
    logits = np.full(tok.vocab_size, -5.0, dtype=np.float32)
    logits[[7, 3, 9]] = [2.0, 2.0, 1.0]  # a tie: the lower id first, as a stable sort gives
    chunk = state.step(logits, context_full=False)[0]
    (lp,) = chunk.logprobs
    lse = float(np.log(np.exp(logits.astype(np.float64)).sum()))
    assert [t for t, _, _ in lp.top] == [3, 7, 9] and lp.token == 3
    assert abs(lp.logprob - (2.0 - lse)) < 1e-6 and abs(lp.top[2][2] - (1.0 - lse)) < 1e-6
