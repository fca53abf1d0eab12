"""The load test's summary statistics (powerinfer/devtools/harness/loadtest.py), on made-up samples."""

from __future__ import annotations

from pathlib import Path

from powerinfer.devtools.harness.loadtest import Run, Sample, main, summarize


def test_p90_is_never_below_the_median_and_stream_speed_leaves_out_the_first_token() -> None:
    run = Run(samples=[Sample(True, ttft=0.1, tokens=5, seconds=0.5), Sample(True, ttft=0.055, tokens=5, seconds=0.455)], wall=1.0)
    s = summarize(1, run)
    assert s["ttft_p90_s"] == 0.1 >= s["ttft_median_s"]
    assert abs(s["stream_tok_s_median"] - 4 / 0.4) < 1e-9  # 4 tokens after the first, in the 0.4 s after it
    ten = Run(samples=[Sample(True, ttft=0.01 * i, tokens=2, seconds=1.0) for i in range(1, 11)], wall=1.0)
    assert summarize(1, ten)["ttft_p90_s"] == 0.09


def test_a_bad_plot_path_is_refused_before_any_request(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["--url", "http://127.0.0.1:1", "--plot", str(tmp_path / "no" / "x.png")]) == 1
    assert "does not exist" in capsys.readouterr().err
