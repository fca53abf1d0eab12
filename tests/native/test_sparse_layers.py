"""Sparse FFNs inside the native decoder (native/sparse_layers.py, decoder.c's sparse_ffn).

Runs in: the pytest process, on tiny planted-sparsity llama files (Q4_0, Q4_1, Q8_0) and a
synthetic float one; each test well under a few seconds.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from powerinfer.api import LLM
from powerinfer.coordinator.inprocess import InProcessExecutor
from powerinfer.coordinator.native_executor import NativeExecutor
from powerinfer.errors import InvalidArgumentError
from powerinfer.native.decoder_lib import ISA_CPU_FLAGS, cpu_flags, decoder_lib
from powerinfer.native import sparse_layers
from powerinfer.native.sparse_layers import PREFILL_DENSE_FROM
from powerinfer.sparsity.calibrate import CalibrationSettings, calibrate
from powerinfer.predictors.predictor_file import PredictorFile, write_predictor
from powerinfer.sparsity.relu_model import ReluSparseSpec, write_relu_sparse_gguf

pytestmark = pytest.mark.skipif(decoder_lib() is None, reason="no C compiler for the native decoder")
IDS = [256, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 10, 65, 66, 67, 1, 2]


@pytest.fixture(scope="module", params=[QT.Q4_0, QT.Q4_1, QT.Q8_0], ids=lambda q: q.name)
def relu(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    qt: QT = request.param
    return write_relu_sparse_gguf(tmp_path_factory.mktemp("relu") / f"tiny-{qt.name}.gguf", ReluSparseSpec.shape("tiny", qtype=qt))


_MADE: dict[tuple[Path, str, float], tuple[Path, PredictorFile]] = {}


def _predictor(model: Path, tmp: Path, mode: str, sparsity: float = 0.8) -> tuple[Path, PredictorFile]:
    """A calibrated predictor file for model (made once per model, mode and level in this session)."""
    key = (model, mode, sparsity)
    if key not in _MADE:
        pf = calibrate(model, CalibrationSettings(mode=mode, sparsity=sparsity, tokens=128, window=64, steps=60))
        path = model.with_name(f"{model.stem}.{mode}-{sparsity}.predictor")
        write_predictor(path, pf)
        _MADE[key] = (path, pf)
    return _MADE[key]


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("mode", ["gate", "predictor"])
def test_sparse_models_run_in_the_native_decoder(relu: Path, tmp_path: Path, mode: str) -> None:
    path, _ = _predictor(relu, tmp_path, mode)
    llm = LLM(relu, n_ctx=128, executor="inprocess", predictor=path)
    ex = llm.engine.executor
    assert isinstance(ex, NativeExecutor) and ex.sparse is not None
    dense = LLM(relu, n_ctx=128, executor="inprocess").logits(IDS)
    sparse = llm.logits(IDS)
    # the planted model leaves ~89% of neurons inactive: a calibrated 80% hardly moves the logits
    assert _rel(sparse, dense) < 0.05
    assert (sparse.argmax(1) == dense.argmax(1)).mean() >= 0.9
    share = ex.decode_share()
    assert 0.02 < share < 0.45, share  # most neurons were skipped (the predictor keeps a recall margin)
    read, full = ex.sparse_bytes()
    assert 0 < read < full


def test_every_neuron_and_the_oracle_equal_dense(relu: Path, tmp_path: Path) -> None:
    """Every neuron through the sparse layout is the dense FFN (int16 vs 8-bit activations aside); the
    true active set (|act(gate) * up| above the calibrated threshold) changes the output no more."""
    path, _ = _predictor(relu, tmp_path, "gate")
    dense = LLM(relu, n_ctx=128, executor="inprocess").logits(IDS)
    llm = LLM(relu, n_ctx=128, executor="inprocess", predictor=path)
    ex = llm.engine.executor
    assert isinstance(ex, NativeExecutor)
    ex.set_sparse(dense=True)
    every = llm.logits(IDS)
    assert _rel(every, dense) < 0.01
    assert ex.decode_share() == 1.0
    ex.reset_sparse_counts()
    ex.set_sparse(dense=False, oracle=True)
    oracle = llm.logits(IDS)
    assert (oracle.argmax(1) == every.argmax(1)).all()
    assert _rel(oracle, every) < 0.01
    assert ex.decode_share() < 0.3  # and it computed only the active neurons
    ex.set_sparse(oracle=False)
    assert ex.sparse is not None and ex.sparse.mode == "file"


def test_prefill_equals_decode_token_by_token(relu: Path, tmp_path: Path) -> None:
    """Each token's sparse FFN follows the same rule whatever else is in the call: decode reads the
    chosen rows four at a time and sums the chosen neurons' rows of the Q8_0 neuron-major down
    projection, a prompt goes through the tiled dense kernels and the file's down matrix (the
    requantized down is within 1/254 of each block's largest value: logits within ~1e-3, and up to
    2.3e-3 of ~100 seen once in a clean-clone CI run, where the suite's earlier tests left torch's
    thread state so that the predictor trained slightly otherwise)."""
    path, _ = _predictor(relu, tmp_path, "predictor")
    llm = LLM(relu, n_ctx=128, executor="inprocess", predictor=path)
    full = llm.engine.eval(IDS, all_logits=True)
    llm.engine.rewind(0)
    llm.engine.eval(IDS[:3])
    steps = np.concatenate([llm.engine.eval([t]) for t in IDS[3:]])
    assert (steps.argmax(1) == full[3:].argmax(1)).all()
    np.testing.assert_allclose(steps.max(1), full[3:].max(1), rtol=4e-3, atol=0)


def test_a_long_prefill_batch_runs_a_predictor_layer_dense(relu: Path, tmp_path: Path) -> None:
    """A prompt batch of PREFILL_DENSE_FROM tokens or more runs the predictor-mode layers dense: the
    dense decoder's numbers, every neuron counted; with set_masked_prefill it applies the
    predictor's rule, and a shorter batch (a lookup step's drafts, a short turn) always does."""
    path, pf = _predictor(relu, tmp_path, "predictor")
    ids = (IDS * 8)[:PREFILL_DENSE_FROM]
    dense = LLM(relu, n_ctx=256, executor="inprocess").engine.eval(ids, all_logits=True)
    llm = LLM(relu, n_ctx=256, executor="inprocess", predictor=path)
    ex = llm.engine.executor
    assert isinstance(ex, NativeExecutor) and ex.sparse is not None and all(ex.sparse.sparse_layers)
    assert [r.dense_from for r in ex.sparse.rules] == [PREFILL_DENSE_FROM] * len(pf.layers)
    for masked in (False, True):
        ex.sparse.set_masked_prefill(masked)
        ex.reset_sparse_counts()
        llm.engine.rewind(0)
        out = llm.engine.eval(ids, all_logits=True)
        if masked:
            assert ex.decode_share() < 0.5 and _rel(out, dense) > 1e-3
        else:  # dense (Q4_0, Q4_1: bit for bit; Q8_0 within ~3e-4, not traced)
            assert ex.decode_share() == 1.0 and _rel(out, dense) < 5e-4
    ex.reset_sparse_counts()
    llm.engine.rewind(0)
    short = llm.engine.eval(ids[: PREFILL_DENSE_FROM - 1], all_logits=True)  # one token short: the predictor's rule
    assert ex.decode_share() < 0.5 and _rel(short, dense[: PREFILL_DENSE_FROM - 1]) > 1e-3


@pytest.mark.parametrize("mode", ["gate", "predictor"])
def test_hot_neurons_first_change_what_is_read_not_what_is_kept(relu: Path, tmp_path: Path, mode: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode computes the hot neurons (calibrated to fire for HOT_FREQ of the tokens or more) from
    one block of rows every step with the dense kernel and keeps those the rule chose: the same
    neurons kept and the same logits as reading the chosen rows alone; more rows computed. Every
    neuron hot (the decode list all hot block, no cold one) keeps the same neurons too."""
    path, _ = _predictor(relu, tmp_path, mode)
    runs = {}
    for hot_freq in (sparse_layers.HOT_FREQ, 2.0, 0.0):  # 2.0: no neuron is hot; 0.0: every one
        monkeypatch.setattr(sparse_layers, "HOT_FREQ", hot_freq)
        llm = LLM(relu, n_ctx=128, executor="inprocess", predictor=path)
        ex = llm.engine.executor
        assert isinstance(ex, NativeExecutor) and ex.sparse is not None
        llm.engine.eval(IDS[:4])
        ex.reset_sparse_counts()
        steps = np.concatenate([llm.engine.eval([t]) for t in IDS[4:]])  # decode: one token a call
        runs[hot_freq] = (steps, ex.sparse.active.copy(), ex.sparse.computed.copy(), list(ex.sparse.hot), ex.sparse_bytes()[0])
    (hot, hot_kept, hot_rows, n_hot, hot_bytes), (cold, kept, rows, none, cold_bytes), (every, all_kept, all_rows, _, _) = runs.values()
    n_ff = ex.sparse.n
    assert (all_rows == n_ff * (len(IDS) - 4)).all() and (all_kept == kept).all()
    # every gate row through the dense kernel: on a Q8_0 file its sums differ from the row kernel's by
    # ~3e-4 (see the dense comparison above), enough to move a gate near zero in predictor mode
    tol = 5e-3 if relu.stem.endswith("Q8_0") and mode == "predictor" else 1e-5
    assert _rel(every, cold) < tol and (every.argmax(1) == cold.argmax(1)).all(), _rel(every, cold)
    assert any(n_hot) and not any(none) and (rows == kept).all()  # without a hot block the rows computed are the chosen ones
    # the hot rows go through the dense kernel, the others one by one: the same values up to float rounding
    assert _rel(hot, cold) < 1e-5 and (hot.argmax(1) == cold.argmax(1)).all(), _rel(hot, cold)
    assert (hot_kept == kept).all() and (hot_rows >= hot_kept).all() and hot_rows.sum() > hot_kept.sum()
    assert hot_bytes > cold_bytes  # the hot block's unchosen rows are read too


