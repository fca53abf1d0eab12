"""Perplexity of the dense and the sparse model on a text, with the predictor's quality per layer.

Runs in: the user's process (`powerinfer perplexity`), in-process executors.

Windows of ``n_ctx`` tokens (each starting from an empty cache, with BOS when the model uses one)
are scored on every token after the first; perplexity = exp(mean negative log-likelihood). The
sparse pass masks the neurons its predictor (or gate threshold) leaves out, exactly what decode
skips, and counts per layer: recall and precision of the predicted active set against the true
one (|act(gate) * up| above the layer threshold), and the achieved sparsity (share not computed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from powerinfer.config import config_from_gguf
from powerinfer.coordinator.engine import Engine
from powerinfer.coordinator.inprocess import InProcessExecutor
from powerinfer.errors import InvalidArgumentError
from powerinfer.gguf_file import GGUFFile
from powerinfer.predictors.predictor_file import PredictorFile
from powerinfer.sparsity.profile import windows_of
from powerinfer.tokenizer import GGUFTokenizer


@dataclass(frozen=True)
class LayerQuality:
    recall: float
    precision: float
    sparsity: float  # share of (token, neuron) pairs not computed


@dataclass(frozen=True)
class PerplexityReport:
    tokens: int
    dense_ppl: float
    sparse_ppl: float | None
    layers: tuple[LayerQuality, ...]

    @property
    def mean_sparsity(self) -> float:
        return float(np.mean([q.sparsity for q in self.layers])) if self.layers else 0.0


def _window_nll(logits: np.ndarray, ids: list[int]) -> np.ndarray:
    """-log p(ids[i + 1]) [len(ids) - 1] from logits [len(ids) - 1, vocab] (row i predicts ids[i + 1])."""
    logits = logits.astype(np.float64)
    logz = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
    return logz - logits[np.arange(len(ids) - 1), ids[1:]]


def token_nll(engine: Engine, windows: list[list[int]]) -> np.ndarray:
    """Negative log-likelihood [tokens] float64 of every token after the first of each window, in order."""
    out = []
    for ids in windows:
        engine.rewind(0)
        out.append(_window_nll(engine.eval(ids, all_logits=True)[:-1], ids))
    return np.concatenate(out) if out else np.zeros(0)


def decode_nll(engine: Engine, windows: list[list[int]]) -> np.ndarray:
    """token_nll's figures with every token fed as its own decode step (one token a call, as
    generation runs them: the native decoder's chosen-row kernels, its hot block and down copy)."""
    out = []
    for ids in windows:
        engine.rewind(0)
        out.append(_window_nll(np.stack([engine.eval([t])[-1] for t in ids[:-1]]), ids))
    return np.concatenate(out) if out else np.zeros(0)


def nll(engine: Engine, windows: list[list[int]], decode: bool = False) -> tuple[float, int]:
    """Summed negative log-likelihood of every token after the first of each window, and how many."""
    per_token = decode_nll(engine, windows) if decode else token_nll(engine, windows)
    return float(per_token.sum()), len(per_token)


def _scored_windows(model: str | Path, text: str, n_ctx: int, max_tokens: int) -> tuple[GGUFFile, list[int], list[list[int]], int]:
    """(the file, text's first max_tokens tokens (0: all), their windows of at most n_ctx, the
    longest window: the KV cache for it, not for a -c far beyond the text)."""
    if n_ctx < 2:
        raise InvalidArgumentError(f"the window (-c) must be at least 2 tokens, got {n_ctx}")
    if max_tokens < 0:
        raise InvalidArgumentError(f"the number of tokens to score (--max-tokens) must be >= 0 (0: all), got {max_tokens}")
    f = GGUFFile(model)
    tok = GGUFTokenizer.from_metadata(f.metadata)
    ids = tok.encode(text, add_bos=False)[: max_tokens or None]
    windows = windows_of(ids, n_ctx, tok.bos_id if tok.add_bos else None)
    if not windows:
        raise InvalidArgumentError(f"the text has {len(ids)} tokens; perplexity needs at least 2")
    return f, ids, windows, max(len(w) for w in windows)


def decode_perplexity(model: str | Path, text: str, predictor: str | Path | None, n_ctx: int = 512, max_tokens: int = 0,
                      n_threads: int | None = None, progress: Callable[[str], None] = lambda _: None) -> tuple[float, float | None, str]:
    """(dense, sparse or None) perplexity of text with every token a decode step of the executor
    generation uses in this process (the native decoder where it runs the model, else the torch
    shards: named in the third value). The torch pass of :func:`perplexity` never runs the native
    kernels, so it cannot see what only they do (docs/sparsity.md: a float file's hot block)."""
    from powerinfer.api import LLM  # the user's own engine, as `powerinfer run` builds it

    _, ids, windows, n_ctx = _scored_windows(model, text, n_ctx, max_tokens)
    out: list[float] = []
    kind = ""
    for pred in (None, predictor) if predictor is not None else (None,):
        progress(f"{'sparse' if pred else 'dense'} decode-path pass over {len(ids)} tokens in {len(windows)} windows")
        with LLM(model, predictor=pred, executor="inprocess", n_ctx=n_ctx, n_threads=n_threads) as llm:
            kind = type(llm.engine.executor).__name__
            total, count = nll(llm.engine, windows, decode=True)
        out.append(math.exp(total / count))
    return out[0], out[1] if len(out) > 1 else None, kind


def perplexity(model: str | Path, text: str, predictor: PredictorFile | None = None, n_ctx: int = 512,
               max_tokens: int = 0, progress: Callable[[str], None] = lambda _: None, dense: bool = True) -> PerplexityReport:
    """Dense (unless dense=False: reported as nan) and, with a predictor, sparse perplexity of text."""
    f, ids, windows, n_ctx = _scored_windows(model, text, n_ctx, max_tokens)
    cfg = config_from_gguf(f)
    count = sum(len(w) - 1 for w in windows)
    d_nll = math.nan
    if dense:
        progress(f"dense pass over {len(ids)} tokens in {len(windows)} windows")
        engine = Engine(f, cfg, InProcessExecutor(f, cfg, n_ctx), n_ctx=n_ctx, n_batch=n_ctx)
        d_nll, count = nll(engine, windows)
        engine.executor.close()
    sparse_ppl, layers = None, ()
    if predictor is not None:
        progress(f"sparse pass ({predictor.mode} mode)")
        ex = InProcessExecutor(f, cfg, n_ctx, predictor=predictor)
        for shards in ex.ffns:
            for shard in shards:
                shard.track_quality = True  # true/false positives need every neuron's activation
        s_nll, _ = nll(Engine(f, cfg, ex, n_ctx=n_ctx, n_batch=n_ctx), windows)
        sparse_ppl = math.exp(s_nll / count)
        out = []
        for layer in ex.ffns:
            c = np.sum([getattr(s, "counts") for s in layer], axis=0)
            tp, fp, fn, seen, computed = (int(v) for v in c)
            out.append(LayerQuality(recall=tp / max(1, tp + fn), precision=tp / max(1, tp + fp), sparsity=1 - computed / max(1, seen)))
        layers = tuple(out)
    return PerplexityReport(tokens=count, dense_ppl=math.exp(d_nll / count), sparse_ppl=sparse_ppl, layers=layers)
