"""A checkpoint's tokenizer and chat template as llama.cpp's GGUF tokenizer keys.

Runs in: the CLI process (``powerinfer convert``).

* ``tokenizer.json`` with a byte-level BPE model -> ``gpt2``: the vocabulary in id order (gaps filled
  with ``[PADn]``), the merges, token types (added special tokens CONTROL, other added tokens
  USER_DEFINED), and ``tokenizer.ggml.pre`` named from the pre-tokenizer: GPT-2's regex alone is
  ``gpt2``, digits split one by one before it is ``smollm``, llama 3's and qwen2's split regexes
  are ``llama-bpe`` and ``qwen2``. A pre-tokenizer we cannot name is an error: a wrong one would
  tokenize silently differently.
* ``tokenizer.json`` with a SentencePiece-style BPE model (byte fallback, the ``▁`` space) ->
  ``llama``: each token's score is minus the rank of the merge that makes it, so merging by score
  (llama.cpp's, and our reader's) merges in the file's order; ``<0xNN>`` tokens are BYTE.
* ``tokenizer.model`` (SentencePiece) when there is no ``tokenizer.json``: read with the
  ``sentencepiece`` package, as llama.cpp's converter does.

Special token ids and add_bos/add_eos come from tokenizer_config.json (then config.json); the chat
template from tokenizer_config.json or chat_template.jinja.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

from powerinfer.convert.checkpoint import HFCheckpoint
from powerinfer.errors import ModelFileError, TokenizerError, UnsupportedModelError, quoted
from powerinfer.tokenizer_models import GPT2_RE, PRE_REGEXES

log = logging.getLogger(__name__)

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _split_regex(p: dict[str, Any]) -> str | None:
    pattern = p.get("pattern")
    return pattern.get("Regex") if isinstance(pattern, dict) else None


def _pre_name(pre: dict[str, Any] | None) -> str:
    """llama.cpp's name for a byte-level BPE pre-tokenizer."""
    if not isinstance(pre, dict):
        raise UnsupportedModelError("tokenizer.json: a byte-level BPE tokenizer without a pre-tokenizer is not supported")
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else [pre]
    if not isinstance(steps, list):
        raise UnsupportedModelError("tokenizer.json: malformed pre_tokenizer")
    kinds = [s.get("type") for s in steps if isinstance(s, dict)]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt2"
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and steps[1].get("use_regex", True):
        return "smollm"
    if kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        regex = _split_regex(steps[0])
        for name in ("llama-bpe", "qwen2", "gpt2"):
            if regex is not None and (regex,) == PRE_REGEXES[name]:
                return name
        if regex == GPT2_RE:
            return "gpt2"
    raise UnsupportedModelError(f"tokenizer.json: pre-tokenizer {quoted(json.dumps(pre))} is not one we can name for "
                                f"llama.cpp (known: GPT-2's ByteLevel, SmolLM's digits + ByteLevel, llama 3's and qwen2's "
                                f"split regexes)")


def _added(tok: dict[str, Any]) -> dict[int, dict[str, Any]]:
    out = {}
    for a in tok.get("added_tokens") or []:
        if isinstance(a, dict) and isinstance(a.get("id"), int) and isinstance(a.get("content"), str):
            out[a["id"]] = a
    return out


def _vocab_list(vocab: dict[str, int], added: dict[int, dict[str, Any]], size: int) -> list[str | None]:
    tokens: list[str | None] = [None] * size
    for text, i in vocab.items():
        if not isinstance(i, int) or not 0 <= i < size:
            raise ModelFileError(f"tokenizer.json: token {quoted(text)} has id {quoted(i)} outside the vocabulary of {size}")
        tokens[i] = text
    for i, a in added.items():
        if 0 <= i < size:
            tokens[i] = a["content"]
    return tokens


def _merges(model: dict[str, Any]) -> list[str]:
    out = []
    for m in model.get("merges") or []:
        if isinstance(m, str):
            out.append(m)
        elif isinstance(m, list) and len(m) == 2:
            out.append(f"{m[0]} {m[1]}")
        else:
            raise ModelFileError(f"tokenizer.json: malformed merge {quoted(m)}")
    return out


