"""Numpy forward pass and sparsity measurement for the synthetic ReLU-sparse llama files.

Runs in: the CLI / tests process. Used by relu_model.py while planting (to calibrate each layer on
the layers already written) and by :func:`measure_sparsity` on a finished file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from powerinfer.config import ModelConfig, config_from_gguf
from powerinfer.errors import InvalidArgumentError
from powerinfer.gguf_file import GGUFFile

QT = GGMLQuantizationType
ROPE_BASE, NORM_EPS = 10000.0, 1e-5


def rms_norm(x: np.ndarray, w: np.ndarray | None = None) -> np.ndarray:
    y = x / np.sqrt((x * x).mean(-1, keepdims=True) + NORM_EPS)
    return y if w is None else y * w


def _rope(x: np.ndarray) -> np.ndarray:
    """llama ("norm") rope on adjacent pairs, as ggml does for llama files. x [B, T, H, D]."""
    d = x.shape[-1]
    ang = np.arange(x.shape[1])[:, None] * ROPE_BASE ** (-np.arange(0, d, 2) / d)  # [T, D/2]
    c, s = np.cos(ang).astype(np.float32)[None, :, None], np.sin(ang).astype(np.float32)[None, :, None]
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = a * c - b * s, a * s + b * c
    return out


def attention(h: np.ndarray, wq: np.ndarray, wk: np.ndarray, wv: np.ndarray, n_heads: int, n_kv: int) -> np.ndarray:
    """Causal GQA attention of normed h [B, T, d] -> per-head outputs concatenated [B, T, n_heads*hd]
    (before attn_output)."""
    B, T, _ = h.shape
    hd = wq.shape[0] // n_heads
    q = _rope((h @ wq.T).reshape(B, T, n_heads, hd)).transpose(0, 2, 1, 3)  # [B, H, T, hd]
    k = _rope((h @ wk.T).reshape(B, T, n_kv, hd)).transpose(0, 2, 3, 1)  # [B, KV, hd, T]
    v = (h @ wv.T).reshape(B, T, n_kv, hd).transpose(0, 2, 1, 3)  # [B, KV, T, hd]
    g = n_heads // n_kv
    k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    s = (q @ k) / np.float32(math.sqrt(hd)) + np.triu(np.full((T, T), -np.inf, np.float32), 1)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return (p @ v).transpose(0, 2, 1, 3).reshape(B, T, n_heads * hd)


def silu(g: np.ndarray) -> np.ndarray:
    return g / (1.0 + np.exp(-np.clip(g, -80.0, 80.0)))


def weight(f: GGUFFile, name: str) -> np.ndarray:
    info = f.tensor(name)
    raw = np.asarray(f.raw(name))
    if info.qtype in (QT.F32, QT.F16):
        return raw.astype(np.float32)
    return dequantize(raw, info.qtype).reshape(info.shape).astype(np.float32)


@dataclass(frozen=True)
class LayerActivations:
    layer: int
    gate: np.ndarray  # [N, n_ff] pre-activations of the N tokens
    up: np.ndarray  # [N, n_ff]
    residual: np.ndarray  # [B, T, d] residual stream after the layer


def run_layers(f: GGUFFile, cfg: ModelConfig, ids: np.ndarray, layers: int | None = None) -> Iterator[LayerActivations]:
    """Run the file's first ``layers`` llama layers on token ids [B, T] (each row a sequence)."""
    if cfg.arch != "llama":
        raise InvalidArgumentError(f"{f.path}: expected a llama file, got {cfg.arch}")
    x = weight(f, "token_embd.weight")[ids]  # [B, T, d]
    for i in range(cfg.n_layers if layers is None else min(layers, cfg.n_layers)):
        w = lambda part: weight(f, f"blk.{i}.{part}.weight")  # noqa: E731
        att = attention(rms_norm(x, w("attn_norm")), w("attn_q"), w("attn_k"), w("attn_v"), cfg.n_heads, cfg.n_kv_heads)
        x = x + att @ w("attn_output").T
        h = rms_norm(x, w("ffn_norm")).reshape(-1, cfg.d_model)
        gate, up = h @ w("ffn_gate").T, h @ w("ffn_up").T
        x = x + ((silu(gate) * up) @ w("ffn_down").T).reshape(x.shape)
        yield LayerActivations(i, gate, up, x)


# -- the writer ------------------------------------------------------------------------------------


FREQ_EDGES = (0.0, 0.001, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 1.0)


