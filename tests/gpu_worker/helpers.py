"""Shared helpers of the GPU worker tests: synthetic models, predictors and GPU runtimes on the CPU backend.

Runs in: the pytest process.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from powerinfer.config import ACT_CODES, ModelConfig, config_from_gguf
from powerinfer.gguf_file import GGUFFile
from powerinfer.gpu_worker.backend import CpuBackend
from powerinfer.gpu_worker.kernels import act
from powerinfer.gpu_worker.layout import GpuPlan
from powerinfer.gpu_worker.model import GpuModel
from powerinfer.model.weights import layer_tensor
from powerinfer.quants import dequantize_rows
from powerinfer.predictors.predictor_file import LayerPredictor, PredictorFile, model_fingerprint


def load(path: Path) -> tuple[GGUFFile, ModelConfig]:
    f = GGUFFile(path)
    return f, config_from_gguf(f)


def make_predictor(f: GGUFFile, cfg: ModelConfig, mode: str, seed: int = 0, rank: int = 8) -> PredictorFile:
    """A valid predictor for this model: gate thresholds at the median |act(gate)| of random inputs,
    or a random low-rank MLP (about half the neurons predicted active); skewed activation masses."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((64, cfg.d_model))
    layers = []
    for i in range(cfg.n_layers):
        name = layer_tensor(i, cfg.gate_part)  # OPT: fc1 (its bias left out: only a threshold's scale)
        info = f.tensor(name)
        g = act(x @ dequantize_rows(info.qtype, f.raw(name), info.n_cols).astype(np.float64).T, ACT_CODES[cfg.activation], cfg.act_threshold)
        r = rank if mode == "predictor" else 0
        mass = rng.pareto(1.5, cfg.n_ff) + 1e-3
        layers.append(LayerPredictor(
            fc1_w=(rng.standard_normal((r, cfg.d_model)) / np.sqrt(cfg.d_model)).astype(np.float32),
            fc1_b=np.zeros(r, np.float32), fc2_w=rng.standard_normal((cfg.n_ff, r)).astype(np.float32),
            fc2_b=np.full(cfg.n_ff, -0.3 if r else 0.0, np.float32), threshold=float(np.median(np.abs(g))),
            act_freq=rng.uniform(0, 1, cfg.n_ff).astype(np.float32), act_mass=(mass / mass.sum()).astype(np.float32)))
    return PredictorFile(mode=mode, model_name=cfg.name, fingerprint=model_fingerprint(f), n_layers=cfg.n_layers,
                         d_model=cfg.d_model, n_ff=cfg.n_ff, rank=rank if mode == "predictor" else 0, target_sparsity=0.5,
                         calibration={"source": "test"}, layers=tuple(layers))


def gpu_model(f: GGUFFile, cfg: ModelConfig, hot: list[np.ndarray] | None = None, gpu_layers: tuple[bool, ...] | None = None,
              *, n_ctx: int = 64, n_slots: int = 1, predictor: PredictorFile | None = None, max_tokens: int = 4,
              budget: int = 1 << 30) -> GpuModel:
    """A GPU runtime on the CPU backend; default: every layer and every neuron on the GPU."""
    hot = hot if hot is not None else [np.arange(cfg.n_ff)] * cfg.n_layers
    gpu_layers = gpu_layers if gpu_layers is not None else (True,) * cfg.n_layers
    plan = GpuPlan(tuple(np.asarray(h, dtype=np.int64) for h in hot), gpu_layers, True, max_tokens)
    return GpuModel(f, cfg, CpuBackend(budget), plan, n_ctx, n_slots, predictor)


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))
