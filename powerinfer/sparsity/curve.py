"""`powerinfer sparsity-curve`: achieved sparsity against perplexity increase, per mode.

Runs in: the user's process.

    powerinfer sparsity-curve -m smollm2 --calib calib.txt --held-out held_out.txt \
        --targets 0.05,0.1,0.2,0.3,0.5 --modes gate,predictor,input --plot curve.png

For each mode and target sparsity: calibrate on --calib, then score --held-out (text calibration
never saw) densely once and sparsely per point. gate and predictor: FFN neurons, through the
engine (achieved: the share of neurons not computed); input: every projection's input thresholded
on the readable model (teal.py; achieved: the share of the layers' weight bytes whose input was
zero, the bound of what skipping input columns saves); input-greedy: the same with the target as
that share, spread over layers and sites by measured damage (teal_greedy.py). Prints one table
row per point and, per mode, the operating point: the sparsest point whose perplexity stays
within --budget (default +2%) of dense.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from powerinfer.sparsity.calibrate import CalibrationSettings, calibrate
from powerinfer.sparsity.perplexity import perplexity
from powerinfer.sparsity.teal_curve import input_curve


@dataclass(frozen=True)
class CurvePoint:
    mode: str
    target: float
    achieved: float  # held-out text: mean share of (token, neuron) pairs not computed; input: share of layer weight bytes skipped
    ppl: float
    dense_ppl: float
    recall: float  # mean over layers

    @property
    def increase(self) -> float:
        return self.ppl / self.dense_ppl - 1


INPUT_MODES = {"input", "input-greedy"}


def sweep(model: str | Path, calib: str, held_out: str, targets: Sequence[float], modes: Sequence[str], tokens: int = 4096,
          max_tokens: int = 2048, progress: Callable[[str], None] = lambda _: None) -> list[CurvePoint]:
    points = []
    for mode, allocation in (("input", "uniform"), ("input-greedy", "greedy")):
        if mode in modes:
            for q in input_curve(model, calib, held_out, targets, tokens=tokens, max_tokens=max_tokens, progress=progress,
                                 allocation=allocation):
                points.append(CurvePoint(mode, q.level, q.skipped_share, q.ppl, q.dense_ppl, 1.0))
    if not set(modes) - INPUT_MODES:
        return points
    dense = perplexity(model, held_out, None, max_tokens=max_tokens, progress=progress).dense_ppl
    for mode in modes:
        if mode in INPUT_MODES:
            continue
        for t in targets:
            pf = calibrate(model, CalibrationSettings(mode=mode, sparsity=t, tokens=tokens), calib)
            rep = perplexity(model, held_out, pf, max_tokens=max_tokens, dense=False)
            assert rep.sparse_ppl is not None
            recall = sum(q.recall for q in rep.layers) / len(rep.layers)
            points.append(CurvePoint(mode, t, rep.mean_sparsity, rep.sparse_ppl, dense, recall))
            progress(f"{mode} {t:.2f}: sparsity {100 * rep.mean_sparsity:.1f}%, perplexity {rep.sparse_ppl:.3f} "
                     f"({100 * points[-1].increase:+.2f}%)")
    return points


def operating_point(points: Sequence[CurvePoint], budget: float) -> CurvePoint | None:
    """The sparsest of points within budget; give it one mode's points (modes count "achieved"
    differently: neurons for gate and predictor, weight bytes for the input modes)."""
    ok = [p for p in points if p.increase <= budget]
    return max(ok, key=lambda p: p.achieved) if ok else None


def plot(points: Sequence[CurvePoint], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in sorted({p.mode for p in points}):
        pts = sorted((p for p in points if p.mode == mode), key=lambda p: p.achieved)
        ax.plot([100 * p.achieved for p in pts], [100 * p.increase for p in pts], marker="o", label=mode)
    ax.axhline(2.0, color="grey", linestyle="--", linewidth=0.8, label="+2%")
    ax.set_xlabel("achieved sparsity on held-out text (%): FFN neurons; input: weight bytes")
    ax.set_ylabel("perplexity increase vs dense (%)")
    ax.set_yscale("symlog", linthresh=5)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
