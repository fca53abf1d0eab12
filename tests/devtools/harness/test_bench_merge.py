"""`powerinfer bench --merge`'s two micro-benchmarks (cli/bench_merge.py) between real processes:
the merge, and the GPU rank's hand-off against a stand-in GPU rank; each rank process checks the
numbers it ends with, so a hand-off that loses or repeats a run fails here.

Runs in: the pytest process, with the rank processes it starts.
"""

from __future__ import annotations

import pytest

from powerinfer.devtools.harness.bench_merge import WARMUP, bench_handoff, bench_merge
from powerinfer.native.decoder_lib import decoder_lib

pytestmark = pytest.mark.skipif(decoder_lib() is None, reason="no C compiler: the native pool is unavailable")


def test_merge_bench_reports_its_latencies() -> None:
    mb = bench_merge(ranks=2, syncs=2000)
    assert mb.kind == "merge" and mb.syncs == 2000 and 0 < mb.median_us <= mb.p99_us
    assert "latency per sync: median" in mb.report()


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_handoff_bench_runs_every_hand_off_once(ranks: int) -> None:
    hb = bench_handoff(ranks=ranks, runs=WARMUP + 300)
    assert hb.kind == "handoff" and hb.ranks == ranks and 0 < hb.median_us <= hb.p99_us
    assert f"{ranks} CPU rank processes and a stand-in GPU rank process" in hb.report()