def _from_tokenizer_json(tok: dict[str, Any], size: int, meta: dict[str, Any]) -> dict[str, int]:
    model = tok.get("model") or {}
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise UnsupportedModelError(f"tokenizer.json: model type {quoted(model.get('type'))} is not supported (BPE only)")
    added = _added(tok)
    size = max([size, len(model["vocab"]), *(i + 1 for i in added)])
    tokens = _vocab_list(model["vocab"], added, size)
    merges = _merges(model)
    types = []
    for i, t in enumerate(tokens):
        a = added.get(i)
        types.append(USER_DEFINED if t is None else (CONTROL if a.get("special") else USER_DEFINED) if a else NORMAL)
    texts = [t if t is not None else f"[PAD{i}]" for i, t in enumerate(tokens)]
    spm = bool(model.get("byte_fallback"))
    if spm:
        rank = {m.replace(" ", "", 1): r for r, m in enumerate(merges)}
        scores = [(-1000.0 if types[i] != NORMAL else -float(rank[t] + 1) if t in rank else 0.0) for i, t in enumerate(texts)]
        for i, t in enumerate(texts):
            if types[i] == NORMAL and _BYTE_TOKEN.fullmatch(t):
                types[i] = BYTE
        unk = model.get("unk_token")
        if isinstance(unk, str) and unk in model["vocab"]:
            types[model["vocab"][unk]] = UNKNOWN
        meta.update({"tokenizer.ggml.model": "llama", "tokenizer.ggml.scores": scores})
    else:
        meta.update({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": _pre_name(tok.get("pre_tokenizer")),
                     "tokenizer.ggml.merges": merges})
    meta["tokenizer.ggml.tokens"] = texts
    meta["tokenizer.ggml.token_type"] = types
    return {t: i for i, t in enumerate(texts)}


def _from_sentencepiece(path: Path, size: int, meta: dict[str, Any]) -> dict[str, int]:
    try:
        import sentencepiece  # optional: only checkpoints that ship tokenizer.model alone need it
    except ImportError:
        raise TokenizerError(f"{path}: reading a SentencePiece tokenizer.model needs the sentencepiece package "
                             f"(pip install sentencepiece)") from None
    sp = sentencepiece.SentencePieceProcessor()
    try:
        sp.LoadFromFile(str(path))
    except (OSError, RuntimeError) as e:
        raise TokenizerError(f"{path}: not a SentencePiece model: {e}") from None
    n = sp.vocab_size()
    texts, scores, types = [], [], []
    for i in range(n):
        texts.append(sp.id_to_piece(i))
        scores.append(float(sp.get_score(i)))
        types.append(UNKNOWN if sp.is_unknown(i) else CONTROL if sp.is_control(i) else UNUSED if sp.is_unused(i)
                     else BYTE if sp.is_byte(i) else NORMAL)
    added = json.loads((path.parent / "added_tokens.json").read_text()) if (path.parent / "added_tokens.json").exists() else {}
    for text, i in sorted(added.items(), key=lambda kv: kv[1]):
        if i == len(texts):
            texts.append(text)
            scores.append(-1000.0)
            types.append(USER_DEFINED)
    while len(texts) < size:
        texts.append(f"[PAD{len(texts)}]")
        scores.append(-1000.0)
        types.append(UNUSED)
    meta.update({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": texts, "tokenizer.ggml.scores": scores,
                 "tokenizer.ggml.token_type": types})
    return {t: i for i, t in enumerate(texts)}


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def tokenizer_metadata(ckpt: HFCheckpoint, vocab_size: int) -> dict[str, Any]:
    """GGUF tokenizer and chat-template keys for the checkpoint (vocab_size: the embedding's rows)."""
    meta: dict[str, Any] = {}
    tok_path, spm_path = ckpt.folder / "tokenizer.json", ckpt.folder / "tokenizer.model"
    if tok_path.exists():
        ids = _from_tokenizer_json(ckpt.json("tokenizer.json"), vocab_size, meta)
    elif spm_path.exists():
        ids = _from_sentencepiece(spm_path, vocab_size, meta)
    else:
        raise TokenizerError(f"{ckpt.folder}: no tokenizer (tokenizer.json or tokenizer.model)")
    if len(meta["tokenizer.ggml.tokens"]) != vocab_size:
        raise ModelFileError(f"{ckpt.folder}: the tokenizer has {len(meta['tokenizer.ggml.tokens'])} tokens, the embedding "
                             f"{vocab_size} rows")
    tcfg = ckpt.json("tokenizer_config.json")
    for what in ("bos", "eos", "unk", "pad"):
        text = _token_text(tcfg.get(f"{what}_token"))
        i = ids.get(text) if text is not None else ckpt.config.get(f"{what}_token_id")
        if isinstance(i, list):  # some configs list several eos ids; the first is the one llama.cpp keeps
            i = i[0] if i else None
        if isinstance(i, int) and 0 <= i < vocab_size:
            meta[f"tokenizer.ggml.{'unknown' if what == 'unk' else 'padding' if what == 'pad' else what}_token_id"] = i
    spm = meta["tokenizer.ggml.model"] == "llama"
    meta["tokenizer.ggml.add_bos_token"] = bool(tcfg.get("add_bos_token", spm and "tokenizer.ggml.bos_token_id" in meta))
    meta["tokenizer.ggml.add_eos_token"] = bool(tcfg.get("add_eos_token", False))
    template = tcfg.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"), None)
    jinja = ckpt.folder / "chat_template.jinja"
    if not isinstance(template, str) and jinja.exists():
        template = jinja.read_text(encoding="utf-8")
    if isinstance(template, str) and template:
        meta["tokenizer.chat_template"] = template
    return meta
