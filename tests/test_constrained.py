"""Constrained decoding (powerinfer/constrained.py): grammars compile or fail with a clear error, the
mask allows exactly what the grammar allows, and a constrained greedy reply always parses.

Runs in: the pytest process (SmolLM2's tokenizer and model, in process).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from powerinfer.api import LLM
from powerinfer.constrained import TokenConstraint, grammar_for
from powerinfer.errors import InvalidArgumentError


@pytest.mark.parametrize("kind, spec", [("json_schema", {"type": "nonsense"}), ("json_schema", "not an object"), ("gbnf", "root ::= (("),
                                        ("lark", "start: (("), ("regex", "(("), ("gbnf", ""), ("xml", "x")])
def test_invalid_grammars_fail_clearly(kind: str, spec: object) -> None:
    with pytest.raises(InvalidArgumentError):
        grammar_for(kind, spec)


def test_mask_and_greedy_json(smollm2_path: Path) -> None:
    llm = LLM(smollm2_path, executor="inprocess", n_ctx=256)
    tok, vocab = llm.tokenizer, llm.config.vocab_size
    c = TokenConstraint(tok, vocab, grammar_for("gbnf", 'root ::= "yes" | "no"'))
    ok = c.allowed()
    first = {int(i) for i in np.flatnonzero(ok)}
    assert first and all(("yes".startswith(tok.decode([i])) or "no".startswith(tok.decode([i]))) for i in first)
    assert tok.encode("yes", add_bos=False)[0] in first and tok.encode("maybe", add_bos=False)[0] not in first
    masked = c.masked(np.zeros(vocab, dtype=np.float32))
    assert np.isneginf(masked).sum() == vocab - len(first)
    # a greedy reply under a JSON schema is valid JSON of that shape
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}}, "required": ["n"],
              "additionalProperties": False}
    chunks = list(llm.generate(llm.chat_ids([{"role": "user", "content": "Give a number as JSON"}]), 64, temperature=0,
                               grammar=grammar_for("json_schema", schema)))
    out = "".join(ch.text for ch in chunks)
    assert chunks[-1].finish_reason == "stop", out  # the grammar ended it
    assert 0 <= json.loads(out)["n"] <= 999
