"""Input sparsity allocated per layer and site by measured damage (TEAL's greedy allocation, taken
from one block to the whole model), on the readable model.

Runs in: the user's process (`powerinfer sparsity-curve --modes input-greedy`); numpy only.

TEAL's uniform allocation thresholds every site at the same level; on Gemma-3 that fails early
because a few sites are fragile (layer 1 alone at 0.3: +5.8% perplexity; qkv and gate/up at 0.3:
+11% each, o +1%). Here the damage of every (layer, site) is measured alone, at each level of a
ladder: the mean KL divergence of the next-token distribution from the dense one over a window of
the calibration text (over each position's dense top-32 tokens and its actual next token), with that site of that layer thresholded and everything else dense (the
layers before it are run once; each trial runs from its layer on). Then, as TEAL's greedy step
does inside a block, the allocation grows one move at a time: the move with the least damage per
weight byte skipped (a site jumping to any higher level of its ladder, so that a damage curve
that is not convex is still followed), until the skipped share of the layers' weight bytes
reaches the target. Damage is treated as additive across sites: the held-out score of the
result, not the sum, is what the curve reports.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from powerinfer.errors import InvalidArgumentError
from powerinfer.sparsity.teal import SITES, InputSparsity, log_softmax

LEVELS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7)
TOP_K = 32  # dense candidates per position kept for the KL


@dataclass(frozen=True)
class Sensitivity:
    """Measured damage of each site alone: kl [n_layers, 4, len(levels)] (nats per token)."""

    levels: tuple[float, ...]
    kl: np.ndarray
    site_bytes: np.ndarray  # [n_layers, 4]: weight bytes read per token behind each site's input


def measure(m: InputSparsity, ids: Sequence[int], samples: dict[tuple[int, str], list[np.ndarray]], levels: Sequence[float] = LEVELS,
            progress: Callable[[str], None] = lambda _: None) -> Sensitivity:
    """The damage of every (layer, site, level) alone on one window ids (see the module docstring)."""
    if len(ids) < 2:
        raise InvalidArgumentError("the sensitivity window needs at least 2 tokens")
    if not levels or any(not 0.0 < v < 1.0 for v in levels) or list(levels) != sorted(set(levels)):
        raise InvalidArgumentError(f"the level ladder must rise within (0, 1), got {list(levels)}")
    n_layers = m.cfg.n_layers

    def dense(x: np.ndarray, i: int, k: int) -> np.ndarray:
        return x

    xs = [m.embed(ids)]  # xs[i]: the dense input of layer i, [1, T, d]
    for i in range(n_layers):
        xs.append(m.layer(xs[i], i, dense))
    # KL over the tokens that matter: every position's dense top TOP_K and its actual next token
    # (a few thousand head rows instead of Gemma's 262k), renormalized over that set
    head, h = m.head(), m.final(xs[-1])
    keep: set[int] = set(int(t) for t in ids[1:])
    for c in range(0, len(h), 64):
        z = h[c : c + 64] @ head.T
        keep.update(np.argpartition(z, -TOP_K, axis=1)[:, -TOP_K:].reshape(-1).tolist())
    sub = head[np.array(sorted(keep))]  # [V', d]
    ref = log_softmax((h @ sub.T).astype(np.float64))  # [T - 1, V']
    p_ref = np.exp(ref)
    kl = np.zeros((n_layers, len(SITES), len(levels)))
    for i in range(n_layers):
        for k, name in enumerate(SITES):
            parts = np.concatenate(samples[(i, name)])
            for j, thr in enumerate(np.quantile(parts, levels)):
                def one(x: np.ndarray, li: int, lk: int, thr: float = float(thr), k: int = k, i: int = i) -> np.ndarray:
                    return np.where(np.abs(x) <= thr, np.float32(0), x) if (li, lk) == (i, k) else x

                x = m.layer(xs[i], i, one)
                for li in range(i + 1, n_layers):
                    x = m.layer(x, li, dense)
                lp = log_softmax((m.final(x) @ sub.T).astype(np.float64))
                kl[i, k, j] = max(0.0, float((p_ref * (ref - lp)).sum(1).mean()))
        progress(f"input sensitivity: layer {i + 1}/{n_layers} measured")
    return Sensitivity(tuple(levels), kl, np.stack([m.site_bytes[s] for s in SITES], axis=1))


def allocate(sens: Sensitivity, target: float) -> np.ndarray:
    """[n_layers, 4] levels whose weight-byte share skipped (sum of level x bytes) reaches target,
    grown greedily by least damage per byte (module docstring). target in (0, max level]."""
    lv = np.array((0.0, *sens.levels))
    if not 0.0 < target <= lv[-1]:
        raise InvalidArgumentError(f"a greedy target must be in (0, {lv[-1]}], got {target}")
    kl = np.concatenate([np.zeros(sens.kl.shape[:2] + (1,)), sens.kl], axis=2)  # [n_layers, 4, 1 + L]: level 0 costs nothing
    b = sens.site_bytes
    want = target * b.sum()
    step = np.zeros(b.shape, dtype=np.int64)  # index into lv per site
    skipped = 0.0
    while skipped < want - 1e-9 * b.sum():
        best, move = np.inf, None
        for i, k in zip(*np.nonzero(step < len(lv) - 1)):
            j = step[i, k]
            gain = (lv[j + 1 :] - lv[j]) * b[i, k]
            ratio = (kl[i, k, j + 1 :] - kl[i, k, j]) / np.maximum(gain, 1e-12)
            jj = int(np.argmin(ratio))
            if ratio[jj] < best:
                best, move = ratio[jj], (i, k, j + 1 + jj)
        if move is None:  # every site at the top of the ladder
            break
        i, k, j = move
        skipped += (lv[j] - lv[step[i, k]]) * b[i, k]
        step[i, k] = j
    return lv[step]