@dataclass(frozen=True)
class LayerSparsity:
    layer: int
    inactive: float  # mean over tokens of the share with |act| < threshold_rel * max|act| of the token
    inactive_min: float  # the least sparse token
    inactive_max: float
    inactive_abs: tuple[tuple[float, float], ...]  # (absolute threshold on |act|, mean share below it)
    gate_negative: float  # share of (token, neuron) pairs with gate pre-activation < 0
    hot_mass_share: float  # share of sum |act| carried by the top hot_fraction most frequently active neurons
    hot_event_share: float  # share of the active (token, neuron) pairs on those neurons
    freq_hist: tuple[int, ...]  # neurons per bin of activation frequency, bins FREQ_EDGES


@dataclass(frozen=True)
class SparsityStats:
    path: str
    n_tokens: int
    threshold_rel: float
    hot_fraction: float
    layers: tuple[LayerSparsity, ...]

    @property
    def mean_inactive(self) -> float:
        return float(np.mean([s.inactive for s in self.layers]))

    def format(self) -> str:
        """A plain-text table (for the CLI and logs)."""
        abs_hdr = " ".join(f"<{t:g}" for t, _ in self.layers[0].inactive_abs) if self.layers else ""
        lines = [f"{self.path}: {self.n_tokens} tokens, inactive = |act| < {self.threshold_rel:g} * max|act| per token",
                 f"layer inactive [min, max]   g<0   abs {abs_hdr}   top{self.hot_fraction:.0%} mass / events"]
        for s in self.layers:
            ab = " ".join(f"{v:.3f}" for _, v in s.inactive_abs)
            lines.append(f"{s.layer:5d} {s.inactive:.3f} [{s.inactive_min:.3f}, {s.inactive_max:.3f}]  {s.gate_negative:.3f}"
                         f"   abs {ab}   {s.hot_mass_share:.3f} / {s.hot_event_share:.3f}")
            lines.append("      frequency histogram " + " ".join(
                f"[{a:g},{b:g}):{n}" for a, b, n in zip(FREQ_EDGES, FREQ_EDGES[1:], s.freq_hist)))
        return "\n".join(lines)


def _layer_sparsity(a: LayerActivations, threshold_rel: float, hot_fraction: float,
                    abs_thresholds: Sequence[float]) -> LayerSparsity:
    act = np.abs(silu(a.gate) * a.up)  # [N, n_ff]
    active = act >= threshold_rel * act.max(1, keepdims=True)
    per_token = 1.0 - active.mean(1)
    freq = active.mean(0)  # [n_ff] share of tokens for which each neuron is active
    hot = np.argsort(-freq, kind="stable")[: max(1, round(hot_fraction * freq.size))]
    hist = np.histogram(freq, bins=np.array(FREQ_EDGES))[0]
    return LayerSparsity(
        layer=a.layer,
        inactive=float(per_token.mean()),
        inactive_min=float(per_token.min()),
        inactive_max=float(per_token.max()),
        inactive_abs=tuple((float(t), float((act < t).mean())) for t in abs_thresholds),
        gate_negative=float((a.gate < 0).mean()),
        hot_mass_share=float(act[:, hot].sum() / act.sum()),
        hot_event_share=float(active[:, hot].sum() / max(1, active.sum())),
        freq_hist=tuple(int(n) for n in hist),
    )


def measure_sparsity(path: str | Path, n_tokens: int = 256, threshold_rel: float = 1e-2, seed: int = 0,
                     layers: int | None = None, hot_fraction: float = 0.2,
                     abs_thresholds: Sequence[float] = (1e-3, 1e-2, 1e-1), seq_len: int = 64) -> SparsityStats:
    """Run the file's first ``layers`` layers (all by default) on random byte-token sequences, each
    opened by <s>, and report per layer how many FFN neurons each token leaves inactive."""
    if n_tokens <= 0 or seq_len <= 0 or not 0 < threshold_rel < 1:
        raise InvalidArgumentError("n_tokens and seq_len must be positive, threshold_rel in (0, 1)")
    f = GGUFFile(path)
    cfg = config_from_gguf(f)
    t = min(seq_len, n_tokens)
    ids = np.random.default_rng([seed, 0x5EED]).integers(0, min(256, cfg.vocab_size), (-(-n_tokens // t), t))
    if cfg.vocab_size > 256:
        ids[:, 0] = 256
    out = [_layer_sparsity(a, threshold_rel, hot_fraction, abs_thresholds) for a in run_layers(f, cfg, ids, layers)]
    return SparsityStats(str(path), int(ids.size), threshold_rel, hot_fraction, tuple(out))
