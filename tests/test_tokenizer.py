"""GGUFTokenizer: synthetic vocabularies of both kinds, plus llama.cpp's tokenizations of the real models.

Runs in: the pytest process. The real-model tests use the models fetched by ``powerinfer.fetch``
(see tests/conftest.py) and llama.cpp's reference in tests/fixtures.
"""

from __future__ import annotations

import heapq
import logging
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from powerinfer.errors import TokenizerError
from powerinfer.gguf_file import GGUFFile
from powerinfer.tokenizer import BYTE, CONTROL, NORMAL, UNKNOWN, USER_DEFINED, GGUFTokenizer, StreamDecoder

SPM_SPACE = "\u2581"


# -- synthetic vocabularies -----------------------------------------------------------------------


def spm_meta(pieces: dict[str, float], user_defined: Sequence[str] = (), control: Sequence[str] = (),
             **overrides: Any) -> dict[str, Any]:
    """A SentencePiece-style ('llama') vocabulary: <unk> <s> </s>, 256 byte tokens, then pieces."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256
    scores = [0.0] * len(tokens)
    for text, score in pieces.items():
        tokens.append(text), types.append(NORMAL), scores.append(score)
    for text in user_defined:
        tokens.append(text), types.append(USER_DEFINED), scores.append(0.0)
    for text in control:
        tokens.append(text), types.append(CONTROL), scores.append(0.0)
    meta: dict[str, Any] = {
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": np.array(scores, dtype=np.float32),
        "tokenizer.ggml.token_type": np.array(types, dtype=np.int32),
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_space_prefix": False,
    }
    meta.update(overrides)
    return meta


def _byte_chars() -> list[str]:
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = dict(zip(bs, bs))
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = 256 + extra
            extra += 1
    return [chr(table[b]) for b in range(256)]


BYTE_CHARS = _byte_chars()  # byte -> its GPT-2 byte-level character


def bpe_meta(merges: Sequence[str], extra_tokens: Sequence[str] = (), control: Sequence[str] = (),
             **overrides: Any) -> dict[str, Any]:
    """A byte-level 'gpt2' vocabulary: the 256 byte characters, every merge result, then extras."""
    tokens = list(BYTE_CHARS)
    for rule in merges:
        merged = rule.replace(" ", "")
        if merged not in tokens:
            tokens.append(merged)
    tokens += [t for t in extra_tokens if t not in tokens]
    types = [NORMAL] * len(tokens) + [CONTROL] * len(control)
    tokens += list(control)
    meta: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt2", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": list(merges),
    }
    meta.update(overrides)
    return meta


def ids_of(tok: GGUFTokenizer, *texts: str) -> list[int]:
    lookup = {tok.token_text(i): i for i in range(tok.vocab_size)}
    return [lookup[t] for t in texts]


def llamacpp_spm(text: str, vocab: dict[str, int], scores: Sequence[float]) -> list[int]:
    """Straight port of llama.cpp's llm_tokenizer_spm_session::tokenize (text already '▁'-escaped)."""
    sym = list(text)
    if not sym:
        return []
    prev, nxt = list(range(-1, len(sym) - 1)), [*range(1, len(sym)), -1]
    heap: list[tuple[float, int, int, int]] = []

    def add(left: int, right: int) -> None:
        if left != -1 and right != -1 and (tid := vocab.get(sym[left] + sym[right])) is not None:
            heapq.heappush(heap, (-float(scores[tid]), left, right, len(sym[left]) + len(sym[right])))

    for i in range(1, len(sym)):
        add(i - 1, i)
    while heap:
        _, left, right, size = heapq.heappop(heap)
        if not sym[left] or not sym[right] or len(sym[left]) + len(sym[right]) != size:
            continue  # stale: one side was merged since
        sym[left], sym[right] = sym[left] + sym[right], ""
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prev[nxt[right]] = left
        add(prev[left], left)
        add(left, nxt[left])
    out, i = [], 0
    while i != -1:
        if sym[i] in vocab:
            out.append(vocab[sym[i]])
        else:
            out += [vocab[f"<0x{b:02X}>"] for b in sym[i].encode("utf-8")]
        i = nxt[i]
    return out


# -- SentencePiece-style ('llama') ----------------------------------------------------------------


