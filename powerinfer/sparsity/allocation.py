"""Per-layer sparsity levels for calibrate's budget search: the damage a gate threshold does at each
level, the ceilings an activation's exact zeros set, and the greedy allocation under them.

Runs in: the user's process (`powerinfer calibrate` without --sparsity), from budget.py, on the
profiler's samples (profile.py: |act(gate)| and |act(gate) * up| per layer).
"""

from __future__ import annotations

import heapq

import numpy as np

from powerinfer.sparsity.calibrate import Profile

STEP = 0.05  # allocation granularity per layer
MAX_LEVEL = 0.95
# Activations whose zeros are exact (relu(g) = 0 for g <= 0; FATReLU's below its t; dReLU's gate):
# gate mode's thresholds stop at each layer's zeros (zero_ceilings). Past them a threshold cuts
# neurons that are truly active, small on the profiled text and not on text unlike it: measured on
# the trained ReLU model, thresholds a point past its zeros that scored +0.29% on the held-out fifth
# (within the aim, at the upper end of their interval) scored +1.71% on 20000 unseen tokens, for
# 1.2 points more sparsity (docs/sparsity.md, "Gate mode stops at the activation's zeros").
EXACT_ZEROS = ("relu", "fatrelu", "drelu")
ZERO_MARGIN = 0.005  # a ceiling's level lies this far below the zero share at least: its quantile is then 0 exactly


def damage_table(p: Profile) -> tuple[np.ndarray, np.ndarray]:
    """(levels [L], damage [n_layers, L]): the share of each layer's activation mass a gate threshold at each level drops."""
    levels = np.round(np.arange(0.0, MAX_LEVEL + 1e-9, STEP), 4)
    out = np.zeros((p.cfg.n_layers, len(levels)))
    for layer in range(p.cfg.n_layers):
        _, gate, act = p.ex.samples[layer].arrays()
        g = gate.astype(np.float32)
        mass = act.astype(np.float32) * p.ex.down_norms(layer)[None, :]
        total = max(float(mass.sum()), 1e-12)
        for i, lv in enumerate(levels[1:], start=1):
            out[layer, i] = float(mass[g <= np.quantile(g, lv)].sum()) / total
    return levels, out


def zero_ceilings(p: Profile, levels: np.ndarray, min_level: float) -> np.ndarray | None:
    """Per layer [n_layers], for an activation that makes exact zeros (EXACT_ZEROS), the highest of
    the grid levels [L] whose gate threshold is still 0 (at least ZERO_MARGIN below the share of the
    layer's profiled |act(gate)| values that are exactly zero) where that is at least min_level:
    there gate mode drops only what is zero anyway, lossless on any text, and the layer is sparse
    enough to pay. A layer whose zeros alone do not reach min_level gets no ceiling (levels[-1]):
    only a threshold that cuts active neurons makes it sparse, and the budget decides whether it may.
    None for an activation without exact zeros (SiLU, GELU)."""
    if p.cfg.activation not in EXACT_ZEROS:
        return None
    out = np.full(p.cfg.n_layers, float(levels[-1]))
    for layer in range(p.cfg.n_layers):
        zero = float((p.ex.samples[layer].arrays()[1] == 0).mean())
        below = levels[levels <= zero - ZERO_MARGIN + 1e-9]  # empty where (nearly) nothing is zero
        top = float(below.max()) if below.size else 0.0
        if top >= min_level - 1e-9:
            out[layer] = top
    return out


def allocate(levels: np.ndarray, damage: np.ndarray, target: float, min_level: float = 0.0,
             ceiling: np.ndarray | None = None) -> np.ndarray:
    """Per-layer levels [n_layers] whose mean reaches target: each move is the one that drops the
    least mass per unit of level gained; a dense layer's first move goes straight to the first level
    >= min_level (levels [L] ascending from 0, damage [n_layers, L]), so no layer ends between 0 and it.
    No layer goes above its ceiling [n_layers] when one is given (zero_ceilings); the mean then
    stops short of a target beyond them."""
    n_layers = damage.shape[0]
    first = int(np.searchsorted(levels, min_level - 1e-9)) if min_level > 0 else 1
    idx = np.zeros(n_layers, dtype=int)

    def move(l: int) -> tuple[float, int, int] | None:
        to = first if idx[l] == 0 else idx[l] + 1
        if to >= len(levels) or (ceiling is not None and levels[to] > ceiling[l] + 1e-9):
            return None
        return ((damage[l, to] - damage[l, idx[l]]) / (levels[to] - levels[idx[l]]), l, to)

    heap = [m for m in (move(l) for l in range(n_layers)) if m is not None]
    heapq.heapify(heap)
    while heap and levels[idx].mean() < target - 1e-9:
        _, l, to = heapq.heappop(heap)
        idx[l] = to
        m = move(l)
        if m is not None:
            heapq.heappush(heap, m)
    return levels[idx]


def gate_shares(p: Profile, levels: np.ndarray) -> list[float]:
    """Per layer, the share of the profiled |act(gate)| values above the threshold at its level:
    what gate mode computes (below a ReLU layer's zeros its threshold is 0: one less its zero share)."""
    out = []
    for i, lv in enumerate(levels):
        g = p.ex.samples[i].arrays()[1].astype(np.float32)
        out.append(float((g > np.quantile(g, lv)).mean()) if lv > 0 else 1.0)
    return out
