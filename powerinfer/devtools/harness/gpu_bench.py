"""Neuron split vs layer split: decode speed of a ReLU-sparse model larger than the VRAM budget.

Runs in: the GPU check process (``python -m powerinfer.devtools.harness.gpu_check``); the GPU side in a GPU
worker process, the CPU side in this process with one torch thread per core.

The model is a planted-sparsity llama file (:mod:`powerinfer.sparsity.relu_model`, cached in the
work directory). Its gate-mode predictor comes from a short profile of the file's own layers
(numpy): per layer the activation frequency and mass of every neuron and a threshold just above
the inactive neurons' |silu(gate)|. Both splits get the same budget, predictor and sparsity;
only the placement differs.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT

from powerinfer.config import ModelConfig, config_from_gguf
from powerinfer.gguf_file import GGUFFile
from powerinfer.model.weights import layer_tensor
from powerinfer.quants import dequantize_rows
from powerinfer.predictors.predictor_file import LayerPredictor, PredictorFile, model_fingerprint, write_predictor

log = logging.getLogger(__name__)

N_CTX = 256
PROMPT = 32
MIN_THRESHOLD = 1e-3  # |silu(gate)| of the planted inactive neurons is ~1e-6; active ones are O(1)


@dataclass(frozen=True)
class Row:
    part: str
    case: str
    value: str
    ok: bool | None  # None: a measurement, not a check


# SmolLM2-135M's shape (llama, Q4_0 here): small enough that a decode step is mostly per-layer overhead
SMOLLM2_SHAPE = dict(d_model=576, n_ff=1536, n_heads=9, n_kv_heads=3, vocab=49152)


def make_model(workdir: Path, shape: str, n_layers: int, qtype: str, tag: str = "", **overrides: int) -> Path:
    from powerinfer.sparsity.relu_model import ReluSparseSpec, write_relu_sparse_gguf

    path = workdir / f"relu-{tag or shape}-{n_layers}L-{qtype}.gguf"
    if not path.exists():
        workdir.mkdir(parents=True, exist_ok=True)
        spec = ReluSparseSpec.shape(shape, n_layers=n_layers, qtype=QT[qtype], calib_tokens=128, **overrides)
        tmp = path.with_name(path.name + ".part")
        write_relu_sparse_gguf(tmp, spec)
        os.replace(tmp, path)
    return path


def _down_norms(f: GGUFFile, layer: int) -> np.ndarray:
    """float64 [n_ff]: the L2 norm of each neuron's down-projection column."""
    name = layer_tensor(layer, "ffn_down")
    info, raw = f.tensor(name), f.raw(name)
    sq = np.zeros(info.n_cols)
    for i in range(0, info.n_rows, 1024):
        w = dequantize_rows(info.qtype, raw[i : i + 1024], info.n_cols)
        sq += np.einsum("ij,ij->j", w, w)
    return np.sqrt(sq)


