"""Building the HF ``tokenizers`` object of a GGUF vocabulary: llama.cpp's pre-tokenizer regexes
for byte-level BPE, and the merge rules that make HF's BPE reproduce SentencePiece-style merging.

Runs in: the coordinator process (tokenizer.py builds its tokenizer through here at load).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from itertools import repeat
from operator import itemgetter
from typing import Any

import numpy as np
from tokenizers import Regex, Tokenizer, models, pre_tokenizers

log = logging.getLogger(__name__)

# Pre-tokenizer regexes, copied from llama.cpp's llm_tokenizer_bpe (applied in sequence).
GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3_RE = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2_RE = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
LLAMA3_FAMILY = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"})
PRE_REGEXES: dict[str, tuple[str, ...]] = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", GPT2_RE, r"\p{N}+", r"[0-9][0-9][0-9]"),
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", GPT2_RE, r"[0-9][0-9][0-9]"),
    **{k: (r"\p{N}", GPT2_RE) for k in ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b")},
    **{k: (GPT2_RE,) for k in ("gpt2", "gpt-2", "phi-2", "mpt", "olmo", "jais", "trillion", "granite-docling")},
    **{k: (_LLAMA3_RE,) for k in (*LLAMA3_FAMILY, "dbrx", "smaug-bpe")},
    **{k: (_QWEN2_RE,) for k in ("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez", "hunyuan")},
}

HASH_P = 0x100000001B3  # odd, hence invertible modulo 2**64


def spm_merges(vocab: dict[str, int], scores: np.ndarray, verify: bool = False) -> list[tuple[str, str]]:
    """Every (a, b) with a, b and a+b in vocab, best merged-token score first (llama.cpp's SPM order).

    Candidate splits (~1.2M for a 262k vocab) are screened with 64-bit substring hashes in numpy,
    which is exact unless two strings collide. Without ``verify`` the hits are trusted (a collision
    then makes the HF builder reject a merge whose part is not a token, and the caller retries
    with ``verify=True``, which checks every hit against the vocabulary).
    """
    keys = list(vocab)
    lens = np.fromiter(map(len, keys), dtype=np.int64, count=len(keys))
    codes = np.frombuffer("".join(keys).encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    total = codes.size
    pw = np.ones(total + 1, dtype=np.uint64)  # P**i, wrapping modulo 2**64 like all the arithmetic here
    np.cumprod(np.full(total, HASH_P, dtype=np.uint64), out=pw[1:])
    inv = np.cumprod(np.full(total, pow(HASH_P, -1, 2**64), dtype=np.uint64))  # P**-(i+1)
    pre = np.zeros(total + 1, dtype=np.uint64)
    np.cumsum((codes.astype(np.uint64) + np.uint64(1)) * inv, out=pre[1:])

    def substring_hash(s: np.ndarray, e: np.ndarray) -> np.ndarray:
        return (pre[e] - pre[s]) * pw[e]  # = sum c_q * P**(e-1-q): equal substrings, equal hashes

    ends = np.cumsum(lens)
    starts = ends - lens
    known = np.sort(substring_hash(starts, ends))

    def member(h: np.ndarray) -> np.ndarray:
        i = np.minimum(np.searchsorted(known, h), known.size - 1)
        return known[i] == h

    splits = lens - 1
    rows = np.repeat(np.arange(len(keys)), splits)
    k = np.arange(rows.size) - np.repeat(np.cumsum(splits) - splits, splits) + 1
    mid = starts[rows] + k
    hit = member(substring_hash(starts[rows], mid))
    rows, k, mid = rows[hit], k[hit], mid[hit]
    hit = member(substring_hash(mid, ends[rows]))
    rows, k = rows[hit], k[hit]
    ids = np.fromiter(vocab.values(), dtype=np.int64, count=len(keys))[rows]
    order = np.lexsort((k, ids, -scores[ids]))  # score desc; equal scores: lower id, then shorter left part
    if not order.size:
        return []
    # Slice with C-level map()s: a Python loop over 500k splits would dominate the load time.
    words = itemgetter(*rows[order].tolist())(keys)
    words = words if isinstance(words, tuple) else (words,)
    cuts = k[order].tolist()
    pairs = list(zip(map(str.__getitem__, words, map(slice, repeat(None), cuts)),
                     map(str.__getitem__, words, map(slice, cuts, repeat(None)))))
    if verify:
        pairs = [(a, b) for a, b in pairs if a in vocab and b in vocab]
    return pairs


def spm_tokenizer(vocab: dict[str, int], scores: np.ndarray, unk: str | None) -> Tokenizer:
    """HF BPE that merges like llama.cpp's SPM session; byte fallback to the <0xNN> tokens."""
    merges = spm_merges(vocab, scores)
    try:
        return Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token=unk, fuse_unk=False))
    except Exception:  # a substring-hash collision in spm_merges: redo with every split checked
        merges = spm_merges(vocab, scores, verify=True)
        return Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token=unk, fuse_unk=False))


def bpe_tokenizer(vocab: dict[str, int], rules: Sequence[Any], pre: str, ignore_merges: bool) -> Tokenizer:
    """HF byte-level BPE with the file's merges and llama.cpp's pre-tokenizer regexes for ``pre``."""
    merges = []
    for rule in rules:
        rule = rule.decode("utf-8", "replace") if isinstance(rule, bytes) else str(rule)
        cut = rule.find(" ", 1)  # llama.cpp splits at the first space after position 0
        a, b = rule[:cut], rule[cut + 1:]
        if cut > 0 and a in vocab and b in vocab and a + b in vocab:  # HF rejects anything else
            merges.append((a, b))
    regexes = PRE_REGEXES.get(pre)
    if regexes is None:
        log.warning("unknown pre-tokenizer %r; using the GPT-2 pre-tokenizer regex", pre)
        regexes = (GPT2_RE,)
    hf = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    return hf
