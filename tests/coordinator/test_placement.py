"""Placement solver: budget respected, optimal on small cases, deterministic, cached, layer-split baseline."""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from powerinfer.config import config_from_gguf
from powerinfer.errors import InvalidArgumentError
from powerinfer.gguf_file import GGUFFile
from powerinfer.coordinator.placement import LayerCosts, cached_neuron_split, layer_costs, solve_layer_split, solve_neuron_split
from powerinfer.predictors.predictor_file import LayerPredictor, PredictorFile


def predictor(masses: np.ndarray) -> PredictorFile:
    n_layers, n_ff = masses.shape
    layers = tuple(
        LayerPredictor(fc1_w=np.zeros((0, 8), np.float32), fc1_b=np.zeros(0, np.float32), fc2_w=np.zeros((n_ff, 0), np.float32),
                       fc2_b=np.zeros(n_ff, np.float32), threshold=0.1, act_freq=np.clip(m * 4, 0, 1).astype(np.float32),
                       act_mass=(m / m.sum()).astype(np.float32))
        for m in masses
    )
    return PredictorFile(mode="gate", model_name="m", fingerprint="f" * 64, n_layers=n_layers, d_model=8, n_ff=n_ff, rank=0,
                         target_sparsity=0.5, calibration={"source": "test"}, layers=layers)


def test_budget_respected_and_hot_neurons_first() -> None:
    rng = np.random.default_rng(0)
    masses = rng.pareto(1.5, size=(4, 64)) + 1e-3
    pf = predictor(masses)
    costs = LayerCosts(np.full(4, 1000, np.int64), np.full(4, 10, np.int64))
    pl = solve_neuron_split(pf, costs, budget=4000 + 10 * 100, n_gpu_layers=4)
    assert pl.used <= pl.budget and sum(len(h) for h in pl.hot) == 100
    assert all(pl.gpu_layers)
    # every chosen neuron is at least as valuable (per byte) as every neuron left out
    values = np.stack([lp.act_mass / lp.act_mass.sum() for lp in pf.layers])
    chosen = np.zeros_like(values, dtype=bool)
    for i, h in enumerate(pl.hot):
        chosen[i, h] = True
    assert values[chosen].min() >= values[~chosen].max()
    assert 0 < pl.mass_on_gpu < 1


def test_optimal_against_brute_force_with_unequal_costs() -> None:
    pf = predictor(np.array([[5.0, 1.0, 3.0], [4.0, 4.0, 0.5]]))
    costs = LayerCosts(np.array([2, 2], np.int64), np.array([3, 2], np.int64))
    values = np.stack([lp.act_mass / lp.act_mass.sum() for lp in pf.layers]) / 2
    for budget in range(4, 20):
        pl = solve_neuron_split(pf, costs, budget, 2)
        best = 0.0
        for pick in itertools.product([0, 1], repeat=6):
            p = np.array(pick).reshape(2, 3)
            if 4 + (p * costs.per_neuron[:, None]).sum() <= budget:
                best = max(best, float((p * values).sum()))
        # greedy by density: optimal up to one neuron (the knapsack's integrality gap)
        assert pl.mass_on_gpu >= best - values.max() - 1e-9
        assert pl.used <= budget


def test_ngl_limits_layers_and_fixed_costs_drop_layers() -> None:
    pf = predictor(np.ones((3, 16)))
    costs = LayerCosts(np.array([100, 100, 100], np.int64), np.full(3, 1, np.int64))
    pl = solve_neuron_split(pf, costs, budget=10_000, n_gpu_layers=2)
    assert pl.gpu_layers == (True, True, False) and len(pl.hot[2]) == 0
    pl = solve_neuron_split(pf, costs, budget=150, n_gpu_layers=3)  # only one layer's attention fits
    assert pl.gpu_layers == (True, False, False) and len(pl.hot[0]) == 16 and pl.used <= 150
    with pytest.raises(InvalidArgumentError):
        solve_neuron_split(pf, costs, budget=0, n_gpu_layers=3)


def test_deterministic_and_layer_split_baseline() -> None:
    pf = predictor(np.random.default_rng(1).random((5, 32)) + 0.1)
    costs = LayerCosts(np.full(5, 50, np.int64), np.full(5, 4, np.int64))
    a, b = solve_neuron_split(pf, costs, 600, 5), solve_neuron_split(pf, costs, 600, 5)
    assert all(np.array_equal(x, y) for x, y in zip(a.hot, b.hot))
    ls = solve_layer_split(32, costs, 600, 5)
    assert ls.gpu_layers == (True, True, True, False, False) and ls.used == 3 * (50 + 4 * 32)
    # at the same budget the neuron split serves more activation mass than whole layers
    assert a.mass_on_gpu > ls.mass_on_gpu