def profile_predictor(path: Path, f: GGUFFile, cfg: ModelConfig, n_tokens: int = 64, inactive: float = 0.85) -> PredictorFile:
    """A gate-mode predictor from the file's own layers run on random byte tokens (numpy)."""
    from powerinfer.sparsity.relu_measure import run_layers

    ids = np.random.default_rng(0).integers(0, 256, (2, n_tokens // 2))
    ids[:, 0] = 256  # <s>
    layers = []
    for a in run_layers(f, cfg, ids):
        act = np.abs(a.gate / (1.0 + np.exp(-np.clip(a.gate, -80, 80))))  # |silu(gate)| [N, n_ff]
        thr = max(MIN_THRESHOLD, float(np.quantile(act, inactive)))
        mass = (act * np.abs(a.up)).sum(0) * _down_norms(f, a.layer)
        layers.append(LayerPredictor(
            fc1_w=np.zeros((0, cfg.d_model), np.float32), fc1_b=np.zeros(0, np.float32), fc2_w=np.zeros((cfg.n_ff, 0), np.float32),
            fc2_b=np.zeros(cfg.n_ff, np.float32), threshold=thr, act_freq=(act > thr).mean(0).astype(np.float32),
            act_mass=(mass / max(float(mass.sum()), 1e-30)).astype(np.float32)))
    return PredictorFile(mode="gate", model_name=cfg.name, fingerprint=model_fingerprint(f), n_layers=cfg.n_layers,
                         d_model=cfg.d_model, n_ff=cfg.n_ff, rank=0, target_sparsity=inactive,
                         calibration={"source": "gpu check profile", "tokens": int(ids.size)}, layers=tuple(layers))


def _decode(ex: object, f: GGUFFile, cfg: ModelConfig, n_tokens: int) -> tuple[float, float]:
    """(prefill tokens/s, decode tokens/s) of a greedy run from a fixed random prompt."""
    from powerinfer.coordinator.engine import Engine

    eng = Engine(f, cfg, ex, N_CTX, 64)  # type: ignore[arg-type]
    prompt = [256] + np.random.default_rng(1).integers(0, 256, PROMPT - 1).tolist()
    t0 = time.perf_counter()
    tok = int(eng.eval(prompt)[-1].argmax())
    t1 = time.perf_counter()
    for _ in range(n_tokens):
        tok = int(eng.eval([tok])[-1].argmax())
    t2 = time.perf_counter()
    return PROMPT / (t1 - t0), n_tokens / (t2 - t1)


def run_benchmark(workdir: Path, shape: str, n_layers: int, qtype: str, budget_gib: float, n_tokens: int,
                  backend: str = "cuda") -> list[Row]:
    import torch

    from powerinfer.coordinator.hybrid_executor import GpuOptions, build_hybrid_executor

    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    path = make_model(workdir, shape, n_layers, qtype)
    f = GGUFFile(path)
    cfg = config_from_gguf(f)
    rows = [Row("bench", "model", f"{shape} x{cfg.n_layers} layers {qtype}: {path.stat().st_size / 2**30:.2f} GiB vs budget "
                f"{budget_gib:g} GiB ({time.perf_counter() - t0:.0f}s)", None)]
    t0 = time.perf_counter()
    pf = profile_predictor(path, f, cfg)
    ppath = workdir / (path.stem + ".predictor")
    write_predictor(ppath, pf)
    share = float(np.mean([lp.act_freq.mean() for lp in pf.layers]))
    rows.append(Row("bench", "profile", f"{share:.1%} of neurons active per token ({time.perf_counter() - t0:.0f}s)", None))
    speeds = {}
    for split in ("neuron", "layer"):
        t0 = time.perf_counter()
        opts = GpuOptions(backend=backend, split=split, vram_budget_gib=budget_gib, reset_index=split == "neuron")
        ex = build_hybrid_executor(path, f, cfg, N_CTX, opts, predictor=pf, predictor_path=ppath)
        try:
            load = time.perf_counter() - t0
            pl = ex.placement
            hot = sum(len(h) for h in pl.hot) / (cfg.n_layers * cfg.n_ff)
            rows.append(Row("bench", f"{split} split placement", f"{sum(pl.gpu_layers)} attn layers, {hot:.1%} of neurons, "
                            f"{pl.mass_on_gpu:.1%} of mass, {pl.used / 2**30:.2f} GiB, load {load:.0f}s", pl.used <= int(budget_gib * (1 << 30))))
            prefill, decode = _decode(ex, f, cfg, n_tokens)
            st = ex.stats
            per = max(1, st.layer_calls // cfg.n_layers)  # forward passes
            rows.append(Row("bench", f"{split} split speed", f"prefill {prefill:.1f}, decode {decode:.2f} tokens/s ({threads} CPU threads); "
                            f"per pass: CPU FFN {1e3 * st.cpu_ffn_s / per:.0f} ms, GPU wait {1e3 * st.gpu_ffn_wait_s / per:.0f} ms, "
                            f"whole GPU layers {1e3 * st.gpu_layers_s / per:.0f} ms", None))
            speeds[split] = decode
        finally:
            ex.close()
    rows.append(Row("bench", "neuron vs layer split", f"{speeds['neuron'] / speeds['layer']:.2f}x decode speed", None))
    rows += _neuron_rank_rows(path, f, cfg, backend, budget_gib, pf, ppath, n_tokens, speeds["neuron"])
    return rows


def _neuron_rank_rows(path: Path, f: GGUFFile, cfg: ModelConfig, backend: str, budget_gib: float, pf: PredictorFile, ppath: Path,
                      n_tokens: int, hybrid: float) -> list[Row]:
    """The same neuron split with the GPU worker as a rank of the native pool (the default
    executor): the cold neurons on the CPU ranks' native kernels, in parallel with the GPU's hot
    ones, instead of the coordinator's torch shards."""
    from powerinfer.coordinator.gpu_rank import gpu_rank_spec
    from powerinfer.coordinator.hybrid_executor import GpuOptions
    from powerinfer.coordinator.native_pool import NativePoolExecutor, shm_blocker
    from powerinfer.native.decoder_lib import decoder_lib
    from powerinfer.cpu_workers.topology import default_workers

    n = min(8, default_workers())
    why = shm_blocker(f, cfg, n, sparse=True)
    if why is not None:
        return [Row("bench", "neuron split, GPU rank of the pool", f"not run: {why}", None)]
    opts = GpuOptions(backend=backend, split="neuron", vram_budget_gib=budget_gib)
    spec = gpu_rank_spec(path, f, cfg, N_CTX, opts, predictor=pf, predictor_path=ppath)
    if spec is None:
        return [Row("bench", "neuron split, GPU rank of the pool", "the budget holds nothing", False)]
    t0 = time.perf_counter()
    ex = NativePoolExecutor(decoder_lib(), f, str(path), cfg, N_CTX, n, max_tokens=64, predictor=str(ppath), gpu=spec)  # type: ignore[arg-type]
    try:
        load = time.perf_counter() - t0
        prefill, decode = _decode(ex, f, cfg, n_tokens)
        per = max(1, ex.stats.calls)
        rows = [Row("bench", "neuron split, GPU rank of the pool", f"prefill {prefill:.1f}, decode {decode:.2f} tokens/s ({n} CPU ranks, "
                    f"load {load:.0f}s); a CPU rank waited {ex.stats.gpu_us / per / 1e3:.1f} ms a step for the GPU (mean, prefill included)", None)]
    finally:
        ex.close()
    rows.append(Row("bench", "neuron split: GPU rank vs hybrid", f"{decode / hybrid:.2f}x decode speed (one round each)", None))
    return rows



def run_worker_overhead(workdir: Path, n_tokens: int, backend: str = "cuda", n_layers: int = 30) -> list[Row]:
    """Decode speed of a SmolLM2-shaped file in alternating rounds. Every layer on the GPU, four
    ways: the GPU worker in its own process sent two requests per layer (protocol 4's path), the
    same worker sent one LAYERS request per step (the hybrid executor's default), the runtime in
    the coordinator's process (``--gpu-worker inprocess``), and the GPU worker as a rank of the
    native pool (the default since protocol 7: the stream handed over in shared memory). Then half
    the layers on the GPU, the hybrid (LAYERS) against the pool with the GPU rank; then a neuron
    split (every attention and about half the neurons on the GPU), the hybrid against the pool with
    the GPU rank (protocol 8): what the process boundary costs a step when the kernels are short,
    and what each design removes."""
    t0 = time.perf_counter()
    path = make_model(workdir, "tiny", n_layers, "Q4_0", tag="smollm2-shape", **SMOLLM2_SHAPE)
    f = GGUFFile(path)
    cfg = config_from_gguf(f)
    rows = [Row("overhead", "model", f"SmolLM2 shape, {cfg.n_layers} layers Q4_0 ({time.perf_counter() - t0:.0f}s)", None)]
    half = cfg.n_layers // 2
    names = {"per-layer": "all on the GPU: GPU worker process, 2 requests a layer", "layers": "all on the GPU: GPU worker process, LAYERS",
             "inprocess": "all on the GPU: GPU runtime in-process", "rank": "all on the GPU: GPU worker as a rank of the pool",
             "layers-half": f"{half} layers on the GPU: hybrid, LAYERS", "rank-half": f"{half} layers on the GPU: pool with a GPU rank",
             "neuron-hybrid": "neuron split (every attention, some neurons): hybrid",
             "neuron-rank": "neuron split (every attention, some neurons): pool with a GPU rank"}
    speeds: dict[str, list[float]] = {k: [] for k in names}
    for _ in range(2):  # alternating rounds
        for way in names:
            ex = _overhead_executor(way, path, f, cfg, backend, half)
            try:
                _, decode = _decode(ex, f, cfg, n_tokens)
            finally:
                ex.close()  # type: ignore[attr-defined]
            speeds[way].append(decode)
    for way, name in names.items():
        rows.append(Row("overhead", f"{name} decode", " / ".join(f"{v:.1f}" for v in speeds[way]) + " tokens/s", None))

    def ratio(a: str, b: str) -> float:
        return float(np.median([y / x for x, y in zip(speeds[a], speeds[b])]))

    rows.append(Row("overhead", "LAYERS vs 2 requests a layer", f"{ratio('per-layer', 'layers'):.2f}x decode speed (median of rounds)", None))
    rows.append(Row("overhead", "in-process vs LAYERS", f"{ratio('layers', 'inprocess'):.2f}x decode speed (median of rounds)", None))
    rows.append(Row("overhead", "GPU rank vs LAYERS, all layers", f"{ratio('layers', 'rank'):.2f}x decode speed (median of rounds)", None))
    rows.append(Row("overhead", f"GPU rank vs LAYERS, {half} layers", f"{ratio('layers-half', 'rank-half'):.2f}x decode speed (median of rounds)",
                    None))
    rows.append(Row("overhead", "neuron split: GPU rank vs hybrid", f"{ratio('neuron-hybrid', 'neuron-rank'):.2f}x decode speed (median of "
                    "rounds)", None))
    return rows


def _overhead_executor(way: str, path: Path, f: GGUFFile, cfg: ModelConfig, backend: str, half: int) -> object:
    """One arm of run_worker_overhead, built and checked (see its docstring)."""
    from powerinfer.coordinator.gpu_rank import gpu_rank_spec
    from powerinfer.coordinator.hybrid_executor import GpuOptions, build_hybrid_executor
    from powerinfer.coordinator.native_pool import NativePoolExecutor
    from powerinfer.native.decoder_lib import decoder_lib
    from powerinfer.cpu_workers.topology import default_workers

    ngl = half if way.endswith("-half") else -1
    opts = GpuOptions(backend=backend, split="layer", vram_budget_gib=2.0, process=way != "inprocess", n_gpu_layers=ngl)
    if way.startswith("neuron"):  # every layer's attention, then about half of each layer's neurons (by index)
        from powerinfer.coordinator.placement import layer_costs

        c = layer_costs(f, cfg, N_CTX, sparse=False)
        budget = int(c.overhead + c.fixed.sum() + c.per_neuron.sum() * cfg.n_ff // 2)
        opts = GpuOptions(backend=backend, split="neuron", vram_budget_gib=budget / 2**30, reset_index=True)
        if way == "neuron-rank":
            spec = gpu_rank_spec(path, f, cfg, N_CTX, opts, sparse=False)
            if spec is None or not spec.split_layers:
                raise RuntimeError("expected a neuron split with layers shared between the GPU and the CPU ranks")
            return NativePoolExecutor(decoder_lib(), f, str(path), cfg, N_CTX, min(8, default_workers()), max_tokens=64, gpu=spec)  # type: ignore[arg-type]
        return build_hybrid_executor(path, f, cfg, N_CTX, opts, sparse=False)
    if way.startswith("rank"):
        lib = decoder_lib()
        spec = gpu_rank_spec(path, f, cfg, N_CTX, opts, sparse=False)
        if lib is None or spec is None or len(spec.layers) != (half if ngl > 0 else cfg.n_layers):
            raise RuntimeError(f"expected a native pool with {ngl if ngl > 0 else 'every'} GPU layers ({way})")
        return NativePoolExecutor(lib, f, str(path), cfg, N_CTX, min(8, default_workers()), max_tokens=64, gpu=spec)
    ex = build_hybrid_executor(path, f, cfg, N_CTX, opts, sparse=False)
    want = half if ngl > 0 else cfg.n_layers
    if sum(ex.placement.gpu_layers) != want or (way != "inprocess" and not ex.pids):
        ex.close()
        raise RuntimeError(f"expected {want} layers on the GPU ({way})")
    if way == "per-layer":
        ex.layer_runs = ()  # the engine then sends attention and FFN of each layer
    return ex
