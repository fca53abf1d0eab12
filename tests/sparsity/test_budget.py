"""Calibration under a quality budget: greedy allocation by measured damage, bisection on held-out perplexity."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from powerinfer.errors import InvalidArgumentError
from powerinfer.native.sparse_layers import down_t_row_bytes
from powerinfer.sparsity import timed_choice
from powerinfer.sparsity.allocation import MAX_LEVEL, STEP, ZERO_MARGIN, damage_table, zero_ceilings
from powerinfer.sparsity.budget import (MARGIN, MIN_LEVEL, Z_UPPER, BudgetPoint, Scored, calibrate_within_budget, ffn_read_bytes,
                                        predictor_bytes)
from powerinfer.sparsity.calibrate import FIRE_ALL_BIAS, CalibrationSettings, RecallShift, at_recall, build_predictor, default_rank, profile
from powerinfer.sparsity.relu_model import ReluSparseSpec, write_relu_sparse_gguf
from powerinfer.sparsity.perplexity import perplexity

REPO = Path(__file__).resolve().parents[2]
TEXT = " ".join(f"The {w} of the {v} went over the hill number {i}." for i, (w, v) in
                enumerate(zip(["cat", "dog", "bird", "fox", "cow", "owl"] * 12, ["king", "town", "sea", "farm", "wood", "moon"] * 12)))


def test_a_candidate_keeps_the_aim_only_at_the_upper_end_of_its_interval() -> None:
    """Scored: the perplexity from the mean, the upper end from the paired per-token differences'
    standard error; a candidate that measures within the aim by less than its noise is not kept."""
    rng = np.random.default_rng(0)
    dense = rng.gamma(2.0, 1.5, 4000)  # per-token nll, mean ~3
    limit = math.exp(dense.mean()) * 1.01  # an aim of +1%
    exact = Scored.against(dense, dense + 0.009)  # +0.9% on every token alike: no noise, kept
    assert exact.upper == pytest.approx(exact.ppl) and exact.within(limit)
    assert exact.ppl == pytest.approx(math.exp(dense.mean() + 0.009))
    noise = rng.normal(0.0, 0.15, 4000)
    noisy = Scored.against(dense, dense + 0.009 + noise - noise.mean())  # the same mean cost, +-0.15 a token
    se = float(noise.std(ddof=1)) / math.sqrt(4000)
    assert noisy.upper / noisy.ppl == pytest.approx(math.exp(Z_UPPER * se))
    assert noisy.ppl <= limit and not noisy.within(limit)  # within the aim as measured, not at 95%
    with pytest.raises(ValueError):
        Scored.against(dense, dense[:-1])


def test_ffn_read_bytes_counts_what_the_native_decoder_reads() -> None:
    n_ff, d = 1024, 256
    rows = [(144, 144, 576)]  # Q4_0 rows: gate and up [n_ff, d] 8 blocks, down [d, n_ff] 32 blocks
    full = n_ff * (144 + 144) + d * 576
    q8_down_row = d // 32 * 34
    for mode in ("gate", "predictor"):  # below 0.75 a layer runs dense whatever it chooses
        assert ffn_read_bytes(mode, [0.7], [0.3], n_ff, d, rows, [10_000]) == (full, 0)
    # gate mode: every gate row and the dense down streamed (above DOWN_MAX_SHARE, 15%, active), the chosen up rows
    assert ffn_read_bytes("gate", [0.8], [0.2], n_ff, d, rows) == (n_ff * 144 + d * 576, int(0.2 * n_ff * 144))
    # at 5% active the down projection comes from the Q8_0 neuron-major copy: 5% of n_ff rows of d outputs
    assert ffn_read_bytes("gate", [0.95], [0.05], n_ff, d, rows) == (n_ff * 144, int(0.05 * n_ff * 144 + 0.05 * n_ff * q8_down_row))
    # predictor mode: only the chosen gate rows, plus the predictor's own Q8_0 bytes streamed
    pb = predictor_bytes(40, d, n_ff)
    assert pb == 64 * q8_down_row + n_ff * 2 * 34  # rank 40 padded to 64
    assert ffn_read_bytes("predictor", [0.95], [0.05], n_ff, d, rows, [pb]) == (pb, int(0.05 * n_ff * 288 + 0.05 * n_ff * q8_down_row))
    # a 4-bit file's neuron-major copy is Q4_0: 18 bytes a block of its rows
    q4_down_row = down_t_row_bytes(d, QT.Q4_0)
    assert q4_down_row == d // 32 * 18
    assert ffn_read_bytes("gate", [0.95], [0.05], n_ff, d, rows, (), MIN_LEVEL, [q4_down_row]) == (
        n_ff * 144, int(0.05 * n_ff * 144 + 0.05 * n_ff * q4_down_row))
    point = BudgetPoint("gate", 0.0, (0.0, 0.0), 10.0, 10.0, 100, 0, 1000)
    assert point.sparse_layers == 0 and "changes nothing" in point.report()


@pytest.mark.parametrize("arch,budget", [("llama", 0.02), ("gemma3", 0.10)])  # gemma3: the native sparse kernel's tanh GELU
def test_budget_search_stays_within_budget_on_held_out_tokens(make_model: Callable[..., Path], arch: str, budget: float) -> None:
    model = make_model(arch=arch, n_layers=2, qtype=QT.Q4_0)  # a quantized file: the native sparse kernel runs
    pf, point = calibrate_within_budget(model, CalibrationSettings(mode="gate", tokens=400, window=32), budget, TEXT, min_level=0.0)
    assert pf.mode == "gate" and len(point.levels) == 2 and all(0 <= v <= MAX_LEVEL for v in point.levels)
    assert point.sparse_ppl <= point.dense_ppl * (1 + MARGIN * budget) + 1e-9
    assert math.isclose(pf.target_sparsity, point.sparsity) and 0 <= point.skipped_bytes < point.ffn_bytes
    # the file's thresholds give the same held-out perplexity when scored from scratch
    held = TEXT  # the whole text: the search scored its last fifth
    rep = perplexity(model, held, pf, n_ctx=33)
    assert rep.sparse_ppl is not None and rep.sparse_ppl <= rep.dense_ppl * (1 + budget) * 1.5
    assert "chose gate mode" in point.report()


def test_budget_refuses_bad_settings(make_model: Callable[..., Path]) -> None:
    model = make_model(arch="llama", n_layers=2)
    with pytest.raises(InvalidArgumentError, match="budget"):
        calibrate_within_budget(model, CalibrationSettings(tokens=64, window=32), 0.0, TEXT)
    with pytest.raises(InvalidArgumentError, match="held-out"):
        calibrate_within_budget(model, CalibrationSettings(tokens=40, window=32), 0.02, TEXT)


def test_cli_calibrate_defaults_to_the_budget_and_checks_flags(make_model: Callable[..., Path], tmp_path: Path) -> None:
    model = str(make_model(arch="llama", n_layers=2))
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    out = tmp_path / "p.predictor"
    run = [sys.executable, str(REPO / "launch.py"), "calibrate", "-m", model, "-o", str(out), "--text", str(text), "--tokens", "400"]
    proc = subprocess.run(run, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    # gate mode, or trained predictors where they decode faster here (timed, so either)
    assert re.search("chose (gate|predictor) mode", proc.stderr) and "skipped per token" in proc.stderr and out.exists()
    for flags, says in ((["--mode", "bogus"], "invalid choice"), (["--sparsity", "1.5"], "sparsity must be in (0, 1)")):
        bad = subprocess.run([*run, *flags], capture_output=True, text=True, timeout=300)
        assert bad.returncode != 0 and says in bad.stderr and "Traceback" not in bad.stderr, bad.stderr


@pytest.fixture(scope="module")
def relu3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny planted ReLU-sparse llama (~89% of the neurons inactive per token), 3 layers."""
    return write_relu_sparse_gguf(tmp_path_factory.mktemp("relu") / "tiny3.gguf", ReluSparseSpec.shape("tiny", n_layers=3))


