"""A neuron predictor's fc2 by sign (native/pred_sign.py's layout, kernels/pred_sign.h).

Runs in: the pytest process: the layout against numpy, and the decoder on a tiny ReGLU file with
a low-rank predictor 48 wide (not a multiple of 32, where the Q8_0 rows were padded).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from powerinfer.api import LLM
from powerinfer.coordinator.native_executor import NativeExecutor
from powerinfer.native import sparse_layers
from powerinfer.native.decoder_lib import ISA_IDS, decoder_lib
from powerinfer.native.pred_sign import GROUP, SCALE_BYTES, sign_layout, sign_width
from powerinfer.predictors.predictor_file import write_predictor
from powerinfer.sparsity.calibrate import CalibrationSettings, calibrate
from powerinfer.sparsity.relu_model import ReluSparseSpec, write_relu_sparse_gguf

IDS = [256, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 10, 65, 66, 67, 1, 2]


def _unpack(out: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """sign_layout's bytes -> (scales [rows], codes [rows, sign_width(k)]) in row order."""
    kq = sign_width(k)
    scale = out[:, :SCALE_BYTES].copy().view(np.float16).astype(np.float32).reshape(-1)
    codes = out[:, SCALE_BYTES:].copy().view(np.int8).reshape(-1, kq // 4, GROUP, 4).transpose(0, 2, 1, 3).reshape(-1, kq)
    return scale, codes


def _decide(out: np.ndarray, n: int, k: int, u: np.ndarray, b2: np.ndarray) -> np.ndarray:
    """The kernel's arithmetic in numpy: u quantized with one scale (offset 128), integer sums, the
    sign of isum * (scale * su) + b2."""
    scale, codes = _unpack(out, k)
    kq = sign_width(k)
    uq = np.zeros(kq, dtype=np.float32)
    uq[:k] = u
    amax = float(np.abs(uq).max())
    a = np.clip(np.rint(uq * (127.0 / amax)), -127, 127).astype(np.int64) if amax > 0 else np.zeros(kq, dtype=np.int64)
    isum = codes[:n].astype(np.int64) @ a
    return (isum.astype(np.float32) * (scale[:n] * np.float32(amax / 127.0)) + b2) > 0


def test_the_layout_holds_each_row_in_8_bits_with_its_scale() -> None:
    rng = np.random.default_rng(0)
    n, k = 37, 10
    fc2 = rng.standard_normal((n, k)).astype(np.float32)
    fc2[5] = 0.0  # a zero row: scale 0, codes 0
    out = sign_layout(fc2, k)
    assert out.dtype == np.uint8 and out.shape == (3, SCALE_BYTES + GROUP * sign_width(k)) == (3, 32 + 16 * 12)
    scale, codes = _unpack(out, k)
    assert not codes[n:].any() and not codes[:, k:].any() and not scale[n:].any()  # padding rows and columns
    assert scale[5] == 0.0 and not codes[5].any()
    live = [i for i in range(n) if i != 5]
    assert (np.abs(codes[live, :k]).max(axis=1) >= 126).all()  # each row spans its 8 bits
    err = np.abs(codes[:n, :k] * scale[:n, None] - fc2)
    assert (err <= 0.51 * scale[:n, None] + 2e-3 * np.abs(fc2)).all()  # half a step, and the f16 scale's rounding


def test_the_sign_decides_as_the_float_predictor_up_to_its_rounding() -> None:
    """Where the float logit's margin exceeds the two roundings' bound the decision is the float
    predictor's; elsewhere (a few neurons near zero) it may differ."""
    rng = np.random.default_rng(1)
    n, k = 512, 48
    fc2 = rng.standard_normal((n, k)).astype(np.float32)
    b2 = (0.3 * rng.standard_normal(n)).astype(np.float32)
    out = sign_layout(fc2, k)
    agree = []
    for _ in range(20):
        u = rng.standard_normal(k).astype(np.float32)
        exact = fc2 @ u + b2
        ours = _decide(out, n, k, u, b2)
        scale = np.abs(fc2).max(axis=1) / 127  # half a step of each rounding, the f16 scale's share, float sums
        bound = 0.5 * scale * np.abs(u).sum() + 0.5 * np.abs(u).max() / 127 * np.abs(fc2).sum(axis=1) + 2e-3 * np.abs(fc2) @ np.abs(u) + 1e-4
        sure = np.abs(exact) > bound
        assert sure.mean() > 0.8 and (ours[sure] == (exact[sure] > 0)).all()
        agree.append((ours == (exact > 0)).mean())
    assert np.mean(agree) > 0.98


@pytest.fixture(scope="module")
def reglu48(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny gated ReLU file and a low-rank predictor of rank 96: folded, 48 wide."""
    tmp = tmp_path_factory.mktemp("sign")
    model = write_relu_sparse_gguf(tmp / "reglu.gguf", ReluSparseSpec.shape("tiny", act="relu", gate_rank=4, gate_scale=1.0, logit_std=3.0))
    pf = calibrate(model, CalibrationSettings(mode="lowrank", sparsity=0.8, rank=96, tokens=128, window=64))
    path = tmp / "lowrank-96.predictor"
    write_predictor(path, pf)
    return model, path


@pytest.mark.skipif(decoder_lib() is None or decoder_lib().pi_isa() != ISA_IDS["vnni"], reason="the sign kernel is AVX-512 VNNI's")
def test_the_decoder_takes_fc2_by_sign_choosing_what_the_8bit_rows_chose(reglu48: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    model, path = reglu48
    runs = {}
    for sign in (True, False):
        if not sign:  # predictor_q8 builds fc2's Q8_0 rows, as on other instruction sets
            monkeypatch.setattr(sparse_layers, "ISA_IDS", {**ISA_IDS, "vnni": -1})
        llm = LLM(model, n_ctx=128, executor="inprocess", predictor=path)
        ex = llm.engine.executor
        assert isinstance(ex, NativeExecutor) and ex.sparse is not None
        preds = [p for p in ex.sparse.preds if p is not None]
        assert preds and all(p.linear for p in preds)
        if sign:
            assert all(p.sg and p.sg_k == 48 and p.fc2.rows == 0 and p.fc1.rows == 64 for p in preds)
        else:
            assert all(not p.sg and p.fc2.rows == 512 and p.fc2.cols == 64 for p in preds)
        llm.engine.eval(IDS[:4])
        ex.reset_sparse_counts()
        runs[sign] = (np.stack([llm.engine.eval([t])[0] for t in IDS[4:16]]), ex.decode_share(), ex.sparse_bytes()[0])
        llm.close()
    (a, share_a, read_a), (b, share_b, read_b) = runs[True], runs[False]
    assert float(np.linalg.norm(a - b) / np.linalg.norm(b)) < 0.01 and abs(share_a - share_b) < 0.01, (share_a, share_b)
    assert read_a < read_b  # fc2 48 wide (50 bytes a row) against Q8_0's 64 (68 bytes)
