"""Input sparsity on the readable model (sparsity/teal.py) and `sparsity-curve --modes input`."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from powerinfer.cli.sparsity_cmds import run_sparsity_curve
from powerinfer.config import config_from_gguf
from powerinfer.errors import InvalidArgumentError
from powerinfer.gguf_file import GGUFFile
from powerinfer.model.reference import logits
from powerinfer.sparsity.teal import SITES, InputSparsity
from powerinfer.sparsity.teal_curve import input_curve
from powerinfer.sparsity.teal_greedy import LEVELS, Sensitivity, allocate, measure

TEXT = " ".join(f"The {w} of the {v} went over the hill number {i}." for i, (w, v) in
                enumerate(zip(["cat", "dog", "bird", "fox", "cow", "owl"] * 8, ["king", "town", "sea", "farm", "wood", "moon"] * 8)))
OTHER = " ".join(f"Item {i}: {n} apples cost {n * 3} coins at the market on day {i % 7}." for i, n in enumerate(range(3, 60, 2)))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_dense_scores_equal_the_readable_model(make_model: Callable[..., Path], arch: str) -> None:
    m = InputSparsity(make_model(arch=arch))
    ids = m.windows(TEXT, 48, 48)[0]
    total, n, zeros = m.run([ids])
    z = logits(GGUFFile(m.f.path), config_from_gguf(m.f), ids)[:-1]  # float64 oracle
    logz = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
    want = float((logz - z[np.arange(len(ids) - 1), ids[1:]]).sum())
    assert n == len(ids) - 1 and not zeros.any()
    assert total == pytest.approx(want, rel=1e-4)


def test_thresholds_zero_their_share_and_cost_quality(make_model: Callable[..., Path]) -> None:
    m = InputSparsity(make_model())
    win = m.windows(TEXT, 64, 512)
    samples: dict[tuple[int, str], list[np.ndarray]] = {}
    dense, n, _ = m.run(win, collect=samples)
    assert set(samples) == {(i, s) for i in range(m.cfg.n_layers) for s in SITES}
    n_tok = sum(len(w) for w in win)
    for level in (0.3, 0.7):
        total, _, zeros = m.run(win, m.thresholds(samples, level))
        share = zeros / n_tok  # scored on the calibration text itself
        assert abs(share[0, 0] - level) < 0.02  # the first site sees the dense inputs it was calibrated on
        assert np.all(np.abs(share - level) < 0.2), share  # later ones, inputs already shifted by the earlier skips
        assert total != dense
    assert np.all(m.thresholds(samples, 0.0) < 0)  # level 0 skips nothing, not even exact zeros


def test_input_curve_points(make_model: Callable[..., Path]) -> None:
    pts = input_curve(make_model(), TEXT, OTHER, [0.1, 0.6], n_ctx=64, tokens=512, max_tokens=256)
    assert [p.level for p in pts] == [0.1, 0.6]
    assert all(math.isfinite(p.ppl) and p.dense_ppl == pts[0].dense_ppl for p in pts)
    assert 0.0 < pts[0].skipped_share < pts[1].skipped_share < 1.0
    # a random synthetic model's perplexity is near its vocabulary size, so which level scores worse is
    # noise; that damage grows with the level is tested on the KL (test_sensitivity_...)
    assert pts[0].ppl != pts[0].dense_ppl and pts[1].ppl != pts[0].ppl
    f = GGUFFile(make_model())
    assert pts[0].layer_bytes == sum(i.nbytes for i in f.tensors.values() if i.name.startswith("blk.") and len(i.shape) == 2)
    with pytest.raises(InvalidArgumentError, match="levels"):
        input_curve(make_model(), TEXT, OTHER, [0.0])


def test_cli_input_mode(make_model: Callable[..., Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    calib, held = tmp_path / "calib.txt", tmp_path / "held.txt"
    calib.write_text(TEXT)
    held.write_text(OTHER)
    argv = ["-m", str(make_model()), "--calib", str(calib), "--held-out", str(held), "--targets", "0.2,0.5", "--modes", "input",
            "--tokens", "256", "--max-tokens", "128"]
    assert run_sparsity_curve(argv) == 0
    out = capsys.readouterr().out
    assert "(readable model)" in out and out.count("\ninput   ") == 2
    assert "input operating point" in out or "input: no point within" in out
    assert run_sparsity_curve([*argv[:-6], "--modes", "input,input-greedy", "--tokens", "256", "--max-tokens", "128"]) == 0
    out = capsys.readouterr().out
    assert out.count("\ninput-greedy   ") == 2 and out.count("\ninput   ") == 2
    # one operating point per mode, in its own unit
    assert sum(f"\n{m} operating point" in out or f"\n{m}: no point" in out for m in ("input", "input-greedy")) == 2
    assert "% sparsity," not in out


def _sens(kl: np.ndarray, site_bytes: np.ndarray) -> Sensitivity:
    return Sensitivity(LEVELS, kl, site_bytes)


def test_greedy_allocation_spares_the_fragile_sites() -> None:
    L = len(LEVELS)
    lv = np.array(LEVELS)
    kl = np.tile(lv ** 2, (2, 4, 1))  # [2 layers, 4 sites, L]: every site equally cheap ...
    kl[1, 0] = 10 * lv  # ... but layer 1's qkv, ten times dearer from the first step
    b = np.array([[4.0, 1.0, 2.0, 1.0], [4.0, 1.0, 2.0, 1.0]])
    prev = np.zeros((2, 4))
    for target in (0.1, 0.3, 0.5, 0.6):
        a = allocate(_sens(kl, b), target)
        assert (a * b).sum() >= target * b.sum() - 1e-9  # reaches the target ...
        assert (a * b).sum() <= target * b.sum() + lv[-1] * b.max()  # ... by at most one move more
        assert a[1, 0] <= a[0, 0] and a[1, 0] < a.max()  # the fragile site goes last
        assert np.all(a >= prev)  # one greedy path: a larger target only adds moves
        prev = a
    assert set(np.unique(allocate(_sens(kl, b), 0.3))) <= {0.0, *LEVELS}
    assert np.allclose(allocate(_sens(kl, b), lv[-1]), lv[-1])  # the top of the ladder: everything at it
    with pytest.raises(InvalidArgumentError, match="greedy target"):
        allocate(_sens(kl, b), 0.0)
    with pytest.raises(InvalidArgumentError, match="greedy target"):
        allocate(_sens(kl, b), lv[-1] + 0.05)
    assert kl.shape[2] == L


def test_greedy_allocation_follows_a_curve_that_is_not_convex() -> None:
    # site (0, 0) costs 1.0 at its first level and nothing more after it: per byte, its top level is
    # cheaper than the other sites' steady cost, so it jumps there rather than being left at 0
    lv = np.array(LEVELS)
    kl = np.tile(3.0 * lv, (1, 4, 1))
    kl[0, 0] = 1.0
    b = np.ones((1, 4))
    a = allocate(_sens(kl, b), 0.3)
    assert a[0, 0] == lv[-1]


def test_sensitivity_is_measured_for_every_layer_site_and_level(make_model: Callable[..., Path]) -> None:
    m = InputSparsity(make_model())
    samples: dict[tuple[int, str], list[np.ndarray]] = {}
    m.run(m.windows(TEXT, 64, 256), collect=samples)
    ids = m.windows(TEXT, 48, 48)[0]
    seen: list[str] = []
    sens = measure(m, ids, samples, levels=(0.2, 0.8), progress=seen.append)
    assert sens.kl.shape == (m.cfg.n_layers, len(SITES), 2) and np.all(sens.kl >= 0)
    assert (sens.kl[:, :, 1] > sens.kl[:, :, 0]).mean() >= 0.75  # more zeroed inputs, more damage, nearly everywhere
    assert np.all(sens.kl[:, :, 1] > 0)
    assert sens.site_bytes.shape == (m.cfg.n_layers, len(SITES)) and len(seen) == m.cfg.n_layers
    with pytest.raises(InvalidArgumentError, match="ladder"):
        measure(m, ids, samples, levels=(0.5, 0.2))
    with pytest.raises(InvalidArgumentError, match="2 tokens"):
        measure(m, ids[:1], samples)


def test_greedy_input_curve_reaches_its_byte_targets(make_model: Callable[..., Path]) -> None:
    pts = input_curve(make_model(), TEXT, OTHER, [0.2, 0.5], n_ctx=64, tokens=512, max_tokens=256, allocation="greedy", sens_tokens=48)
    for p in pts:  # held-out text: the share skipped lands near the calibrated target
        assert abs(p.skipped_share - p.level) < 0.12, (p.level, p.skipped_share)
        assert math.isfinite(p.ppl)
    with pytest.raises(InvalidArgumentError, match="allocation"):
        input_curve(make_model(), TEXT, OTHER, [0.2], allocation="best")
    with pytest.raises(InvalidArgumentError, match="at most"):
        input_curve(make_model(), TEXT, OTHER, [0.9], allocation="greedy")
