"""`powerinfer bench --paired --workers ...`: the report's columns, from results made up here, and
one sparse run on a tiny model.

Runs in: the pytest process (and, for the run, its worker processes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

from powerinfer.cpu_workers.topology import read_topology, split_threads
from powerinfer.devtools.harness.bench_scaling import ConfigResult, ScalingResult, compare_scaling


def test_report_shows_per_rank_waiting_and_time_outside_native_code() -> None:
    configs = [
        ConfigResult("1 worker", 1, [100.0, 110.0], [500.0, 510.0], 0.1, 0.3, 0.0, 121, [0.0], 0.05),
        ConfigResult("2 workers", 2, [150.0, 160.0], [800.0, 820.0], 0.5, 9.0, 0.03, 121, [0.05, 0.01], 0.04),
        ConfigResult("in-process, 2 threads", 2, [160.0, 170.0], [900.0, 910.0]),
    ]
    text = ScalingResult("m", None, 64, 64, 2, configs).report()
    lines = text.splitlines()
    assert "per rank" in lines[1] and "outside" in lines[1]
    two = next(line for line in lines if line.startswith("2 workers"))
    assert two.split()[-3:] == ["3%", "5/1%", "4%"]
    inproc = next(line for line in lines if line.startswith("in-process"))
    assert inproc.split()[-3:] == ["-", "-", "-"]
    assert "imbalance of work" in text


@pytest.mark.slow
def test_sparse_scaling_runs_every_configuration_sparse(make_model: Callable[..., Path], tmp_path: Path) -> None:
    """--paired --predictor: each configuration (the default executor at each thread count, single-thread
    ranks, in process) loads the predictor, so the ratios compare sparse with sparse."""
    from powerinfer.predictors.predictor_file import write_predictor
    from powerinfer.sparsity.calibrate import CalibrationSettings, calibrate

    model = make_model(arch="llama", n_layers=2)
    pred = tmp_path / "m.predictor"
    write_predictor(pred, calibrate(model, CalibrationSettings(mode="gate", sparsity=0.8, tokens=32, window=32, steps=1)))
    res = compare_scaling(str(model), [1, 2], prompt_tokens=8, gen_tokens=2, rounds=2, predictor=str(pred))
    w, t = split_threads(read_topology(), 2)  # this machine's default layout of 2 threads (a worker per node and cache)
    two = f"-t 2: {w} worker{'s' if w > 1 else ''} x {t} thread{'s' if t > 1 else ''}"
    other = "2 workers x 1 thread" if t > 1 else "1 worker x 2 threads"  # the other layout of the same threads
    assert [c.name for c in res.configs] == ["-t 1: 1 worker x 1 thread", two, other, "in-process, 2 threads"]
    assert [c.threads for c in res.configs] == [1, 2, 2, 2]  # the threads each ran
    assert all(len(c.decode_tps) == 2 and min(c.decode_tps) > 0 for c in res.configs)
    assert res.report().splitlines()[0].startswith(f"model: {res.model}  sparse: {pred}")
