"""Planted-sparsity llama files: they load as plain llama, run, and show the planted sparsity.

Runs in: the pytest process. Only the "tiny" shape (a few hundred KB, well under a second each).
"""

from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from powerinfer.api import LLM
from powerinfer.config import config_from_gguf
from powerinfer.errors import InvalidArgumentError
from powerinfer.gguf_file import GGUFFile
from powerinfer.model.reference import rms_norm, weight
from powerinfer.cli.main import main as cli_main
from powerinfer.sparsity.relu_measure import SparsityStats, fit_predictors, measure_sparsity, run_layers
from powerinfer.sparsity.relu_model import ReluSparseSpec, firing_probabilities, write_relu_sparse_gguf
from powerinfer.model.reference import logits as reference_logits

IDS = [256, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 10, 65, 66, 67, 1, 2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_relu_sparse_gguf(tmp_path_factory.mktemp("relu") / "tiny.gguf", ReluSparseSpec.shape("tiny"))


@pytest.fixture(scope="module")
def stats(tiny: Path) -> SparsityStats:
    # Another seed than the writer's calibration tokens: the plant must generalize to new tokens.
    return measure_sparsity(tiny, n_tokens=256, seed=1)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_loads_as_plain_llama(tiny: Path) -> None:
    f = GGUFFile(tiny)
    cfg = config_from_gguf(f)
    spec = ReluSparseSpec.shape("tiny")
    assert (cfg.arch, cfg.n_layers, cfg.d_model, cfg.n_ff) == ("llama", spec.n_layers, spec.d_model, spec.n_ff)
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.vocab_size) == (spec.n_heads, spec.n_kv_heads, spec.head_dim, 259)
    assert cfg.tied_embeddings and cfg.activation == "silu"
    assert f.tensor("blk.0.ffn_gate.weight").qtype == QT.Q4_0
    assert f.tensor("blk.1.ffn_down.weight").shape == (spec.d_model, spec.n_ff)
    assert f.tensor("token_embd.weight").qtype == QT.Q8_0
    assert f.tensor("blk.0.attn_norm.weight").shape == (spec.d_model,)
    # llama.cpp refuses a gpt2 tokenizer without a merges key.
    assert list(f.get("tokenizer.ggml.merges")) == ["\u0120 \u0120"]


def test_runs_in_the_engine(tiny: Path) -> None:
    with LLM(tiny, executor="inprocess", n_ctx=64) as llm:
        logits = llm.logits(llm.tokenize("Hello, sparse world"))
        assert logits.shape[1] == 259 and np.isfinite(logits).all()
        assert llm.tokenize("a   ", add_bos=False) == [ord("a"), 258, ord(" ")]  # the one merge
        chunks = list(llm.generate("Hi", max_tokens=4, temperature=0))
        assert chunks[-1].finish_reason is not None


def test_measurement_forward_matches_the_reference(tiny: Path) -> None:
    """measure_sparsity runs the readable model in float32: its logits match the float64 one."""
    f = GGUFFile(tiny)
    cfg = config_from_gguf(f)
    *_, last = run_layers(f, cfg, np.array([IDS]))
    ours = rms_norm(last.residual[0], weight(f, "output_norm.weight"), cfg.norm_eps) @ weight(f, "token_embd.weight").T
    ref = reference_logits(f, cfg, IDS)
    assert np.linalg.norm(ours - ref) / np.linalg.norm(ref) < 1e-4


def test_planted_sparsity(stats: SparsityStats) -> None:
    target = ReluSparseSpec.shape("tiny").inactive_fraction
    assert len(stats.layers) == 2
    for layer in stats.layers:
        assert abs(layer.inactive - target) <= 0.05, layer
        assert abs(layer.gate_negative - target) <= 0.03, layer  # what the plant calibrates
        assert layer.hot_mass_share > 0.6, layer
        assert layer.hot_event_share > 0.6, layer
        assert sum(layer.freq_hist) == ReluSparseSpec.shape("tiny").n_ff
        # Skewed, not uniform: many neurons (nearly) never fire, some fire for most tokens.
        assert layer.freq_hist[0] + layer.freq_hist[1] > 0.2 * sum(layer.freq_hist)
        assert layer.freq_hist[-1] + layer.freq_hist[-2] > 0
    assert abs(stats.mean_inactive - target) <= 0.05 and "frequency histogram" in stats.format()


def test_denser_target_is_followed(tmp_path: Path) -> None:
    path = write_relu_sparse_gguf(tmp_path / "dense.gguf", ReluSparseSpec.shape("tiny", inactive_fraction=0.7, hot_share=0.6, n_layers=1))
    assert abs(measure_sparsity(path, n_tokens=128, seed=3).layers[0].inactive - 0.7) <= 0.05


