"""The native sparse FFN kernel against its numpy statement, and inside the sparse shard.

Runs in: the pytest process (the kernel is compiled into the cache on first use).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from powerinfer.native.sparse_kernel import NativeFFN, native_lib, reference_ffn
from powerinfer.native.neuron_major import supported, zero_multiple
from powerinfer.quants.grouped import Grouped

pytestmark = pytest.mark.skipif(native_lib() is None, reason="no C compiler: the native kernel is not built")

D, N = 96, 128


def _grouped(rng: np.random.Generator, n: int, k: int, kind: str) -> Grouped:
    """Random codes in a format's range: q4 (0..15, group 32, free zeros), q40 (Q4_0: zeros -8 scales),
    q8 (int8, group 32), q6k-like (-32..31, group 16)."""
    if kind == "q40":
        q, scale = rng.integers(0, 16, (n, k)), rng.uniform(0.002, 0.02, (n, k // 32)).astype(np.float16).astype(np.float32)
        return Grouped(q.astype(np.int8), scale, -8 * scale, 32, 4)
    if kind == "q4":
        q, group, bits = rng.integers(0, 16, (n, k)), 32, 4
    elif kind == "q8":
        q, group, bits = rng.integers(-128, 128, (n, k)), 32, 8
    else:
        q, group, bits = rng.integers(-32, 32, (n, k)), 16, 8
    scale = rng.uniform(0.002, 0.02, (n, k // group)).astype(np.float32)
    zero = (rng.uniform(-0.1, 0.1, (n, k // group)) if bits == 4 else np.zeros((n, k // group))).astype(np.float32)
    return Grouped(q.astype(np.int8), scale, zero, group, bits)


def _ffn(kinds: tuple[str, str, str], activation: str = "silu", seed: int = 0,
         act_threshold: float = 0.0) -> tuple[NativeFFN, Grouped, Grouped, Grouped]:
    rng = np.random.default_rng(seed)
    gate, up, down = _grouped(rng, N, D, kinds[0]), _grouped(rng, N, D, kinds[1]), _grouped(rng, D, N, kinds[2])
    lib = native_lib()
    assert lib is not None
    return NativeFFN(lib, gate, up, down, activation, act_threshold=act_threshold), gate, up, down


def _close(y: np.ndarray, ref: np.ndarray) -> None:
    np.testing.assert_allclose(y, ref, rtol=0, atol=2e-5 * float(np.abs(ref).max()))


@pytest.mark.parametrize("kinds", [("q4", "q4", "q4"), ("q40", "q40", "q40"), ("q8", "q8", "q6k"), ("q8", "q4", "q4"), ("q4", "q8", "q6k")])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "relu", "fatrelu", "drelu"])
@pytest.mark.parametrize("threads", [1, 2])
def test_every_mode_matches_the_numpy_statement(kinds: tuple[str, str, str], activation: str, threads: int) -> None:
    at = 0.5 if activation == "fatrelu" else 0.0  # FATReLU's threshold: about a third of the positive gates pass
    ffn, gate, up, down = _ffn(kinds, activation, act_threshold=at)
    x = np.random.default_rng(1).standard_normal((3, D)).astype(np.float32)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _, a_ref = reference_ffn(x, gate, up, down, activation, "all", act_threshold=at)
        for mode in ("all", "gate", "oracle", "mask"):
            mask = np.random.default_rng(2).random((3, N)) < 0.3
            # a threshold halfway between two neighbouring |values| so float32 and float64 pick the same set
            if mode == "gate":
                g, _ = ffn.activations(torch.from_numpy(x))
                v = np.sort(np.abs(g.numpy()).ravel())
            else:
                _, h = ffn.activations(torch.from_numpy(x))
                v = np.sort(np.abs(h.numpy()).ravel())
            i = int(np.argmax(np.diff(v[len(v) // 3 : 2 * len(v) // 3]))) + len(v) // 3
            thr = float((v[i] + v[i + 1]) / 2)
            ref, ref_active = reference_ffn(x, gate, up, down, activation, mode, thr, mask, act_threshold=at)
            y, active = ffn.forward(torch.from_numpy(x), mode, thr, torch.from_numpy(mask))
            _close(y.numpy(), ref)
            assert active.tolist() == ref_active.tolist(), mode
            if mode != "all":
                assert 0 < int(active.sum()) < 3 * N  # the mode really skipped some neurons
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("kinds", [("q4", "q4", "q4"), ("q8", "q8", "q6k")])
def test_given_activations_read_only_what_is_left(kinds: tuple[str, str, str]) -> None:
    """given_gate: the caller's act(gate) picks neurons, up and down are read; given_h: only down."""
    rng = np.random.default_rng(5)
    gate, up, down = _grouped(rng, N, D, kinds[0]), _grouped(rng, N, D, kinds[1]), _grouped(rng, D, N, kinds[2])
    lib = native_lib()
    assert lib is not None
    x = rng.standard_normal((2, D)).astype(np.float32)
    a = rng.standard_normal((2, N)).astype(np.float32)
    h = rng.standard_normal((2, N)).astype(np.float32)
    for mode, with_up in (("given_gate", True), ("given_h", False)):
        ffn = NativeFFN(lib, gate, up, down, "silu", with_gate=False, with_up=with_up)
        ref, ref_active = reference_ffn(x, gate, up, down, "silu", mode, 0.8, given_a=a, given_h=h)
        y, active = ffn.forward(torch.from_numpy(x), mode, 0.8, given_a=torch.from_numpy(a), given_h=torch.from_numpy(h))
        _close(y.numpy(), ref)
        assert active.tolist() == ref_active.tolist() == (np.abs(a) > 0.8).sum(1).tolist()
        with pytest.raises(ValueError, match="built without"):
            ffn.forward(torch.from_numpy(x), "gate", 0.8)


