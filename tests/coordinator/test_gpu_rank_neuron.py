"""The GPU rank in neuron split (coordinator/gpu_rank.py, gpu_worker/rank.py, kernels/handoff.h's
PI_GPU_ATTN / PI_GPU_FFN) on the CPU backend: a layer's attention or hot neurons on the GPU rank,
the cold neurons on the CPU ranks.

Oracles: on float32 files the CPU ranks' kernels and the numpy GPU backend compute in float, so
the pool with a GPU rank must give the all-CPU pool's numbers up to float rounding (a neuron
counted twice or lost moves a logit by the FFN's whole contribution); the same GPU share over 1,
2 or 3 CPU ranks gives the same bits (the CPU merge is exact); on quantized files and SmolLM2, the
hybrid executor's tokens.

Runs in: the pytest process (coordinator), with CPU worker processes and a GPU worker process.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

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
from powerinfer.gguf_file import GGUFFile
from powerinfer.gpu_worker.client import GpuSetup, LocalGpuWorker
from powerinfer.gpu_worker.layout import GpuPlan
from powerinfer.predictors.predictor_file import PredictorFile, write_predictor
from powerinfer.protocol import WorkerError
from tests.coordinator.helpers import gone, kill_the_gpu_rank_mid_step, long_prompt_runs
from tests.gpu_worker.helpers import make_predictor

IDS = [256, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33]
CTX = 64
lib = decoder_lib()
pytestmark = pytest.mark.skipif(lib is None, reason="no C compiler: the native pool is unavailable")

# per layer of a 4-layer model: (attention on the GPU, share of neurons hot); shares below 0 take
# the first -share of the neurons (the solver's order without a predictor: the CPU ranks then skip
# whole blocks of 16 gate and up rows)
SPLITS = {
    "attention and half the neurons": ((True, 0.5), (True, 0.5), (False, 0.5), (False, 0.0)),
    "the first neurons": ((True, -0.6), (False, -0.3), (False, -0.6), (True, 0.0)),
    "hot neurons only": ((False, 0.3), (False, 0.3), (False, 0.3), (False, 0.3)),
    "attention only": ((False, 0.0), (True, 0.0), (False, 0.0), (True, 0.0)),
    "a whole layer among split ones": ((True, 1.0), (True, 0.25), (False, 1.0), (False, 0.0)),
}


def _setup(n_ff: int, split: tuple[tuple[bool, float], ...], seed: int = 0) -> GpuSetup:
    rng = np.random.default_rng(seed)
    hot = tuple(np.arange(int(-share * n_ff), dtype=np.int32) if share < 0 else
                np.sort(rng.choice(n_ff, int(share * n_ff), replace=False)).astype(np.int32) for _, share in split)
    return GpuSetup("cpu", 1 << 30, GpuPlan(hot, tuple(a for a, _ in split), True, 8))


def _pool(path: Path, setup: GpuSetup | None, n_workers: int = 2, predictor: str = "", gpu_ctx: int = CTX) -> NativePoolExecutor:
    assert lib is not None
    f = GGUFFile(path)
    cfg = config_from_gguf(f)
    spec = GpuRankSpec(str(path), setup, gpu_ctx, 1, predictor, n_ff=cfg.n_ff) if setup is not None else None
    return NativePoolExecutor(lib, f, str(path), cfg, CTX, n_workers, max_tokens=8, predictor=predictor, gpu=spec)


def _decode(path: Path, ex: object) -> np.ndarray:
    """The engine's decode logits after each token (prefill of 6, then one token a step): [n, V]."""
    f = GGUFFile(path)
    eng = Engine(f, config_from_gguf(f), ex, CTX, 8)  # type: ignore[arg-type]
    try:
        return np.stack([eng.eval(IDS[:6])[0]] + [eng.eval([t])[0] for t in IDS[6:]])
    finally:
        ex.close()  # type: ignore[attr-defined]


def _close_best(a: np.ndarray, b: np.ndarray, atol: float) -> None:
    """Each row's best token agrees, and its float32-refined logit within atol."""
    assert (a.argmax(-1) == b.argmax(-1)).all()
    r, ia = np.arange(len(a)), a.argmax(-1)
    np.testing.assert_allclose(a[r, ia], b[r, ia], atol=atol)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("split", list(SPLITS))
def test_gpu_share_plus_cpu_share_is_the_whole_model(make_model: Callable[..., Path], arch: str, split: str) -> None:
    path = make_model(arch=arch, qtype=QT.F32, n_layers=4)
    cfg = config_from_gguf(GGUFFile(path))
    ex = _pool(path, _setup(cfg.n_ff, SPLITS[split]))
    assert len(ex.pids) == 3  # two CPU ranks and the GPU rank
    ours = _decode(path, ex)
    # float rounding only (the numpy GPU backend keeps the down projection's rows in float16)
    _close_best(ours, _decode(path, _pool(path, None)), atol=3e-3)