def test_spm_merges_any_split_by_score_like_llamacpp() -> None:
    # "bc" outscores "ab", so llama.cpp first makes [a][bc], then merges (a, bc) into "abc" - a merge a
    # trained-merges-only BPE would not have. Our derived merges must have it.
    tok = GGUFTokenizer.from_metadata(spm_meta({"a": -10, "b": -10, "c": -10, "ab": -2, "bc": -1, "abc": -3}))
    assert tok.encode("abc", add_bos=False) == ids_of(tok, "abc")
    tok = GGUFTokenizer.from_metadata(spm_meta({"a": -10, "b": -10, "c": -10, "ab": -2, "bc": -1}))
    assert tok.encode("abc", add_bos=False) == ids_of(tok, "a", "bc")
    assert tok.encode("abab", add_bos=False) == ids_of(tok, "ab", "ab")


def test_spm_matches_llamacpp_port_on_random_vocab() -> None:
    rng = random.Random(1)
    pieces: dict[str, float] = {c: -100.0 - i for i, c in enumerate("abcde" + SPM_SPACE)}
    while len(pieces) < 120:
        pieces.setdefault("".join(rng.choice("abcde" + SPM_SPACE) for _ in range(rng.randint(2, 5))), -rng.random() * 50)
    meta = spm_meta(pieces)
    tok = GGUFTokenizer.from_metadata(meta)
    vocab = {t: i for i, t in enumerate(meta["tokenizer.ggml.tokens"])}
    for _ in range(500):
        text = "".join(rng.choice("abcde xé") for _ in range(rng.randint(1, 40)))
        while "  " in text:  # keep to plain text: no runs of spaces
            text = text.replace("  ", " ")
        expected = llamacpp_spm(text.replace(" ", SPM_SPACE), vocab, meta["tokenizer.ggml.scores"])
        assert tok.encode(text, add_bos=False) == expected, text
        assert tok.decode(expected) == text


def test_spm_byte_fallback_and_decode() -> None:
    tok = GGUFTokenizer.from_metadata(spm_meta({"a": -1}))
    ids = tok.encode("aé", add_bos=False)
    assert ids == ids_of(tok, "a", "<0xC3>", "<0xA9>")
    assert tok.decode(ids) == "aé"
    assert tok.token_bytes(ids[1]) == b"\xc3"


def test_spm_bos_eos_and_space_prefix() -> None:
    pieces = {SPM_SPACE: -5, "a": -5, "b": -5, SPM_SPACE + "a": -1, SPM_SPACE + "b": -1}
    tok = GGUFTokenizer.from_metadata(spm_meta(pieces, control=["<ctl>"], **{"tokenizer.ggml.add_space_prefix": True}))
    assert tok.add_bos and tok.bos_id == 1 and tok.eos_id == 2
    assert tok.encode("a") == [1, *ids_of(tok, SPM_SPACE + "a")]
    assert tok.encode("a", add_bos=False) == ids_of(tok, SPM_SPACE + "a")
    assert tok.encode("") == [1] and tok.encode("", add_bos=False) == []
    # llama.cpp prefixes a space at the start and again after every special token
    assert tok.encode("a<ctl>b", add_bos=False, special=True) == ids_of(tok, SPM_SPACE + "a", "<ctl>", SPM_SPACE + "b")
    assert tok.decode(tok.encode("a b")) == "a b"  # the prefixed space is dropped again
    assert tok.decode(tok.encode(" a")) == " a"
    assert tok.decode(tok.encode("a"), skip_special=False) == "<s> a"
    tok = GGUFTokenizer.from_metadata(spm_meta(pieces, **{"tokenizer.ggml.add_eos_token": True}))
    assert tok.encode("a") == [1, *ids_of(tok, "a"), 2]


def test_user_defined_always_whole_control_only_with_special() -> None:
    tok = GGUFTokenizer.from_metadata(spm_meta({"a": -1}, user_defined=["\n\n", "<b>"], control=["<ctl>"]))
    nn, b_tag, ctl = ids_of(tok, "\n\n", "<b>", "<ctl>")
    assert tok.encode("a\n\na<b>", add_bos=False) == [*ids_of(tok, "a"), nn, *ids_of(tok, "a"), b_tag]
    plain = tok.encode("<ctl>", add_bos=False)
    assert ctl not in plain and tok.decode(plain) == "<ctl>"
    assert tok.encode("<ctl>", add_bos=False, special=True) == [ctl]
    assert tok.encode("<unk>", add_bos=False, special=True) == [0]  # UNKNOWN is matched like CONTROL
    assert tok.is_special(ctl) and tok.is_special(0) and not tok.is_special(b_tag)
    assert tok.token_bytes(ctl) == b"" and tok.token_bytes(b_tag) == b"<b>"
    assert tok.decode([ctl, b_tag]) == "<b>" and tok.decode([ctl, b_tag], skip_special=False) == "<ctl><b>"


