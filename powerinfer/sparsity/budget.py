"""Calibration under a quality budget: the sparsest setting (gate, low-rank or trained predictor) whose held-out perplexity stays within it.

Runs in: the user's process (`powerinfer calibrate` without --sparsity), in-process executors; the
decode timing (timed_choice.py) starts the default executor's worker processes.

1. The corpus (the user's text, or text the model writes itself) is split: the first 80% is
   profiled, the rest is held out and scored.
2. Damage, measured per layer and level (TEAL's block-wise view): the share of the layer's
   activation mass (|act(gate) * up| times the norm of the neuron's down column) that a gate
   threshold at that level of the profile drops.
3. For a target mean sparsity S a greedy allocation raises one layer at a time, always the move
   that drops the least mass per unit of sparsity gained, until the mean reaches S: sensitive
   layers stay dense, tolerant ones go far. A layer's first move jumps straight to the lowest
   level at which the native decoder skips anything (``min_level``: it runs a layer dense above
   MAX_SPARSE_SHARE active, where skipping rows stops paying on this CPU), later moves are one step
   (0.05): a level below that would spend the budget on perplexity and skip nothing. Where the
   activation makes exact zeros (the ReLU family) a layer whose zeros alone make it min_level
   sparse goes no further than them (zero_ceilings): up to there gate mode drops nothing that is
   not zero on any text, past it the cuts measured within the aim on the held-out fifth and not on
   other text. A layer whose zeros fall short of min_level can still be cut to it within the budget.
4. S itself is bisected: the largest allocation whose held-out perplexity stays within half the
   budget of dense (a margin for text unlike the corpus: see MARGIN), each candidate scored by one
   sparse pass over the held-out tokens with the thresholds set in place on one executor (nothing
   is reloaded between candidates). A candidate stays within it only at the upper end of its
   one-sided 95% interval (Scored: per-token differences from dense, paired on the same tokens):
   the largest allocation that merely measures within the aim was, by the luck of those few
   thousand tokens, often the one whose cost they underestimated (measured: the trained ReLU model's
   thresholds scored +0.83% on the fifth and +1.04% on 20000 unseen tokens).
5. Mode: for a gated ReLU-family model ('auto' or 'lowrank') the gate's own low-rank sign
   (lowrank.py: no training, each layer's width the least that keeps the recall) is scored first at
   those levels, and kept where it stays within the aim and ('auto') decodes faster than gate mode,
   or as fast within the timing's noise and more accurate (timed_choice.rejection); then no predictor
   is trained. Else, unless told 'gate', predictors are trained for the layers that allocation leaves
   sparse (at their levels; the dense layers get one that fires every neuron) and scored the same
   way, raising the recall (RECALLS: only the decision biases move) until they keep the aim.
   'predictor' keeps them when they stay within it; 'auto' (the default) only when they also
   decode at least SPEED_MARGIN faster than gate mode, which computes every gate row but reads them
   streamed: timed on this machine in the default executor (timed_choice.py, paired rounds), since what a chosen row costs
   against a streamed one differs from CPU to CPU. The bytes each reads (ffn_read_bytes) are
   reported beside it. SmolLM2 and Gemma-3 have no layer sparse within +2%, so nothing is trained
   for them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from powerinfer.config import config_from_gguf
from powerinfer.coordinator.engine import Engine
from powerinfer.coordinator.inprocess import InProcessExecutor
from powerinfer.native.sparse_layers import MAX_SPARSE_SHARE, down_t_row_bytes, layer_reads, low_rank_pairs
from powerinfer.errors import InvalidArgumentError
from powerinfer.gguf_file import GGUFFile
from powerinfer.model.weights import layer_tensor
from powerinfer.sparsity.allocation import MAX_LEVEL, allocate, damage_table, gate_shares, zero_ceilings
from powerinfer.sparsity.lowrank import check_lowrank, lowrank_applies
from powerinfer.sparsity.calibrate import CalibrationSettings, Profile, RecallShift, at_recall, build_predictor, profile
from powerinfer.sparsity.perplexity import token_nll
from powerinfer.predictors.predictor_file import LayerPredictor, PredictorFile
from powerinfer.sparsity.profile import windows_of
from powerinfer.sparsity.timed_choice import SPEED_PROMPT, rejection, time_against_gate, timed_note

MIN_LEVEL = round(1.0 - MAX_SPARSE_SHARE, 4)  # the lowest level at which the native decoder runs a layer sparse
HOLD_OUT = 0.2  # share of the corpus scored, not profiled
BISECTIONS = 7  # ~0.007 resolution on the mean sparsity
# The search aims at this share of the budget on its own held-out tokens: text of another kind can
# be more sensitive than the calibration corpus (measured: Gemma-3-270M calibrated on its own text at
# +1.81% on the held-out fifth scored +2.40% on the GPL-3 text).
MARGIN = 0.5
# Recalls tried in turn (above the settings' own) when predictors at that one break the aim: a deep
# model loses the missed mass in every layer (the 1.1B file: +94% at 0.97 over 22 layers).
RECALLS = (0.99, 0.995, 0.999)
# One-sided 95%: a candidate keeps the aim only if its perplexity does at this many standard errors up
Z_UPPER = 1.645


@dataclass(frozen=True)
class Scored:
    """A candidate's held-out perplexity and the upper end of its one-sided 95% interval, from the
    per-token differences of its negative log-likelihood from dense's on the same tokens (tokens
    treated as independent: they are not quite, so the interval is if anything narrow)."""

    ppl: float
    upper: float

    @staticmethod
    def against(dense: np.ndarray, nll: np.ndarray) -> Scored:
        """dense, nll: per-token negative log-likelihoods [tokens] of dense and of the candidate."""
        if dense.shape != nll.shape or len(nll) < 2:
            raise ValueError(f"paired scores need the same tokens, at least 2: {dense.shape} vs {nll.shape}")
        diff = nll - dense
        se = float(diff.std(ddof=1)) / math.sqrt(len(diff))
        ppl = math.exp(float(nll.mean()))
        return Scored(ppl, ppl * math.exp(Z_UPPER * se))

    def within(self, limit: float) -> bool:
        return self.upper <= limit

    def describe(self, dense: float) -> str:
        return f"{self.ppl:.3f} ({100 * (self.ppl / dense - 1):+.2f}%, at most {100 * (self.upper / dense - 1):+.2f}% at 95%)"


@dataclass(frozen=True)
class BudgetPoint:
    """What the search chose: the mode, mean and per-layer sparsity, held-out perplexities, FFN bytes."""

    mode: str  # "gate" | "predictor" | "lowrank" (a predictor-mode file read off the gate)
    sparsity: float
    levels: tuple[float, ...]
    dense_ppl: float
    sparse_ppl: float
    held_out_tokens: int
    skipped_bytes: int  # per token, what the native decoder leaves unread (ffn_read_bytes)
    ffn_bytes: int  # per token: gate, up and down of every layer
    min_level: float = MIN_LEVEL  # a layer below this level runs dense
    note: str = ""  # how the other mode fared

    @property
    def increase(self) -> float:
        return self.sparse_ppl / self.dense_ppl - 1.0

    @property
    def sparse_layers(self) -> int:
        return sum(v >= self.min_level - 1e-9 for v in self.levels)

    def report(self) -> str:
        lv = ", ".join(f"{v:.2f}" for v in self.levels)
        text = (f"chose {self.mode} mode, mean sparsity {100 * self.sparsity:.1f}%, {self.sparse_layers} of {len(self.levels)} layers "
                f"sparse: held-out perplexity {self.dense_ppl:.3f} -> {self.sparse_ppl:.3f} ({100 * self.increase:+.2f}%, "
                f"{self.held_out_tokens} tokens); FFN weight bytes skipped per token {self.skipped_bytes / 2**20:.1f} of "
                f"{self.ffn_bytes / 2**20:.1f} MiB ({100 * self.skipped_bytes / self.ffn_bytes:.1f}%)\nper-layer sparsity: {lv}")
        if self.note:
            text += "\n" + self.note
        if self.sparse_layers == 0:
            text += (f"\nno layer of this model stays within the budget at {100 * self.min_level:.0f}% sparsity or more, the least at "
                     f"which the native decoder skips rows (below it a layer runs dense: skipping does not pay on this CPU), so "
                     f"this predictor changes nothing; --sparsity forces a level")
        return text


def _q8_bytes(cols: int) -> int:
    """Bytes of one Q8_0 row of cols values padded to whole blocks of 32 (34 bytes a block)."""
    return -(-cols // 32) * 34


def predictor_bytes(rank: int, d: int, n_ff: int) -> int:
    """Bytes a layer's predictor takes in the native decoder: Q8_0 fc1 [r, d] and fc2 [n_ff, r], r padded to 32
    (on AVX-512 VNNI its fc2 is read by sign, n_ff x (2 + r) bytes: native/pred_sign.py; this is the larger count)."""
    rp = -(-rank // 32) * 32
    return rp * _q8_bytes(d) + n_ff * _q8_bytes(rp)


def decoder_width(lp: LayerPredictor) -> int:
    """The width the native decoder runs a layer's predictor at: half a low-rank one's (folded)."""
    return lp.rank // 2 if low_rank_pairs(lp.fc1_w, lp.fc1_b, lp.fc2_w) else lp.rank


def ffn_read_bytes(mode: str, levels: Sequence[float], shares: Sequence[float], n_ff: int, d: int,
                   rows: Sequence[tuple[int, int, int]], pred_bytes: Sequence[int] = (),
                   min_level: float = MIN_LEVEL, down_t_rows: Sequence[int] = ()) -> tuple[int, int]:
    """(streamed, scattered): FFN weight bytes per token the native decoder reads whole matrices at
    a time, and as chosen rows (NativeSparseFFNs.bytes_per_token's rule, from calibrated shares). A
    layer below min_level is streamed in full (it runs dense); else the gate rows (all of them
    streamed in gate mode; the chosen ones plus the predictor's own streamed bytes in predictor
    mode), the chosen up rows, and the down projection: the chosen neurons' rows of its
    neuron-major copy at most DOWN_MAX_SHARE active, else all of it streamed. shares[i]: the share
    of layer i's neurons computed (gate mode 1 - level, predictor mode what it predicts); rows[i]:
    bytes of one row of its gate [n_ff, d], up [n_ff, d] and down [d, n_ff]; pred_bytes[i]: its
    predictor's (predictor mode); down_t_rows[i]: bytes of one neuron's row of its neuron-major copy
    (sparse_layers.down_t_row_bytes; () for Q8_0 rows). Each sparse layer by the decoder's own rule, layer_reads."""
    streamed = scattered = 0.0
    for i, (lv, share, (g, u, dn)) in enumerate(zip(levels, shares, rows)):
        if lv < min_level - 1e-9:
            streamed += n_ff * (g + u) + d * dn
            continue
        dt = down_t_rows[i] if down_t_rows else _q8_bytes(d)
        s, c = layer_reads(mode == "predictor", share, n_ff, d, (g, u, dn), dt, pred_bytes[i] if mode == "predictor" else 0)
        streamed, scattered = streamed + s, scattered + c
    return int(streamed), int(scattered)


def _layer_rows(p: Profile) -> list[tuple[int, int, int]]:
    """Per layer: bytes of one row of its gate, up and down matrices in the file (OPT: fc1 as the gate, no up)."""
    parts = (p.cfg.gate_part, "ffn_up" if p.cfg.gated_ffn else None, "ffn_down")
    return [tuple(p.f.tensor(layer_tensor(i, part)).row_bytes if part else 0 for part in parts)  # type: ignore[misc]
            for i in range(p.cfg.n_layers)]


def _shares(p: Profile, pf: PredictorFile, levels: np.ndarray, min_level: float) -> list[float]:
    """Per layer, the share of neurons pf's predictor chooses on the profiled rows (1 for a layer
    below min_level: it runs dense)."""
    return [float(pf.layers[i].predict(p.ex.samples[i].arrays()[0].astype(np.float32)).mean()) if levels[i] >= min_level else 1.0
            for i in range(p.cfg.n_layers)]


def _score_file(p: Profile, pf: PredictorFile | None, windows: list[list[int]], n_ctx: int) -> np.ndarray:
    """Held-out per-token negative log-likelihoods with a predictor file's own rule, or dense (pf None); a fresh in-process executor."""
    ex = InProcessExecutor(p.f, p.cfg, n_ctx, predictor=pf)
    try:
        return token_nll(Engine(p.f, p.cfg, ex, n_ctx=n_ctx, n_batch=n_ctx), windows)
    finally:
        ex.close()


def calibrate_within_budget(model: str | Path, settings: CalibrationSettings, budget: float = 0.02, text: str | None = None,
                            progress: Callable[[str], None] = lambda _: None,
                            min_level: float = MIN_LEVEL) -> tuple[PredictorFile, BudgetPoint]:
    """The sparsest predictor within budget (relative perplexity increase on held-out tokens) whose
    sparse layers are each at least min_level sparse (0: any level). The levels come from the gate
    search; settings.mode 'gate' stops there, 'predictor' then trains predictors for the sparse
    layers and keeps them if they stay within the budget, 'auto' keeps them only if they also read
    fewer bytes a token than gate mode."""
    if not 0.0 < budget < 1.0:
        raise InvalidArgumentError(f"the perplexity budget must be in (0, 1), got {budget}")
    if not 0.0 <= min_level <= MAX_LEVEL:
        raise InvalidArgumentError(f"the least sparsity of a sparse layer must be in [0, {MAX_LEVEL}], got {min_level}")
    if settings.mode == "lowrank":  # before minutes of profiling
        check_lowrank(config_from_gguf(GGUFFile(model)))
    gate_settings = replace(settings, mode="gate")
    p = profile(model, gate_settings, text, hold_out=HOLD_OUT, progress=progress)
    windows = windows_of(p.held_out, settings.window + 1, p.tok.bos_id if p.tok.add_bos else None)
    if not windows or sum(len(w) - 1 for w in windows) < 32:
        raise InvalidArgumentError(f"{len(p.held_out)} held-out tokens are too few to score; give more (--tokens, or a longer --text)")
    n_ctx = settings.window + 1
    levels, damage = damage_table(p)
    ceiling = zero_ceilings(p, levels, min_level)
    if ceiling is not None:
        progress(f"{p.cfg.activation}'s exact zeros: a layer they make at least {100 * min_level:.0f}% sparse stops there "
                 f"(levels at most {', '.join(f'{v:.2f}' for v in ceiling)}; {MAX_LEVEL:.2f}: no ceiling)")
    ex = InProcessExecutor(p.f, p.cfg, n_ctx, predictor=build_predictor(p, gate_settings, [0.0] * p.cfg.n_layers))
    engine = Engine(p.f, p.cfg, ex, n_ctx=n_ctx, n_batch=n_ctx)

    def score(per_layer: np.ndarray | None) -> np.ndarray:
        ex.set_sparse(dense=per_layer is None)
        if per_layer is not None:
            for layer, shards in enumerate(ex.ffns):
                _, gate, _ = p.ex.samples[layer].arrays()
                thr = float(np.quantile(gate.astype(np.float32), per_layer[layer])) if per_layer[layer] > 0 else 0.0
                for shard in shards:
                    shard.threshold = thr  # type: ignore[union-attr]
        return token_nll(engine, windows)

    try:
        dense_nll = score(None)
        dense = math.exp(float(dense_nll.mean()))
        limit = dense * (1 + MARGIN * budget)
        progress(f"dense held-out perplexity {dense:.3f} over {sum(len(w) - 1 for w in windows)} tokens; budget +{100 * budget:.1f}% "
                 f"(aiming at +{100 * MARGIN * budget:.1f}% here, at the upper end of each candidate's 95% interval)")
        lo, hi = 0.0, MAX_LEVEL
        best = (np.zeros(p.cfg.n_layers), dense)
        scored: dict[tuple[float, ...], Scored] = {}  # with a least level the mean moves a whole layer at a time: targets repeat
        for _ in range(BISECTIONS):
            mid = (lo + hi) / 2
            alloc = allocate(levels, damage, mid, min_level, ceiling)
            key = tuple(float(v) for v in alloc)
            if key not in scored:
                scored[key] = Scored.against(dense_nll, score(alloc))
                progress(f"mean sparsity {100 * alloc.mean():.1f}%: perplexity {scored[key].describe(dense)}")
            if scored[key].within(limit):
                lo, best = mid, (alloc, scored[key].ppl)
            else:
                hi = mid
    finally:
        ex.close()
    alloc, ppl = best
    n_ff, d, rows = p.cfg.n_ff, p.cfg.d_model, _layer_rows(p)
    dt = [down_t_row_bytes(d, p.f.tensor(layer_tensor(i, "ffn_down")).qtype) for i in range(p.cfg.n_layers)]
    ffn = sum(n_ff * (g + u) + d * dn for g, u, dn in rows)
    gate_reads = ffn_read_bytes("gate", alloc, gate_shares(p, alloc), n_ff, d, rows, (), min_level, dt)
    point = BudgetPoint("gate", float(alloc.mean()), tuple(float(v) for v in alloc), dense, ppl, sum(len(w) - 1 for w in windows),
                        ffn - sum(gate_reads), ffn, min_level)
    out = build_predictor(p, gate_settings, list(alloc), progress)
    prompt = windows[0][:SPEED_PROMPT]  # decode_speedup's prompt: held-out text
    lowrank_kept = False
    if settings.mode in ("auto", "lowrank") and point.sparse_layers > 0 and lowrank_applies(p.cfg):
        # the gate's own low-rank sign first: no training, so minutes, where it keeps the aim
        lr = build_predictor(p, replace(settings, mode="lowrank"), list(alloc), progress)
        lr_score = Scored.against(dense_nll, _score_file(p, lr, windows, n_ctx))
        lr_ppl = lr_score.ppl
        shares = _shares(p, lr, alloc, min_level)
        reads = ffn_read_bytes("predictor", alloc, shares, n_ff, d, rows, [predictor_bytes(decoder_width(lp), d, n_ff) for lp in lr.layers], min_level, dt)
        how = (f"low-rank predictor at these levels: held-out perplexity {lr_score.describe(dense)}, "
               f"{100 * float(np.mean(shares)):.1f}% of the neurons chosen on average, {100 * (ffn - sum(reads)) / ffn:.1f}% of the FFN "
               "bytes skipped")
        progress(how)
        speed = time_against_gate(p, lr, out, prompt, progress, "the low-rank predictor") if settings.mode == "auto" and lr_score.within(limit) else None
        why_not = rejection(how, lr_score.upper, limit, MARGIN * budget, speed, ", so gate mode" if settings.mode == "lowrank" else ", so not kept",
                            more_accurate=lr_ppl < ppl)
        if why_not:
            point = replace(point, note=why_not)
        else:
            lowrank_kept = True
            point = replace(point, mode="lowrank", sparse_ppl=lr_ppl, skipped_bytes=ffn - sum(reads),
                            note=f"gate mode at these levels: held-out perplexity {ppl:.3f} ({100 * (ppl / dense - 1):+.2f}%), "
                                 f"{100 * point.skipped_bytes / ffn:.1f}% of the FFN bytes skipped{timed_note(speed)}; no predictor trained")
            out = lr
    elif settings.mode == "lowrank":
        check_lowrank(p.cfg)  # says why it does not apply
        point = replace(point, note="the low-rank predictor not tried: the levels leave no layer sparse, so gate mode")
    if settings.mode in ("auto", "predictor") and not lowrank_kept:
        if point.sparse_layers == 0:
            point = replace(point, note="predictor mode not tried: the levels leave no layer sparse")
        else:
            lr_note = f"{point.note}; " if point.note else ""
            trained: list[RecallShift | None] = []
            first = build_predictor(p, replace(settings, mode="predictor"), list(alloc), progress, trained)
            pred_bytes = [predictor_bytes(decoder_width(lp), d, n_ff) for lp in first.layers]
            # the least recall (the fewest neurons chosen) whose predictors keep the aim; each step only moves the biases
            for recall in [settings.recall, *(r for r in RECALLS if r > settings.recall)]:
                pred = at_recall(first, trained, recall)
                pred_score = Scored.against(dense_nll, _score_file(p, pred, windows, n_ctx))
                pred_ppl = pred_score.ppl
                # the share each predictor chooses, on the profiled rows it was trained from
                shares = _shares(p, pred, alloc, min_level)
                progress(f"predictor mode at recall {recall}: {100 * float(np.mean(shares)):.1f}% of the neurons chosen, held-out "
                         f"perplexity {pred_score.describe(dense)}")
                if pred_score.within(limit):
                    break
            reads = ffn_read_bytes("predictor", alloc, shares, n_ff, d, rows, pred_bytes, min_level, dt)
            skipped = ffn - sum(reads)
            speed = time_against_gate(p, pred, out, prompt, progress, "the trained predictors") if settings.mode == "auto" and pred_score.within(limit) else None
            how = (f"predictor mode at these levels (recall {recall}): held-out perplexity {pred_score.describe(dense)}, "
                   f"{100 * float(np.mean(shares)):.1f}% of the neurons chosen on average, {100 * skipped / ffn:.1f}% of the FFN bytes skipped")
            why_not = rejection(how, pred_score.upper, limit, MARGIN * budget, speed, ", so gate mode", more_accurate=pred_ppl < ppl)
            if why_not:
                point = replace(point, note=f"{lr_note}{why_not}")
            else:
                point = replace(point, mode="predictor", sparse_ppl=pred_ppl, skipped_bytes=skipped,
                                note=f"{lr_note}recall {recall}; gate mode at these levels: held-out perplexity {ppl:.3f} "
                                     f"({100 * (ppl / dense - 1):+.2f}%), {100 * point.skipped_bytes / ffn:.1f}% of the FFN bytes "
                                     f"skipped{timed_note(speed)}")
                out = pred
    out = replace(out, calibration={**out.calibration, "budget": budget, "held_out_ppl_dense": dense,
                                    "held_out_ppl_sparse": point.sparse_ppl})
    return out, point


# A forced level whose held-out perplexity rises past this is reported as damaging, not just printed
FORCED_WARN = 0.10


def calibrate_forced(model: str | Path, settings: CalibrationSettings, text: str | None = None,
                     progress: Callable[[str], None] = lambda _: None) -> tuple[PredictorFile, float | None, float | None]:
    """One forced level for every layer (settings.sparsity), made from all but a held-out fifth of
    the text and scored on that fifth: (the predictor, dense and sparse held-out perplexity), so a
    level that wrecks the model is said at once (FORCED_WARN), not found by its first user. Fewer
    than 32 held-out tokens (a short --tokens): None for both, the predictor made all the same.
    Mode 'auto' means gate here: with no budget there is nothing to weigh the predictors against."""
    if settings.mode == "auto":
        settings = replace(settings, mode="gate")
    p = profile(model, settings, text, hold_out=HOLD_OUT, progress=progress)
    pf = build_predictor(p, settings, [settings.sparsity] * p.cfg.n_layers, progress)
    windows = windows_of(p.held_out, settings.window + 1, p.tok.bos_id if p.tok.add_bos else None)
    if not windows or sum(len(w) - 1 for w in windows) < 32:
        return pf, None, None
    n_ctx = settings.window + 1
    dense = math.exp(float(_score_file(p, None, windows, n_ctx).mean()))
    sparse = math.exp(float(_score_file(p, pf, windows, n_ctx).mean()))
    pf = replace(pf, calibration={**pf.calibration, "held_out_ppl_dense": dense, "held_out_ppl_sparse": sparse})
    return pf, dense, sparse
