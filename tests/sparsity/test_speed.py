"""`powerinfer bench --vs-dense`: dense and sparse engines side by side, paired per round.

Runs in: the pytest process (in-process engines on a tiny synthetic model) and one CLI child.
Speed is never asserted: the figures must be measured (positive, consistent with each other).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from powerinfer.errors import InvalidArgumentError
from powerinfer.sparsity.calibrate import CalibrationSettings, calibrate
from powerinfer.predictors.predictor_file import write_predictor
from powerinfer.sparsity.speed import compare_decode

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_and_predictor(make_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    model = make_model(arch="llama", n_layers=2)
    path = tmp_path_factory.mktemp("speed") / "m.predictor"
    # 80%: the native decoder runs a layer sparsely only below 25% of its neurons active
    write_predictor(path, calibrate(model, CalibrationSettings(mode="gate", sparsity=0.8, tokens=32, window=32, steps=1)))
    return model, path


def test_compare_decode_measures_both(model_and_predictor: tuple[Path, Path]) -> None:
    model, pred = model_and_predictor
    cmp = compare_decode(str(model), str(pred), threads=1, prompt_tokens=8, gen_tokens=4, rounds=4, read_bytes=True)
    assert cmp.mode == "gate" and cmp.rounds == 4 and cmp.gen_tokens == 4
    assert cmp.dense_tps > 0 and cmp.sparse_tps > 0
    assert cmp.ratio_p25 <= cmp.ratio_median <= cmp.ratio_p75
    assert 0 <= cmp.sparse_faster_rounds <= 4
    assert 0 < cmp.decode_share < 1  # the sparse engine really skipped neurons
    assert cmp.llama_cpp_tps is None
    # bytes: the sparse rule reads less than every matrix, and no more than the FFNs it skips
    assert cmp.dense_bytes is not None and cmp.sparse_bytes is not None and 0 < cmp.sparse_bytes < cmp.dense_bytes
    assert cmp.read_bandwidth_gbs is not None and cmp.read_bandwidth_gbs > 0
    assert cmp.prompt_tokens == 8 and cmp.prefill_ratio_median is not None and cmp.prefill_ratio_median > 0
    assert cmp.memory_mib is not None and cmp.memory_mib[0] > 0 and cmp.memory_mib[1] > 0
    # a gate-rule file: the replay's step is timed, but there is no predictor to time or to score
    assert cmp.replay_step_us is not None and cmp.replay_step_us > 0 and cmp.predictor_us is None and cmp.recall is None
    text = cmp.report()
    assert "recall" not in text
    assert "sparse / dense, paired per round" in text and f"{cmp.dense_tps:.1f}" in text
    assert "weights read per decode step: dense" in text and "prefill of 8 tokens" in text and "PSS" in text
    with pytest.raises(InvalidArgumentError, match="at least 2 rounds"):
        compare_decode(str(model), str(pred), rounds=1)


def test_cli(model_and_predictor: tuple[Path, Path], tmp_path: Path) -> None:
    model, pred = model_and_predictor
    out = tmp_path / "cmp.json"
    cmd = [sys.executable, str(REPO / "launch.py"), "bench", "-m", str(model), "--executor", "inprocess", "--workers", "1",
           "--prompt-tokens", "8", "--gen-tokens", "2", "--rounds", "2"]
    proc = subprocess.run([*cmd, "--predictor", str(pred), "--vs-dense", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "decode tokens/s (median): dense" in proc.stdout
    data = json.loads(out.read_text())
    assert data["sparse_tps"] > 0 and np.isfinite(data["ratio_median"])
    proc = subprocess.run([*cmd, "--vs-dense"], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "give it --predictor" in proc.stderr and "Traceback" not in proc.stderr
    proc = subprocess.run([*cmd, "--predictor", str(pred), "--sparse"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "GB/s" in proc.stdout and "streaming read bandwidth" in proc.stdout, proc.stderr
    proc = subprocess.run([*cmd, "--predictor", str(pred), "--vs-dense", "--rounds", "1"], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "at least 2 rounds" in proc.stderr and "Traceback" not in proc.stderr
    proc = subprocess.run([*cmd, "--predictor", str(pred), "--sparse", "--vs-powerinfer", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "give -m a PowerInfer file" in proc.stderr and "Traceback" not in proc.stderr
    proc = subprocess.run([*cmd, "--predictor", str(pred), "--sparse", "--powerinfer-model", str(model)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "give --vs-powerinfer" in proc.stderr and "Traceback" not in proc.stderr
    proc = subprocess.run([*cmd, "--predictor", str(pred), "--vs-llama-cpp"], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "give --vs-dense" in proc.stderr and "Traceback" not in proc.stderr


def test_llama_cpp_side_by_side(tmp_path: Path) -> None:
    pytest.importorskip("llama_cpp")
    from powerinfer.sparsity.relu_model import ReluSparseSpec, write_relu_sparse_gguf

    model = write_relu_sparse_gguf(tmp_path / "tiny.gguf", ReluSparseSpec.shape("tiny"))  # a file llama.cpp runs
    pred = tmp_path / "tiny.predictor"
    write_predictor(pred, calibrate(model, CalibrationSettings(mode="gate", sparsity=0.8, tokens=32, window=32, steps=1)))
    cmp = compare_decode(str(model), str(pred), threads=1, prompt_tokens=8, gen_tokens=4, rounds=2, llama_cpp=True)
    assert cmp.llama_cpp_tps is not None and cmp.llama_cpp_tps > 0 and cmp.sparse_vs_llama_cpp is not None
    assert "llama.cpp (llama-cpp-python) on the same file" in cmp.report()


def test_llama_cpp_missing_is_a_clear_error(model_and_predictor: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from powerinfer.errors import PowerInferError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    model, pred = model_and_predictor
    with pytest.raises(PowerInferError, match="needs llama-cpp-python"):
        compare_decode(str(model), str(pred), threads=1, prompt_tokens=8, gen_tokens=2, rounds=2, llama_cpp=True)