def test_special_tokens_split_longest_first_like_llamacpp() -> None:
    # llama.cpp splits on each special token in order of length, not leftmost-first.
    tok = GGUFTokenizer.from_metadata(spm_meta({"a": -1, "b": -1}, user_defined=["ab", "bab"]))
    assert tok.encode("abab", add_bos=False) == ids_of(tok, "a", "bab")


def test_end_of_generation_ids() -> None:
    meta = spm_meta({"a": -1}, control=["<end_of_turn>"])
    meta["tokenizer.ggml.tokens"] = [*meta["tokenizer.ggml.tokens"], "<|im_end|>"]  # a NORMAL token, by mistake
    meta["tokenizer.ggml.token_type"] = [*meta["tokenizer.ggml.token_type"], NORMAL]
    meta["tokenizer.ggml.scores"] = [*meta["tokenizer.ggml.scores"], 0.0]
    tok = GGUFTokenizer.from_metadata(meta)
    im_end, eot = ids_of(tok, "<|im_end|>", "<end_of_turn>")
    assert tok.eog_ids == {2, eot, im_end}
    assert tok.is_special(im_end)  # llama.cpp forces end tokens to CONTROL
    # Gemma's "</s>" is an HTML tag (USER_DEFINED), not an end token.
    meta["tokenizer.ggml.token_type"][2] = USER_DEFINED
    meta["tokenizer.ggml.eos_token_id"] = eot
    tok = GGUFTokenizer.from_metadata(meta)
    assert tok.eog_ids == {eot, im_end} and not tok.is_special(2)


def test_stream_decoder_holds_back_partial_utf8() -> None:
    tok = GGUFTokenizer.from_metadata(spm_meta({"a": -1}))
    ids = tok.encode("a€🎉", add_bos=False)
    dec = StreamDecoder(tok)
    out = [dec.push(i) for i in ids]
    assert "".join(out) + dec.flush() == "a€🎉"
    assert out[:4] == ["a", "", "", "€"]
    assert dec.push(ids[-1]) == "\ufffd"  # a lone continuation byte
    assert dec.push(ids[1]) == ""  # an unfinished sequence is held back ...
    assert dec.flush() == "\ufffd"  # ... until the end
    assert dec.push(ids[0]) == "a"


# -- byte-level BPE ('gpt2') ----------------------------------------------------------------------

MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld", "1 2", "12 3"]


def test_bpe_encode_decode_round_trip() -> None:
    tok = GGUFTokenizer.from_metadata(bpe_meta(MERGES, control=["<|im_start|>"]))
    assert not tok.add_bos
    assert tok.encode("hello world") == ids_of(tok, "hello", "Ġworld")
    for text in ["hello world", "  tabs\tand\nnewlines ", "naïve café — “quotes” 🎉", "123 1234"]:
        assert tok.decode(tok.encode(text)) == text
    start = ids_of(tok, "<|im_start|>")[0]
    assert tok.encode("<|im_start|>hello", special=True) == [start, *ids_of(tok, "hello")]
    assert start not in tok.encode("<|im_start|>hello")
    assert tok.token_bytes(ids_of(tok, "Ġworld")[0]) == b" world" and tok.token_bytes(start) == b""


def test_bpe_pre_tokenizer_per_pre_type(caplog: pytest.LogCaptureFixture) -> None:
    gpt2 = GGUFTokenizer.from_metadata(bpe_meta(MERGES))
    assert gpt2.encode("123") == ids_of(gpt2, "123")
    smollm = GGUFTokenizer.from_metadata(bpe_meta(MERGES, **{"tokenizer.ggml.pre": "smollm"}))
    assert smollm.encode("123") == ids_of(smollm, "1", "2", "3")  # digits are split one by one first
    with caplog.at_level(logging.WARNING, logger="powerinfer.tokenizer"):
        odd = GGUFTokenizer.from_metadata(bpe_meta(MERGES, **{"tokenizer.ggml.pre": "no-such-pre"}))
    assert "no-such-pre" in caplog.text
    assert odd.encode("hello world 123") == gpt2.encode("hello world 123")


