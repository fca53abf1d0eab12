"""Calibration, sparse FFN execution and perplexity on a synthetic model (fast), plus the real SmolLM2."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from powerinfer.api import LLM
from powerinfer.errors import InvalidArgumentError
from powerinfer.sparsity.calibrate import CalibrationSettings, calibrate
from powerinfer.sparsity.perplexity import decode_perplexity, perplexity
from powerinfer.predictors.predictor_file import read_predictor, write_predictor

TEXT = "The quick brown fox jumps over the lazy dog. " * 20
IDS = [256, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]


@pytest.fixture(scope="module")
def model(make_model: Callable[..., Path]) -> Path:
    return make_model(arch="llama", n_layers=2)


@pytest.mark.parametrize("mode", ["predictor", "gate"])
def test_calibrate_writes_a_loadable_predictor(model: Path, tmp_path: Path, mode: str) -> None:
    pf = calibrate(model, CalibrationSettings(mode=mode, sparsity=0.5, tokens=64, window=32, steps=30))
    assert pf.mode == mode and pf.n_layers == 2 and pf.n_ff == 160 and len(pf.layers) == 2
    for lp in pf.layers:
        assert lp.threshold > 0 and lp.act_freq.shape == (160,)
        assert 0.3 < float(lp.act_freq.mean()) < 0.7  # calibrated for half the (token, neuron) pairs
        assert abs(float(lp.act_mass.sum()) - 1.0) < 1e-4
    path = tmp_path / f"m.{mode}.predictor"
    write_predictor(path, pf)
    # the torch sparse shards (the native decoder runs layers this dense, 50% active, densely:
    # tests/native/test_sparse_layers.py)
    llm = LLM(model, n_ctx=64, executor="inprocess", predictor=path, native=False)
    logits = llm.logits(IDS)
    assert np.isfinite(logits).all()
    llm.complete(IDS, max_tokens=6, temperature=0)  # decode path: gathered rows only
    share = llm.engine.executor.decode_share()  # type: ignore[attr-defined]
    # random synthetic weights are not sparse: the gate rule skips about half, a predictor that must
    # keep 97% of the activation mass skips little
    assert 0 < share < (0.8 if mode == "gate" else 1.0)


def test_sparse_matches_dense_when_nothing_is_skipped(model: Path, tmp_path: Path) -> None:
    pf = calibrate(model, CalibrationSettings(mode="gate", sparsity=0.5, tokens=32, window=32, steps=1))
    dense = LLM(model, n_ctx=64, executor="inprocess").logits(IDS)
    llm = LLM(model, n_ctx=64, executor="inprocess", predictor=_save(pf, tmp_path), native=False)  # the torch sparse shards
    llm.engine.executor.set_sparse(dense=True)  # type: ignore[attr-defined]
    forced = llm.logits(IDS)
    # same packed gate/up as the dense path; only the float16 down rows (vs its packed down) differ
    assert np.linalg.norm(forced - dense) / np.linalg.norm(dense) < 0.01
    llm.engine.executor.set_sparse(dense=False, oracle=True)  # type: ignore[attr-defined]
    oracle = llm.logits(IDS)
    llm.engine.executor.set_sparse(oracle=False)  # type: ignore[attr-defined]
    gated = llm.logits(IDS)
    # the oracle keeps the true active set; it stays at least as close to dense as the gate rule
    assert np.linalg.norm(oracle - forced) <= np.linalg.norm(gated - forced) * 1.01


def test_sparse_prefill_equals_decode_token_by_token(make_model: Callable[..., Path], tmp_path: Path) -> None:
    """Prefill and decode sum each token's active down rows the same way: the logits agree to the bit.

    On an F16 file, whose torch linears are bf16: an F32 file's are float32 (exact), where a batch's
    GEMM and a token's GEMV round differently and a neuron at the gate threshold may then flip."""
    model = make_model(arch="llama", n_layers=2, qtype=GGMLQuantizationType.F16)
    pf = calibrate(model, CalibrationSettings(mode="gate", sparsity=0.5, tokens=32, window=32, steps=1))
    llm = LLM(model, n_ctx=64, executor="inprocess", predictor=_save(pf, tmp_path), native=False)  # the torch sparse shards
    full = llm.logits(IDS)
    llm.engine.rewind(0)
    llm.engine.eval(IDS[:2])
    steps = np.concatenate([llm.engine.eval([t]) for t in IDS[2:]])
    # the best logits of each row are refined in float32 (the rest are bf16-rounded head outputs)
    assert (steps.argmax(1) == full[2:].argmax(1)).all()
    np.testing.assert_allclose(steps.max(1), full[2:].max(1), rtol=0, atol=1e-4)  # attention paths differ by rounding only