@pytest.mark.parametrize("qtype", [QT.F32, QT.F16], ids=lambda q: q.name)
def test_a_float_files_hot_block_reads_whole_rows(qtype: QT, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A float file's hot rows are [rows, cols] floats, not [rows, row_bytes] bytes: the hot block
    read them at a quarter (F32) or half (F16) of their stride until 2026-12-08, and the trained
    ReLU model's decode-path perplexity rose 37% with its default predictor. Its decode now keeps
    the logits of reading the chosen rows alone."""
    model = write_relu_sparse_gguf(tmp_path / f"tiny-{qtype.name}.gguf", ReluSparseSpec.shape("tiny", qtype=qtype))
    path, _ = _predictor(model, tmp_path, "predictor")
    runs = []
    for hot_freq in (sparse_layers.HOT_FREQ, 2.0):  # 2.0: no neuron is hot
        monkeypatch.setattr(sparse_layers, "HOT_FREQ", hot_freq)
        llm = LLM(model, n_ctx=128, executor="inprocess", predictor=path)
        assert isinstance(llm.engine.executor, NativeExecutor) and llm.engine.executor.sparse is not None
        llm.engine.eval(IDS[:4])
        runs.append((np.concatenate([llm.engine.eval([t]) for t in IDS[4:]]), list(llm.engine.executor.sparse.hot)))
        llm.close()
    (hot, n_hot), (cold, none) = runs
    assert any(n_hot) and not any(none)
    assert _rel(hot, cold) < 1e-5 and (hot.argmax(1) == cold.argmax(1)).all(), _rel(hot, cold)


def test_predictor_mask_follows_the_float_predictor(relu: Path, tmp_path: Path) -> None:
    """The 8-bit predictor in the decoder picks (nearly) the neurons the float32 predictor picks."""
    path, _ = _predictor(relu, tmp_path, "predictor")
    llm = LLM(relu, n_ctx=128, executor="inprocess", predictor=path)
    ex = llm.engine.executor
    assert isinstance(ex, NativeExecutor)
    torch_llm = LLM(relu, n_ctx=128, executor="inprocess", predictor=path, native=False)
    assert isinstance(torch_llm.engine.executor, InProcessExecutor)
    llm.logits(IDS)
    torch_llm.logits(IDS)
    ours = ex.decode_share()
    theirs = float(np.mean([s.last_active for layer in torch_llm.engine.executor.ffns for s in layer]))  # type: ignore[attr-defined]
    assert abs(ours - theirs) < 0.02, (ours, theirs)


def test_every_type_the_decoder_reads(make_model: Callable[..., Path], tmp_path: Path) -> None:
    """The sparse rule reads the file's rows through the decoder's own dot products: a float model
    runs sparsely in the native decoder too, and agrees with the torch path's sparse FFN."""
    model = make_model(arch="llama", n_layers=2)  # F32 weights
    path, _ = _predictor(model, tmp_path, "gate", sparsity=0.8)  # 20% active: under MAX_SPARSE_SHARE, the layers run sparse
    llm = LLM(model, n_ctx=64, executor="inprocess", predictor=path)
    assert isinstance(llm.engine.executor, NativeExecutor)
    assert llm.engine.executor.sparse is not None and all(llm.engine.executor.sparse.sparse_layers)
    torch_llm = LLM(model, n_ctx=64, executor="inprocess", predictor=path, native=False)
    assert isinstance(torch_llm.engine.executor, InProcessExecutor)
    ours, theirs = llm.logits(IDS), torch_llm.logits(IDS)
    assert _rel(ours, theirs) < 0.05  # 8-bit activations here, bf16 there; a few neurons near the threshold differ


def test_layers_too_dense_to_pay_run_dense(relu: Path, tmp_path: Path) -> None:
    """A predictor that leaves most neurons active (here 50%) would make decode slower than dense on
    this CPU: such layers run dense, exactly the dense decoder."""
    path, _ = _predictor(relu, tmp_path, "gate", sparsity=0.5)
    llm = LLM(relu, n_ctx=128, executor="inprocess", predictor=path)
    ex = llm.engine.executor
    assert isinstance(ex, NativeExecutor) and ex.sparse is not None and not any(ex.sparse.sparse_layers)
    np.testing.assert_array_equal(llm.logits(IDS), LLM(relu, n_ctx=128, executor="inprocess").logits(IDS))
    assert ex.decode_share() == 1.0


ISAS = [isa for isa in ("scalar", "avx2", "vnni") if ISA_CPU_FLAGS[isa] <= cpu_flags()]


@pytest.mark.parametrize("isa", ISAS)
def test_decode_paths_on_every_isa(relu: Path, tmp_path: Path, isa: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode's sparse paths on each instruction set this CPU runs: chosen rows (split layout on
    AVX-512, four-row kernel on AVX2, one row at a time portable) and, with few neurons active, the
    neuron-major Q8_0 down projection. Every ISA agrees with the dense decoder on the same rule."""
    monkeypatch.setenv("POWERINFER_ISA", isa)
    monkeypatch.setenv("POWERINFER_DOWN_T", "q8_0")  # a 4-bit file's default is Q4_0: the next test
    path, _ = _predictor(relu, tmp_path, "gate", sparsity=0.95)  # ~5% active: under the sparse down's 15%
    llm = LLM(relu, n_ctx=128, executor="inprocess", predictor=path, n_threads=2)
    ex = llm.engine.executor
    assert isinstance(ex, NativeExecutor) and ex.decoder.lib is decoder_lib(isa)
    dense = LLM(relu, n_ctx=128, executor="inprocess", n_threads=2)
    llm.engine.eval(IDS[:4])
    dense.engine.eval(IDS[:4])
    for t in IDS[4:12]:  # decode steps: one token each
        a, b = llm.engine.eval([t]), dense.engine.eval([t])
        assert _rel(a, b) < 0.05 and a.argmax() == b.argmax()
    assert ex.decode_share() < 0.1
    read, full = ex.sparse_bytes()
    assert read < 0.5 * full


@pytest.mark.parametrize("isa", ISAS)
def test_a_4bit_down_copy_moves_logits_by_its_rounding(relu: Path, tmp_path: Path, isa: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 4-bit file's neuron-major down copy is Q4_0 (half of Q8_0's bytes a chosen neuron): each
    ISA's Q4_0 sum agrees with its Q8_0 one on the same rule within the requantization's rounding
    (0.016-0.018 measured on these files; a misread nibble or scale is of the order of the logits)."""
    monkeypatch.setenv("POWERINFER_ISA", isa)
    path, _ = _predictor(relu, tmp_path, "gate", sparsity=0.95)  # ~5% active: the sparse down projection
    runs = {}
    for down_t in ("q8_0", "q4_0"):
        monkeypatch.setenv("POWERINFER_DOWN_T", down_t)
        llm = LLM(relu, n_ctx=128, executor="inprocess", predictor=path, n_threads=2)
        ex = llm.engine.executor
        assert isinstance(ex, NativeExecutor) and ex.sparse is not None and ex.decoder.lib is decoder_lib(isa)
        llm.engine.eval(IDS[:4])
        runs[down_t] = (np.stack([llm.engine.eval([t])[0] for t in IDS[4:12]]), ex.sparse_bytes()[0])
    (q8, q8_read), (q4, q4_read) = runs["q8_0"], runs["q4_0"]
    for a, b in zip(q4, q8):
        assert _rel(a, b) < 0.03 and a.argmax() == b.argmax()
    assert q4_read < q8_read  # the chosen neurons' down rows: 18 bytes a block against 34
    monkeypatch.setenv("POWERINFER_DOWN_T", "q2_k")
    with pytest.raises(InvalidArgumentError, match="POWERINFER_DOWN_T"):
        LLM(relu, n_ctx=128, executor="inprocess", predictor=path)


def test_the_down_copy_follows_the_files_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Q4_0 for a 4-bit down projection, Q8_0 for wider ones, unless POWERINFER_DOWN_T says."""
    monkeypatch.delenv("POWERINFER_DOWN_T", raising=False)
    assert [sparse_layers.down_t_type(q) for q in (QT.Q4_0, QT.Q4_1, QT.Q4_K, QT.Q5_0, QT.Q8_0, QT.F16, QT.F32)] == [QT.Q4_0] * 3 + [QT.Q8_0] * 4
    assert sparse_layers.down_t_row_bytes(2048, QT.Q4_0) == 1152 and sparse_layers.down_t_row_bytes(2048, QT.F16) == 2176
    monkeypatch.setenv("POWERINFER_DOWN_T", "q8_0")
    assert sparse_layers.down_t_type(QT.Q4_0) == QT.Q8_0


@pytest.fixture(scope="module")
def reglu(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A gated ReLU file whose gate has rank 4 (what the low-rank predictor reads off it)."""
    spec = ReluSparseSpec.shape("tiny", act="relu", gate_rank=4, gate_scale=1.0, logit_std=3.0)
    return write_relu_sparse_gguf(tmp_path_factory.mktemp("reglu") / "reglu.gguf", spec)


def test_a_low_rank_predictor_runs_folded_to_half_its_width(reglu: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A low-rank predictor fc2(relu(fc1 x)) with fc1 = [V; -V], fc2 = [P, -P] is the linear
    P (V x): the decoder runs it so (half of fc1's rows and fc2's columns, no relu), choosing the
    neurons the paired form chooses, to the 8-bit rounding of its hidden units."""
    pf = calibrate(reglu, CalibrationSettings(mode="lowrank", sparsity=0.8, rank=64, tokens=128, window=64))  # k = 32: 64 -> 32 wide
    path = tmp_path / "lowrank-64.predictor"
    write_predictor(path, pf)
    runs = {}
    for folded in (True, False):
        if not folded:
            monkeypatch.setattr(sparse_layers, "low_rank_pairs", lambda *_: False)
        llm = LLM(reglu, n_ctx=128, executor="inprocess", predictor=path)
        ex = llm.engine.executor
        assert isinstance(ex, NativeExecutor) and ex.sparse is not None and ex.sparse.uses_predictor
        preds = [p for p in ex.sparse.preds if p is not None]
        assert preds and all(p.linear == folded and p.fc1.rows == (-(-lp.rank // 2 // 32) * 32 if folded else lp.rank)
                             for p, lp in zip(preds, pf.layers))
        llm.engine.eval(IDS[:4])
        ex.reset_sparse_counts()
        runs[folded] = (np.stack([llm.engine.eval([t])[0] for t in IDS[4:16]]), ex.decode_share(), ex.sparse_bytes()[0])
    (a, share_a, read_a), (b, share_b, read_b) = runs[True], runs[False]
    assert _rel(a, b) < 0.01 and abs(share_a - share_b) < 0.01, (_rel(a, b), share_a, share_b)
    assert read_a < read_b


def test_only_the_exact_pair_form_is_folded() -> None:
    rng = np.random.default_rng(0)
    v, p = rng.standard_normal((16, 64)).astype(np.float32), rng.standard_normal((96, 16)).astype(np.float32)
    fc1, fc2, b1 = np.concatenate([v, -v]), np.concatenate([p, -p], axis=1), np.zeros(32, np.float32)
    assert sparse_layers.low_rank_pairs(fc1, b1, fc2)
    x = rng.standard_normal(64).astype(np.float32)
    np.testing.assert_allclose(fc2 @ np.maximum(fc1 @ x, 0), p @ (v @ x), rtol=1e-4, atol=1e-4)
    assert not sparse_layers.low_rank_pairs(fc1, b1 + 0.5, fc2)  # a bias: relu no longer cancels
    bent = fc2.copy()
    bent[3, 20] += 1e-3
    assert not sparse_layers.low_rank_pairs(fc1, b1, bent)
    assert not sparse_layers.low_rank_pairs(fc1[:31], b1[:31], fc2[:, :31])  # an odd width


def test_a_neurons_gate_and_up_rows_bundled_read_the_same_numbers(relu: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In predictor mode a neuron's split gate and up rows sit side by side (one contiguous read):
    decode reads the same bytes from there, so the logits are those of the separate copies exactly."""
    path, _ = _predictor(relu, tmp_path, "predictor")
    out = {}
    for bundled in (True, False):
        monkeypatch.setattr(sparse_layers, "BUNDLE_GATE_UP", bundled)
        llm = LLM(relu, n_ctx=128, executor="inprocess", predictor=path, n_threads=2)
        ex = llm.engine.executor
        assert isinstance(ex, NativeExecutor) and ex.sparse is not None
        rules = [r for r, sp in zip(ex.sparse.rules, ex.sparse.sparse_layers) if sp]
        if bundled and not all(r.gate_split for r in rules):
            pytest.skip("no split layout in this build or type: the file's rows are read in place")
        assert all((r.split_stride == 2 * (r.up_split - r.gate_split)) == bundled for r in rules)
        llm.engine.eval(IDS[:4])
        out[bundled] = np.stack([llm.engine.eval([t])[0] for t in IDS[4:12]])
    np.testing.assert_array_equal(out[True], out[False])


def test_the_predictors_quality_counts_what_fired_and_what_it_chose(relu: Path, tmp_path: Path) -> None:
    """Tracked decode steps count the predictor against the true active set: its choices (true and
    false positives) are the neurons decode kept, and the neurons that fired (true positives and
    false negatives) are those the oracle keeps on the same tokens, up to the dense kernel's rounding
    near the threshold; untracked steps count nothing. replay_decode reports the same measure."""
    from powerinfer.sparsity.speed import replay_decode

    path, _ = _predictor(relu, tmp_path, "predictor")
    llm = LLM(relu, n_ctx=128, executor="inprocess", predictor=path)
    ex = llm.engine.executor
    assert isinstance(ex, NativeExecutor) and ex.sparse is not None
    sp = ex.sparse

    def decode(oracle: bool) -> np.ndarray:
        ex.set_sparse(oracle=oracle)
        llm.engine.rewind(0)
        llm.engine.eval(IDS[:4])
        ex.reset_sparse_counts()
        for t in IDS[4:]:
            llm.engine.eval([t])
        return sp.active.copy()

    decode(False)
    assert not sp.quality.any() and not sp.pred_s.any()
    sp.track(quality=True, timing=True)
    chosen = decode(False)
    tp, fn, fp = sp.quality.T.copy()  # the next decode resets the counts
    pred_s = sp.pred_s.copy()
    fired = decode(True)
    sp.track(quality=False, timing=False)
    assert (tp + fp == chosen).all() and chosen.sum() > 0
    assert abs(int((tp + fn).sum()) - int(fired.sum())) <= 0.01 * fired.sum(), ((tp + fn).sum(), fired.sum())
    assert fn.sum() > 0 and fp.sum() > 0  # an imperfect predictor: both kinds of miss are seen
    assert (pred_s > 0).sum() == sum(sp.sparse_layers)
    ids = llm.tokenize("hello world, again and again")
    llm.close()
    rep = replay_decode(str(relu), str(path), ids, 8, 1)
    assert rep.recall is not None and rep.precision is not None and 0.0 < rep.recall < 1.0 and 0.0 < rep.precision < 1.0
    assert rep.predictor_us is not None and 0 < rep.predictor_us < rep.step_us and 0 < rep.sparse_bytes < rep.dense_bytes