def test_cache_beside_the_model(make_model: Callable[..., Path], tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(make_model(arch="llama").read_bytes())
    f = GGUFFile(model)
    cfg = config_from_gguf(f)
    pf = predictor(np.random.default_rng(2).random((cfg.n_layers, cfg.n_ff)) + 0.1)
    costs = layer_costs(f, cfg, n_ctx=64)
    assert (costs.per_neuron > 0).all() and (costs.fixed > 0).all() and costs.overhead > 0
    budget = int(costs.overhead + costs.fixed.sum() + costs.per_neuron.sum() * 40)
    first = cached_neuron_split(model, f, cfg, pf, budget, 2, 64)
    assert (tmp_path / "m.gguf.gpuidx.json").exists()
    again = cached_neuron_split(model, f, cfg, pf, budget, 2, 64)
    assert all(np.array_equal(x, y) for x, y in zip(first.hot, again.hot))
    other = cached_neuron_split(model, f, cfg, pf, budget // 2, 2, 64)  # another budget: re-solved
    assert other.used <= budget // 2 < first.used
    (tmp_path / "m.gguf.gpuidx.json").write_text("{garbage")
    assert cached_neuron_split(model, f, cfg, pf, budget, 2, 64, reset=False).used == first.used


def test_seventy_b_shape_solves(capsys: pytest.CaptureFixture[str]) -> None:
    # 80 layers x 28672 neurons: runs in well under a second; printed, never asserted
    pf = predictor(np.random.default_rng(3).pareto(1.2, size=(80, 28672)) + 1e-4)
    costs = LayerCosts(np.full(80, 300 << 20, np.int64), np.full(80, 3 * 8192 * 9 // 16, np.int64))
    t = time.perf_counter()
    pl = solve_neuron_split(pf, costs, 24 << 30, 80)
    print(f"70B-shaped placement: {time.perf_counter() - t:.2f}s, {pl.mass_on_gpu:.1%} of mass on GPU")
    assert pl.used <= 24 << 30


def test_solvers_never_exceed_random_budgets() -> None:
    # property test: random shapes, costs, masses, budgets and -ngl; the bytes used are exactly the
    # priced ones and never more than the budget; attention is a prefix, hot neurons only in taking-part layers
    rng = np.random.default_rng(11)
    for trial in range(300):
        n_layers, n_ff = int(rng.integers(1, 6)), int(rng.integers(1, 40))
        costs = LayerCosts(rng.integers(0, 500, n_layers).astype(np.int64), rng.integers(1, 30, n_layers).astype(np.int64),
                           int(rng.integers(0, 300)), rng.integers(0, 100, n_layers).astype(np.int64) if trial % 2 else None)
        pf = predictor(rng.pareto(1.0, size=(n_layers, n_ff)) + 1e-6) if trial % 3 else None
        whole = int(costs.overhead + costs.fixed.sum() + costs.first_neuron().sum() + n_ff * costs.per_neuron.sum())
        budget, ngl = int(rng.integers(1, whole + 50)), int(rng.integers(0, n_layers + 2))
        for pl in (solve_neuron_split(pf, costs, budget, ngl, n_ff=n_ff), solve_layer_split(n_ff, costs, budget, ngl)):
            assert pl.used <= budget
            gpu = np.array(pl.gpu_layers)
            assert gpu.sum() <= ngl and not np.any(np.diff(gpu.astype(int)) > 0)  # a prefix of the layers
            placed = gpu.any() or any(len(h) for h in pl.hot)
            priced = (costs.overhead if placed else 0) + int(costs.fixed[gpu].sum())
            priced += sum(int(c) * len(h) + (int(first) if len(h) else 0) for c, first, h in zip(costs.per_neuron, costs.first_neuron(), pl.hot))
            assert pl.used == priced
            for i, h in enumerate(pl.hot):
                assert (len(h) == 0 or i < ngl) and np.all(np.diff(h) > 0) and (len(h) == 0 or (h.min() >= 0 and h.max() < n_ff))
            if whole <= budget and ngl >= n_layers:
                assert all(len(h) == n_ff for h in pl.hot) and all(pl.gpu_layers)  # everything fits: everything is placed
