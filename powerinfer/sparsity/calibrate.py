"""Calibration: profile a model's FFN activations, set per-layer thresholds, train neuron predictors.

Runs in: the user's process (`powerinfer calibrate`), in-process executor, torch for training.

1. Corpus: the user's ``--text`` file, or text the model samples itself (no downloads).
2. Profile (profile.py): per layer a sample of FFN inputs x and |act(gate) * up|, |act(gate)|.
3. Thresholds (TEAL/CATS style): per layer the quantile of |activation| at the target sparsity, so
   that share of (token, neuron) pairs counts as inactive. ``gate`` mode thresholds |act(gate)|.
4. Predictors (``predictor`` mode): per layer Linear(d, r) -> ReLU -> Linear(r, n_ff), trained with
   a recall-weighted BCE to flag the active neurons; the output bias is then shifted so that the
   predicted set keeps ``recall`` of the activation mass on held-out rows.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from powerinfer.config import ModelConfig, config_from_gguf
from powerinfer.coordinator.engine import Engine
from powerinfer.errors import InvalidArgumentError
from powerinfer.gguf_file import GGUFFile
from powerinfer.sampling import Sampler, SamplingParams
from powerinfer.predictors.predictor_file import LayerPredictor, PredictorFile, model_fingerprint
from powerinfer.sparsity.lowrank import check_lowrank, choose_width, gate_lowrank
from powerinfer.sparsity.profile import ProfilingExecutor, run_tokens, windows_of
from powerinfer.tokenizer import GGUFTokenizer

log = logging.getLogger(__name__)

SEED_PROMPTS = ("The", "Once upon a time", "In this paper we", "def main():", "Question: Why is the sky blue?\nAnswer:",
                "The history of", "Dear Sir or Madam,", "1. Introduction\n")


@dataclass(frozen=True)
class CalibrationSettings:
    mode: str = "predictor"  # "predictor" | "gate" | "lowrank" (a predictor-mode file from the gate's SVD) | "auto"
    sparsity: float = 0.5  # target share of inactive (token, neuron) pairs per layer
    tokens: int = 4096  # calibration tokens (generated when no text is given)
    window: int = 256  # tokens per forward window
    rank: int = 0  # predictor width; 0: default_rank(d_model)
    recall: float = 0.97  # share of activation mass the predicted set must keep
    steps: int = 300  # training steps per layer (full batch)
    max_rows: int = 2048  # profiled token rows kept per layer
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode not in ("predictor", "gate", "lowrank", "auto"):
            raise InvalidArgumentError(f"mode must be 'predictor', 'gate', 'lowrank' or 'auto' (the budget search's choice), got {self.mode!r}")
        if not 0.0 < self.sparsity < 1.0:
            raise InvalidArgumentError(f"sparsity must be in (0, 1), got {self.sparsity}")
        if not 0.5 <= self.recall <= 1.0:
            raise InvalidArgumentError(f"recall must be in [0.5, 1], got {self.recall}")
        if self.tokens < 16 or self.window < 8:
            raise InvalidArgumentError("need at least 16 calibration tokens and windows of at least 8")


def default_rank(d_model: int) -> int:
    """The predictor's hidden width when none is given: d_model / 4, within [32, 128]. Every sparse
    layer reads its predictor each token: on the 1.1B file (d 2048) rank 512 read 4 MB a layer and
    took ~2 min a layer to train, where rank 128 chose as well (docs/sparsity.md)."""
    return max(32, min(128, d_model // 4))


# A layer the budget leaves dense still needs a predictor in a predictor-mode file: rank 1, zero
# weights and this bias, so every neuron is predicted active (the native decoder runs such a layer
# dense and never reads it).
FIRE_ALL_BIAS = 30.0


def generate_corpus(engine: Engine, tok: GGUFTokenizer, n_tokens: int, window: int, seed: int) -> list[int]:
    """The model writes its own calibration text: seeded prompts, sampled at temperature 1."""
    out: list[int] = []
    i = 0
    while len(out) < n_tokens:
        ids = tok.encode(SEED_PROMPTS[i % len(SEED_PROMPTS)])
        sampler = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.02, seed=seed + i))
        engine.rewind(0)
        logits = engine.eval(ids)
        gen = list(ids)
        while len(gen) < window:
            t = sampler(logits[-1], gen)
            if t in tok.eog_ids:
                break
            gen.append(t)
            logits = engine.eval([t])
        out.extend(gen)
        i += 1
    return out[:n_tokens]


@dataclass(frozen=True)
class RecallShift:
    """What sets a trained predictor's decision bias for a recall, without retraining: its logits
    [V, n_ff] on the held-back validation rows (with the unshifted fc2 bias) and each neuron's mass
    [V, n_ff] there (|act| times its down column's norm)."""

    logits: np.ndarray
    mass: np.ndarray

    def shift(self, recall: float) -> float:
        """The amount added to every fc2 bias so that the predicted set keeps recall of the active mass."""
        total = max(float(self.mass.sum(dtype=np.float64)), 1e-12)
        lo, hi = -50.0, 50.0
        for _ in range(40):
            mid = (lo + hi) / 2
            kept = float(self.mass[self.logits + mid > 0].sum(dtype=np.float64)) / total
            lo, hi = (lo, mid) if kept >= recall else (mid, hi)
        return hi


def train_predictor(x: np.ndarray, act: np.ndarray, thr: float, weight: np.ndarray, rank: int, steps: int,
                     seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, RecallShift]:
    """MLP x [N, d] -> logits [N, n_ff] for act > thr; returns fc1_w, fc1_b, fc2_w, fc2_b (unshifted)
    and the validation data that sets the bias shift for a recall."""
    import torch

    g = torch.Generator().manual_seed(seed)
    n = len(x)
    perm = torch.randperm(n, generator=g)
    n_val = max(1, n // 10)
    val, trn = perm[:n_val], perm[n_val:]
    X = torch.from_numpy(x)
    Y = torch.from_numpy(act.astype(np.float32) > thr).float()
    mass = torch.from_numpy(act.astype(np.float32) * weight[None, :])  # contribution to the output
    d, n_ff = X.shape[1], Y.shape[1]
    with torch.random.fork_rng(devices=[]):  # initial weights from the seed, not the process's generator state
        torch.manual_seed(seed)
        fc1 = torch.nn.Linear(d, rank)
        fc2 = torch.nn.Linear(rank, n_ff)
    with torch.no_grad():
        fc2.bias.fill_(float(torch.logit(Y[trn].mean().clamp(1e-4, 1 - 1e-4))))
    p = float(Y[trn].mean().clamp(1e-3, 1 - 1e-3))
    loss_fn = torch.nn.BCEWithLogitsLoss(pos_weight=torch.tensor(min(20.0, 2.0 * (1 - p) / p)))
    opt = torch.optim.Adam([*fc1.parameters(), *fc2.parameters()], lr=3e-3)
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn(fc2(torch.relu(fc1(X[trn]))), Y[trn])
        loss.backward()
        opt.step()
    with torch.no_grad():
        logits = fc2(torch.relu(fc1(X[val])))  # [V, n_ff]
    return (fc1.weight.detach().numpy().copy(), fc1.bias.detach().numpy().copy(), fc2.weight.detach().numpy().copy(),
            fc2.bias.detach().numpy().copy(), RecallShift(logits.numpy().copy(), mass[val].numpy().copy()))


def at_recall(pf: PredictorFile, shifts: Sequence[RecallShift | None], recall: float) -> PredictorFile:
    """pf (as build_predictor made it, with its shifts) with each trained layer's bias set for recall."""
    if pf.mode != "predictor" or len(shifts) != pf.n_layers:
        raise InvalidArgumentError("at_recall needs a predictor-mode file and one shift (or None) per layer")
    old = float(pf.calibration.get("recall", 0.0))
    layers = tuple(lp if sh is None else replace(lp, fc2_b=(lp.fc2_b - np.float32(sh.shift(old)) + np.float32(sh.shift(recall))))
                   for lp, sh in zip(pf.layers, shifts))
    return replace(pf, layers=layers, calibration={**pf.calibration, "recall": recall})


@dataclass
class Profile:
    """A profiled corpus: the model, the profiler's per-layer samples, and the tokens held out."""

    f: GGUFFile
    cfg: ModelConfig
    tok: GGUFTokenizer
    ex: ProfilingExecutor
    tokens: int  # profiled
    source: str  # "text" | "generated"
    held_out: list[int]  # not profiled (the budget search scores them)


def _writer(f: GGUFFile, cfg: ModelConfig, n_ctx: int) -> Engine | None:
    """An engine on the native decoder to write the corpus (one token at a time: the torch
    profiler would take minutes), or None where it cannot run (the profiler writes it then)."""
    from powerinfer.coordinator.native_executor import NativeExecutor
    from powerinfer.native.decoder_lib import decoder_lib
    from powerinfer.native.decoder import supports
    from powerinfer.cpu_workers.topology import default_workers

    lib = decoder_lib()
    if lib is None or supports(f, cfg) is not None:
        return None
    return Engine(f, cfg, NativeExecutor(lib, f, cfg, n_ctx, default_workers(), max_tokens=n_ctx), n_ctx=n_ctx, n_batch=n_ctx)


def profile(model: str | Path, settings: CalibrationSettings, text: str | None = None, hold_out: float = 0.0,
            progress: Callable[[str], None] = lambda _: None) -> Profile:
    """Profile settings.tokens tokens of text (or of text the model writes itself), keeping the last
    hold_out share of them out of the profile."""
    f = GGUFFile(model)
    cfg = config_from_gguf(f)
    tok = GGUFTokenizer.from_metadata(f.metadata)
    ex = ProfilingExecutor(f, cfg, settings.window + 1, max_rows=settings.max_rows, seed=settings.seed)
    engine = Engine(f, cfg, ex, n_ctx=settings.window + 1, n_batch=settings.window + 1)
    if text is not None:
        ids = tok.encode(text, add_bos=False)
        source = "text"
        if len(ids) < 16:
            raise InvalidArgumentError(f"the calibration text has only {len(ids)} tokens; give at least 16")
    else:
        progress(f"generating {settings.tokens} calibration tokens with the model itself")
        writer = _writer(f, cfg, settings.window + 1)
        ex.recording = writer is not None  # the profiler itself writes: not recorded
        ids = generate_corpus(writer or engine, tok, settings.tokens, settings.window, settings.seed)
        ex.recording = True
        source = "generated"
    ids = ids[: settings.tokens]
    cut = len(ids) - int(len(ids) * hold_out)
    ids, held = ids[:cut], ids[cut:]
    progress(f"profiling {len(ids)} tokens")
    run_tokens(engine, windows_of(ids, settings.window, tok.bos_id if tok.add_bos else None))
    return Profile(f, cfg, tok, ex, len(ids), source, held)


def build_predictor(p: Profile, settings: CalibrationSettings, levels: Sequence[float],
                    progress: Callable[[str], None] = lambda _: None,
                    shifts: list[RecallShift | None] | None = None) -> PredictorFile:
    """The predictor file for per-layer sparsity levels (thresholds at those quantiles; in
    predictor mode each layer's MLP trained for its level, a layer at level 0 given one that fires
    every neuron; shifts, when given, receives each layer's RecallShift, None where nothing was
    trained: at_recall then moves the file to another recall without retraining)."""
    cfg = p.cfg
    if settings.mode not in ("gate", "predictor", "lowrank"):
        raise InvalidArgumentError(f"a predictor file is 'gate' or 'predictor' mode (or lowrank's), not {settings.mode!r}")
    if settings.mode == "lowrank":
        check_lowrank(cfg)
    rank = settings.rank or default_rank(cfg.d_model)
    file_mode = "gate" if settings.mode == "gate" else "predictor"
    layers = []
    for layer in range(cfg.n_layers):
        x, gate, act = p.ex.samples[layer].arrays()
        level = float(levels[layer])
        score = gate if settings.mode == "gate" else act
        thr = float(np.quantile(score.astype(np.float32), level)) if level > 0 else 0.0
        active = act.astype(np.float32) > float(np.quantile(act.astype(np.float32), level))
        norms = p.ex.down_norms(layer)
        mass = (act.astype(np.float32) * norms[None, :]).sum(0)
        shift = None
        if settings.mode != "gate" and level <= 0:
            w1, b1 = np.zeros((1, cfg.d_model), np.float32), np.zeros(1, np.float32)
            w2, b2 = np.zeros((cfg.n_ff, 1), np.float32), np.full(cfg.n_ff, FIRE_ALL_BIAS, np.float32)
        elif settings.mode == "lowrank":  # no biases: exact in PowerInfer's layout too
            if settings.rank:
                w1, w2 = gate_lowrank(p.f, cfg, layer, rank)
            else:  # the gate's own rank, measured on the profiled rows
                w1, w2, width = choose_width(p.f, cfg, layer, x.astype(np.float32), act, norms, settings.recall)
                progress(f"layer {layer + 1}/{cfg.n_layers}: low-rank width {2 * width.k} (recall {width.recall:.3f}, "
                         f"{100 * width.share:.1f}% of the neurons chosen on the profiled tokens)")
            b1, b2 = np.zeros(w1.shape[0], np.float32), np.zeros(cfg.n_ff, np.float32)
        elif settings.mode == "predictor":
            w1, b1, w2, b2, shift = train_predictor(x, act, thr, norms, rank, settings.steps, settings.seed + layer)
            b2 = b2 + np.float32(shift.shift(settings.recall))
        else:
            w1, b1 = np.zeros((0, cfg.d_model), np.float32), np.zeros(0, np.float32)
            w2, b2 = np.zeros((cfg.n_ff, 0), np.float32), np.zeros(cfg.n_ff, np.float32)
        layers.append(LayerPredictor(fc1_w=w1, fc1_b=b1, fc2_w=w2, fc2_b=b2, threshold=thr,
                                     act_freq=active.mean(0).astype(np.float32),
                                     act_mass=(mass / max(float(mass.sum()), 1e-12)).astype(np.float32)))
        if shifts is not None:
            shifts.append(shift)
        progress(f"layer {layer + 1}/{cfg.n_layers}: sparsity {level:.2f}, threshold {thr:.4g}")
    return PredictorFile(
        mode=file_mode, model_name=cfg.name, fingerprint=model_fingerprint(p.f), n_layers=cfg.n_layers,
        d_model=cfg.d_model, n_ff=cfg.n_ff, rank=max((lp.rank for lp in layers), default=0) if file_mode == "predictor" else 0,
        target_sparsity=float(np.mean(levels)),
        calibration={"source": p.source, "tokens": p.tokens, "window": settings.window, "seed": settings.seed,
                     "recall": settings.recall, "steps": settings.steps, "method": settings.mode},
        layers=tuple(layers),
    )


def calibrate(model: str | Path, settings: CalibrationSettings, text: str | None = None,
              progress: Callable[[str], None] = lambda _: None) -> PredictorFile:
    """One sparsity level for every layer (settings.sparsity); mode 'auto' is gate mode here."""
    t0 = time.perf_counter()
    if settings.mode == "auto":
        settings = replace(settings, mode="gate")
    p = profile(model, settings, text, progress=progress)
    pf = build_predictor(p, settings, [settings.sparsity] * p.cfg.n_layers, progress)
    log.info("calibrated %d layers in %.1fs", p.cfg.n_layers, time.perf_counter() - t0)
    return pf
