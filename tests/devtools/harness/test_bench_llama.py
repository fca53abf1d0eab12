"""`powerinfer bench --vs-llama-cpp` (dense): paired rounds against llama.cpp on the same file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from powerinfer.devtools.harness.bench_llama import compare_llama_cpp, paired

REPO = Path(__file__).resolve().parents[3]


def test_paired_ratio_is_the_median_of_per_round_ratios() -> None:
    p = paired([10.0, 30.0, 20.0], [10.0, 10.0, 40.0])  # per round 1.0, 3.0, 0.5
    assert p.ratio == 1.0 and p.ours_tps == 20.0 and p.llama_cpp_tps == 10.0 and p.ours_faster_rounds == 1


def test_side_by_side_on_a_file_llama_cpp_runs(tmp_path: Path) -> None:
    pytest.importorskip("llama_cpp")
    from powerinfer.sparsity.relu_model import ReluSparseSpec, write_relu_sparse_gguf

    model = write_relu_sparse_gguf(tmp_path / "tiny.gguf", ReluSparseSpec.shape("tiny"))
    vs = compare_llama_cpp(str(model), threads=1, prompt_tokens=16, gen_tokens=4, rounds=2)
    assert vs.executor == "native" and vs.prompt_tokens == 16
    assert vs.decode.ours_tps > 0 and vs.decode.llama_cpp_tps > 0 and vs.prefill.ratio > 0
    assert vs.weight_bytes_per_token > 0 and vs.read_bandwidth_gbs > 0
    text = vs.report()
    assert "ours / llama.cpp paired" in text and "GB/s" in text
    out = tmp_path / "vs.json"
    proc = subprocess.run([sys.executable, str(REPO / "launch.py"), "bench", "-m", str(model), "--executor", "inprocess", "--workers", "1",
                           "--prompt-tokens", "8", "--gen-tokens", "2", "--rounds", "2", "--vs-llama-cpp", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text())["decode"]["ratio"] > 0


def test_profile_splits_a_decode_step(make_model) -> None:  # type: ignore[no-untyped-def]
    from gguf import GGMLQuantizationType as QT

    from powerinfer.devtools.harness.bench_profile import profile_decode
    from powerinfer.native.decoder_lib import PHASES

    prof = profile_decode(str(make_model(arch="llama", qtype=QT.Q4_0, n_layers=2)), threads=1, prompt_tokens=4, gen_tokens=8)
    assert set(prof.phases_us) == set(PHASES) and all(v >= 0 for v in prof.phases_us.values())
    assert prof.head_us > 0 and prof.rest_us > 0 and prof.sampling_us > 0
    assert abs(sum(prof.phases_us.values()) + prof.head_us + prof.sampling_us + prof.rest_us - prof.step_us) < 1e-6 * prof.step_us
    assert "the engine's Python per layer" in prof.report()