def test_a_token_gets_the_same_bits_whatever_shares_its_call() -> None:
    ffn, *_ = _ffn(("q4", "q4", "q4"))
    x = torch.randn(5, D)
    batch, _ = ffn.forward(x, "gate", 0.05)
    for t in range(5):
        one, _ = ffn.forward(x[t : t + 1], "gate", 0.05)
        assert torch.equal(one[0], batch[t])


def test_masked_neurons_bytes_are_never_used() -> None:
    """Gate and up rows of neurons outside the mask get NaN scales: a read would poison the output."""
    rng = np.random.default_rng(3)
    gate, up, down = _grouped(rng, N, D, "q4"), _grouped(rng, N, D, "q4"), _grouped(rng, D, N, "q4")
    mask = np.zeros((1, N), dtype=bool)
    mask[0, ::5] = True
    x = rng.standard_normal((1, D)).astype(np.float32)
    ref, _ = reference_ffn(x, gate, up, down, "silu", "mask", 0.0, mask)
    poisoned = [Grouped(m.q, np.where(mask[0][:, None], m.scale, np.nan).astype(np.float32), m.zero, m.group, m.bits) for m in (gate, up)]
    lib = native_lib()
    assert lib is not None
    ffn = NativeFFN(lib, poisoned[0], poisoned[1], down, "silu")
    y, active = ffn.forward(torch.from_numpy(x), "mask", 0.0, torch.from_numpy(mask))
    assert int(active[0]) == int(mask.sum())
    _close(y.numpy(), ref)


def test_zeros_that_are_a_multiple_of_the_scales_are_not_stored() -> None:
    rng = np.random.default_rng(6)
    q40, q4, q8 = _grouped(rng, 32, 64, "q40"), _grouped(rng, 32, 64, "q4"), _grouped(rng, 32, 64, "q8")
    assert zero_multiple(q40.scale, q40.zero) == -8.0
    assert zero_multiple(q8.scale, q8.zero) == 0.0
    assert zero_multiple(q4.scale, q4.zero) is None
    lib = native_lib()
    assert lib is not None
    with_zeros = NativeFFN(lib, q4, q4, _grouped(rng, 64, 32, "q4"), "silu")
    derived = NativeFFN(lib, q40, q40, _grouped(rng, 64, 32, "q40"), "silu")
    assert all(m.zero for m in with_zeros.weights.mats) and not any(m.zero for m in derived.weights.mats)
    assert derived.nbytes < with_zeros.nbytes


def test_layouts_the_kernel_does_not_take() -> None:
    rng = np.random.default_rng(4)
    assert supported(_grouped(rng, 4, 64, "q4"))
    assert not supported(np.zeros((4, 64), np.float32))  # float tensors stay on the torch path
    assert not supported(Grouped(np.zeros((4, 48), np.int8), np.ones((4, 3), np.float32), np.zeros((4, 3), np.float32), 16, 4))


@pytest.fixture(scope="module")
def q4_model(make_model: Callable[..., Path]) -> Path:
    from gguf import GGMLQuantizationType

    return make_model(arch="llama", n_layers=2, qtype=GGMLQuantizationType.Q4_0)


