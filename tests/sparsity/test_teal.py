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
from powerinfer.sparsity.teal import SITES, InputSparsity, input_curve

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
    assert abs(pts[1].increase) > abs(pts[0].increase)
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
    assert "(readable model)" in out and out.count("\ninput ") == 2
