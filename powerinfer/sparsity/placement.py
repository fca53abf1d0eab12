"""Hot/cold neuron placement under a VRAM budget (PowerInfer's split), and llama.cpp's layer split.

Runs in: the coordinator (before the GPU worker is started); numpy only.

Neuron split: the first ``n_gpu_layers`` layers take part. Each pays a fixed cost on the GPU
(attention weights and its KV cache); then neurons of those layers are chosen by expected
activation mass per byte (the predictor file's ``act_mass``, or ``act_freq`` when mass is absent)
until the budget is spent. All neurons of a layer cost the same (one gate row, one up row, one
down column in the layer's quantization), so taking them in descending mass/byte order is the
optimal fractional-knapsack choice; the only loss is the last neuron that does not fit, which is
the knapsack's integrality gap of one neuron. Ties break on (layer, neuron) order, so the result
is deterministic. Layers whose fixed cost would not fit are dropped from the end.

Layer split (the baseline): whole layers 0..k-1 on the GPU while they fit, as llama.cpp's -ngl.

The result is cached beside the model as ``<model>.gpuidx.json`` with the budget, the layer count
and the predictor/model fingerprints it was solved for; a cache that does not match is re-solved.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from powerinfer.config import ModelConfig
from powerinfer.errors import InvalidArgumentError
from powerinfer.gguf_file import GGUFFile
from powerinfer.model.weights import layer_tensor
from powerinfer.sparsity.predictor_file import PredictorFile

log = logging.getLogger(__name__)

CACHE_VERSION = 1


@dataclass(frozen=True)
class LayerCosts:
    """Bytes on the GPU: fixed per offloaded layer (attention + KV cache) and per hot neuron."""

    fixed: np.ndarray  # int64 [n_layers]
    per_neuron: np.ndarray  # int64 [n_layers]


@dataclass(frozen=True)
class Placement:
    mode: str  # "neuron" | "layer"
    budget: int  # bytes
    hot: tuple[np.ndarray, ...]  # per layer: sorted int32 indices of GPU neurons (all of them in layer mode)
    gpu_layers: tuple[bool, ...]  # per layer: attention (and KV cache) on the GPU
    used: int  # bytes used on the GPU
    mass_on_gpu: float  # share of the expected activation mass served by the GPU (0..1)


def layer_costs(f: GGUFFile, cfg: ModelConfig, n_ctx: int, kv_bytes: int = 2) -> LayerCosts:
    """Costs from the file's own tensor sizes; KV cache at ``kv_bytes`` per element (f16: 2)."""
    fixed, per = [], []
    for i in range(cfg.n_layers):
        attn = sum(f.tensor(layer_tensor(i, p)).nbytes for p in ("attn_q", "attn_k", "attn_v", "attn_output"))
        kv = 2 * n_ctx * cfg.n_kv_heads * cfg.head_dim * kv_bytes
        fixed.append(attn + kv)
        per.append(sum(f.tensor(layer_tensor(i, p)).nbytes for p in ("ffn_gate", "ffn_up", "ffn_down")) // cfg.n_ff)
    return LayerCosts(np.array(fixed, dtype=np.int64), np.array(per, dtype=np.int64))


def _values(pf: PredictorFile) -> np.ndarray:
    """[n_layers, n_ff] expected activation mass per neuron, each layer weighted equally."""
    rows = []
    for lp in pf.layers:
        v = lp.act_mass if float(np.sum(lp.act_mass)) > 0 else lp.act_freq
        s = float(np.sum(v))
        rows.append(np.asarray(v, dtype=np.float64) / s if s > 0 else np.full(pf.n_ff, 1.0 / pf.n_ff))
    return np.stack(rows) / len(rows)


def solve_neuron_split(pf: PredictorFile, costs: LayerCosts, budget: int, n_gpu_layers: int) -> Placement:
    if budget <= 0:
        raise InvalidArgumentError(f"VRAM budget must be positive, got {budget} bytes")
    n_layers = pf.n_layers
    k = min(max(0, n_gpu_layers), n_layers)
    # drop layers from the end until their fixed costs fit
    while k and int(costs.fixed[:k].sum()) > budget:
        k -= 1
    if k == 0:
        return Placement("neuron", budget, tuple(np.zeros(0, np.int32) for _ in range(n_layers)), (False,) * n_layers, 0, 0.0)
    values = _values(pf)[:k]  # [k, n_ff]
    density = values / costs.per_neuron[:k, None]
    order = np.lexsort((np.arange(values.size), -density.ravel()))  # by density desc, then (layer, neuron)
    cost = np.repeat(costs.per_neuron[:k], pf.n_ff)[order]
    room = budget - int(costs.fixed[:k].sum())
    take = order[np.cumsum(cost) <= room]
    layer_of, neuron_of = np.divmod(take, pf.n_ff)
    hot = [np.sort(neuron_of[layer_of == i]).astype(np.int32) for i in range(k)]
    hot += [np.zeros(0, np.int32) for _ in range(n_layers - k)]
    used = int(costs.fixed[:k].sum() + cost[: len(take)].sum())
    mass = float(values.ravel()[take].sum())
    return Placement("neuron", budget, tuple(hot), tuple(i < k for i in range(n_layers)), used, mass)


def solve_layer_split(n_ff: int, costs: LayerCosts, budget: int, n_gpu_layers: int) -> Placement:
    """llama.cpp -ngl: whole layers from the first while they fit."""
    n_layers = len(costs.fixed)
    whole = costs.fixed + costs.per_neuron * n_ff
    k = 0
    while k < min(n_gpu_layers, n_layers) and int(whole[: k + 1].sum()) <= budget:
        k += 1
    hot = tuple(np.arange(n_ff, dtype=np.int32) if i < k else np.zeros(0, np.int32) for i in range(n_layers))
    return Placement("layer", budget, hot, tuple(i < k for i in range(n_layers)), int(whole[:k].sum()), k / n_layers)


def _cache_path(model: Path) -> Path:
    return model.with_name(model.name + ".gpuidx.json")


def cached_neuron_split(model: Path, f: GGUFFile, cfg: ModelConfig, pf: PredictorFile, budget: int, n_gpu_layers: int,
                        n_ctx: int, reset: bool = False) -> Placement:
    """The neuron split for these settings, from the cache beside the model when it matches."""
    key = {"version": CACHE_VERSION, "budget": budget, "n_gpu_layers": n_gpu_layers, "n_ctx": n_ctx,
           "model": pf.fingerprint, "predictor": [pf.mode, pf.target_sparsity, pf.n_layers, pf.n_ff]}
    path = _cache_path(model)
    if not reset and path.exists():
        try:
            data = json.loads(path.read_text())
            if data.get("key") == key:
                hot = tuple(np.array(h, dtype=np.int32) for h in data["hot"])
                return Placement("neuron", budget, hot, tuple(data["gpu_layers"]), int(data["used"]), float(data["mass"]))
            log.info("placement cache %s was solved for other settings: re-solving", path)
        except (OSError, ValueError, KeyError, TypeError):
            log.warning("placement cache %s is unreadable: re-solving", path)
    pl = solve_neuron_split(pf, layer_costs(f, cfg, n_ctx), budget, n_gpu_layers)
    data = {"key": key, "hot": [h.tolist() for h in pl.hot], "gpu_layers": list(pl.gpu_layers), "used": pl.used, "mass": pl.mass_on_gpu}
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh)
        os.replace(tmp, path)
    except OSError as e:  # a read-only model directory only costs a re-solve next time
        log.warning("could not cache the placement beside the model (%s)", e)
    return pl