def test_sparse_shard_native_and_torch_paths_agree(q4_model: Path, tmp_path: Path) -> None:
    from powerinfer.config import config_from_gguf
    from powerinfer.cpu_workers.shards import FFNShard
    from powerinfer.cpu_workers.sparse_ffn import SparseFFNShard
    from powerinfer.gguf_file import GGUFFile
    from powerinfer.sparsity.calibrate import CalibrationSettings, calibrate

    f = GGUFFile(q4_model)
    cfg = config_from_gguf(f)
    pf = calibrate(q4_model, CalibrationSettings(mode="gate", sparsity=0.5, tokens=32, window=32, steps=1))
    neurons = np.arange(cfg.n_ff)
    native = SparseFFNShard(f, cfg, 1, neurons, pf.layers[1], "gate")
    fallback = SparseFFNShard(f, cfg, 1, neurons, pf.layers[1], "gate", native=False)
    assert native.native is not None and fallback.native is None
    x = torch.randn(4, cfg.d_model, generator=torch.Generator().manual_seed(0))
    dense = FFNShard(f, cfg, 1, neurons).forward(x)
    for shard in (native, fallback):
        shard.force_dense = True
        # the paths differ only in how x is rounded (int16 per 32 vs bfloat16): well under 2%
        assert float((shard.forward(x) - dense).norm() / dense.norm()) < 0.02
        shard.force_dense = False
    ys = [s.forward(x) for s in (native, fallback)]
    assert float((ys[0] - ys[1]).norm() / ys[1].norm()) < 0.05  # a few borderline neurons may flip
    assert 0.3 < native.last_active < 0.7


def test_int8_predictor_with_any_rank_matches_float32(q4_model: Path) -> None:
    """The shard's int8 predictor (inputs padded to a multiple of 32: torch's int8 kernel misreads
    other widths) agrees with the float32 numpy statement wherever the logit is not near zero."""
    from dataclasses import replace

    from powerinfer.config import config_from_gguf
    from powerinfer.cpu_workers.sparse_ffn import SparseFFNShard
    from powerinfer.gguf_file import GGUFFile
    from powerinfer.sparsity.calibrate import CalibrationSettings, calibrate

    f = GGUFFile(q4_model)
    cfg = config_from_gguf(f)
    base = calibrate(q4_model, CalibrationSettings(mode="gate", sparsity=0.5, tokens=32, window=32, steps=1)).layers[0]
    rng = np.random.default_rng(7)
    for rank in (20, 36, 100):
        lp = replace(base, fc1_w=rng.standard_normal((rank, cfg.d_model)).astype(np.float32), fc1_b=rng.standard_normal(rank).astype(np.float32),
                     fc2_w=rng.standard_normal((cfg.n_ff, rank)).astype(np.float32), fc2_b=rng.standard_normal(cfg.n_ff).astype(np.float32))
        shard = SparseFFNShard(f, cfg, 0, np.arange(cfg.n_ff), lp, "predictor")
        x = rng.standard_normal((5, cfg.d_model)).astype(np.float32)
        got = shard.predict(torch.from_numpy(x)).numpy()
        logits = np.maximum(x @ lp.fc1_w.T + lp.fc1_b, 0) @ lp.fc2_w.T + lp.fc2_b
        clear = np.abs(logits) > 0.05 * np.abs(logits).max()
        assert clear.mean() > 0.8
        assert (got[clear] == (logits > 0)[clear]).all()


@pytest.mark.parametrize("mode", ["gate", "predictor"])
def test_a_scattered_neuron_set_runs_native_and_adds_up_to_the_layer(q4_model: Path, mode: str) -> None:
    """The cold neurons beside a GPU worker's hot ones are any set: the kernel covers it with whole
    down groups, so a set and its complement add up to the whole layer, choosing the same neurons."""
    from powerinfer.config import config_from_gguf
    from powerinfer.cpu_workers.sparse_ffn import SparseFFNShard
    from powerinfer.gguf_file import GGUFFile
    from powerinfer.model.sharding import cold_neurons
    from tests.gpu_worker.helpers import make_predictor

    f = GGUFFile(q4_model)
    cfg = config_from_gguf(f)
    lp = make_predictor(f, cfg, mode).layers[1]
    hot = np.sort(np.random.default_rng(3).choice(cfg.n_ff, cfg.n_ff // 2, replace=False))
    whole = SparseFFNShard(f, cfg, 1, np.arange(cfg.n_ff), lp, mode)
    parts = [SparseFFNShard(f, cfg, 1, s, lp, mode) for s in (hot, cold_neurons(hot, cfg.n_ff))]
    assert whole.mine is None and all(p.native is not None and p.mine is not None for p in parts)
    # a small scattered set would be covered by the whole layer: the torch path holds less
    few = SparseFFNShard(f, cfg, 1, hot[:: 8], lp, mode)
    assert few.native is None and few.mine is None
    rng = np.random.default_rng(8)
    for dense in (True, False):
        for t in (1, 3):
            x = torch.from_numpy(rng.standard_normal((t, cfg.d_model)).astype(np.float32))
            for s in (whole, *parts):
                s.force_dense = dense
            want = whole.forward(x)
            got = parts[0].forward(x) + parts[1].forward(x)
            # only the down's int16 rounding of act(gate) * up differs (per group's max |h|)
            assert float((got - want).norm() / want.norm()) < 1e-3
            if t == 1:  # each neuron is chosen the same way in its part as in the whole layer
                assert parts[0].last_active * parts[0].n + parts[1].last_active * parts[1].n == pytest.approx(whole.last_active * cfg.n_ff)
                assert dense or whole.last_active < 0.9