@pytest.mark.slow
@pytest.mark.parametrize("n_workers", [1, 3])
@pytest.mark.parametrize("split", ["attention and half the neurons", "the first neurons"])
def test_the_cpu_ranks_split_the_cold_neurons_exactly(make_model: Callable[..., Path], n_workers: int, split: str) -> None:
    path = make_model(arch="llama", qtype=QT.Q4_0, n_layers=4)
    setup = _setup(config_from_gguf(GGUFFile(path)).n_ff, SPLITS[split])
    np.testing.assert_array_equal(_decode(path, _pool(path, setup, n_workers)), _decode(path, _pool(path, setup, 2)))


def _hybrid(path: Path, setup: GpuSetup) -> HybridExecutor:
    f = GGUFFile(path)
    cfg = config_from_gguf(f)
    pl = Placement("neuron", setup.budget, setup.plan.hot, setup.plan.gpu_layers, 0, 0.0)
    return HybridExecutor(f, cfg, CTX, pl, LocalGpuWorker(f, cfg, setup, CTX))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_quantized_neuron_split_gives_the_hybrids_tokens(make_model: Callable[..., Path], arch: str) -> None:
    """The hybrid computes the CPU's share on float torch shards, the pool on the 8-bit kernels."""
    path = make_model(arch=arch, qtype=QT.Q4_0, n_layers=4)
    setup = _setup(config_from_gguf(GGUFFile(path)).n_ff, SPLITS["attention and half the neurons"])
    _close_best(_decode(path, _pool(path, setup)), _decode(path, _hybrid(path, setup)), atol=0.05)


def _decided_predictor(f: GGUFFile, cfg: ModelConfig, mode: str, few: bool) -> PredictorFile:
    """make_predictor's, made decisive: predictor mode's logits are +-3 plus a little (the GPU's
    float predictor and the CPU ranks' 8-bit one then pick the same neurons, about half); gate mode
    with few: a threshold that leaves about 5% of the neurons active, below the 10% under which a
    decode step's down projection takes the sparse Q8_0 path (sparse_rows.h) on every side."""
    pf = make_predictor(f, cfg, mode)
    rng = np.random.default_rng(1)
    layers = []
    for lp in pf.layers:
        if mode == "predictor":
            lp = replace(lp, fc2_w=lp.fc2_w * np.float32(0.01), fc2_b=rng.choice(np.float32([-3.0, 3.0]), cfg.n_ff))
        elif few:
            lp = replace(lp, threshold=lp.threshold * 4.0)
        layers.append(lp)
    return replace(pf, layers=tuple(layers))


@pytest.mark.parametrize("mode, few", [("gate", False), ("gate", True), ("predictor", False)])
def test_sparse_cold_neurons_leave_the_hot_ones_to_the_gpu(make_model: Callable[..., Path], tmp_path: Path, mode: str, few: bool) -> None:
    """With a predictor both sides apply its rule; a hot neuron computed on the CPU as well would
    be counted twice (that moves these logits by 1.2-1.7 when every hot neuron is; one lost neuron
    by about 0.016). Oracle: the same pool with the attention alone on the GPU (the same rule,
    every neuron on the CPU ranks), on a float file. The CPU ranks choose the sparse down
    projection by their own active neurons, so with a GPU share it may take the Q8_0 path where
    the all-CPU pool takes the dense one (within 1/254 of a block, up to 0.07 of these hidden
    states); `few` makes both take it, where the oracle's hot neurons go through the CPU's Q8_0
    copy of the down projection and ours through the GPU's float one (0.015 apart on these
    logits, so only a gross error shows there)."""
    path = make_model(arch="qwen2", qtype=QT.F32, n_layers=4)
    f = GGUFFile(path)
    cfg = config_from_gguf(f)
    ppath = str(tmp_path / "m.predictor")
    write_predictor(ppath, _decided_predictor(f, cfg, mode, few))
    split = SPLITS["attention and half the neurons"]
    ours = _decode(path, _pool(path, _setup(cfg.n_ff, split), predictor=ppath))
    attention_only = _setup(cfg.n_ff, tuple((a, 0.0) for a, _ in split))
    _close_best(ours, _decode(path, _pool(path, attention_only, predictor=ppath)), atol=0.03 if few else 3e-3)