def test_deterministic_for_a_seed(tiny: Path, tmp_path: Path) -> None:
    again = write_relu_sparse_gguf(tmp_path / "again.gguf", ReluSparseSpec.shape("tiny"))
    other = write_relu_sparse_gguf(tmp_path / "other.gguf", ReluSparseSpec.shape("tiny", seed=1))
    assert sha(again) == sha(tiny)
    assert sha(other) != sha(tiny)


@pytest.mark.parametrize("qtype", [QT.F16, QT.Q8_0])
def test_other_types(tmp_path: Path, qtype: QT) -> None:
    path = write_relu_sparse_gguf(tmp_path / "m.gguf", ReluSparseSpec.shape("tiny", qtype=qtype, n_layers=1, vocab=300))
    f = GGUFFile(path)
    assert f.tensor("blk.0.ffn_up.weight").qtype == qtype
    assert config_from_gguf(f).vocab_size == 300
    assert abs(measure_sparsity(path, n_tokens=128).layers[0].inactive - 0.89) <= 0.05


def test_firing_probabilities() -> None:
    p = firing_probabilities(5632, 0.11, 0.2, 0.8)
    assert np.all(np.diff(p) <= 0) and p.max() <= 0.95 and p.min() > 0
    assert p.mean() == pytest.approx(0.11, rel=1e-3)
    assert p[: round(0.2 * p.size)].sum() / p.sum() == pytest.approx(0.8, abs=1e-3)


def test_shapes_and_validation() -> None:
    s = ReluSparseSpec.shape("tinyllama-1.1b")
    assert (s.n_layers, s.d_model, s.n_ff, s.n_heads, s.n_kv_heads, s.head_dim) == (22, 2048, 5632, 32, 4, 64)
    s = ReluSparseSpec.shape("llama2-7b", qtype=QT.F16)
    assert (s.n_layers, s.d_model, s.n_ff, s.n_kv_heads, s.qtype) == (32, 4096, 11008, 32, QT.F16)
    with pytest.raises(InvalidArgumentError):
        ReluSparseSpec.shape("gpt-5")
    with pytest.raises(InvalidArgumentError):
        ReluSparseSpec.shape("tiny", qtype=QT.Q6_K)
    with pytest.raises(InvalidArgumentError):
        ReluSparseSpec.shape("tiny", d_model=100)
    with pytest.raises(InvalidArgumentError):
        ReluSparseSpec.shape("tiny", hot_fraction=0.01, hot_share=0.9)


def test_synth_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli.gguf"
    assert cli_main(["synth", "-o", str(out), "--shape", "tiny", "--quant", "q8_0", "--act", "drelu", "--measure-layers", "1",
                     "--measure-tokens", "640"]) == 0
    text = capsys.readouterr().out
    assert out.exists() and "inactive" in text and "frequency histogram" in text and "rank-32 predictor recall" in text
    cfg = config_from_gguf(GGUFFile(out))
    assert cfg.activation == "drelu" and GGUFFile(out).tensor("blk.0.ffn_up.weight").qtype == QT.Q8_0
    # logits spread like a trained model's (a few units), not sqrt(d) apart
    np.testing.assert_allclose(weight(GGUFFile(out), "output_norm.weight"), 3.0 / np.sqrt(cfg.d_model), rtol=1e-6)
    assert cli_main(["synth", "-o", str(tmp_path / "bad.gguf"), "--shape", "tiny", "--sparsity", "1.5"]) == 2
    assert "error:" in capsys.readouterr().err
    assert cli_main(["synth", "-o", str(tmp_path / "no" / "dir.gguf"), "--shape", "tiny"]) == 1
    assert "error:" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # argparse's own usage error
        cli_main(["synth", "-o", str(tmp_path / "bad.gguf"), "--shape", "tiny", "--act", "gelu"])
    assert e.value.code == 2


@pytest.mark.parametrize("act", ["relu", "drelu"])
def test_relu_families_are_exactly_sparse_and_learnable(tmp_path: Path, act: str) -> None:
    """ReGLU / dReLU files: ~89% of act(gate) * up exactly zero per token, the hot fifth carrying most
    firings, and with a low-rank gate subspace a rank-32 predictor catches >= 95% of the nonzero
    neurons on tokens it did not see; with full-rank random gates the same predictor does worse."""
    spec = ReluSparseSpec.shape("tiny", act=act, gate_rank=4, gate_scale=1.0)
    path = write_relu_sparse_gguf(tmp_path / "m.gguf", spec)
    assert config_from_gguf(GGUFFile(path)).activation == act
    for layer in measure_sparsity(path, n_tokens=512, seed=1).layers:
        assert abs(layer.exact_zero - 0.89) <= 0.04, layer
        assert layer.hot_event_share > 0.7, layer
    learnable = fit_predictors(path, rank=32, n_tokens=1024, layers=1, seed=2)[0]
    random = fit_predictors(write_relu_sparse_gguf(tmp_path / "r.gguf", replace(spec, gate_rank=0)), rank=32,
                            n_tokens=1024, layers=1, seed=2)[0]
    assert learnable.recall >= 0.95 and learnable.precision > random.precision + 0.1, (learnable, random)


