"""Calibration under a quality budget: greedy allocation by measured damage, bisection on held-out perplexity."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from powerinfer.errors import InvalidArgumentError
from powerinfer.sparsity.budget import MARGIN, MAX_LEVEL, STEP, allocate, calibrate_within_budget
from powerinfer.sparsity.calibrate import CalibrationSettings
from powerinfer.sparsity.perplexity import perplexity

REPO = Path(__file__).resolve().parents[2]
TEXT = " ".join(f"The {w} of the {v} went over the hill number {i}." for i, (w, v) in
                enumerate(zip(["cat", "dog", "bird", "fox", "cow", "owl"] * 12, ["king", "town", "sea", "farm", "wood", "moon"] * 12)))


def test_allocate_reaches_the_target_cheapest_layers_first() -> None:
    levels = np.round(np.arange(0.0, MAX_LEVEL + 1e-9, STEP), 4)
    # layer 0 is fragile (damage grows fast), layer 1 tolerant, layer 2 in between
    damage = np.stack([levels * 5.0, levels * 0.1, levels * 1.0])
    for target in (0.1, 0.3, 0.5):
        alloc = allocate(levels, damage, target)
        assert alloc.mean() >= target - 1e-9 and alloc.mean() < target + STEP
        assert alloc[1] >= alloc[2] >= alloc[0]
    assert (allocate(levels, damage, 0.0) == 0).all()
    assert allocate(levels, damage, 1.0).max() <= MAX_LEVEL


@pytest.mark.parametrize("arch,budget", [("llama", 0.02), ("gemma3", 0.10)])  # gemma3: the native sparse kernel's tanh GELU
def test_budget_search_stays_within_budget_on_held_out_tokens(make_model: Callable[..., Path], arch: str, budget: float) -> None:
    model = make_model(arch=arch, n_layers=2, qtype=QT.Q4_0)  # a quantized file: the native sparse kernel runs
    pf, point = calibrate_within_budget(model, CalibrationSettings(tokens=400, window=32), budget, TEXT)
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
    assert "chose gate mode" in proc.stderr and "skipped per token" in proc.stderr and out.exists()
    bad = subprocess.run([*run, "--mode", "predictor"], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "needs --sparsity" in bad.stderr and "Traceback" not in bad.stderr
