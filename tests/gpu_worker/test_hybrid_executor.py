"""The hybrid executor (coordinator/hybrid_executor.py) on the CPU backend: the engine's logits with hot
neurons and offloaded layers on the "GPU" match the in-process executor and the float64 reference,
for neuron split and layer split; loaded bytes never exceed the budget; clear budget errors.

Runs in: the pytest process (the GPU runtime in-process; one test with the worker process).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from powerinfer.coordinator.engine import Engine
from powerinfer.coordinator.executor import Batch, Want
from powerinfer.coordinator.inprocess import InProcessExecutor
from powerinfer.coordinator.hybrid_executor import GpuOptions, build_hybrid_executor
from powerinfer.gpu_worker.client import NoGpu
from powerinfer.gpu_worker.errors import GIB, GpuMemoryError
from powerinfer.coordinator.placement import layer_costs
from powerinfer.predictors.predictor_file import write_predictor
from tests.gpu_worker.helpers import load, make_predictor, rel
from powerinfer.model.reference import logits as reference_logits

IDS = [256, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 10, 65, 66, 67, 1, 2]
CTX = 64


def _opts(split: str, budget: int, **kw: object) -> GpuOptions:
    return GpuOptions(backend="cpu", split=split, vram_budget_gib=budget / GIB, process=False, max_tokens=8, **kw)  # type: ignore[arg-type]


def _budget(f, cfg, split: str, pf=None) -> int:  # type: ignore[no-untyped-def]
    """neuron: both layers' attention and about 40% of the neurons; layer: the first layer whole."""
    c = layer_costs(f, cfg, CTX, predictor=pf, max_tokens=8)
    if split == "neuron":
        return int(c.overhead + c.fixed.sum() + 0.4 * cfg.n_ff * c.per_neuron.sum())
    return int(c.overhead + c.fixed[0] + cfg.n_ff * c.per_neuron[0] + c.fixed[1] // 2)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("split", ["neuron", "layer"])
def test_engine_logits_match_inprocess_and_reference(make_model: Callable[..., Path], arch: str, split: str) -> None:
    path = make_model(arch=arch, qtype=QT.Q4_0)
    f, cfg = load(path)
    budget = _budget(f, cfg, split)
    ex = build_hybrid_executor(path, f, cfg, CTX, _opts(split, budget))
    pl = ex.placement
    if split == "neuron":
        assert pl.gpu_layers == (True, True) and all(0 < len(h) < cfg.n_ff for h in pl.hot)
    else:
        assert pl.gpu_layers == (True, False) and len(pl.hot[0]) == cfg.n_ff and len(pl.hot[1]) == 0
    assert ex.gpu_bytes == pl.used <= budget
    ours = Engine(f, cfg, ex, CTX, 8).eval(IDS, all_logits=True)
    oracle = Engine(f, cfg, InProcessExecutor(f, cfg, CTX), CTX, 8).eval(IDS, all_logits=True)
    ref = reference_logits(f, cfg, IDS)
    assert rel(ours, ref) <= rel(oracle, ref) + 0.01  # the GPU side computes in float32: no worse
    assert rel(ours, oracle) < 0.03
    assert np.mean(ours.argmax(-1) == oracle.argmax(-1)) >= 0.9
    assert ex.stats.layer_calls == cfg.n_layers * 3  # 20 tokens in batches of 8
    assert ex.stats.whole_layer_calls == (3 if split == "layer" else 0)  # layer 0 of layer split: one LAYERS request
    ex.close()


def test_incremental_decode_equals_the_full_pass(make_model: Callable[..., Path]) -> None:
    path = make_model(arch="qwen2", qtype=QT.F32)
    f, cfg = load(path)
    opts = _opts("neuron", _budget(f, cfg, "neuron"))
    full = Engine(f, cfg, build_hybrid_executor(path, f, cfg, CTX, opts), CTX, 64).eval(IDS, all_logits=True)
    eng = Engine(f, cfg, build_hybrid_executor(path, f, cfg, CTX, opts), CTX, 3)
    prefix = eng.eval(IDS[:10], all_logits=True)
    steps = [eng.eval([t])[0] for t in IDS[10:]]
    assert rel(np.concatenate([prefix, np.stack(steps)]), full) < 1e-3


@pytest.mark.parametrize("mode", ["gate", "predictor"])
def test_sparse_hybrid_in_a_worker_process_tracks_the_sparse_inprocess_engine(make_model: Callable[..., Path], tmp_path: Path,
                                                                            mode: str) -> None:
    path = make_model(arch="llama", qtype=QT.Q8_0)
    f, cfg = load(path)
    pf = make_predictor(f, cfg, mode)
    write_predictor(tmp_path / "m.predictor", pf)
    opts = GpuOptions(backend="cpu", split="neuron", vram_budget_gib=_budget(f, cfg, "neuron", pf) / GIB, max_tokens=8)
    ex = build_hybrid_executor(path, f, cfg, CTX, opts, predictor=pf, predictor_path=tmp_path / "m.predictor")
    try:
        # hot neurons follow the predictor's activation mass: the hottest neuron of each layer is on the GPU
        for lp, hot in zip(pf.layers, ex.placement.hot):
            assert int(np.argmax(lp.act_mass)) in set(hot.tolist())
        ours = Engine(f, cfg, ex, CTX, 8)
        oracle = Engine(f, cfg, InProcessExecutor(f, cfg, CTX, predictor=pf), CTX, 8)
        a, b = ours.eval(IDS[:12], all_logits=True), oracle.eval(IDS[:12], all_logits=True)
        assert rel(a, b) < 0.1  # int8 CPU weights flip a few neurons across the threshold
        steps = np.stack([ours.eval([t])[0] for t in IDS[12:]]), np.stack([oracle.eval([t])[0] for t in IDS[12:]])
        assert rel(*steps) < 0.1 and np.mean(steps[0].argmax(-1) == steps[1].argmax(-1)) >= 0.75
    finally:
        ex.close()


@pytest.mark.parametrize("split", ["neuron", "layer"])
def test_loaded_bytes_never_exceed_random_budgets(make_model: Callable[..., Path], split: str) -> None:
    path = make_model(arch="gemma3", qtype=QT.Q4_1)
    f, cfg = load(path)
    c = layer_costs(f, cfg, CTX, max_tokens=8)
    whole = int(c.overhead + c.fixed.sum() + cfg.n_ff * c.per_neuron.sum())
    rng = np.random.default_rng(7)
    for budget in [int(b) for b in rng.integers(c.overhead // 2, whole + whole // 4, size=5)] + [whole]:
        ngl = int(rng.integers(0, 3))
        ex = build_hybrid_executor(path, f, cfg, CTX, _opts(split, budget, n_gpu_layers=ngl))
        pl = ex.placement
        assert ex.gpu_bytes == pl.used <= budget
        assert all(len(h) == 0 for h in pl.hot[ngl:])  # -ngl bounds the layers that take part
        x = np.ones((1, cfg.d_model), np.float32)
        # every neuron on one side: layers with no GPU part run whole in the native decoder
        native = ex.native.only if ex.native is not None else frozenset()
        assert native == {i for i in range(cfg.n_layers) if not pl.gpu_layers[i] and not len(pl.hot[i])}
        assert all(np.isfinite(ex.ffn(i, x)).all() for i in range(cfg.n_layers) if i not in native)
        ex.close()


def test_a_budget_beyond_the_device_is_a_clear_error(make_model: Callable[..., Path]) -> None:
    path = make_model(arch="llama")
    f, cfg = load(path)
    with pytest.raises(GpuMemoryError, match=r"more than the 1.00 GiB free .*--vram-budget.*-ngl"):
        build_hybrid_executor(path, f, cfg, CTX, GpuOptions(backend="cpu", vram_budget_gib=2.0, capacity_gib=1.0, process=False))


def test_a_cpu_failure_between_gpu_request_and_result_leaves_the_executor_usable(make_model: Callable[..., Path]) -> None:
    path = make_model(arch="llama", qtype=QT.Q8_0)
    f, cfg = load(path)
    opts = GpuOptions(backend="cpu", split="neuron", vram_budget_gib=_budget(f, cfg, "neuron") / GIB, max_tokens=8)
    ex = build_hybrid_executor(path, f, cfg, CTX, opts)  # the GPU runtime in its worker process
    try:
        layer = next(i for i in range(cfg.n_layers) if ex.n_hot[i] and ex.ffns[i] is not None)
        x = np.random.default_rng(0).standard_normal((1, cfg.d_model)).astype(np.float32)
        want = ex.ffn(layer, x)
        shard = ex.ffns[layer]
        real = shard.forward

        def broken(*a: object) -> object:
            raise KeyboardInterrupt  # e.g. Ctrl+C while the cold neurons run

        shard.forward = broken  # type: ignore[method-assign]
        with pytest.raises(KeyboardInterrupt):
            ex.ffn(layer, x)  # the GPU request is in flight when the CPU side fails
        shard.forward = real  # type: ignore[method-assign]
        np.testing.assert_array_equal(ex.ffn(layer, x), want)  # not "one GPU request at a time"
    finally:
        ex.close()


@pytest.mark.parametrize("process", [False, True])
def test_whole_gpu_layers_go_as_one_request_with_the_same_numbers(make_model: Callable[..., Path], process: bool) -> None:
    # layer split with room for every layer: one LAYERS request per step instead of two per layer,
    # computed with the stream on the device, whose norms and adds are the engine's own float32
    # operations on the numpy backend, so the logits are the same bits
    path = make_model(arch="gemma3", qtype=QT.Q4_0)  # post-attention and post-FFN norms too
    f, cfg = load(path)
    ex = build_hybrid_executor(path, f, cfg, CTX, GpuOptions(backend="cpu", split="layer", vram_budget_gib=0.5, process=process, max_tokens=8))
    try:
        assert ex.layer_runs == ((0, cfg.n_layers),)
        fused = Engine(f, cfg, ex, CTX, 8).eval(IDS, all_logits=True)
        assert ex.stats.gpu_layers_s > 0 and ex.stats.gpu_attention_s == 0 and ex.stats.ffn_calls == 0
        assert (ex.stats.layer_runs, ex.stats.whole_layer_calls) == (3, cfg.n_layers * 3)
        ex.layer_runs = ()  # the per-layer path, over the same GPU runtime (its KV cache is rewritten alike)
        per_layer = Engine(f, cfg, ex, CTX, 8).eval(IDS, all_logits=True)
        assert ex.stats.gpu_attention_s > 0
        np.testing.assert_array_equal(fused, per_layer)
        if process:  # six forward passes (three chunks each way), numbered 0..5 whatever their requests
            assert ex.gpu._step == 5  # type: ignore[attr-defined]
    finally:
        ex.close()


def test_runs_of_whole_layers_sit_between_split_layers(make_model: Callable[..., Path]) -> None:
    path = make_model(arch="llama", qtype=QT.Q4_0)
    f, cfg = load(path)
    ex = build_hybrid_executor(path, f, cfg, CTX, _opts("layer", _budget(f, cfg, "layer")))
    try:
        assert ex.layer_runs == ((0, 1), (1, 2))  # layer 0 whole on the GPU, layer 1 in the native decoder
        assert ex.native is not None and ex.native.only == {1}
        with pytest.raises(Exception, match="do not all live wholly on the GPU"):
            ex.layers(0, 2, np.zeros((1, cfg.d_model), np.float32), np.zeros(1, np.int64))
    finally:
        ex.close()


@pytest.mark.parametrize("mode", [None, "gate", "predictor"])
def test_cpu_only_layers_run_in_the_native_decoder(make_model: Callable[..., Path], mode: str | None) -> None:
    # a budget below one layer: every layer is CPU-only, so the hybrid is the native decoder
    # (its layers here, the final norm and head in the engine): the in-process executor's numbers
    from powerinfer.coordinator.native_executor import NativeExecutor
    from powerinfer.native.decoder_lib import decoder_lib

    lib = decoder_lib()
    if lib is None:
        pytest.skip("no C compiler: the native decoder is not built")
    path = make_model(arch="qwen2", qtype=QT.Q4_0)
    f, cfg = load(path)
    pf = make_predictor(f, cfg, mode) if mode else None
    c = layer_costs(f, cfg, CTX, predictor=pf, max_tokens=8)
    if pf is not None:
        # calibrated too dense to pay (half the neurons fire): the in-process decoder would run these
        # layers dense, but in the hybrid every layer applies the rule, wherever it lives
        dense_pf = build_hybrid_executor(path, f, cfg, CTX, _opts("layer", int(c.overhead + 1)), predictor=pf)
        assert dense_pf.native is not None and dense_pf.native.sparse is not None
        assert dense_pf.native.sparse.sparse_layers == (True,) * cfg.n_layers
        dense_pf.close()
        from dataclasses import replace

        # sparse enough to pay: the in-process decoder applies the same rule, to compare with
        pf = replace(pf, layers=tuple(replace(lp, act_freq=np.full(cfg.n_ff, 0.1, np.float32)) for lp in pf.layers))
    ex = build_hybrid_executor(path, f, cfg, CTX, _opts("layer", int(c.overhead + 1)), predictor=pf)
    try:
        assert ex.layer_runs == ((0, cfg.n_layers),) and ex.native is not None
        assert isinstance(ex.gpu, NoGpu) and ex.pids == []  # nothing on the GPU: no worker
        ids, pos, slots = np.array(IDS), np.arange(len(IDS)), np.zeros(len(IDS), np.int64)
        ours = ex.execute(Batch(ids, pos, slots, Want.HIDDEN))  # final hidden states [T, d]
        oracle = NativeExecutor(lib, f, cfg, CTX, 1, max_tokens=8, predictor=pf)
        want = oracle.execute(Batch(ids, pos, slots, Want.HIDDEN))
        assert rel(ours, want) < 1e-5  # the same layers; only the final norm moved (numpy here, C there)
        assert ex.stats.native_layer_calls == cfg.n_layers and ex.stats.ffn_calls == 0
        if pf is not None:  # the same per-layer sparse decisions as the in-process decoder's
            assert ex.native.sparse is not None and oracle.sparse is not None
            assert ex.native.sparse.sparse_layers == oracle.sparse.sparse_layers == (True,) * cfg.n_layers
            assert 0 < ex.native.sparse.active.sum() == oracle.sparse.active.sum() < len(IDS) * cfg.n_layers * cfg.n_ff
    finally:
        ex.close()


def test_a_budget_that_holds_nothing_starts_no_gpu_worker(make_model: Callable[..., Path]) -> None:
    path = make_model(arch="llama", qtype=QT.Q4_0)
    f, cfg = load(path)
    c = layer_costs(f, cfg, CTX, max_tokens=8)
    opts = GpuOptions(backend="cpu", split="neuron", vram_budget_gib=(c.overhead + 1) / GIB, max_tokens=8)  # a worker process
    ex = build_hybrid_executor(path, f, cfg, CTX, opts)
    try:
        assert isinstance(ex.gpu, NoGpu) and ex.pids == [] and ex.gpu_bytes == 0
        assert Engine(f, cfg, ex, CTX, 8).eval(IDS[:5]).shape == (1, cfg.vocab_size)
    finally:
        ex.close()
