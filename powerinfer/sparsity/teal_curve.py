"""The input-sparsity curve: held-out perplexity and the weight bytes left unread at each level, with
thresholds allocated uniformly (TEAL) or greedily by measured damage.

Runs in: the user's process (`powerinfer sparsity-curve --modes input`); numpy only (teal.py's
readable model, teal_greedy.py's allocation).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from powerinfer.errors import InvalidArgumentError
from powerinfer.sparsity.teal import SITES, InputPoint, InputSparsity
from powerinfer.sparsity.teal_greedy import LEVELS, allocate, measure


def input_curve(model: str | Path, calib: str, held_out: str, levels: Sequence[float], n_ctx: int = 512, tokens: int = 2048,
                max_tokens: int = 1024, progress: Callable[[str], None] = lambda _: None, allocation: str = "uniform",
                sens_tokens: int = 256) -> list[InputPoint]:
    """Profile |inputs| on calib, then score held_out densely and at each level. allocation
    "uniform": every site at the level; "greedy": the level is the target share of layer weight
    bytes, spread over layers and sites by the damage each showed alone on the first sens_tokens
    of calib (teal_greedy.py)."""
    if not levels or not all(0.0 < v < 1.0 for v in levels):
        raise InvalidArgumentError(f"input sparsity levels must be in (0, 1), got {list(levels)}")
    if allocation not in ("uniform", "greedy"):
        raise InvalidArgumentError(f"allocation must be uniform or greedy, got {allocation!r}")
    if allocation == "greedy":
        if max(levels) > LEVELS[-1]:  # before minutes of calibration, not after
            raise InvalidArgumentError(f"greedy targets must be at most {LEVELS[-1]}, got {max(levels)}")
        if sens_tokens < 2:
            raise InvalidArgumentError(f"the sensitivity window needs at least 2 tokens, got {sens_tokens}")
    m = InputSparsity(model)
    samples: dict[tuple[int, str], list[np.ndarray]] = {}
    calib_windows = m.windows(calib, n_ctx, tokens)
    m.run(calib_windows, collect=samples)
    plan: Callable[[float], float | np.ndarray] = lambda level: level
    if allocation == "greedy":
        n_sens = min(sens_tokens, tokens)  # the first tokens of the calibration text, within its budget
        sens = measure(m, m.windows(calib, n_sens, n_sens)[0], samples, progress=progress)
        plan = lambda level: allocate(sens, level)  # noqa: E731
    held = m.windows(held_out, n_ctx, max_tokens)
    dense_total, n, _ = m.run(held)
    dense = math.exp(dense_total / n)
    progress(f"input dense: perplexity {dense:.3f} over {n} tokens")
    n_tok = sum(len(w) for w in held)
    layer_bytes = int(sum(b.sum() for b in m.site_bytes.values()))
    points = []
    for level in levels:
        total, _, zeros = m.run(held, m.thresholds(samples, plan(level)))
        share = zeros / n_tok  # [n_layers, 4]: share of each input's entries that were zero
        skipped = float(sum((share[:, k] * m.site_bytes[s]).sum() for k, s in enumerate(SITES)))
        p = InputPoint(level, math.exp(total / n), dense, {s: float(share[:, k].mean()) for k, s in enumerate(SITES)}, skipped, layer_bytes)
        points.append(p)
        progress(f"input ({allocation}) {level:.2f}: perplexity {p.ppl:.3f} ({100 * p.increase:+.2f}%), layer weight bytes skipped "
                 f"{100 * p.skipped_share:.1f}% (" + ", ".join(f"{s} {100 * v:.0f}%" for s, v in p.zero_share.items()) + ")")
    return points
