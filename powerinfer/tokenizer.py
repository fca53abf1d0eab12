"""Text <-> token ids for GGUF models, reproducing llama.cpp's tokenizer.

Runs in: the coordinator process.

Two kinds, named by ``tokenizer.ggml.model``:

* ``gpt2``: byte-level BPE with the file's merges, pre-split by the regexes llama.cpp uses for
  the file's ``tokenizer.ggml.pre``.
* ``llama``: SentencePiece-style BPE. llama.cpp repeatedly merges the adjacent pair whose
  concatenation is a vocabulary token with the highest score. HF ``tokenizers``' BPE gives the
  same result when it gets one merge rule per (token, split into two vocabulary tokens), ranked
  by the merged token's score; we derive those rules from the vocabulary at load time.

The HF tokenizer only ever sees plain text fragments. Special-token splitting (USER_DEFINED
tokens always, CONTROL/UNKNOWN only with ``special=True``, longest token first), BOS/EOS and the
SentencePiece space prefix are done here the way llama.cpp's ``tokenize`` does them.
"""

from __future__ import annotations

import codecs
import logging
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from powerinfer.errors import TokenizerError, quoted
from powerinfer.tokenizer_models import LLAMA3_FAMILY, bpe_tokenizer, spm_tokenizer

_SURROGATE = re.compile("[\ud800-\udfff]")

log = logging.getLogger(__name__)

# GGUF token types (llama.cpp's llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


# Token texts llama.cpp treats as end-of-generation (and forces to CONTROL), from llama-vocab.cpp.
_EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<｜end▁of▁sentence｜>",
})
# FIM pad/repo/file-separator tokens also end generation; llama.cpp finds them by text when unset.
_FIM_EOG_TEXTS = {
    "tokenizer.ggml.fim_pad_token_id": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "tokenizer.ggml.fim_rep_token_id": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "tokenizer.ggml.fim_sep_token_id": ("<|file_sep|>",),
}
# llama.cpp always renders these gpt-oss tokens, i.e. treats them as USER_DEFINED.
_FORCED_USER_DEFINED = frozenset({"<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"})



def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: printable stand-in character -> byte."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}


_BYTE_DECODER = _byte_decoder()


def _array(meta: Mapping[str, Any], key: str, n: int, dtype: type, default: float) -> np.ndarray:
    value = meta.get(key)
    if value is None:
        return np.full(n, default, dtype=dtype)
    try:
        arr = np.asarray(value, dtype=dtype)
    except (TypeError, ValueError, OverflowError):  # strings, nested arrays: not what the key holds
        raise TokenizerError(f"{key} has type {type(value).__name__}, expected an array of numbers") from None
    if arr.ndim != 1 or arr.size < n:
        raise TokenizerError(f"{key} has {arr.size} entries for {n} tokens")
    return arr[:n]


def _token_id(meta: Mapping[str, Any], key: str, default: int | None, n: int) -> int | None:
    """A special token id from the metadata; like llama.cpp, a bad one falls back to the default."""
    fallback = default if default is not None and 0 <= default < n else None
    value = meta.get(key)
    if value is None:
        return fallback
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= int(value) < n:
        log.warning("%s = %r is not a token id of this %d-token vocabulary; ignoring it", key, value, n)
        return fallback
    return int(value)


def _flag(meta: Mapping[str, Any], key: str, default: bool) -> bool:
    """A boolean setting; an array or string there is a corrupt file (``bool(array)`` would raise)."""
    value = meta.get(key, default)
    if isinstance(value, (bool, int, np.bool_, np.integer)):
        return bool(value)
    raise TokenizerError(f"{key} has type {type(value).__name__}, expected a boolean")


