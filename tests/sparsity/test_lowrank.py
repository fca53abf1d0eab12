"""`calibrate --mode lowrank`: a predictor read off the gate's singular directions (no training, no biases).

Runs in: the pytest process, on tiny `powerinfer synth` files (gate directions of rank 4).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from powerinfer.api import LLM
from powerinfer.cli.main import main as cli_main
from powerinfer.config import config_from_gguf
from powerinfer.errors import InvalidArgumentError
from powerinfer.gguf_file import GGUFFile
from powerinfer.model.reference import weight
from powerinfer.predictors.predictor_file import read_predictor
from powerinfer.sparsity.calibrate import CalibrationSettings, calibrate
from powerinfer.sparsity import budget, timed_choice
from powerinfer.sparsity.lowrank import choose_width, gate_lowrank
from powerinfer.sparsity.relu_measure import run_layers
from powerinfer.sparsity.relu_model import ReluSparseSpec, write_relu_sparse_gguf


@pytest.fixture(scope="module")
def relu(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = ReluSparseSpec.shape("tiny", act="relu", gate_rank=4, gate_scale=1.0, logit_std=3.0)
    return write_relu_sparse_gguf(tmp_path_factory.mktemp("lowrank") / "relu.gguf", spec)


def test_the_predictor_is_the_gate_projected_on_its_leading_directions(relu: Path) -> None:
    f = GGUFFile(relu)
    cfg = config_from_gguf(f)
    fc1, fc2 = gate_lowrank(f, cfg, 0, 16)
    assert fc1.shape == (16, cfg.d_model) and fc2.shape == (cfg.n_ff, 16)
    g = weight(f, "blk.0.ffn_gate.weight", np.float32)
    x = np.random.default_rng(0).standard_normal((8, cfg.d_model)).astype(np.float32)
    v = fc1[:8].T  # [d, k], orthonormal
    np.testing.assert_allclose(v.T @ v, np.eye(8), atol=1e-4)
    np.testing.assert_allclose(np.maximum(x @ fc1.T, 0) @ fc2.T, x @ v @ v.T @ g.T, rtol=1e-4, atol=1e-4)
    # on the model's own FFN inputs the sign of the rank-8 gate is the gate's for nearly every neuron
    a = next(run_layers(f, cfg, np.random.default_rng(1).integers(0, 256, (4, 64))))
    fired, predicted = a.gate > 0, (np.maximum(a.ffn_in @ fc1.T, 0) @ fc2.T) > 0
    recall = (fired & predicted).sum() / fired.sum()
    assert recall > 0.9 and predicted.mean() < 2 * fired.mean(), (recall, predicted.mean(), fired.mean())


def test_calibrate_lowrank_runs_sparse_and_exports_to_powerinfer(relu: Path, tmp_path: Path) -> None:
    pred = tmp_path / "lr.predictor"
    assert cli_main(["calibrate", "-m", str(relu), "-o", str(pred), "--mode", "lowrank", "--sparsity", "0.89", "--rank", "16",
                     "--tokens", "256"]) == 0
    pf = read_predictor(pred)
    assert pf.mode == "predictor" and pf.rank == 16 and pf.calibration["method"] == "lowrank"
    assert all(not lp.fc1_b.any() and not lp.fc2_b.any() for lp in pf.layers)
    with LLM(relu, executor="inprocess", n_ctx=64, predictor=pred) as llm:
        ids = llm.tokenize("Hello, sparse world")
        sparse = llm.logits(ids)
        llm.engine.executor.set_sparse(dense=True)  # type: ignore[attr-defined]
        dense = llm.logits(ids)
    assert (sparse.argmax(1) == dense.argmax(1)).mean() >= 0.9
    # bias-free, so PowerInfer's layout holds it exactly: our engine runs the export with the same choices
    out = tmp_path / "relu.powerinfer.gguf"
    assert cli_main(["convert", str(relu), "--predictor", str(pred), "--powerinfer", "--outtype", "f32", "-o", str(out)]) == 0
    x = np.random.default_rng(2).standard_normal((64, pf.d_model)).astype(np.float32)
    with LLM(out, executor="inprocess", n_ctx=64) as llm:
        assert llm.predictor is not None and llm.predictor.mode == "predictor"
        for ours, theirs in zip(pf.layers, llm.predictor.layers):  # the norm folded out and back: the same choices
            assert (ours.predict(x) == theirs.predict(x)).mean() > 0.999
        # an F32 file (the Q4_0 values decoded) on the F32 kernels: the same greedy choices up to their rounding
        assert (llm.logits(ids).argmax(1) == sparse.argmax(1)).mean() >= 0.9


def test_refused_where_the_gate_sign_says_nothing(make_model, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    silu = make_model(arch="llama", n_layers=1)
    with pytest.raises(InvalidArgumentError, match="gated ReLU-family"):
        calibrate(silu, CalibrationSettings(mode="lowrank", sparsity=0.8, tokens=32, window=32))
    assert cli_main(["calibrate", "-m", str(silu), "-o", str(tmp_path / "p.predictor"), "--mode", "lowrank"]) == 2  # no --sparsity


@pytest.mark.parametrize("gate_rank,k", [(4, 16), (24, 32)])
def test_the_width_is_the_least_that_keeps_the_recall(tmp_path: Path, gate_rank: int, k: int) -> None:
    spec = ReluSparseSpec.shape("tiny", act="relu", gate_rank=gate_rank, gate_scale=1.0, logit_std=3.0, n_layers=1)
    f = GGUFFile(write_relu_sparse_gguf(tmp_path / "g.gguf", spec))
    cfg = config_from_gguf(f)
    a = next(run_layers(f, cfg, np.random.default_rng(1).integers(0, 256, (4, 64))))
    act = np.maximum(a.gate, 0) * a.up
    fc1, fc2, width = choose_width(f, cfg, 0, a.ffn_in, act, np.ones(cfg.n_ff, np.float32), 0.97)
    # a gate of rank 24 needs more than 16 directions; 4 needs the fewest tried
    assert width.k == k and width.recall >= 0.97 and fc1.shape == (2 * k, cfg.d_model) and fc2.shape == (cfg.n_ff, 2 * k)
    assert width.share < 2 * float((a.gate > 0).mean())


RELU_TEXT = " ".join(f"The cat {i} of the moon went over hill number {i * 7}." for i in range(60))


def test_the_budget_search_tries_the_low_rank_predictor_first(relu: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = CalibrationSettings(mode="auto", tokens=400, window=32, steps=20)
    said: list[str] = []
    monkeypatch.setattr(timed_choice, "decode_speedup", lambda *a, **k: 1.5)  # timed on this machine in the product
    pf, point = budget.calibrate_within_budget(relu, settings, 0.1, RELU_TEXT, progress=said.append)
    assert point.mode == "lowrank" and "chose lowrank mode" in point.report() and "1.50x gate mode's speed" in point.note
    assert pf.mode == "predictor" and pf.calibration["method"] == "lowrank" and point.sparse_layers > 0
    assert all(not lp.fc1_b.any() for lp in pf.layers) and any("low-rank width" in s for s in said)
    assert not any("predictor mode at recall" in s for s in said)  # nothing trained
    assert point.sparse_ppl <= point.dense_ppl * (1 + budget.MARGIN * 0.1) + 1e-9
    # slower than gate mode here: not kept, and the trained predictors are tried next
    monkeypatch.setattr(timed_choice, "decode_speedup", lambda *a, **k: 0.5)
    said.clear()
    pf, point = budget.calibrate_within_budget(relu, settings, 0.1, RELU_TEXT, progress=said.append)
    assert point.mode == pf.mode == "gate" and "low-rank predictor at these levels" in point.note and "0.50x" in point.note
    assert any("predictor mode at recall" in s for s in said)


def test_a_predictor_as_fast_as_gate_mode_within_the_noise_is_kept_when_more_accurate() -> None:
    from powerinfer.sparsity.timed_choice import SPEED_MARGIN, rejection

    def kept(speed: float, more_accurate: bool) -> bool:
        return rejection("p", 1.0, 1.01, 0.01, speed, ", so gate mode", more_accurate=more_accurate) == ""

    assert kept(SPEED_MARGIN, False) and kept(1.2, False)  # faster: kept whatever its accuracy
    assert kept(0.97, True) and kept(1.0 / SPEED_MARGIN, True)  # a tie within the timing's noise: the more accurate
    assert not kept(0.97, False) and not kept(0.9, True)  # a tie goes to gate mode; clearly slower is never kept
    assert "0.95x and more accurate" in rejection("p", 1.0, 1.01, 0.01, 0.97, "", more_accurate=False)
    assert "over the budget" in rejection("p", 1.02, 1.01, 0.01, 2.0, "", more_accurate=True)  # the aim first
    assert not kept(0.5, True)
    assert rejection("p", 1.0, 1.01, 0.01, None, "") == ""  # untimed (not 'auto'): the aim alone


def test_calibrate_lowrank_without_sparsity_searches_the_budget(relu: Path, tmp_path: Path) -> None:
    pred = tmp_path / "lr.predictor"
    text = tmp_path / "t.txt"
    text.write_text(RELU_TEXT)
    assert cli_main(["calibrate", "-m", str(relu), "-o", str(pred), "--mode", "lowrank", "--text", str(text), "--tokens", "400",
                     "--max-ppl-increase", "0.1"]) == 0  # 80 held-out tokens: a wide interval
    pf = read_predictor(pred)
    assert pf.calibration["method"] == "lowrank" and "budget" in pf.calibration
