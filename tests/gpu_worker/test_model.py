"""The GPU runtime on the CPU backend: same numbers as the CPU shards, exact merges, sparse paths that
agree with each other, KV slots, and byte accounting that equals the placement solver's prices.

Runs in: the pytest process (numpy oracles stand in for the CUDA kernels).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from powerinfer.cpu_workers.shards import AttentionShard
from powerinfer.cpu_workers.sparse_ffn import SparseFFNShard
from powerinfer.errors import ContextOverflowError, InvalidArgumentError
from powerinfer.gpu_worker.backend import CpuBackend
from powerinfer.gpu_worker.errors import GpuMemoryError
from powerinfer.gpu_worker.weights import neox_perm
from powerinfer.model.layer_loop import load_layer_norms, run_layers
from powerinfer.model.ops import RopeTable, neox_to_norm_perm
from powerinfer.model.sharding import HeadRange, cold_neurons
from powerinfer.coordinator.placement import layer_costs
from tests.gpu_worker.helpers import gpu_model, load, make_predictor, rel

ARCHS = ["llama", "qwen2", "gemma3"]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("qtype", [QT.F32, QT.Q4_0, QT.Q8_0, QT.Q5_1])
def test_attention_matches_the_cpu_shard(make_model: Callable[..., Path], arch: str, qtype: QT) -> None:
    # 12 tokens (> gemma3's window of 8) in chunks of 4 (max_tokens), then two decode steps
    f, cfg = load(make_model(arch=arch, qtype=qtype))
    gm = gpu_model(f, cfg, max_tokens=4)
    rng = np.random.default_rng(1)
    for layer in range(cfg.n_layers):
        shard = AttentionShard(f, cfg, layer, HeadRange(0, cfg.n_kv_heads, cfg.gqa_group), 64, {})
        steps = [(rng.standard_normal((12, cfg.d_model)).astype(np.float32), np.arange(12))]
        steps += [(rng.standard_normal((1, cfg.d_model)).astype(np.float32), np.array([p])) for p in (12, 13)]
        for x, pos in steps:
            want = shard.forward(torch.from_numpy(x), torch.from_numpy(pos)).numpy()
            got = gm.attention(layer, x, pos)
            assert got.shape == want.shape
            assert rel(got, want) < 0.02  # the CPU shard runs bf16 activations, the GPU float32


def test_batched_slots_equal_one_sequence_at_a_time(make_model: Callable[..., Path]) -> None:
    f, cfg = load(make_model(arch="qwen2"))
    rng = np.random.default_rng(2)
    prompts = [rng.standard_normal((n, cfg.d_model)).astype(np.float32) for n in (5, 3, 7)]
    step = rng.standard_normal((3, cfg.d_model)).astype(np.float32)
    batched = gpu_model(f, cfg, n_slots=3)
    for s, p in enumerate(prompts):
        batched.attention(0, p, np.arange(len(p)), np.full(len(p), s))
    lens = np.array([len(p) for p in prompts])
    got = batched.attention(0, step, lens, np.arange(3))
    for s, p in enumerate(prompts):
        alone = gpu_model(f, cfg)
        alone.attention(0, p, np.arange(len(p)))
        np.testing.assert_allclose(got[s], alone.attention(0, step[s : s + 1], lens[s : s + 1])[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("qtype", [QT.F32, QT.Q4_1])
def test_hot_plus_cold_equals_the_whole_layer(make_model: Callable[..., Path], qtype: QT) -> None:
    # the merge: two partial sums over a split of the neurons add up to the layer (summation order only)
    f, cfg = load(make_model(arch="llama", qtype=qtype))
    hot = np.sort(np.random.default_rng(3).choice(cfg.n_ff, 57, replace=False))
    whole = gpu_model(f, cfg)
    a = gpu_model(f, cfg, [hot] * cfg.n_layers)
    b = gpu_model(f, cfg, [cold_neurons(hot, cfg.n_ff)] * cfg.n_layers)
    for t in (1, 3):
        x = np.random.default_rng(t).standard_normal((t, cfg.d_model)).astype(np.float32)
        np.testing.assert_allclose(a.ffn(1, x) + b.ffn(1, x), whole.ffn(1, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["gate", "predictor"])
def test_sparse_decode_equals_masked_batch_and_skips_neurons(make_model: Callable[..., Path], mode: str) -> None:
    f, cfg = load(make_model(arch="llama", qtype=QT.Q8_0))
    pf = make_predictor(f, cfg, mode)
    hot = np.arange(0, cfg.n_ff, 2)
    sparse = gpu_model(f, cfg, [hot] * cfg.n_layers, predictor=pf)
    dense = gpu_model(f, cfg, [hot] * cfg.n_layers)
    x = np.random.default_rng(4).standard_normal((1, cfg.d_model)).astype(np.float32)
    decode = sparse.ffn(0, x)  # compacted active list, only those rows read
    masked = sparse.ffn(0, np.concatenate([x, x]))[:1]  # every hot neuron, inactive ones zeroed
    np.testing.assert_allclose(decode, masked, rtol=1e-5, atol=1e-5)
    assert rel(decode, dense.ffn(0, x)) > 1e-3  # some neurons were really skipped
    count = int(sparse.ws["count"][0])
    assert 0 < count < len(hot)


@pytest.mark.parametrize("mode", ["gate", "predictor"])
def test_sparse_hot_neurons_match_the_cpu_sparse_shard(make_model: Callable[..., Path], mode: str) -> None:
    f, cfg = load(make_model(arch="llama", qtype=QT.F32))
    pf = make_predictor(f, cfg, mode)
    hot = np.sort(np.random.default_rng(5).choice(cfg.n_ff, 96, replace=False))
    gm = gpu_model(f, cfg, [hot] * cfg.n_layers, predictor=pf)
    shard = SparseFFNShard(f, cfg, 1, hot, pf.layers[1], mode)
    for t in (1, 4):
        x = np.random.default_rng(10 + t).standard_normal((t, cfg.d_model)).astype(np.float32)
        # int8 weights on the CPU side move a few activations across the threshold
        assert rel(gm.ffn(1, x), shard.forward(torch.from_numpy(x)).numpy()) < 0.08


@pytest.mark.parametrize("arch,qtype,mode", [("llama", QT.Q4_0, None), ("qwen2", QT.F32, "predictor"),
                                             ("gemma3", QT.Q5_0, "gate"), ("llama", QT.F16, "predictor")])
def test_allocated_bytes_equal_the_solver_prices(make_model: Callable[..., Path], arch: str, qtype: QT, mode: str | None) -> None:
    f, cfg = load(make_model(arch=arch, qtype=qtype))
    pf = make_predictor(f, cfg, mode) if mode else None
    hot = [np.arange(0, cfg.n_ff, 3), np.arange(40)]  # layer 1: hot neurons, attention on the CPU
    costs = layer_costs(f, cfg, 48, n_slots=2, predictor=pf, max_tokens=4)
    gm = gpu_model(f, cfg, hot, (True, False), n_ctx=48, n_slots=2, predictor=pf, max_tokens=4)
    want = costs.overhead + int(costs.fixed[0]) + sum(int(c) * len(h) + int(c1) for c, c1, h in zip(costs.per_neuron, costs.first_neuron(), hot))
    assert gm.nbytes == want
    assert (costs.first_neuron() > 0).all() == (mode == "predictor")
    with pytest.raises(GpuMemoryError, match=r"--vram-budget.*-ngl"):
        gpu_model(f, cfg, hot, (True, False), n_ctx=48, n_slots=2, predictor=pf, max_tokens=4, budget=want - 1)


def test_budget_beyond_the_device_and_bad_requests_are_clear_errors(make_model: Callable[..., Path]) -> None:
    with pytest.raises(GpuMemoryError, match="more than the .* free"):
        CpuBackend(budget=2 << 30, capacity=1 << 30)
    f, cfg = load(make_model(arch="llama"))
    gm = gpu_model(f, cfg, [np.arange(10), np.zeros(0, np.int64)], (True, False), n_ctx=16, n_slots=2)
    x = np.zeros((1, cfg.d_model), np.float32)
    with pytest.raises(ContextOverflowError, match="context of 16"):
        gm.attention(0, x, np.array([16]))
    with pytest.raises(InvalidArgumentError, match="slot 2"):
        gm.attention(0, x, np.array([0]), np.array([2]))
    x2 = np.zeros((2, cfg.d_model), np.float32)  # the bad value is named, not the largest (review)
    with pytest.raises(InvalidArgumentError, match="position -1 is negative"):
        gm.attention(0, x2, np.array([-1, 5]))
    with pytest.raises(InvalidArgumentError, match="slot -1 out of range"):
        gm.attention(0, x2, np.array([0, 1]), np.array([-1, 0]))
    with pytest.raises(InvalidArgumentError, match="not on the GPU"):
        gm.attention(1, x, np.array([0]))
    with pytest.raises(InvalidArgumentError, match="no hot neurons"):
        gm.ffn(1, x)


def test_neox_permutation_and_rope_table_agree_with_the_cpu_ops() -> None:
    for head, rope in ((16, 16), (64, 32), (128, 128)):
        np.testing.assert_array_equal(neox_perm(head, rope), neox_to_norm_perm(head, rope))
    from powerinfer.gpu_worker.kernels import ref_rope

    table = RopeTable(32, 10000.0, 0.5)
    x = torch.randn(3, 2, 32)
    pos = torch.tensor([0, 7, 300])
    flat = x.numpy().reshape(-1).copy()
    ref_rope(flat, 64, pos.numpy(), 3, 2, 32, 32, table.inv_freq.numpy())
    np.testing.assert_allclose(flat.reshape(3, 2, 32), table.apply(x, pos).numpy(), rtol=1e-5, atol=1e-5)


def test_a_failure_inside_a_run_of_layers_names_its_layer(make_model: Callable[..., Path]) -> None:
    # the worker runtime reports failed_layer in its ERROR, not the run's first layer
    f, cfg = load(make_model(arch="llama", qtype=QT.Q4_0))
    gm = gpu_model(f, cfg)
    ffn_dev = gm._ffn_dev

    def failing(ffn: object, t: int) -> None:
        if ffn is gm.ffns[1]:
            raise RuntimeError("boom")
        ffn_dev(ffn, t)  # type: ignore[arg-type]

    gm._ffn_dev = failing  # type: ignore[method-assign]
    x = np.random.default_rng(0).standard_normal((1, cfg.d_model)).astype(np.float32)
    with pytest.raises(RuntimeError, match="boom") as info:
        gm.layers(0, 2, x, np.zeros(1, np.int64))
    assert info.value.failed_layer == 1  # type: ignore[attr-defined]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("mode", [None, "gate", "predictor"])
def test_a_run_on_the_device_is_the_engines_loop(make_model: Callable[..., Path], arch: str, mode: str | None) -> None:
    """layers() keeps the stream on the device; on the numpy backend it is run_layers over the same
    sub-layers bit for bit: prompts longer than max_tokens (chunks through every layer), decode
    steps, slots out of order, and a run that starts past layer 0 (review, trimmed)."""
    f, cfg = load(make_model(arch=arch, qtype=QT.Q4_0, n_layers=3))
    pf = make_predictor(f, cfg, mode) if mode else None
    host, dev = gpu_model(f, cfg, predictor=pf, n_slots=2, max_tokens=4), gpu_model(f, cfg, predictor=pf, n_slots=2, max_tokens=4)
    norms = load_layer_norms(f, cfg)
    rng = np.random.default_rng(7)
    steps = [(11, np.arange(11), np.zeros(11, np.int64)), (1, np.array([11]), np.zeros(1, np.int64)),
             (5, np.array([0, 1, 12, 2, 3]), np.array([1, 1, 0, 1, 1]))]
    for t, pos, sl in steps:
        x = rng.standard_normal((t, cfg.d_model)).astype(np.float32) * 3
        want = run_layers(cfg, norms, 0, cfg.n_layers, x, pos, sl, host.attention, host.ffn)
        np.testing.assert_array_equal(dev.layers(0, cfg.n_layers, x, pos, sl), want)
    x = rng.standard_normal((5, cfg.d_model)).astype(np.float32)
    pos, sl = np.arange(20, 25), np.zeros(5, np.int64)
    np.testing.assert_array_equal(dev.layers(1, 3, x, pos, sl), run_layers(cfg, norms, 1, 3, x, pos, sl, host.attention, host.ffn))


def test_the_first_run_checks_the_device_path_against_the_per_layer_path(make_model: Callable[..., Path],
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    """The device path is trusted after its first run agrees with the per-layer path; one that
    disagrees (as a miscompiled kernel on an untried card would) is dropped with a warning."""
    f, cfg = load(make_model(arch="gemma3", qtype=QT.Q4_0))
    x, pos = np.random.default_rng(3).standard_normal((3, cfg.d_model)).astype(np.float32), np.arange(3)
    good = gpu_model(f, cfg)
    first = good.layers(0, 2, x, pos)
    assert good._device_run is True
    np.testing.assert_array_equal(good.layers(0, 2, x, pos), first)
    bad = gpu_model(f, cfg)
    device = bad._device_layers
    bad._device_layers = lambda *a: device(*a) + np.float32(1.0)  # type: ignore[method-assign]
    with caplog.at_level("WARNING"):
        out = bad.layers(0, 2, x, pos)
    assert bad._device_run is False and "differ from the per-layer path" in caplog.text
    np.testing.assert_array_equal(out, first)  # the per-layer path's numbers, now and after
    np.testing.assert_array_equal(bad.layers(0, 2, x, pos), first)


@pytest.mark.parametrize("act", ["relu", "fatrelu", "drelu"])
def test_relu_family_ffn_matches_the_reference_and_its_sparse_decode(make_model: Callable[..., Path], act: str) -> None:
    """The numpy backend of the CUDA kernels (act_mul, act_inplace, gather_mul with their activation
    kinds) against model/reference.py's statement of the FFN, dense and as a sparse decode step."""
    from powerinfer.model import reference

    f, cfg = load(make_model(arch="llama", qtype=QT.F32, activation=act, act_threshold=0.3 if act == "fatrelu" else 0.0))
    assert cfg.activation == act
    x = np.random.default_rng(6).standard_normal((3, cfg.d_model)).astype(np.float32)
    w = reference._Layer(f, 0, np.float64)
    xd = x.astype(np.float64)
    want = reference.glu(xd @ w("ffn_gate").T, xd @ w("ffn_up").T, cfg.activation, cfg.act_threshold) @ w("ffn_down").T
    dense = gpu_model(f, cfg)
    assert rel(dense.ffn(0, x), want) < 1e-5
    pf = make_predictor(f, cfg, "gate")
    sparse = gpu_model(f, cfg, predictor=pf)
    decode = sparse.ffn(0, x[:1])  # compacted active list: act_inplace, compact, gather_mul
    masked = sparse.ffn(0, np.concatenate([x[:1], x[:1]]))[:1]  # every neuron, inactive ones zeroed by act_mul
    np.testing.assert_allclose(decode, masked, rtol=1e-5, atol=1e-5)
    assert 0 < int(sparse.ws["count"][0]) < cfg.n_ff