def _end_of_generation(
    meta: Mapping[str, Any], tokens: list[str], types: list[int], vocab: dict[str, int], eos_id: int | None
) -> frozenset[int]:
    """llama.cpp's end-of-generation set; fixes up ``types`` the way llama_vocab::impl::load does."""

    def force_control(i: int) -> None:
        if types[i] != UNKNOWN:
            types[i] = CONTROL

    n = len(tokens)
    eot_id = _token_id(meta, "tokenizer.ggml.eot_token_id", None, n)
    eom_id = _token_id(meta, "tokenizer.ggml.eom_token_id", None, n)
    eog = {i for i in (eos_id, eot_id, eom_id) if i is not None}
    for key, texts in _FIM_EOG_TEXTS.items():
        fim = _token_id(meta, key, None, n)
        fim = fim if fim is not None else next((vocab[t] for t in texts if t in vocab), None)
        if fim is not None:
            eog.add(fim)
            force_control(fim)
    for text in _EOG_TEXTS.intersection(vocab):
        if text == "</s>" and types[vocab[text]] == USER_DEFINED:
            continue  # Gemma's HTML strike-through tag, not an end token (llama.cpp lists it for PaddleOCR)
        eog.add(vocab[text])
        force_control(vocab[text])
    for text in _FORCED_USER_DEFINED.intersection(vocab):
        types[vocab[text]] = USER_DEFINED
    if {"<|return|>", "<|call|>", "<|end|>"} <= {tokens[i] for i in eog}:
        eog.discard(vocab["<|end|>"])  # o200k_harmony: <|end|> ends a message, not the generation
        types[vocab["<|end|>"]] = USER_DEFINED
    return frozenset(eog)