def test_smollm2_neuron_split_through_llm_agrees_with_llama_cpp(smollm2_path: Path, reference: dict[str, Any]) -> None:
    """The default split (neuron), no predictor: the first 10 layers' attention and ~795 of their
    1536 neurons (by index) on the GPU rank. Teacher-forced on llama.cpp's greedy run: 29/32 best
    tokens and top-5 logits within 0.63 when written (the all-CPU pool 31/32, the hybrid with the
    same placement 30/32, the layer split's GPU rank 29/32 and 1.26: llama.cpp's near-ties at
    tokens 5, 14 and 19 fall either way once the numpy GPU backend's float16/Q8_0 copies take
    part); greedy text as the hybrid's while no near-tie decides it (the 6th token is one: its two
    best differ by 0.007-0.14 between executors)."""
    gpu = GpuOptions(backend="cpu", split="neuron", vram_budget_gib=0.02, n_gpu_layers=10)
    run = reference["smollm2"]["greedy"][0]
    prompt, gen = run["prompt_tokens"], run["generated_tokens"]
    with LLM(smollm2_path, gpu=gpu, n_threads=2, worker_threads=1, n_ctx=256) as llm:
        ex = llm.engine.executor
        assert type(ex).__name__ == "NativePoolExecutor" and len(ex.pids) == 3
        assert ex.gpu_spec is not None and len(ex.gpu_spec.split_layers) == 10 and not ex.gpu_spec.layers
        logits = llm.engine.eval(prompt + gen, all_logits=True)
        llm.engine.rewind(0)
        ours = llm.complete("The capital of France is", max_tokens=5, temperature=0)[0]
    agree = int((logits[len(prompt) - 1 : len(prompt) - 1 + len(gen)].argmax(-1) == np.array(gen)).sum())
    worst = max(abs(float(logits[len(prompt) - 1 + i][t]) - v) for i, top in enumerate(run["top5"]) for t, v in top)
    assert agree >= 29 and worst < 1.0, (agree, worst)
    with LLM(smollm2_path, gpu=gpu, executor="inprocess", n_ctx=256) as llm:
        assert type(llm.engine.executor).__name__ == "HybridExecutor"
        assert ours == llm.complete("The capital of France is", max_tokens=5, temperature=0)[0]


def test_a_prompt_longer_than_the_gpus_chunk(smollm2_path: Path) -> None:
    """A 200-odd token prompt: hand-offs of more rows than the GPU computes at a time (128), chunked there."""
    gpu = GpuOptions(backend="cpu", split="neuron", vram_budget_gib=0.02, n_gpu_layers=10)
    out = long_prompt_runs(smollm2_path, gpu)
    assert (out["process"][1].argmax(-1) == out["inprocess"][1].argmax(-1)).mean() >= 0.95


def _answers(ex: NativePoolExecutor) -> list[int]:
    """Each CPU rank's return code for the failed step: every one answered (none hangs in a barrier)."""
    assert lib is not None and ex.seg is not None
    out = np.zeros((len(ex.ranks), 5), dtype=np.int64)
    deadline = time.monotonic() + 5.0
    while lib.pi_door_wait(ex.seg.base, ex._gen, 100, out.ctypes.data) != 0:  # the abort flag is set: poll
        assert time.monotonic() < deadline, "a CPU rank did not answer the failed step"
        time.sleep(0.05)
    return [int(v) for v in out[:, 0]]


@pytest.mark.parametrize("split", ["hot neurons only", "attention only"])
def test_a_gpu_rank_that_dies_inside_a_layer(make_model: Callable[..., Path], split: str) -> None:
    """Stopped, then killed while the CPU ranks wait for its hot partial (or its attention): the
    step fails within seconds naming it, every CPU rank answers with a failure code and lives on,
    the pool restarts, nothing is left."""
    path = make_model(arch="llama", qtype=QT.Q4_0, n_layers=4)
    ex = _pool(path, _setup(config_from_gguf(GGUFFile(path)).n_ff, SPLITS[split]))
    pids = list(ex.pids)
    try:
        pids, before = kill_the_gpu_rank_mid_step(ex, IDS)
        assert set(_answers(ex)) <= {10, 11} and all(psutil.pid_exists(p) for p in pids[:-1])  # aborted / peer dead
        ex.restart()
        np.testing.assert_array_equal(ex.native_step(IDS[:6], range(6), [0] * 6, False, 1.0, 8), before)
        pids += ex.pids
    finally:
        ex.close()
    assert gone(pids)


@pytest.mark.parametrize("split", ["hot neurons only", "attention only"])
def test_a_failed_gpu_task_fails_the_step_with_the_reason(make_model: Callable[..., Path], split: str) -> None:
    """The GPU's KV cache holds 8 positions, the CPU ranks' 64: its attention (or, for the hot
    neurons, nothing: they keep no cache) fails past position 8."""
    path = make_model(arch="llama", qtype=QT.Q4_0, n_layers=4)
    ex = _pool(path, _setup(config_from_gguf(GGUFFile(path)).n_ff, SPLITS[split]), gpu_ctx=8)
    try:
        ex.native_step(IDS[:6], range(6), [0] * 6, False, 1.0, 8)
        if split == "attention only":
            with pytest.raises(WorkerError, match="GPU worker failed its part of the step"):
                ex.native_step(IDS[:4], range(6, 10), [0] * 4, False, 1.0, 8)
            assert set(_answers(ex)) == {14} and all(psutil.pid_exists(p) for p in ex.pids)
            ex.restart()
            ex.native_step(IDS[:6], range(6), [0] * 6, False, 1.0, 8)
        else:  # the hot neurons keep no positions to outgrow
            ex.native_step(IDS[:4], range(6, 10), [0] * 4, False, 1.0, 8)
    finally:
        ex.close()
