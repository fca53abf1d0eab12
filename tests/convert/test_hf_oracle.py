"""Oracle 1: seeded tiny Hugging Face checkpoints of each ReLU family (and OPT), converted by ``powerinfer
convert``, against transformers' own logits, on every executor (in-process native decoder, the
default multiprocess pool, the torch path)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from powerinfer.api import LLM
from powerinfer.convert.run import convert
from powerinfer.gguf_file import GGUFFile
from powerinfer.model import reference
from powerinfer.config import config_from_gguf
from tests.convert.hf_models import SPLIT, TEXT, load_oracle, make_checkpoint, oracle_logits, q8_0_agreement, tokens

FAMILIES = ("silu", "relu", "fatrelu", "drelu", "opt")
EXECUTORS = {"native": dict(executor="inprocess"), "pool": dict(executor="process", n_threads=2),
             "torch": dict(executor="inprocess", native=False)}


def _prompt(seed: int, n: int = 64) -> list[int]:
    return [int(i) for i in np.random.default_rng(seed).integers(2, 290, n)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {act: make_checkpoint(root / act, act, seed=i) for i, act in enumerate(FAMILIES)}


@pytest.fixture(scope="module")
def f32_files(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf")
    return {act: convert(src, root / f"{act}.gguf", "f32")[0] for act, src in checkpoints.items()}


def _logits(path: Path, ids: list[int], **kw: object) -> np.ndarray:
    llm = LLM(path, n_ctx=128, **kw)  # type: ignore[arg-type]
    try:
        return llm.logits(ids)
    finally:
        llm.close()


@pytest.mark.parametrize("act", FAMILIES)
def test_the_file_says_its_activation(f32_files: dict[str, Path], act: str) -> None:
    cfg = config_from_gguf(GGUFFile(f32_files[act]))
    assert cfg.activation == ("relu" if act == "opt" else act)
    assert cfg.arch == {"drelu": "bamboo", "opt": "opt"}.get(act, "llama")
    assert cfg.act_threshold == pytest.approx(0.02 if act == "fatrelu" else 0.0)


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("act", FAMILIES)
def test_f32_logits_match_transformers(checkpoints: dict[str, Path], f32_files: dict[str, Path], act: str, executor: str) -> None:
    ids = _prompt(1)
    ref = oracle_logits(load_oracle(checkpoints[act]), ids)
    ours = _logits(f32_files[act], ids, **EXECUTORS[executor])
    err = np.abs(ours - ref).max() / (ref.max() - ref.min())
    assert err < 1e-3, f"{act} on {executor}: {err:.2e} of the logits' range"
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.slow
@pytest.mark.parametrize("act", ("relu", "fatrelu", "drelu", "opt"))
def test_q8_0_top1_agrees_with_transformers(tmp_path: Path, act: str) -> None:
    """Q8_0 against transformers on the held-out text (2368 positions each) of checkpoints trained 120
    steps (a random one's flat distributions flip at any rounding), pooled over four seeds: one
    checkpoint's figure moves by +-0.3 points with its seed and with the machine that trained it
    (measured: 97.85-99.20% over ten seeds a family), so one draw says little about a 98% bar.
    What Q8_0's weight rounding costs by itself is measured too, as transformers with the same Q8_0
    weights (98.1-99.3% against the float model); we hold ours within 98.5% of that (our own error:
    8-bit activations, as llama.cpp) and no more than 1 point below it. The 98% figure itself is
    measured over ten seeds by ``python -m tests.convert.oracle_report`` (docs/powerinfer-models.md);
    here the pooled floor is 97.8%, so that another machine's training draws do not fail CI."""
    counts = [q8_0_agreement(tmp_path / str(seed), act, seed) for seed in range(3, 7)]
    vs_float, rounded_vs_float, vs_rounded, total = (sum(c[i] for c in counts) for i in range(4))
    assert total > 8000
    assert vs_rounded / total >= 0.985, f"ours vs transformers with the Q8_0 weights: {vs_rounded}/{total}"
    assert vs_float / total >= rounded_vs_float / total - 0.01, f"{vs_float} vs {rounded_vs_float} of {total}"
    assert vs_float / total >= 0.978, f"ours vs transformers: {vs_float}/{total}"


def test_tied_embeddings_and_q4_0_load(tmp_path: Path) -> None:
    src = make_checkpoint(tmp_path / "tied", "relu", seed=7, tied=True)
    f32 = convert(src, tmp_path / "tied.gguf", "f32")[0]
    assert "output.weight" not in GGUFFile(f32).tensors
    ids = _prompt(3)
    ref = oracle_logits(load_oracle(src), ids)
    ours = _logits(f32, ids, executor="inprocess")
    assert np.abs(ours - ref).max() / (ref.max() - ref.min()) < 1e-3
    q4 = convert(src, tmp_path / "tied-q4.gguf", "q4_0")[0]
    f = GGUFFile(q4)
    assert f.tensor("token_embd.weight").qtype == QT.Q8_0  # the tied head: 8 bits under q4_0
    assert f.tensor("blk.0.ffn_gate.weight").qtype == QT.Q4_0 and f.tensor("blk.0.ffn_norm.weight").qtype == QT.F32
    # a random model's top-1 means little at 4 bits: hold the file to the numpy statement of itself
    want = reference.logits(f, config_from_gguf(f), ids)
    got = _logits(q4, ids, executor="inprocess")
    assert np.abs(got - want).max() / (want.max() - want.min()) < 2e-2


def test_tokenizer_and_chat_template_come_along(checkpoints: dict[str, Path], f32_files: dict[str, Path]) -> None:
    from tokenizers import Tokenizer

    hf = Tokenizer.from_file(str(checkpoints["relu"] / "tokenizer.json"))
    llm = LLM(f32_files["relu"], n_ctx=128, executor="inprocess")
    try:
        for text in ("The quick brown fox", "sparse models, 2024 and 0123!", "  spaces\nand lines"):
            assert llm.tokenize(text, add_bos=False) == hf.encode(text).ids
        assert llm.tokenize("hi", add_bos=True)[0] == 0  # <s>
        assert llm.chat_template is not None
    finally:
        llm.close()


def test_sentencepiece_checkpoint(tmp_path: Path) -> None:
    """A Llama-2-style checkpoint with only tokenizer.model: the vocabulary, scores and byte tokens come
    through the sentencepiece package; tokenization equals SentencePiece's, logits transformers'."""
    import sentencepiece as spm

    src = make_checkpoint(tmp_path / "spm", "relu", seed=2, spm=True)
    path = convert(src, tmp_path / "spm.gguf", "f32")[0]
    sp = spm.SentencePieceProcessor(model_file=str(src / "tokenizer.model"))
    llm = LLM(path, n_ctx=128, executor="inprocess")
    try:
        for text in ("The standard library", "Hello, world! 123", "  two  spaces\nnew line", "ünïcödé ✓"):
            assert llm.tokenize(text, add_bos=False) == sp.encode(text)
        assert llm.tokenize("x", add_bos=True)[0] == 1
        ids = tokens(src, TEXT[SPLIT : SPLIT + 400])[:64]
        ref = oracle_logits(load_oracle(src), ids)
        assert np.abs(llm.logits(ids) - ref).max() / (ref.max() - ref.min()) < 1e-3
    finally:
        llm.close()