class GGUFTokenizer:
    """llama.cpp-compatible tokenizer built from a GGUF metadata mapping (see ``from_metadata``)."""

    def __init__(
        self, *, model: str, tokens: list[str], types: list[int], hf: Tokenizer, bos_id: int | None, eos_id: int | None,
        eog_ids: frozenset[int], add_bos: bool, add_eos: bool, add_space_prefix: bool,
    ) -> None:
        self.model = model
        self.vocab_size = len(tokens)
        self.bos_id, self.eos_id, self.eog_ids = bos_id, eos_id, eog_ids
        self.add_bos, self.add_eos, self.add_space_prefix = add_bos, add_eos, add_space_prefix
        self._spm = model == "llama"
        self._tokens, self._types, self._hf = tokens, types, hf
        self._pieces: list[bytes | None] = [None] * len(tokens)
        # Candidates for the special-token split, grouped by their first characters so one
        # `prefix in text` test rules out whole groups (gemma has 6k <unusedN> control tokens).
        self._split_all: dict[str, list[tuple[int, int, str]]] = {}
        self._split_user: dict[str, list[tuple[int, int, str]]] = {}
        for i in np.flatnonzero(np.isin(np.asarray(types), (CONTROL, UNKNOWN, USER_DEFINED))).tolist():
            text = tokens[i]
            entry = (-len(text), i, text)  # sorts longest first, like llama.cpp's cache_special_tokens
            self._split_all.setdefault(text[:4], []).append(entry)
            if types[i] == USER_DEFINED:
                self._split_user.setdefault(text[:4], []).append(entry)

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any]) -> GGUFTokenizer:
        """Build from GGUF metadata (keys as in the file; big arrays may be lists or numpy arrays)."""
        t0 = time.perf_counter()
        model = meta.get("tokenizer.ggml.model")
        if not isinstance(model, str) or model not in ("llama", "gpt2"):  # (`array in (...)` would raise)
            raise TokenizerError(f"unsupported tokenizer model {quoted(model)} (supported: 'llama', 'gpt2')")
        raw = meta.get("tokenizer.ggml.tokens")
        if not isinstance(raw, (list, tuple, np.ndarray)) or len(raw) == 0:  # a number has no len()
            held = "" if raw is None or isinstance(raw, (list, tuple, np.ndarray)) else f": a {type(raw).__name__}"
            raise TokenizerError(f"the file has no tokenizer vocabulary (tokenizer.ggml.tokens{held})")
        tokens = list(raw)
        if set(map(type, tokens)) != {str}:  # bytes or numpy strings from other readers
            tokens = [t.decode("utf-8", "surrogateescape") if isinstance(t, bytes) else str(t) for t in tokens]
        if "" in tokens:
            tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(tokens)]  # llama.cpp's name for them
        n = len(tokens)
        types = _array(meta, "tokenizer.ggml.token_type", n, np.int64, NORMAL).tolist()
        vocab = dict(zip(tokens, range(n)))
        if len(vocab) < n:
            log.warning("the vocabulary has %d duplicate token texts; the last id of each wins", n - len(vocab))
        spm = model == "llama"
        pre_value = meta.get("tokenizer.ggml.pre")
        if not isinstance(pre_value, (str, type(None))):  # `array or "default"` would raise
            raise TokenizerError(f"tokenizer.ggml.pre has type {type(pre_value).__name__}, expected a string")
        pre = pre_value or "default"
        llama3 = not spm and pre in LLAMA3_FAMILY
        # Defaults where the metadata is silent are llama.cpp's.
        add_bos = _flag(meta, "tokenizer.ggml.add_bos_token", spm or llama3)
        add_eos = _flag(meta, "tokenizer.ggml.add_eos_token", False)
        add_space_prefix = spm and _flag(meta, "tokenizer.ggml.add_space_prefix", True)
        bos_id = _token_id(meta, "tokenizer.ggml.bos_token_id", 1 if spm else None, n)
        eos_id = _token_id(meta, "tokenizer.ggml.eos_token_id", 2 if spm else None, n)
        if add_bos and bos_id is None:
            raise TokenizerError("the file asks for a BOS token but names none (tokenizer.ggml.bos_token_id)")
        if add_eos and eos_id is None:
            raise TokenizerError("the file asks for an EOS token but names none (tokenizer.ggml.eos_token_id)")
        eog = _end_of_generation(meta, tokens, types, vocab, eos_id)

        # HF's Rust side cannot take strings with lone surrogates (invalid UTF-8 in the file);
        # no text we are given can contain them, so those tokens simply stay out of its vocab.
        try:
            "".join(tokens).encode("utf-8")
            hf_vocab = vocab
        except UnicodeEncodeError:
            hf_vocab = {t: i for t, i in vocab.items() if not any("\ud800" <= c <= "\udfff" for c in t)}
        try:
            if spm:
                unk_id = _token_id(meta, "tokenizer.ggml.unknown_token_id", 0, n)
                unk = tokens[unk_id] if unk_id is not None and tokens[unk_id] in hf_vocab else None
                hf = spm_tokenizer(hf_vocab, _array(meta, "tokenizer.ggml.scores", n, np.float32, 0.0), unk)
            else:
                hf = bpe_tokenizer(hf_vocab, meta.get("tokenizer.ggml.merges") or (), pre, llama3)
        except Exception as e:  # the HF builder reports bad vocabularies as plain Exceptions
            reason = " ".join(str(e).split())  # the HF builder's messages may span lines
            raise TokenizerError(f"cannot build the {model!r} tokenizer: {reason[:300]}") from e
        tok = cls(model=model, tokens=tokens, types=types, hf=hf, bos_id=bos_id, eos_id=eos_id,
                  eog_ids=eog, add_bos=add_bos, add_eos=add_eos, add_space_prefix=add_space_prefix)
        log.debug("built the %s tokenizer (%d tokens) in %.2fs", model, n, time.perf_counter() - t0)
        return tok

    # -- encoding ------------------------------------------------------------------------------

    def _partition(self, text: str, special: bool) -> list[str | int]:
        """Split text around special tokens: each longest-first, over every remaining text piece."""
        groups = self._split_all if special else self._split_user
        found = sorted(e for prefix, entries in groups.items() if prefix in text for e in entries if e[2] in text)
        frags: list[str | int] = [text]
        for _, tid, tok_text in found:
            out: list[str | int] = []
            for frag in frags:
                if isinstance(frag, int) or tok_text not in frag:
                    out.append(frag)
                    continue
                for j, piece in enumerate(frag.split(tok_text)):
                    if j:
                        out.append(tid)
                    if piece:
                        out.append(piece)
            frags = out
        return frags

    def encode(self, text: str, add_bos: bool = True, special: bool = False) -> list[int]:
        """Token ids of text. add_bos: add BOS (and EOS) where the model's metadata asks for them.

        special=True also turns CONTROL token texts (``<|im_start|>``) into their ids; USER_DEFINED
        tokens are always matched whole, as llama.cpp does.
        """
        if not isinstance(text, str):
            raise TokenizerError(f"can only tokenize str, not {type(text).__name__}")
        if _SURROGATE.search(text):  # a lone UTF-16 half (JSON "\ud800"): not text; U+FFFD, as a UTF-8 decoder would
            text = _SURROGATE.sub("\ufffd", text)
        out: list[int] = []
        if add_bos and self.add_bos and self.bos_id is not None:
            out.append(self.bos_id)
        prev_special = True  # llama.cpp's SPM prefixes a space at the start and after each special token
        for frag in self._partition(text, special) if text else ():
            if isinstance(frag, int):
                out.append(frag)
                prev_special = True
                continue
            if self._spm:
                frag = (" " + frag if self.add_space_prefix and prev_special else frag).replace(" ", "\u2581")
            prev_special = False
            out.extend(self._hf.encode(frag, add_special_tokens=False).ids)
        if add_bos and self.add_eos and self.eos_id is not None:
            out.append(self.eos_id)
        return out

    # -- decoding ------------------------------------------------------------------------------

    def _check(self, token_id: int) -> int:
        if isinstance(token_id, bool) or not isinstance(token_id, (int, np.integer)) or not 0 <= token_id < self.vocab_size:
            raise TokenizerError(f"token id {token_id!r} is outside the vocabulary of {self.vocab_size} tokens")
        return int(token_id)

    def token_text(self, token_id: int) -> str:
        """The token's text as stored in the vocabulary (``▁Hello``, ``ĠHello``, ``<|im_end|>``)."""
        return self._tokens[self._check(token_id)]

    def is_special(self, token_id: int) -> bool:
        """True for CONTROL/UNKNOWN tokens: their text is hidden unless asked for."""
        return self._types[self._check(token_id)] in (CONTROL, UNKNOWN)

    def token_bytes(self, token_id: int) -> bytes:
        """Raw bytes of one token's piece (b"" for control tokens), for streaming."""
        token_id = self._check(token_id)
        piece = self._pieces[token_id]
        if piece is None:
            text, kind = self._tokens[token_id], self._types[token_id]
            if kind == USER_DEFINED:
                piece = text.encode("utf-8", "surrogateescape")
            elif kind == BYTE and len(text) == 6 and text.startswith("<0x"):
                piece = bytes([int(text[3:5], 16)])
            elif kind == NORMAL and self._spm:
                piece = text.replace("\u2581", " ").encode("utf-8", "surrogateescape")
            elif kind == NORMAL:
                # Characters outside the byte-level alphabet cannot come from the BPE; keep their UTF-8.
                piece = b"".join(bytes([_BYTE_DECODER[c]]) if c in _BYTE_DECODER
                                 else c.encode("utf-8", "surrogateescape") for c in text)
            else:
                piece = b""  # control, unknown, unused and undefined tokens render as nothing
            self._pieces[token_id] = piece
        return piece

    def decode(self, ids: Sequence[int], skip_special: bool = True, strip_bos: bool | None = None) -> str:
        """Text of ids. skip_special=False also renders CONTROL/UNKNOWN token texts. strip_bos: drop
        a leading BOS that encode() adds (default: when skip_special) - a prompt's text with the
        special tokens it was written with is decode(ids, False, strip_bos=True)."""
        return b"".join(self._parts([self._check(i) for i in ids], skip_special, strip_bos)).decode("utf-8", "replace")

    def _parts(self, ids: list[int], skip_special: bool, strip_bos: bool | None) -> list[bytes]:
        """Each token's bytes as decode() joins them (b"" for a stripped BOS)."""
        strip = skip_special if strip_bos is None else strip_bos
        parts = [self.token_bytes(i) if skip_special or not self.is_special(i)
                 else self._tokens[i].encode("utf-8", "surrogateescape") for i in ids]
        first = 1 if strip and ids and self.add_bos and ids[0] == self.bos_id else 0
        if first:
            parts[0] = b""
        if len(parts) > first and self.add_space_prefix and parts[first].startswith(b" "):
            # The space encode() prefixed; llama.cpp keeps it after a BOS, we drop it so text round-trips.
            parts[first] = parts[first][1:]
        return parts

    def text_offsets(self, ids: Sequence[int], skip_special: bool = True, strip_bos: bool | None = None) -> list[int]:
        """Where each token's text starts in decode(ids, skip_special, strip_bos), in characters (a
        token without text, and each piece of a split character, starts where the next text does)."""
        utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        offsets, pos = [], 0
        for piece in self._parts([self._check(i) for i in ids], skip_special, strip_bos):
            offsets.append(pos)
            # the characters a token completes start where its first byte went in: pieces of one
            # character all point at it (its earlier pieces added nothing, so pos has not moved)
            pos += len(utf8.decode(piece))
        return offsets

    def __repr__(self) -> str:
        return f"GGUFTokenizer(model={self.model!r}, vocab_size={self.vocab_size}, bos={self.bos_id}, eos={self.eos_id})"


class StreamDecoder:
    """Incremental detokenizer: text comes out as soon as its UTF-8 sequences are complete."""

    def __init__(self, tok: GGUFTokenizer) -> None:
        self._tok = tok
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, token_id: int) -> str:
        """Text completed by this token; a partial multi-byte character is held back."""
        return self._utf8.decode(self._tok.token_bytes(token_id))

    def flush(self) -> str:
        """Whatever is held back, with an incomplete sequence shown as U+FFFD; resets the decoder."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text
