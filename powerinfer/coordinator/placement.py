"""Hot/cold neuron placement under a VRAM budget (PowerInfer's split), and llama.cpp's layer split.

Runs in: the coordinator (before the GPU worker is started); numpy only.

Costs are the GPU worker's own byte counts (:mod:`powerinfer.gpu_worker.layout`): per layer a
fixed cost for its attention (weights and KV cache), a cost for its first hot neuron (the
predictor's first layer, in predictor mode) and a cost per hot neuron (gate and up rows,
transposed down row, predictor row); once, the worker's scratch buffers (``overhead``) as soon
as anything is placed. ``Placement.used`` is exactly what the worker's ledger shows after
loading, and it never exceeds the budget.

Neuron split: the first ``n_gpu_layers`` layers take part. Attention is dense (read for every
token), so it is worth more per byte than any neuron that is not always active: the attention
of layers 0..k-1 goes first, k as large as fits. Then the neurons of every taking-part layer
compete by expected activation mass per byte (the predictor file's ``act_mass``, or
``act_freq`` when mass is absent; uniform without a predictor) until the budget is spent; a
layer's hot neurons do not need its attention on the GPU. Within a layer all neurons cost the
same, so taking them in descending mass/byte order is the fractional-knapsack optimum up to the
last neuron that does not fit (the integrality gap of one neuron, plus a layer's first-neuron
cost). Ties break on (neuron, layer) order, so the result is deterministic and equal masses
spread evenly over the layers.

Layer split (the baseline): whole layers 0..k-1 on the GPU while they fit, as llama.cpp's -ngl.

The result is cached beside the model as ``<model>.gpuidx.json`` with the budget, the layer count,
the costs and the predictor/model fingerprints it was solved for; a cache that does not match is
re-solved (``--reset-gpu-index`` forces it).
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
from powerinfer.gpu_worker.layout import (
    DEFAULT_MAX_TOKENS,
    attention_bytes,
    kv_bytes,
    neuron_bytes,
    predictor_fixed_bytes,
    workspace_bytes,
)
from powerinfer.predictors.predictor_file import PredictorFile

log = logging.getLogger(__name__)

CACHE_VERSION = 3  # 3: costs from the GPU worker's layout; hot neurons in any taking-part layer


@dataclass(frozen=True)
class LayerCosts:
    """Bytes on the GPU per layer (attention; first hot neuron; each hot neuron) and once (scratch)."""

    fixed: np.ndarray  # int64 [n_layers]: attention weights + KV cache of a GPU layer
    per_neuron: np.ndarray  # int64 [n_layers]
    overhead: int = 0  # the GPU worker's scratch buffers, once anything is placed
    ffn_fixed: np.ndarray | None = None  # int64 [n_layers]: with a layer's first hot neuron (predictor fc1); None: 0

    def first_neuron(self) -> np.ndarray:
        return np.zeros_like(self.fixed) if self.ffn_fixed is None else self.ffn_fixed

    def key(self) -> list[int]:
        """A short fingerprint for the placement cache."""
        w = np.arange(1, len(self.fixed) + 1)
        return [int((self.fixed * w).sum()), int((self.per_neuron * w).sum()), int((self.first_neuron() * w).sum()), int(self.overhead)]


@dataclass(frozen=True)
class Placement:
    mode: str  # "neuron" | "layer"
    budget: int  # bytes
    hot: tuple[np.ndarray, ...]  # per layer: sorted int32 indices of GPU neurons (all of them in layer mode)
    gpu_layers: tuple[bool, ...]  # per layer: attention (and KV cache) on the GPU (a prefix of the layers)
    used: int  # bytes used on the GPU
    mass_on_gpu: float  # share of the expected activation mass served by the GPU (0..1)


def layer_costs(f: GGUFFile, cfg: ModelConfig, n_ctx: int, *, n_slots: int = 1, predictor: PredictorFile | None = None,
                sparse: bool = True, max_tokens: int = DEFAULT_MAX_TOKENS) -> LayerCosts:
    """The GPU worker's bytes for this model and context (predictor mode adds the predictor's rows)."""
    ranks = [lp.rank for lp in predictor.layers] if predictor is not None and sparse and predictor.mode == "predictor" else [0] * cfg.n_layers
    kv = kv_bytes(cfg, n_ctx, n_slots)
    fixed = [attention_bytes(f, cfg, i) + kv for i in range(cfg.n_layers)]
    per = [neuron_bytes(f, cfg, i, ranks[i]) for i in range(cfg.n_layers)]
    first = [predictor_fixed_bytes(cfg, r) for r in ranks]
    return LayerCosts(np.array(fixed, dtype=np.int64), np.array(per, dtype=np.int64), workspace_bytes(cfg, max_tokens, max(ranks)),
                      np.array(first, dtype=np.int64))


def _values(pf: PredictorFile) -> np.ndarray:
    """[n_layers, n_ff] expected activation mass per neuron, each layer weighted equally."""
    rows: list[np.ndarray] = []
    for lp in pf.layers:
        v = lp.act_mass if float(np.sum(lp.act_mass)) > 0 else lp.act_freq
        s = float(np.sum(v))
        rows.append(np.asarray(v, dtype=np.float64) / s if s > 0 else np.full(pf.n_ff, 1.0 / pf.n_ff))
    return np.stack(rows) / len(rows)


def _empty(mode: str, budget: int, n_layers: int) -> Placement:
    return Placement(mode, budget, tuple(np.zeros(0, np.int32) for _ in range(n_layers)), (False,) * n_layers, 0, 0.0)


def solve_neuron_split(pf: PredictorFile | None, costs: LayerCosts, budget: int, n_gpu_layers: int, n_ff: int = 0) -> Placement:
    """Neuron split; without a predictor file (pf None, n_ff given) every neuron has the same mass."""
    if budget <= 0:
        raise InvalidArgumentError(f"VRAM budget must be positive, got {budget} bytes")
    n_layers = len(costs.fixed)
    if pf is not None:
        n_ff = pf.n_ff
        values_all = _values(pf)
    else:
        values_all = np.full((n_layers, n_ff), 1.0 / (n_layers * n_ff))
    m = min(max(0, n_gpu_layers), n_layers)  # layers taking part
    k = m  # attention on the GPU for layers 0..k-1: as many as fit
    while k and int(costs.fixed[:k].sum()) + costs.overhead > budget:
        k -= 1
    if m == 0 or n_ff == 0:
        return _empty("neuron", budget, n_layers)
    values = values_all[:m]  # [m, n_ff]
    density = values / costs.per_neuron[:m, None]
    # by density desc, then (neuron, layer): ties are dealt round-robin over the layers
    tie = (np.arange(n_ff)[None, :] * m + np.arange(m)[:, None]).ravel()
    order = np.lexsort((tie, -density.ravel()))
    layer_of, neuron_of = np.divmod(order, n_ff)
    cost = costs.per_neuron[layer_of].copy()
    _, first = np.unique(layer_of, return_index=True)  # each layer's first hot neuron pays its first-neuron cost
    cost[first] += costs.first_neuron()[layer_of[first]]
    room = budget - costs.overhead - int(costs.fixed[:k].sum())
    n_take = int(np.searchsorted(np.cumsum(cost), room, side="right")) if room > 0 else 0  # a prefix of the order
    if k == 0 and n_take == 0:
        return _empty("neuron", budget, n_layers)
    hot = [np.sort(neuron_of[:n_take][layer_of[:n_take] == i]).astype(np.int32) for i in range(m)]
    hot += [np.zeros(0, np.int32) for _ in range(n_layers - m)]
    used = costs.overhead + int(costs.fixed[:k].sum()) + int(cost[:n_take].sum())
    mass = float(values.ravel()[order[:n_take]].sum())
    return Placement("neuron", budget, tuple(hot), tuple(i < k for i in range(n_layers)), used, mass)


def solve_layer_split(n_ff: int, costs: LayerCosts, budget: int, n_gpu_layers: int) -> Placement:
    """llama.cpp -ngl: whole layers from the first while they fit."""
    n_layers = len(costs.fixed)
    whole = costs.fixed + costs.first_neuron() + costs.per_neuron * n_ff
    k = 0
    while k < min(n_gpu_layers, n_layers) and int(whole[: k + 1].sum()) + costs.overhead <= budget:
        k += 1
    hot = tuple(np.arange(n_ff, dtype=np.int32) if i < k else np.zeros(0, np.int32) for i in range(n_layers))
    used = int(whole[:k].sum()) + (costs.overhead if k else 0)
    return Placement("layer", budget, hot, tuple(i < k for i in range(n_layers)), used, k / n_layers)


def _cache_path(model: Path) -> Path:
    return model.with_name(model.name + ".gpuidx.json")


def cached_neuron_split(model: Path, f: GGUFFile, cfg: ModelConfig, pf: PredictorFile, budget: int, n_gpu_layers: int,
                        n_ctx: int, reset: bool = False, costs: LayerCosts | None = None) -> Placement:
    """The neuron split for these settings, from the cache beside the model when it matches."""
    costs = layer_costs(f, cfg, n_ctx, predictor=pf) if costs is None else costs
    key = {"version": CACHE_VERSION, "budget": budget, "n_gpu_layers": n_gpu_layers, "n_ctx": n_ctx, "costs": costs.key(),
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
    pl = solve_neuron_split(pf, costs, budget, n_gpu_layers)
    data = {"key": key, "hot": [h.tolist() for h in pl.hot], "gpu_layers": list(pl.gpu_layers), "used": pl.used, "mass": pl.mass_on_gpu}
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh)
        os.replace(tmp, path)
    except OSError as e:  # a read-only model directory only costs a re-solve next time
        log.warning("could not cache the placement beside the model (%s)", e)
    return pl