def test_bpe_llama3_ignores_merges_for_whole_words() -> None:
    meta = bpe_meta(MERGES, extra_tokens=["xyz"], control=["<|begin_of_text|>"], **{"tokenizer.ggml.pre": "llama-bpe"})
    meta["tokenizer.ggml.bos_token_id"] = len(meta["tokenizer.ggml.tokens"]) - 1
    tok = GGUFTokenizer.from_metadata(meta)
    assert tok.add_bos  # llama.cpp's default for the llama3 pre-tokenizer
    assert tok.encode("xyz") == [tok.bos_id, *ids_of(tok, "xyz")]  # no merges lead there; llama3 takes it whole
    plain = GGUFTokenizer.from_metadata(bpe_meta(MERGES, extra_tokens=["xyz"]))
    assert plain.encode("xyz") == ids_of(plain, "x", "y", "z")


# -- errors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["bert", "rwkv", None])
def test_unsupported_model_is_named(model: str | None) -> None:
    with pytest.raises(TokenizerError, match=repr(model)):
        GGUFTokenizer.from_metadata({**spm_meta({"a": -1}), "tokenizer.ggml.model": model})


def test_bad_metadata_errors() -> None:
    with pytest.raises(TokenizerError, match="tokenizer.ggml.tokens"):
        GGUFTokenizer.from_metadata({"tokenizer.ggml.model": "gpt2"})
    meta = spm_meta({"a": -1})
    with pytest.raises(TokenizerError, match="token_type"):
        GGUFTokenizer.from_metadata({**meta, "tokenizer.ggml.token_type": [1, 1]})
    with pytest.raises(TokenizerError, match="BOS"):
        GGUFTokenizer.from_metadata({**bpe_meta(MERGES), "tokenizer.ggml.add_bos_token": True})
    tok = GGUFTokenizer.from_metadata(meta)
    for bad in (-1, tok.vocab_size, "3"):
        with pytest.raises(TokenizerError, match="outside the vocabulary"):
            tok.decode([bad])  # type: ignore[list-item]
    with pytest.raises(TokenizerError):
        tok.encode(b"bytes")  # type: ignore[arg-type]


# -- the real models against llama.cpp ------------------------------------------------------------


@pytest.fixture(scope="session")
def smollm2_metadata(smollm2_path: Path) -> dict[str, Any]:
    return GGUFFile(smollm2_path).metadata


@pytest.fixture(scope="session")
def gemma3_metadata(gemma3_path: Path) -> dict[str, Any]:
    return GGUFFile(gemma3_path).metadata


_REAL: dict[str, GGUFTokenizer] = {}


@pytest.fixture(params=["smollm2", "gemma3"])
def real(request: pytest.FixtureRequest) -> tuple[str, GGUFTokenizer]:
    name = request.param
    if name not in _REAL:
        meta = request.getfixturevalue(f"{name}_metadata")
        t0 = time.perf_counter()
        _REAL[name] = GGUFTokenizer.from_metadata(meta)
        logging.getLogger(__name__).info("%s tokenizer built in %.2fs", name, time.perf_counter() - t0)
    return name, _REAL[name]


@pytest.mark.real_model
def test_real_matches_llamacpp_tokenize(real: tuple[str, GGUFTokenizer], reference: dict[str, Any]) -> None:
    name, tok = real
    for case in reference[name]["tokenize"]:
        assert tok.encode(case["text"], add_bos=case["add_bos"]) == case["ids"], case["text"]
        assert tok.encode(case["text"], add_bos=case["add_bos"], special=True) == case["ids_special"], case["text"]
        assert tok.decode(case["ids"]) == case["text"]
    for run in reference[name]["greedy"]:
        assert tok.encode(run["prompt"]) == run["prompt_tokens"]
        assert tok.decode(run["prompt_tokens"]) == run["prompt"]


