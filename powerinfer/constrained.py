"""Constrained decoding: a grammar (JSON schema, any JSON object, Lark, GBNF) enforced token by token.

Runs in: the coordinator process (the sampler's side of a sequence); grammars are also compiled on
the server's HTTP side to validate a request before it is queued.

Built on llguidance (Microsoft's Rust grammar engine, also used by llama.cpp and vLLM): a matcher
per sequence computes the bitmask of tokens the grammar allows next, the disallowed logits become
-inf before sampling, and each sampled token is fed back to the matcher. Chosen over xgrammar
because it has no torch dependency (our workers and the server process do not load torch), its
wheel is 3 MB, it compiles JSON schemas lazily (no per-schema precomputation over the
vocabulary) and it reads GBNF, llama.cpp's grammar format, directly. The per-token mask time on
this CPU: ``python -m powerinfer.devtools.harness.grammar_time MODEL`` (SmolLM2's 49k tokens: median 72 µs; Gemma-3's
262k: 83 µs; docs/guide.md).

The tokenizer bridge: llguidance needs each token's bytes and a way to tokenize text; both come
from our GGUF tokenizer (control tokens count as special and never match grammar text).
"""

from __future__ import annotations

import functools
import json
import logging
from typing import Any, Sequence

import numpy as np

from powerinfer.errors import InvalidArgumentError
from powerinfer.tokenizer import GGUFTokenizer

log = logging.getLogger(__name__)

MAX_GRAMMAR_CHARS = 1 << 20


def available() -> bool:
    try:
        import llguidance  # noqa: F401
    except ImportError:
        return False
    return True


class _Tokens:
    """What llguidance.TokenizerWrapper reads from a tokenizer object."""

    def __init__(self, tok: GGUFTokenizer, n_vocab: int) -> None:
        eog = sorted(tok.eog_ids)
        self.eos_token_id = eog[0] if eog else n_vocab - 1
        self.bos_token_id = tok.bos_id
        self.tokens: list[bytes] = []
        self.special_token_ids: list[int] = []
        for i in range(n_vocab):
            if i >= tok.vocab_size or tok.is_special(i):
                # control tokens: their rendered text, flagged special so grammars never produce them by accident
                self.tokens.append(tok.decode([i], skip_special=False).encode("utf-8") if i < tok.vocab_size else b"")
                self.special_token_ids.append(i)
            else:
                self.tokens.append(tok.token_bytes(i))
        self._tok = tok

    def __call__(self, s: str | bytes) -> list[int]:
        text = s.decode("utf-8", errors="replace") if isinstance(s, bytes) else s
        return self._tok.encode(text, add_bos=False)


# JSON with fixed separators and no free whitespace: given free whitespace, a small model that wants
# a character the schema forbids writes spaces and newlines instead, until max_tokens.
COMPACT_JSON: dict[str, Any] = {"x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}


@functools.lru_cache(maxsize=4)
def grammar_tokenizer(tok: GGUFTokenizer, n_vocab: int) -> Any:
    """The llguidance tokenizer of a model (built once: ~0.1-0.5 s for 50-260k tokens)."""
    import llguidance

    wrapper = llguidance.TokenizerWrapper(_Tokens(tok, n_vocab))
    return llguidance.LLTokenizer(wrapper, n_vocab=n_vocab, eos_token=sorted(tok.eog_ids) or None)


def grammar_for(kind: str, spec: Any) -> str:
    """The llguidance grammar of a request: kind "json_schema" (spec: a schema object), "json_object"
    (any JSON object), "lark" or "gbnf" (spec: the grammar's text), "regex". Raises
    InvalidArgumentError naming what is wrong (an invalid schema or grammar)."""
    if not available():
        raise InvalidArgumentError("constrained decoding needs the llguidance package (pip install llguidance)")
    import llguidance

    try:
        if kind == "json_object":
            grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "object", **COMPACT_JSON})
        elif kind == "json_schema":
            if not isinstance(spec, dict):
                raise InvalidArgumentError("a JSON schema must be an object")
            text = json.dumps({**COMPACT_JSON, **spec})  # a schema's own x-guidance wins
            if len(text) > MAX_GRAMMAR_CHARS:
                raise InvalidArgumentError(f"the schema has {len(text)} characters; at most {MAX_GRAMMAR_CHARS}")
            grammar = llguidance.LLMatcher.grammar_from_json_schema(text)
        elif kind in ("lark", "gbnf", "regex"):
            if not isinstance(spec, str) or not spec.strip():
                raise InvalidArgumentError(f"a {kind} grammar must be a non-empty string")
            if len(spec) > MAX_GRAMMAR_CHARS:
                raise InvalidArgumentError(f"the grammar has {len(spec)} characters; at most {MAX_GRAMMAR_CHARS}")
            if kind == "gbnf":
                grammar = llguidance.grammar_from("gbnf", spec)
            elif kind == "lark":
                grammar = llguidance.LLMatcher.grammar_from_lark(spec)
            else:
                grammar = llguidance.LLMatcher.grammar_from_regex(spec)
        else:
            raise InvalidArgumentError(f"unknown grammar kind {kind!r}")
    except (ValueError, TypeError) as e:  # llguidance's own errors for malformed input
        raise InvalidArgumentError(str(e)) from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise InvalidArgumentError(messages[0] if messages else "the grammar is not valid")
    return grammar


class TokenConstraint:
    """One sequence's matcher: masks the logits before sampling, consumes the sampled token."""

    def __init__(self, tok: GGUFTokenizer, n_vocab: int, grammar: str) -> None:
        import llguidance

        self.n_vocab = n_vocab
        self.matcher = llguidance.LLMatcher(grammar_tokenizer(tok, n_vocab), grammar)
        if self.matcher.is_error():
            raise InvalidArgumentError(f"the grammar is not valid: {self.matcher.get_error()}")
        self.eog = sorted(tok.eog_ids)
        self._mask = np.zeros((n_vocab + 31) // 32, dtype=np.int32)

    @property
    def stopped(self) -> bool:
        """The grammar is complete and takes no more tokens (the sequence ends)."""
        return self.matcher.is_stopped()

    def allowed(self) -> np.ndarray:
        """bool [n_vocab]: the tokens the grammar allows next (end-of-generation ones when it accepts)."""
        self.matcher.unsafe_compute_mask_ptr(self._mask.ctypes.data, self._mask.nbytes)
        bits = np.unpackbits(self._mask.view(np.uint8), bitorder="little")[: self.n_vocab]
        return bits.astype(bool)

    def masked(self, logits: np.ndarray) -> np.ndarray:
        """A copy of logits [n_vocab] with every token the grammar forbids at -inf."""
        ok = self.allowed()
        if not ok.any():  # an error state: nothing fits, end the sequence cleanly
            ok[self.eog[0] if self.eog else 0] = True
        out = np.array(logits, dtype=np.float32)
        out[~ok[: out.size]] = -np.inf
        return out

    def advance(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise InvalidArgumentError(f"the grammar refused token {token}: {self.matcher.get_error()}")

    def accepts(self, tokens: Sequence[int]) -> bool:
        """Whether tokens (from the start) complete the grammar (tests)."""
        m = self.matcher.deep_copy()
        m.reset()
        return m.consume_tokens(list(tokens)) and m.is_accepting()
