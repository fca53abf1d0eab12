"""Input sparsity (TEAL/CATS-style), measured on the readable model: the quality it costs and the
weight bytes it would leave unread.

Runs in: the user's process (`powerinfer sparsity-curve --modes input`); numpy only, through
model/reference.py's building blocks (no engine: nothing here runs it fast).

Every projection's input entry whose magnitude is at or below a threshold is set to zero, so the
weight columns it multiplies need not be read. Four sites a layer, each with its own threshold:

    qkv      the normed attention input            -> attn_q, attn_k, attn_v   [T, d]
    o        the heads' concatenated outputs       -> attn_output              [T, H * D]
    gate_up  the normed FFN input                  -> ffn_gate, ffn_up         [T, d]
    down     act(gate) * up                        -> ffn_down                 [T, n_ff]

A threshold is the layer's and site's quantile of |input| at the target level, taken on the
calibration text's dense activations: TEAL's uniform allocation (every site at the same level),
or levels per layer and site allocated greedily by measured damage (teal_greedy.py). The curve
(teal_curve.py) reports the held-out perplexity and the share of the layers' weight bytes whose input was zero on
the held-out text. Those bytes are an upper bound of what a kernel saves: the file's row-major
blocks mix skipped and kept columns, so reading only the kept ones needs the matrices stored
column-major (docs/sparsity.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from powerinfer.config import ModelConfig, config_from_gguf
from powerinfer.errors import InvalidArgumentError, UnsupportedModelError
from powerinfer.gguf_file import GGUFFile
from powerinfer.model.reference import attention_heads, glu, rms_norm, weight
from powerinfer.sparsity.profile import windows_of
from powerinfer.tokenizer import GGUFTokenizer

SITES = ("qkv", "o", "gate_up", "down")
CONSUMERS = {"qkv": ("attn_q", "attn_k", "attn_v"), "o": ("attn_output",), "gate_up": ("ffn_gate", "ffn_up"), "down": ("ffn_down",)}
SAMPLE = 1 << 16  # |input| values kept per layer and site for the quantiles (spread over the windows)


@dataclass(frozen=True)
class InputPoint:
    """One level: held-out perplexity, and the input-skipped share of the layers' weight bytes."""

    level: float
    ppl: float
    dense_ppl: float
    zero_share: dict[str, float]  # per site: share of input entries at or below the threshold, held-out text
    skipped_bytes: float  # per token, bytes of the layers' matrices whose input entries were zero
    layer_bytes: int  # per token, bytes of every layer matrix (the head excluded)

    @property
    def increase(self) -> float:
        return self.ppl / self.dense_ppl - 1.0

    @property
    def skipped_share(self) -> float:
        return self.skipped_bytes / self.layer_bytes


class _Weights:
    """Every tensor dequantized once to float32 (the model is scored window after window)."""

    def __init__(self, f: GGUFFile) -> None:
        self.f, self.cache = f, {}  # type: dict[str, np.ndarray]

    def get(self, name: str) -> np.ndarray:
        if name not in self.cache:
            self.cache[name] = weight(self.f, name, np.float32)
        return self.cache[name]

    def layer(self, i: int) -> Callable[..., np.ndarray]:
        return lambda part, kind="weight": self.get(f"blk.{i}.{part}.{kind}")


