"""Sparsity measurement for the synthetic ReLU-sparse llama files, through the readable model.

Runs in: the CLI / tests process (:func:`measure_sparsity` on a finished file; ``powerinfer synth``
prints it after writing, the GPU benchmark profiles with :func:`run_layers`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from powerinfer.config import ModelConfig, config_from_gguf
from powerinfer.errors import InvalidArgumentError
from powerinfer.gguf_file import GGUFFile
from powerinfer.model import reference
from powerinfer.model.reference import LayerOut
from powerinfer.sparsity.calibrate import train_predictor


def run_layers(f: GGUFFile, cfg: ModelConfig, ids: np.ndarray, layers: int | None = None) -> Iterator[LayerOut]:
    """The file's first ``layers`` layers on token ids [B, T] (each row a sequence), through the
    readable model (powerinfer/model/reference.py) in float32: each layer's gate and up
    pre-activations [N, n_ff] and the residual [B, T, d] after it."""
    if cfg.arch != "llama":
        raise InvalidArgumentError(f"{f.path}: expected a llama file, got {cfg.arch}")
    yield from reference.layers(f, cfg, ids, layers, dtype=np.float32)


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
    exact_zero: float  # share of (token, neuron) pairs whose act(gate) * up is exactly 0 (ReLU families)
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
                 f"layer inactive [min, max]   g<0  act=0   abs {abs_hdr}   top{self.hot_fraction:.0%} mass / events"]
        for s in self.layers:
            ab = " ".join(f"{v:.3f}" for _, v in s.inactive_abs)
            lines.append(f"{s.layer:5d} {s.inactive:.3f} [{s.inactive_min:.3f}, {s.inactive_max:.3f}]  {s.gate_negative:.3f}  {s.exact_zero:.3f}"
                         f"   abs {ab}   {s.hot_mass_share:.3f} / {s.hot_event_share:.3f}")
            lines.append("      frequency histogram " + " ".join(
                f"[{a:g},{b:g}):{n}" for a, b, n in zip(FREQ_EDGES, FREQ_EDGES[1:], s.freq_hist)))
        return "\n".join(lines)


def layer_acts(a: LayerOut, cfg: ModelConfig) -> np.ndarray:
    """|act(gate) * up| [N, n_ff] of one measured layer, by the file's activation."""
    return np.abs(reference.activation(a.gate, cfg.activation, cfg.act_threshold) * reference.up_value(a.up, cfg.activation))


def _layer_sparsity(a: LayerOut, act: np.ndarray, threshold_rel: float, hot_fraction: float,
                    abs_thresholds: Sequence[float]) -> LayerSparsity:
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
        exact_zero=float((act == 0).mean()),
        hot_mass_share=float(act[:, hot].sum() / act.sum()),
        hot_event_share=float(active[:, hot].sum() / max(1, active.sum())),
        freq_hist=tuple(int(n) for n in hist),
    )


def _byte_sequences(cfg: ModelConfig, n_tokens: int, seq_len: int, seed: list[int]) -> np.ndarray:
    """Random byte-token sequences [B, min(seq_len, n_tokens)] covering n_tokens, each opened by <s> (id 256)."""
    t = min(seq_len, n_tokens)
    ids = np.random.default_rng(seed).integers(0, min(256, cfg.vocab_size), (-(-n_tokens // t), t))
    if cfg.vocab_size > 256:
        ids[:, 0] = 256
    return ids


def measure_sparsity(path: str | Path, n_tokens: int = 256, threshold_rel: float = 1e-2, seed: int = 0,
                     layers: int | None = None, hot_fraction: float = 0.2,
                     abs_thresholds: Sequence[float] = (1e-3, 1e-2, 1e-1), seq_len: int = 64) -> SparsityStats:
    """Run the file's first ``layers`` layers (all by default) on random byte-token sequences, each
    opened by <s>, and report per layer how many FFN neurons each token leaves inactive."""
    if n_tokens <= 0 or seq_len <= 0 or not 0 < threshold_rel < 1:
        raise InvalidArgumentError("n_tokens and seq_len must be positive, threshold_rel in (0, 1)")
    f = GGUFFile(path)
    cfg = config_from_gguf(f)
    ids = _byte_sequences(cfg, n_tokens, seq_len, [seed, 0x5EED])
    out = [_layer_sparsity(a, layer_acts(a, cfg), threshold_rel, hot_fraction, abs_thresholds) for a in run_layers(f, cfg, ids, layers)]
    return SparsityStats(str(path), int(ids.size), threshold_rel, hot_fraction, tuple(out))


@dataclass(frozen=True)
class PredictorFit:
    """How well a rank-limited predictor (calibrate's: fc2(relu(fc1 x)), trained the same way) learns
    which of one layer's neurons are nonzero, on the tenth of the tokens it did not train on."""

    layer: int
    rank: int
    active: float  # share of (token, neuron) pairs that are nonzero
    chosen: float  # share the predictor chooses (logit > 0)
    recall: float  # share of the nonzero pairs it chooses
    precision: float  # share of its choices that are nonzero

    def format(self) -> str:
        return (f"layer {self.layer}: rank-{self.rank} predictor recall {self.recall:.3f}, precision {self.precision:.3f} "
                f"({100 * self.chosen:.1f}% chosen, {100 * self.active:.1f}% nonzero)")


def fit_predictors(path: str | Path, rank: int, n_tokens: int = 2048, layers: int | None = 2, steps: int = 300,
                   seed: int = 0, seq_len: int = 64) -> list[PredictorFit]:
    """Train a rank-``rank`` predictor per measured layer on random byte-token sequences (another
    seed than the writer's) and report its neuron-level recall and precision on held-back tokens."""
    if rank <= 0 or n_tokens < 20 * seq_len // 2 or steps <= 0:
        raise InvalidArgumentError("rank and steps must be positive and n_tokens at least 10 sequences")
    f = GGUFFile(path)
    cfg = config_from_gguf(f)
    ids = _byte_sequences(cfg, n_tokens, seq_len, [seed, 0xF17])
    fits = []
    for a in run_layers(f, cfg, ids, layers):
        act = layer_acts(a, cfg)
        *_, val = train_predictor(a.ffn_in.astype(np.float32), act, 0.0, np.ones(cfg.n_ff, np.float32), rank, steps, seed + a.layer)
        chosen, nonzero = val.logits > 0, val.mass > 0
        hit = float((chosen & nonzero).sum())
        fits.append(PredictorFit(a.layer, rank, float(nonzero.mean()), float(chosen.mean()),
                                 hit / max(1.0, float(nonzero.sum())), hit / max(1.0, float(chosen.sum()))))
    return fits