def test_oracle_sparse_output_equals_dense(tiny: Path, tmp_path: Path) -> None:
    """The true active set, computed sparsely, gives the dense output while skipping most neurons.

    "True active": |act(gate) * up| above 1e-5; the plant's inactive neurons (silu of a gate below
    -gate_scale) sit near 2e-6. Against the same shards computing every neuron: greedy tokens
    identical, each row's best logit (refined in float32) equal to float32 rounding (measured
    3e-5 on logits near 105, as with thresholds down to 1e-6), the rest within bf16 rounding,
    while over 70% of neurons are skipped per decode step (measured 74%). Dropping the weakly
    active neurons too (the gate rule at 1e-2: 84% skipped) moves the logits ~300x more, so the
    comparison can fail.
    """
    from powerinfer.sparsity.calibrate import CalibrationSettings, calibrate
    from powerinfer.predictors.predictor_file import write_predictor

    pf = calibrate(tiny, CalibrationSettings(mode="gate", sparsity=0.85, tokens=64, window=32, steps=1))
    paths = {}
    for name, thr in (("oracle", 1e-5), ("coarse", 1e-2)):
        paths[name] = tmp_path / f"{name}.predictor"
        write_predictor(paths[name], replace(pf, layers=tuple(replace(lp, threshold=thr) for lp in pf.layers)))
    out: dict[str, tuple[np.ndarray, list[int], float]] = {}
    for name, dense, oracle in (("dense", True, False), ("oracle", False, True), ("coarse", False, False)):
        with LLM(tiny, executor="inprocess", n_ctx=64, predictor=paths["coarse" if name == "coarse" else "oracle"]) as llm:
            ex = llm.engine.executor
            ex.set_sparse(dense=dense, oracle=oracle)  # type: ignore[attr-defined]
            logits = llm.logits(IDS)
            tokens = [c.token for c in llm.generate(IDS[:4], max_tokens=12, temperature=0)]
            out[name] = (logits, tokens, 1.0 - ex.decode_share())  # type: ignore[attr-defined]
    dense_logits, dense_tokens, _ = out["dense"]
    oracle_logits, oracle_tokens, skipped = out["oracle"]
    scale = float(np.abs(dense_logits).max())
    assert skipped > 0.7
    assert oracle_tokens == dense_tokens
    assert (oracle_logits.argmax(1) == dense_logits.argmax(1)).all()
    best_err = float(np.abs(oracle_logits.max(1) - dense_logits.max(1)).max())
    assert best_err < 1e-6 * scale
    # bf16-rounded logits: one bf16 step of the largest is 2^-8 of it
    np.testing.assert_allclose(oracle_logits, dense_logits, rtol=0, atol=2**-8 * scale)
    coarse_logits, _, coarse_skipped = out["coarse"]
    assert coarse_skipped > skipped
    assert float(np.abs(coarse_logits.max(1) - dense_logits.max(1)).max()) > 30 * best_err


def test_planter_blocks_match_the_readable_model(tiny: Path) -> None:
    """The planter's float32 building blocks (on the weights it is writing) compute what the readable
    model computes from the finished file: norm, rope'd causal attention, SiLU."""
    from powerinfer.model import reference
    from powerinfer.sparsity.relu_model import attention, rms_norm

    f = GGUFFile(tiny)
    cfg = config_from_gguf(f)
    w = lambda part: reference.weight(f, f"blk.0.{part}.weight", np.float32)  # noqa: E731
    x = reference.weight(f, "token_embd.weight", np.float32)[np.array([IDS])]  # [1, T, d]
    h = rms_norm(x, w("attn_norm"))
    ours = attention(h, w("attn_q"), w("attn_k"), w("attn_v"), cfg.n_heads, cfg.n_kv_heads) @ w("attn_output").T

    class Layer0:
        def __call__(self, part: str, kind: str = "weight") -> np.ndarray:
            return reference.weight(f, f"blk.0.{part}.{kind}", np.float64)

    ref = reference.attention(cfg, 0, reference.rms_norm(x.astype(np.float64), Layer0()("attn_norm"), cfg.norm_eps), Layer0())  # type: ignore[arg-type]
    assert np.linalg.norm(ours - ref) / np.linalg.norm(ref) < 1e-4
    g = np.linspace(-90, 90, 181, dtype=np.float32)  # the planter computes act in float32 through the same function
    np.testing.assert_allclose(reference.activation(g, "silu"), reference.activation(g.astype(np.float64), "silu"), rtol=1e-5, atol=1e-30)
