"""The GPU check's own code paths, dry-run on the numpy backend so that the one run on a GPU machine
does not die of a Python mistake: every kernel case, the benchmark on a tiny ReLU model, the table.

Runs in: the pytest process (the benchmark starts GPU worker processes on the CPU backend).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from powerinfer.gpu_worker.backend import CpuBackend
from powerinfer.devtools.harness.gpu_bench import Row, run_benchmark, run_worker_overhead
from powerinfer.devtools.harness.gpu_check import _print_table, _quant_cases, _small_cases


def test_every_kernel_case_runs_on_the_numpy_backend() -> None:
    rng = np.random.default_rng(0)
    cases = [*_quant_cases(rng), *_small_cases(rng)]
    assert len(cases) == 3 * 9 + 7
    for name, case in cases:
        out = case(CpuBackend(1 << 30))
        assert out and all(o.size and np.isfinite(o).all() for o in out), name
        again = case(CpuBackend(1 << 30))
        assert all(np.array_equal(a, b) for a, b in zip(out, again)), name  # deterministic inputs


def test_benchmark_dry_run_on_a_tiny_relu_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = run_benchmark(tmp_path, "tiny", 2, "F32", 0.0015, 3, backend="cpu")
    by_case = {r.case: r for r in rows}
    for split in ("neuron", "layer"):
        assert by_case[f"{split} split placement"].ok is True  # within the budget
        assert "decode" in by_case[f"{split} split speed"].value
    assert "x decode speed" in by_case["neuron vs layer split"].value
    _print_table([*rows, Row("x", "y", "z", False)])
    assert "FAIL" in capsys.readouterr().out


@pytest.mark.slow
def test_worker_overhead_dry_run(tmp_path: Path) -> None:
    rows = run_worker_overhead(tmp_path, 2, backend="cpu", n_layers=2)
    by_case = {r.case: r.value for r in rows}
    assert "2 layers Q4_0" in by_case["model"]
    for name in ("all on the GPU: GPU worker process, 2 requests a layer", "all on the GPU: GPU worker process, LAYERS",
                 "all on the GPU: GPU runtime in-process", "all on the GPU: GPU worker as a rank of the pool",
                 "1 layers on the GPU: hybrid, LAYERS", "1 layers on the GPU: pool with a GPU rank",
                 "neuron split (every attention, some neurons): hybrid", "neuron split (every attention, some neurons): pool with a GPU rank"):
        assert by_case[f"{name} decode"].count(" / ") == 1 and by_case[f"{name} decode"].endswith("tokens/s")
    for ratio in ("LAYERS vs 2 requests a layer", "in-process vs LAYERS", "GPU rank vs LAYERS, all layers", "GPU rank vs LAYERS, 1 layers",
                  "neuron split: GPU rank vs hybrid"):
        assert "x decode speed" in by_case[ratio]
