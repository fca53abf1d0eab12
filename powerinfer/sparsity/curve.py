"""`powerinfer sparsity-curve`: achieved FFN sparsity against perplexity increase, for both modes.

Runs in: the user's process.

    powerinfer sparsity-curve -m smollm2 --calib calib.txt --held-out held_out.txt \
        --targets 0.05,0.1,0.2,0.3,0.5 --modes gate,predictor --plot curve.png

For each mode and target sparsity: calibrate on --calib, then score --held-out (text calibration
never saw) densely once and sparsely per point. Prints one table row per point and the operating
point: the sparsest point whose perplexity stays within --budget (default +2%) of dense.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

from powerinfer.sparsity.calibrate import CalibrationSettings, calibrate
from powerinfer.sparsity.perplexity import perplexity


@dataclass(frozen=True)
class CurvePoint:
    mode: str
    target: float
    achieved: float  # mean share of (token, neuron) pairs not computed on the held-out text
    ppl: float
    dense_ppl: float
    recall: float  # mean over layers

    @property
    def increase(self) -> float:
        return self.ppl / self.dense_ppl - 1


def sweep(model: str | Path, calib: str, held_out: str, targets: Sequence[float], modes: Sequence[str], tokens: int = 4096,
          max_tokens: int = 2048, progress: Callable[[str], None] = lambda _: None) -> list[CurvePoint]:
    dense = perplexity(model, held_out, None, max_tokens=max_tokens, progress=progress).dense_ppl
    points = []
    for mode in modes:
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
    ax.set_xlabel("achieved FFN sparsity on held-out text (%)")
    ax.set_ylabel("perplexity increase vs dense (%)")
    ax.set_yscale("symlog", linthresh=5)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: Sequence[str]) -> int:
    from powerinfer.cli.common import Parser, positive_int, progress, read_text
    from powerinfer.cli.main import CLIError
    from powerinfer.fetch import resolve_model

    p = Parser(prog="powerinfer sparsity-curve", description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", required=True)
    p.add_argument("--calib", required=True, help="calibration text file")
    p.add_argument("--held-out", required=True, help="text to score, not seen in calibration")
    p.add_argument("--targets", default="0.05,0.1,0.2,0.3,0.5", help="comma-separated target sparsities")
    p.add_argument("--modes", default="gate,predictor")
    p.add_argument("--tokens", type=positive_int, default=4096, help="calibration tokens")
    p.add_argument("--max-tokens", type=positive_int, default=2048, help="held-out tokens scored")
    p.add_argument("--budget", type=float, default=0.02, help="perplexity increase allowed at the operating point (default 0.02)")
    p.add_argument("--plot", default=None, help="PNG of the curve")
    p.add_argument("--json", default=None, help="write the points here")
    args = p.parse_args(argv)
    try:
        targets = [float(t) for t in args.targets.split(",")]
    except ValueError:
        raise CLIError(f"--targets must be comma-separated numbers, got {args.targets!r}") from None
    if any(not 0 < t < 1 for t in targets):
        raise CLIError("--targets must be in (0, 1)")
    modes = args.modes.split(",")
    if any(m not in ("gate", "predictor") for m in modes):
        raise CLIError("--modes: gate and/or predictor")
    model = resolve_model(args.model, progress=sys.stderr.isatty())
    points = sweep(model, read_text(args.calib), read_text(args.held_out), targets, modes, args.tokens, args.max_tokens, progress)
    print(f"dense perplexity {points[0].dense_ppl:.3f} on {args.max_tokens} held-out tokens")
    print(f"{'mode':<10} {'target':>6} {'achieved':>9} {'perplexity':>11} {'change':>8} {'recall':>7}")
    for pt in points:
        print(f"{pt.mode:<10} {pt.target:>6.2f} {100 * pt.achieved:>8.1f}% {pt.ppl:>11.3f} {100 * pt.increase:>+7.2f}% {pt.recall:>7.3f}")
    op = operating_point(points, args.budget)
    if op is None:
        print(f"no point within +{100 * args.budget:.1f}%")
    else:
        print(f"operating point (+{100 * args.budget:.1f}% budget): {op.mode} target {op.target:.2f}, "
              f"{100 * op.achieved:.1f}% sparsity, {100 * op.increase:+.2f}% perplexity")
    if args.plot:
        plot(points, args.plot, Path(model).name)
        print(f"plot: {args.plot}")
    if args.json:
        Path(args.json).write_text(json.dumps([{**asdict(pt), "increase": pt.increase} for pt in points], indent=1))
    return 0 if all(math.isfinite(pt.ppl) for pt in points) else 1
