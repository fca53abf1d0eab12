"""`powerinfer bench --paired --workers ...`: the report's columns, from results made up here.

Runs in: the pytest process (no model is loaded).
"""

from __future__ import annotations

from powerinfer.cli.bench_scaling import ConfigResult, ScalingResult


def test_report_shows_per_rank_waiting_and_time_outside_native_code() -> None:
    configs = [
        ConfigResult("1 worker", 1, [100.0, 110.0], [500.0, 510.0], 0.1, 0.3, 0.0, 121, [0.0], 0.05),
        ConfigResult("2 workers", 2, [150.0, 160.0], [800.0, 820.0], 0.5, 9.0, 0.03, 121, [0.05, 0.01], 0.04),
        ConfigResult("in-process, 2 threads", 2, [160.0, 170.0], [900.0, 910.0]),
    ]
    text = ScalingResult("m", 64, 64, 2, configs).report()
    lines = text.splitlines()
    assert "per rank" in lines[1] and "outside" in lines[1]
    two = next(line for line in lines if line.startswith("2 workers"))
    assert two.split()[-3:] == ["3%", "5/1%", "4%"]
    inproc = next(line for line in lines if line.startswith("in-process"))
    assert inproc.split()[-3:] == ["-", "-", "-"]
    assert "imbalance of work" in text
