"""The GPU worker as a rank of the native pool (coordinator/gpu_rank.py, gpu_worker/rank.py,
native/kernels/handoff.h) on the CPU backend: the pool with a GPU rank gives the hybrid
executor's numbers for any set of GPU layers, on synthetic models and SmolLM2, with 1-3 CPU ranks;
a GPU rank that dies or fails its run fails the step without a hang and the pool restarts; an idle
GPU rank sleeps.

Runs in: the pytest process (coordinator), with CPU worker processes and a GPU worker process.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

import numpy as np
import psutil
import pytest
from gguf import GGMLQuantizationType as QT

from powerinfer.api import LLM
from powerinfer.config import ModelConfig, config_from_gguf
from powerinfer.coordinator.engine import Engine
from powerinfer.coordinator.gpu_rank import GpuRankSpec
from powerinfer.coordinator.hybrid_executor import GpuOptions, HybridExecutor
from powerinfer.coordinator.native_pool import NativePoolExecutor
from powerinfer.coordinator.placement import Placement
from powerinfer.native.decoder_lib import decoder_lib
from powerinfer.errors import InvalidArgumentError
from powerinfer.gguf_file import GGUFFile
from powerinfer.gpu_worker.client import GpuSetup, LocalGpuWorker
from powerinfer.gpu_worker.layout import GpuPlan
from powerinfer.predictors.predictor_file import read_predictor, write_predictor
from powerinfer.protocol import WorkerDiedError, WorkerError
from tests.coordinator.helpers import gone, kill_the_gpu_rank_mid_step, long_prompt_runs
from tests.gpu_worker.helpers import make_predictor

IDS = [256, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33]
CTX = 64
lib = decoder_lib()
pytestmark = pytest.mark.skipif(lib is None, reason="no C compiler: the native pool is unavailable")


def _setup(cfg: ModelConfig, layers: set[int]) -> GpuSetup:
    hot = tuple(np.arange(cfg.n_ff, dtype=np.int32) if i in layers else np.zeros(0, np.int32) for i in range(cfg.n_layers))
    return GpuSetup("cpu", 1 << 30, GpuPlan(hot, tuple(i in layers for i in range(cfg.n_layers)), True, 8))


def _pool(path: Path, layers: set[int], n_workers: int = 2, gpu_ctx: int = CTX, n_slots: int = 1, predictor: str = "",
          step_channel: str = "shm") -> NativePoolExecutor:
    assert lib is not None
    f = GGUFFile(path)
    cfg = config_from_gguf(f)
    spec = GpuRankSpec(str(path), _setup(cfg, layers), gpu_ctx, n_slots, predictor, n_ff=cfg.n_ff)
    return NativePoolExecutor(lib, f, str(path), cfg, CTX, n_workers, n_slots=n_slots, max_tokens=8, step_channel=step_channel,
                              predictor=predictor, gpu=spec)


def _hybrid(path: Path, layers: set[int], predictor: str = "") -> HybridExecutor:
    f = GGUFFile(path)
    cfg = config_from_gguf(f)
    setup = _setup(cfg, layers)
    pl = Placement("layer", setup.budget, setup.plan.hot, setup.plan.gpu_layers, 0, 0.0)
    pf = read_predictor(predictor, model=f) if predictor else None
    return HybridExecutor(f, cfg, CTX, pl, LocalGpuWorker(f, cfg, setup, CTX, predictor=pf), predictor=pf)


def _decode(path: Path, ex: object, ids: list[int]) -> np.ndarray:
    """The engine's decode logits after each token (prefill of 6, then one token a step): [n, V]."""
    f = GGUFFile(path)
    cfg = config_from_gguf(f)
    eng = Engine(f, cfg, ex, CTX, 8)  # type: ignore[arg-type]
    rows = [eng.eval(ids[:6])[0]] + [eng.eval([t])[0] for t in ids[6:]]
    return np.stack(rows)