def test_perplexity_reports_both_and_layer_quality(model: Path, tmp_path: Path) -> None:
    pf = calibrate(model, CalibrationSettings(mode="predictor", sparsity=0.4, tokens=64, window=32, steps=30))
    rep = perplexity(model, TEXT, pf, n_ctx=32, max_tokens=96)
    assert rep.tokens > 60 and rep.dense_ppl > 1 and rep.sparse_ppl is not None and rep.sparse_ppl > 1
    assert len(rep.layers) == 2
    for q in rep.layers:
        assert 0 <= q.recall <= 1 and 0 <= q.precision <= 1 and 0 < q.sparsity < 1


def test_the_decode_path_scores_token_by_token_what_the_batched_pass_scores(model: Path, tmp_path: Path) -> None:
    """--decode-path: every token its own step of the engine generation uses (here the native
    decoder): the dense figure is the batched pass's up to float rounding, and a sparse one comes."""
    pf = calibrate(model, CalibrationSettings(mode="predictor", sparsity=0.4, tokens=64, window=32, steps=30))
    dense, sparse, kind = decode_perplexity(model, TEXT, _save(pf, tmp_path), n_ctx=32, max_tokens=96)
    batched = perplexity(model, TEXT, None, n_ctx=32, max_tokens=96)
    assert abs(dense / batched.dense_ppl - 1) < 1e-3 and sparse is not None and sparse > 1 and kind
    assert decode_perplexity(model, TEXT, None, n_ctx=32, max_tokens=96)[1] is None
    for bad in (dict(n_ctx=1), dict(max_tokens=-3)):
        with pytest.raises(InvalidArgumentError):
            decode_perplexity(model, TEXT, None, **bad)  # type: ignore[arg-type]


def test_bad_settings_and_no_sparse(model: Path, tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError):
        CalibrationSettings(sparsity=1.5)
    with pytest.raises(InvalidArgumentError):
        CalibrationSettings(mode="magic")
    pf = calibrate(model, CalibrationSettings(mode="gate", sparsity=0.5, tokens=32, window=32, steps=1))
    llm = LLM(model, n_ctx=64, executor="inprocess", predictor=_save(pf, tmp_path), sparse=False)
    assert llm.predictor is not None and not llm.sparse


def test_worker_processes_run_sparse_shards(model: Path, tmp_path: Path) -> None:
    pf = calibrate(model, CalibrationSettings(mode="predictor", sparsity=0.5, tokens=64, window=32, steps=30))
    path = _save(pf, tmp_path)
    oracle = LLM(model, n_ctx=64, executor="inprocess", n_shards=2, predictor=path).logits(IDS)
    # the torch shards over ZeroMQ (the native ranks' sparse path: tests/coordinator/test_native_pool.py)
    llm = LLM(model, n_ctx=64, n_threads=2, worker_threads=1, pin=False, predictor=path, transport="zmq")
    try:
        np.testing.assert_allclose(llm.logits(IDS), oracle, atol=1e-3, rtol=0)
    finally:
        llm.close()


def _save(pf, tmp_path: Path) -> Path:  # type: ignore[no-untyped-def]
    path = tmp_path / "p.predictor"
    write_predictor(path, pf)
    assert read_predictor(path).n_layers == pf.n_layers
    return path