@pytest.fixture(scope="module")
def reglu3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """relu3 with ReGLU's exact zeros (the file declares relu)."""
    return write_relu_sparse_gguf(tmp_path_factory.mktemp("reglu") / "tiny3.gguf", ReluSparseSpec.shape("tiny", n_layers=3, act="relu"))


RELU_TEXT = " ".join(f"The cat {i} of the moon went over hill number {i * 7}." for i in range(80))


@pytest.mark.slow
def test_budget_in_predictor_mode_trains_the_sparse_layers_and_keeps_the_budget(relu3: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_speedup = timed_choice.decode_speedup
    settings = CalibrationSettings(mode="predictor", tokens=600, window=32, steps=60)
    pf, point = calibrate_within_budget(relu3, settings, 0.1, RELU_TEXT)
    assert point.sparse_layers == 3 and all(v >= MIN_LEVEL for v in point.levels)
    assert point.mode == pf.mode == "predictor" and "gate mode at these levels" in point.note
    assert point.sparse_ppl <= point.dense_ppl * (1 + MARGIN * 0.1) + 1e-9
    assert all(lp.rank == default_rank(128) for lp in pf.layers) and "chose predictor mode" in point.report()
    again, _ = calibrate_within_budget(relu3, settings, 0.1, RELU_TEXT)  # the same seed trains the same predictors
    assert all(np.array_equal(a.fc2_w, b.fc2_w) for a, b in zip(pf.layers, again.layers))
    # gate mode stops at the same levels and trains nothing
    gpf, gpoint = calibrate_within_budget(relu3, replace(settings, mode="gate"), 0.1, RELU_TEXT)
    assert gpf.mode == gpoint.mode == "gate" and gpoint.note == "" and gpoint.levels == point.levels
    # auto keeps the predictors only where they decode faster than gate mode, timed here (decode_speedup, stood in for)
    for speed, mode in ((0.8, "gate"), (1.3, "predictor")):
        monkeypatch.setattr(timed_choice, "decode_speedup", lambda *a, speed=speed, **k: speed)
        apf, apoint = calibrate_within_budget(relu3, replace(settings, mode="auto"), 0.1, RELU_TEXT)
        assert apf.mode == apoint.mode == mode and f"at {speed:.2f}x gate mode's speed here (measured" in apoint.note, apoint.note
    # the timing itself: the same rule against itself decodes at about 1x (wide bounds: a loaded machine)
    p = profile(relu3, replace(settings, mode="gate"), RELU_TEXT)
    assert 0.2 < real_speedup(p, gpf, gpf, list(range(1, 17)), rounds=2, steps=4) < 5


def test_gate_thresholds_stop_at_a_relu_layers_exact_zeros(reglu3: Path, make_model: Callable[..., Path]) -> None:
    """On an activation with exact zeros the ceilings lie a margin below each layer's zero share,
    where the threshold is exactly 0; the budget search stays under them, so gate mode changes
    nothing the dense model computes, even with a budget that would allow more."""
    settings = CalibrationSettings(mode="gate", tokens=400, window=32)
    p = profile(reglu3, settings, RELU_TEXT)
    levels, _ = damage_table(p)
    ceiling = zero_ceilings(p, levels, MIN_LEVEL)
    assert ceiling is not None
    zeros = []
    for layer, top in enumerate(ceiling):
        g = p.ex.samples[layer].arrays()[1].astype(np.float32)
        zeros.append(float((g == 0).mean()))
        assert 0.8 < zeros[-1] < 0.95 and zeros[-1] - ZERO_MARGIN - STEP < top <= zeros[-1] - ZERO_MARGIN + 1e-9
        assert float(np.quantile(g, top)) == 0.0 and float(np.quantile(g, top + STEP)) > 0.0
    # a layer whose zeros do not reach the least sparse level gets no ceiling: only cuts make it sparse, if the budget allows
    high = max(zeros) + ZERO_MARGIN  # a least level above every layer's zeros
    assert list(zero_ceilings(p, levels, high)) == [MAX_LEVEL] * 3
    pf, point = calibrate_within_budget(reglu3, settings, 0.5, RELU_TEXT)  # +50%: far past what the zeros give
    assert point.sparse_layers == 3 and all(v <= c + 1e-9 for v, c in zip(point.levels, ceiling)), (point.levels, ceiling)
    assert all(lp.threshold == 0.0 for lp in pf.layers)
    assert math.isclose(point.sparse_ppl, point.dense_ppl, rel_tol=1e-4), (point.sparse_ppl, point.dense_ppl)
    # the bytes skipped are the zeros' up rows at least (gate, up and down of one type: a third each), not the lower levels'
    zeros = float(np.mean([(p.ex.samples[i].arrays()[1] == 0).mean() for i in range(3)]))
    assert point.skipped_bytes >= zeros * point.ffn_bytes / 3 > float(np.mean(point.levels)) * point.ffn_bytes / 3
    # an activation without exact zeros has no ceiling
    silu = profile(make_model(arch="llama", n_layers=2), settings, TEXT)
    assert zero_ceilings(silu, damage_table(silu)[0], MIN_LEVEL) is None


def test_a_dense_layer_of_a_predictor_mode_file_fires_every_neuron(relu3: Path) -> None:
    settings = CalibrationSettings(mode="predictor", tokens=200, window=32, steps=20)
    p = profile(relu3, settings, RELU_TEXT)
    pf = build_predictor(p, settings, [0.0, 0.9, 0.0])
    x = p.ex.samples[0].arrays()[0].astype(np.float32)
    assert pf.layers[0].rank == 1 and pf.layers[0].predict(x).all() and float(pf.layers[0].fc2_b[0]) == FIRE_ALL_BIAS
    assert pf.layers[1].rank == default_rank(128) and pf.rank == pf.layers[1].rank
    assert not pf.layers[1].predict(p.ex.samples[1].arrays()[0].astype(np.float32)).all()
    with pytest.raises(InvalidArgumentError, match="'gate' or 'predictor'"):
        build_predictor(p, replace(settings, mode="auto"), [0.0] * 3)
    # a higher recall only moves the trained layers' biases: more neurons chosen, the same weights
    shifts: list[RecallShift | None] = []
    low = build_predictor(p, replace(settings, recall=0.9), [0.0, 0.9, 0.0], shifts=shifts)
    assert shifts[0] is None and shifts[2] is None and shifts[1] is not None
    high = at_recall(low, shifts, 0.999)
    x1 = p.ex.samples[1].arrays()[0].astype(np.float32)
    assert high.layers[1].predict(x1).mean() > low.layers[1].predict(x1).mean() and high.calibration["recall"] == 0.999
    assert np.array_equal(high.layers[1].fc2_w, low.layers[1].fc2_w) and high.layers[0] is low.layers[0]
    back = at_recall(high, shifts, 0.9)
    assert np.allclose(back.layers[1].fc2_b, low.layers[1].fc2_b, atol=1e-5)