class InputSparsity:
    """The readable model with its projection inputs thresholded, scored on token windows."""

    def __init__(self, model: str | Path) -> None:
        self.f = GGUFFile(model)
        self.cfg: ModelConfig = config_from_gguf(self.f)
        if not self.cfg.gated_ffn or self.cfg.norm != "rms":
            raise UnsupportedModelError(f"{model}: input sparsity is measured on gated RMSNorm models; this is {self.cfg.arch}")
        self.tok = GGUFTokenizer.from_metadata(self.f.metadata)
        self.w = _Weights(self.f)
        names = {s: [[f"blk.{i}.{c}.weight" for c in CONSUMERS[s]] for i in range(self.cfg.n_layers)] for s in SITES}
        # bytes a token reads per layer and site: [n_layers] each
        self.site_bytes = {s: np.array([sum(self.f.tensor(n).nbytes for n in per) for per in names[s]], dtype=np.float64) for s in SITES}

    def windows(self, text: str, n_ctx: int, max_tokens: int) -> list[list[int]]:
        ids = self.tok.encode(text, add_bos=False)[:max_tokens]
        out = windows_of(ids, n_ctx, self.tok.bos_id if self.tok.add_bos else None)
        if not out:
            raise InvalidArgumentError("the text is too short to score (fewer than 2 tokens)")
        return out

    def run(self, windows: Sequence[list[int]], thr: np.ndarray | None = None,
            collect: dict[tuple[int, str], list[np.ndarray]] | None = None) -> tuple[float, int, np.ndarray]:
        """Summed nll over windows and the token count; zeros [n_layers, 4] (inputs at or below thr
        per layer and site, summed) with thr [n_layers, 4] set, and |input| samples into collect."""
        cfg, rng = self.cfg, np.random.default_rng(0)
        zeros = np.zeros((cfg.n_layers, len(SITES)))
        total, count = 0.0, 0
        per_window = max(1, SAMPLE // max(1, len(windows)))  # SAMPLE per layer and site over all windows

        def site(x: np.ndarray, i: int, k: int) -> np.ndarray:
            a = np.abs(x)
            if collect is not None:
                flat = a.reshape(-1)
                collect.setdefault((i, SITES[k]), []).append(flat[rng.integers(0, flat.size, min(flat.size, per_window))])
            if thr is None:
                return x
            off = a <= thr[i, k]
            zeros[i, k] += off.sum() / x.shape[-1]
            return np.where(off, np.float32(0), x)

        for ids in windows:
            x = self.embed(ids)
            for i in range(cfg.n_layers):
                x = self.layer(x, i, site)
            for c, lp in self.log_probs(x):
                total -= float(lp[np.arange(len(lp)), np.asarray(ids[c + 1 : c + 1 + len(lp)])].sum())
            count += len(ids) - 1
        return total, count, zeros

    def embed(self, ids: Sequence[int]) -> np.ndarray:
        """[1, T, d]: the scaled embeddings of a window."""
        return self.w.get("token_embd.weight")[np.asarray(ids)][None] * np.float32(self.cfg.embed_scale)

    def layer(self, x: np.ndarray, i: int, site: Callable[[np.ndarray, int, int], np.ndarray]) -> np.ndarray:
        """Layer i on x [1, T, d]; site(input, i, k) may threshold the input of site k."""
        cfg, w = self.cfg, self.w.layer(i)
        h = site(rms_norm(x, w("attn_norm"), cfg.norm_eps), i, 0)
        a = site(attention_heads(cfg, i, h, w), i, 1) @ w("attn_output").T
        x = x + (rms_norm(a, w("post_attention_norm"), cfg.norm_eps) if cfg.post_norms else a)
        h = site(rms_norm(x, w("ffn_norm"), cfg.norm_eps), i, 2)
        m = site(glu(h @ w("ffn_gate").T, h @ w("ffn_up").T, cfg.activation, cfg.act_threshold), i, 3) @ w("ffn_down").T
        return x + (rms_norm(m, w("post_ffw_norm"), cfg.norm_eps) if cfg.post_norms else m)

    def final(self, x: np.ndarray) -> np.ndarray:
        """[T - 1, d]: the final-normed hidden states of the positions that predict a next token."""
        return rms_norm(x[0, :-1], self.w.get("output_norm.weight"), self.cfg.norm_eps)

    def head(self) -> np.ndarray:
        """[V, d]: the output head (the embeddings when tied)."""
        return self.w.get("token_embd.weight" if self.cfg.tied_embeddings else "output.weight")

    def log_probs(self, x: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
        """(first row, log-probabilities [c, V] in float64) of the positions that predict a next
        token, in slices of 64 rows (Gemma's 262k vocabulary)."""
        h, head = self.final(x), self.head()
        for c in range(0, len(h), 64):
            yield c, log_softmax((h[c : c + 64] @ head.T).astype(np.float64))

    def thresholds(self, samples: dict[tuple[int, str], list[np.ndarray]], level: float | np.ndarray) -> np.ndarray:
        """[n_layers, 4]: each layer's and site's |input| quantile at level, one for all or
        [n_layers, 4] of them (0: nothing skipped, not even exact zeros)."""
        levels = np.broadcast_to(np.asarray(level, dtype=np.float64), (self.cfg.n_layers, len(SITES)))
        out = np.full((self.cfg.n_layers, len(SITES)), -1.0)
        for (i, s), parts in samples.items():
            k = SITES.index(s)
            if levels[i, k] > 0:
                out[i, k] = float(np.quantile(np.concatenate(parts), levels[i, k]))
        return out


def log_softmax(z: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax of z [n, V]."""
    mx = z.max(1, keepdims=True)
    return z - (np.log(np.exp(z - mx).sum(1, keepdims=True)) + mx)
