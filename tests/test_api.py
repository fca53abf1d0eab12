"""The LLM API on synthetic models: logits, generation limits, stop strings, prefix reuse, errors."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from powerinfer.api import LLM
from powerinfer.coordinator.sequence import _held_back
from powerinfer.errors import ContextOverflowError, InvalidArgumentError, ModelFileError


@pytest.fixture(scope="module")
def llm(make_model: Callable[..., Path]) -> LLM:
    return LLM(make_model(arch="llama"), n_ctx=64, n_batch=8, executor="inprocess")


def test_logits_shape_and_determinism(llm: LLM) -> None:
    ids = llm.tokenize("hello world")
    assert ids[0] == llm.tokenizer.bos_id
    a = llm.logits(ids)
    assert a.shape == (len(ids), llm.config.vocab_size) and a.dtype == np.float32
    np.testing.assert_array_equal(a, llm.logits(ids))


def test_generate_respects_max_tokens_and_streams_text(llm: LLM) -> None:
    chunks = list(llm.generate("abc", max_tokens=5, temperature=0))
    assert chunks[-1].finish_reason == "length"
    assert len([c for c in chunks if c.token >= 0]) == 5
    text, finish = llm.complete("abc", max_tokens=5, temperature=0)
    assert text == "".join(c.text for c in chunks) and finish == chunks[-1].finish_reason
    # a generation left early (Ctrl+C in the CLI) still reports its time and tokens
    it = llm.generate("abc", max_tokens=20, temperature=0)
    for _ in zip(range(3), it):
        pass
    it.close()
    assert llm.timings.generated_tokens == 3 and llm.timings.generate_s > 0


def test_seeded_sampling_is_reproducible(llm: LLM) -> None:
    a = llm.complete("xyz", max_tokens=8, temperature=1.0, seed=5)
    b = llm.complete("xyz", max_tokens=8, temperature=1.0, seed=5)
    assert a == b


def test_stop_string_cuts_text(llm: LLM) -> None:
    text, finish = llm.complete("abc", max_tokens=12, temperature=0)
    assert finish == "length" and len(text) >= 6  # this synthetic model never emits EOS greedily here
    stop = text[3:5]
    cut, finish = llm.complete("abc", max_tokens=12, temperature=0, stop=[stop])
    assert finish == "stop" and cut == text[: text.index(stop)]


def test_held_back_suffix() -> None:
    assert _held_back("hello wor", ("world",)) == 3
    assert _held_back("hello", ("xyz",)) == 0


def test_prefix_reuse_computes_only_new_tokens(llm: LLM) -> None:
    llm.complete("the same long prefix", max_tokens=1, temperature=0)
    llm.complete("the same long prefix and more", max_tokens=1, temperature=0)
    assert llm.timings.prompt_tokens == len(llm.tokenize(" and more", add_bos=False))


def test_context_overflow_and_bad_args(llm: LLM) -> None:
    with pytest.raises(ContextOverflowError):
        llm.complete("x" * 100, max_tokens=1)
    with pytest.raises(InvalidArgumentError):
        llm.complete("x", max_tokens=0)
    with pytest.raises(InvalidArgumentError):
        llm.complete("x", max_tokens=2, temperature=-1)
    with pytest.raises(InvalidArgumentError):
        llm.complete("x", max_tokens=2, stop=[""])
    # wrong types are refused by name, not left to fail inside numpy at the first sample
    for kwargs, says in ((dict(top_k=1.5), "top_k must be an integer"), (dict(seed=1.5), "seed must be an integer"),
                         (dict(temperature="0.5"), "temperature must be a number"), (dict(top_k=None), "top_k must be an integer"),
                         (dict(bogus=1), "unknown sampling parameter"), (dict(logprobs=-1), "logprobs must be an integer in"), (dict(logprobs=21), r"\[0, 20\]"),
                         (dict(stop=None), "stop sequences"), (dict(logit_bias=[(1.5, 1.0)]), "integer token ids")):
        with pytest.raises(InvalidArgumentError, match=says):
            llm.complete("x", max_tokens=2, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="max_tokens"):
        llm.complete("x", max_tokens=2.5)  # type: ignore[arg-type]
    # the engine is still usable afterwards; a {token id: bias} mapping is taken as the OpenAI API gives it
    assert llm.complete("x", max_tokens=2, temperature=0)[1] in ("length", "stop")
    banned = llm.complete("x", max_tokens=1, temperature=0)[0]
    first = llm.tokenize(banned, add_bos=False)[0]
    assert llm.complete("x", max_tokens=1, temperature=0, logit_bias={first: float("-inf")})[0] != banned


def test_a_stop_string_is_one_string_and_a_closed_llm_refuses_use(make_model: Callable[..., Path]) -> None:
    for executor in ("inprocess", "process"):
        llm = LLM(make_model(arch="llama", n_layers=2), n_ctx=64, executor=executor, n_threads=1)
        text, _ = llm.complete("abc", max_tokens=8, temperature=0)
        cut = text[len(text) // 2:] or text
        assert llm.complete("abc", max_tokens=8, temperature=0, stop=cut)[0] == llm.complete("abc", max_tokens=8, temperature=0, stop=[cut])[0]
        llm.close()
        for use in (lambda: llm.complete("abc", max_tokens=2), lambda: llm.logits([1, 2])):
            with pytest.raises(InvalidArgumentError, match="closed"):  # the native caches are freed: not a crash
                use()


def test_generation_stops_at_context_end(make_model: Callable[..., Path]) -> None:
    small = LLM(make_model(arch="llama"), n_ctx=12, executor="inprocess")
    chunks = list(small.generate("abcd", max_tokens=-1, temperature=0))
    assert chunks[-1].finish_reason in ("length", "stop")
    assert len(small.engine.tokens) <= 12


def test_missing_model_file(tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match="no such file"):
        LLM(tmp_path / "missing.gguf")


def test_default_context_must_be_positive(make_model: Callable[..., Path]) -> None:
    for bad in (0, -5):
        with pytest.raises(InvalidArgumentError, match="default context must be positive"):
            LLM(make_model(arch="llama"), default_ctx=bad, executor="inprocess")