@pytest.mark.real_model
def test_real_chat_markup_with_special(real: tuple[str, GGUFTokenizer]) -> None:
    name, tok = real
    start, end, user = ("<|im_start|>", "<|im_end|>", "user") if name == "smollm2" else ("<start_of_turn>", "<end_of_turn>", "user")
    text = f"{start}{user}\nHi there{end}\n"
    ids = tok.encode(text, add_bos=False, special=True)
    s, e = ids_of(tok, start, end)
    assert ids == [s, *tok.encode(f"{user}\nHi there", add_bos=False), e, *tok.encode("\n", add_bos=False)]
    assert s not in tok.encode(text, add_bos=False)
    assert e in tok.eog_ids and tok.eos_id in tok.eog_ids
    assert tok.decode(ids, skip_special=False) == text and tok.decode(ids) == f"{user}\nHi there\n"


@pytest.mark.real_model
def test_real_gemma_matches_llamacpp_spm_port(gemma3_metadata: dict[str, Any]) -> None:
    tok = _REAL.get("gemma3") or GGUFTokenizer.from_metadata(gemma3_metadata)
    tokens, scores = gemma3_metadata["tokenizer.ggml.tokens"], gemma3_metadata["tokenizer.ggml.scores"]
    vocab = {t: i for i, t in enumerate(tokens)}
    normal = [t.replace(SPM_SPACE, " ") for t, k in zip(tokens, gemma3_metadata["tokenizer.ggml.token_type"]) if k == NORMAL]
    rng = random.Random(0)
    for _ in range(300):  # concatenated vocabulary pieces: the hardest case for merge order
        text = " ".join("".join(rng.choice(normal) for _ in range(rng.randint(1, 6))).split())
        if any(t in text for t in ("<", "\n", "\t")):
            continue  # keep clear of Gemma's user-defined tokens (HTML tags, newlines, tabs)
        assert tok.encode(text, add_bos=False) == llamacpp_spm(text.replace(" ", SPM_SPACE), vocab, scores), text


@pytest.mark.real_model
def test_real_round_trip_and_stream(real: tuple[str, GGUFTokenizer]) -> None:
    _, tok = real
    text = "Straße, 東京, emoji 🎉👍🏽, code:\n\tif x:  return 42\n\n  done."
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    dec = StreamDecoder(tok)
    assert "".join(dec.push(i) for i in ids) + dec.flush() == text


def test_a_lone_surrogate_is_encoded_as_the_replacement_character(smollm2_path: Path) -> None:
    from powerinfer.gguf_file import GGUFFile
    from powerinfer.tokenizer import GGUFTokenizer

    tok = GGUFTokenizer.from_metadata(GGUFFile(smollm2_path).metadata)
    assert tok.encode("\ud800 hi", add_bos=False) == tok.encode("\ufffd hi", add_bos=False)
    assert tok.encode("\ud83d\ude00", add_bos=False) == tok.encode("\ufffd\ufffd", add_bos=False)  # two lone halves
    assert tok.encode("\U0001f600", add_bos=False) != tok.encode("\ufffd", add_bos=False)  # a real emoji stays itself


def test_text_offsets_follow_decode() -> None:
    """Each token's offset is len(decode(ids[:i])) where that is whole characters; the pieces of a
    split character share its offset; a BOS and SentencePiece's space prefix take no room."""
    for tok in (GGUFTokenizer.from_metadata(spm_meta({"▁a": -1, "b": -2})), GGUFTokenizer.from_metadata(bpe_meta(MERGES))):
        for text in ("a€b🎉 a", " hello world", "€"):
            ids = tok.encode(text, add_bos=True)
            offsets = tok.text_offsets(ids)
            assert len(offsets) == len(ids) and offsets == sorted(offsets)
            for i, off in enumerate(offsets):
                prefix = tok.decode(ids[:i])
                if "\ufffd" not in prefix:
                    assert off == len(prefix), (text, i)
            assert offsets[-1] < len(tok.decode(ids))


def test_decode_with_special_texts_and_their_offsets() -> None:
    """A prompt's text as written: special tokens rendered, the BOS encode() added left out."""
    tok = GGUFTokenizer.from_metadata(spm_meta({"▁a": -1, "b": -2}, control=["<sep>"]))
    ids = tok.encode("a<sep>b", add_bos=True, special=True)
    assert ids[0] == tok.bos_id and tok.decode(ids) == "ab"
    assert tok.decode(ids, skip_special=False, strip_bos=True) == "a<sep>b"
    assert tok.decode(ids, skip_special=False).startswith(tok.token_text(tok.bos_id))
    assert tok.text_offsets(ids, skip_special=False, strip_bos=True) == [0, 0, 1, 6]