def _same_best(a: np.ndarray, b: np.ndarray) -> None:
    """Each row's best token and its (float32-refined) logit agree: the hidden states agree, the
    8-bit head's other entries may not (the hybrid's head is another path)."""
    assert (a.argmax(-1) == b.argmax(-1)).all()
    ia = a.argmax(-1)
    np.testing.assert_allclose(a[np.arange(len(a)), ia], b[np.arange(len(b)), ia], atol=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("layers", [{0}, {2, 3}, {1, 3}, {0, 1, 2, 3}])
def test_pool_with_a_gpu_rank_equals_the_hybrid(make_model: Callable[..., Path], arch: str, layers: set[int]) -> None:
    path = make_model(arch=arch, qtype=QT.Q4_0, n_layers=4)
    ex = _pool(path, layers)
    try:
        assert len(ex.pids) == 3  # two CPU ranks and the GPU rank
        ours = _decode(path, ex, IDS)
    finally:
        ex.close()
    oracle = _decode(path, _hybrid(path, layers), IDS)
    _same_best(ours, oracle)


@pytest.mark.parametrize("mode", ["gate", "predictor"])
def test_sparse_layers_on_both_sides_equal_the_hybrid(make_model: Callable[..., Path], tmp_path: Path, mode: str) -> None:
    path = make_model(arch="qwen2", qtype=QT.Q8_0, n_layers=4)
    f = GGUFFile(path)
    ppath = str(tmp_path / "m.predictor")
    write_predictor(ppath, make_predictor(f, config_from_gguf(f), mode))
    ex = _pool(path, {1, 2}, predictor=ppath)
    try:
        ours = _decode(path, ex, IDS)
    finally:
        ex.close()
    _same_best(ours, _decode(path, _hybrid(path, {1, 2}, ppath), IDS))


@pytest.mark.parametrize("n_workers", [1, 2, 3])
def test_smollm2_layer_split_through_llm_equals_the_hybrid(smollm2_path: Path, n_workers: int) -> None:
    gpu = GpuOptions(backend="cpu", split="layer", vram_budget_gib=1.0, n_gpu_layers=12)
    prompt = "The capital of France is"
    with LLM(smollm2_path, gpu=gpu, n_threads=n_workers, worker_threads=1, n_ctx=128) as llm:
        assert type(llm.engine.executor).__name__ == "NativePoolExecutor" and len(llm.engine.executor.pids) == n_workers + 1
        ours = llm.complete(prompt, max_tokens=16, temperature=0)[0]
        ours_logits = llm.logits(llm.tokenize(prompt))
    with LLM(smollm2_path, gpu=gpu, executor="inprocess", n_ctx=128) as llm:
        assert type(llm.engine.executor).__name__ == "HybridExecutor"
        oracle = llm.complete(prompt, max_tokens=16, temperature=0)[0]
        oracle_logits = llm.logits(llm.tokenize(prompt))
    assert ours == oracle
    _same_best(ours_logits, oracle_logits)


def test_steps_as_zmq_messages_give_the_doorbells_numbers(make_model: Callable[..., Path]) -> None:
    """The GPU rank reads the step's positions and slots from the segment whichever way the CPU
    ranks got the step (a review found them unwritten for STEP messages)."""
    path = make_model(arch="llama", qtype=QT.Q4_0, n_layers=4)
    out = {}
    for channel in ("shm", "zmq"):
        ex = _pool(path, {1, 2}, step_channel=channel)
        try:
            ex.native_step(IDS[:6], range(6), [0] * 6, False, 1.0, 8)
            out[channel] = ex.native_step(IDS[6:10], range(6, 10), [0] * 4, True, 1.0, 8)
        finally:
            ex.close()
    np.testing.assert_array_equal(out["zmq"], out["shm"])


def test_a_prompt_longer_than_the_gpus_chunk(smollm2_path: Path) -> None:
    """A 200-odd token prompt: one hand-off of more tokens than the GPU computes at a time (128), chunked there."""
    gpu = GpuOptions(backend="cpu", split="layer", vram_budget_gib=1.0, n_gpu_layers=6)
    out = long_prompt_runs(smollm2_path, gpu)
    assert out["process"][0] == out["inprocess"][0]
    assert (out["process"][1].argmax(-1) == out["inprocess"][1].argmax(-1)).mean() >= 0.99


def test_batched_slots_equal_each_sequence_alone(make_model: Callable[..., Path]) -> None:
    path = make_model(arch="llama", qtype=QT.Q4_0, n_layers=4)
    ex = _pool(path, {1, 2}, n_slots=2)
    try:
        a = ex.native_step(IDS[:5], range(5), [0] * 5, False, 1.0, 8)
        b = ex.native_step(IDS[5:9], range(4), [1] * 4, False, 1.0, 8)
        both = ex.native_step([IDS[9], IDS[10]], [5, 4], [0, 1], True, 1.0, 8)
    finally:
        ex.close()
    alone = _pool(path, {1, 2}, n_slots=2)
    try:
        alone.native_step(IDS[:5], range(5), [0] * 5, False, 1.0, 8)
        first = alone.native_step([IDS[9]], [5], [0], False, 1.0, 8)
        alone.native_step(IDS[5:9], range(4), [1] * 4, False, 1.0, 8)
        second = alone.native_step([IDS[10]], [4], [1], False, 1.0, 8)
    finally:
        alone.close()
    assert a.shape == b.shape == (1, both.shape[1])
    np.testing.assert_array_equal(both, np.concatenate([first, second]))


def test_a_dead_gpu_rank_fails_the_step_and_the_pool_restarts(make_model: Callable[..., Path]) -> None:
    path = make_model(arch="llama", qtype=QT.Q4_0, n_layers=4)
    ex = _pool(path, {1, 2})
    try:
        before = ex.native_step(IDS[:6], range(6), [0] * 6, False, 1.0, 8)
        gpu_pid = ex.pids[-1]
        psutil.Process(gpu_pid).kill()
        t0 = time.monotonic()
        with pytest.raises(WorkerDiedError, match="the GPU worker"):
            ex.native_step(IDS[:6], range(6), [0] * 6, False, 1.0, 8)
        assert time.monotonic() - t0 < 10  # noticed inside the hand-off's wait, not at a deadline
        ex.restart()
        assert gpu_pid not in ex.pids and gone([gpu_pid])
        np.testing.assert_array_equal(ex.native_step(IDS[:6], range(6), [0] * 6, False, 1.0, 8), before)
    finally:
        ex.close()


def test_a_gpu_rank_that_dies_while_the_cpu_ranks_wait_for_it(make_model: Callable[..., Path]) -> None:
    """Stopped, then killed while the CPU ranks wait inside the hand-off: the step fails at once
    (the ranks see it die through /proc), and no process is left behind."""
    path = make_model(arch="llama", qtype=QT.Q4_0, n_layers=4)
    ex = _pool(path, {0, 3})
    pids = list(ex.pids)
    try:
        pids, _ = kill_the_gpu_rank_mid_step(ex, IDS)
        ex.restart()
        ex.native_step(IDS[:6], range(6), [0] * 6, False, 1.0, 8)
        pids += ex.pids
    finally:
        ex.close()
    assert gone(pids)


def test_a_failed_gpu_run_fails_the_step_with_the_reason(make_model: Callable[..., Path]) -> None:
    path = make_model(arch="llama", qtype=QT.Q4_0, n_layers=4)
    ex = _pool(path, {2}, gpu_ctx=8)  # the GPU's KV cache holds 8 positions, the CPU ranks' 64
    try:
        ex.native_step(IDS[:6], range(6), [0] * 6, False, 1.0, 8)
        with pytest.raises(WorkerError, match="GPU worker failed its part of the step"):
            ex.native_step(IDS[:4], range(6, 10), [0] * 4, False, 1.0, 8)
        ex.restart()
        ex.native_step(IDS[:6], range(6), [0] * 6, False, 1.0, 8)
    finally:
        ex.close()


def test_an_idle_gpu_rank_sleeps(make_model: Callable[..., Path]) -> None:
    path = make_model(arch="llama", qtype=QT.Q4_0, n_layers=4)
    ex = _pool(path, {1})
    try:
        ex.native_step(IDS[:6], range(6), [0] * 6, False, 1.0, 8)
        procs = [psutil.Process(p) for p in ex.pids]
        cpu0 = [sum(p.cpu_times()[:2]) for p in procs]
        time.sleep(3.0)
        used = [sum(p.cpu_times()[:2]) - c for p, c in zip(procs, cpu0)]
        assert max(used) < 0.15, used
    finally:
        ex.close()


def test_the_spec_names_what_goes_where(make_model: Callable[..., Path]) -> None:
    path = make_model(arch="llama", qtype=QT.Q4_0, n_layers=4)
    cfg = config_from_gguf(GGUFFile(path))
    hot = _setup(cfg, {1, 2}).plan.hot
    mixed = (np.arange(5, dtype=np.int32), hot[1][: cfg.n_ff // 2], hot[2], hot[3])  # layers 0, 1 split, layer 2 whole
    spec = GpuRankSpec(str(path), GpuSetup("cpu", 1 << 30, GpuPlan(mixed, (False, True, True, True), True, 8)), CTX, n_ff=cfg.n_ff)
    assert (spec.layers, spec.attn_layers, spec.split_layers) == ((2,), (1, 3), (0, 1, 3))
    assert json.loads(spec.hot_json()) == [list(range(5)), list(range(cfg.n_ff // 2)), [], []]
    with pytest.raises(InvalidArgumentError, match="FFN width"):
        GpuRankSpec(str(path), _setup(cfg, {1}), CTX)
    with pytest.raises(InvalidArgumentError, match="places nothing on the GPU"):
        GpuRankSpec(str(path), _setup(cfg, set()), CTX, n_ff=cfg.n_ff)
    bad = (np.array([0, 0], np.int32), hot[1], hot[2], hot[3])
    with pytest.raises(InvalidArgumentError, match="layer 0: hot neurons must be distinct"):
        GpuRankSpec(str(path), GpuSetup("cpu", 1 << 30, GpuPlan(bad, (False,) * 4, True, 8)), CTX, n_ff=cfg.n_ff)
