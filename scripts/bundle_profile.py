"""Phase times of sparse decode with a neuron's gate and up rows bundled and apart, alternating.

Runs in: a developer's shell, outside the product (docs/sparsity.md, "A 4-bit down copy, a folded
predictor, bundled rows"): ``python scripts/bundle_profile.py MODEL PREDICTOR ROUNDS``. Each round
loads the in-process sparse decoder once with ``sparse_layers.BUNDLE_GATE_UP`` on and once off
(the order alternating between rounds, since the second decoder loaded in a process measured
faster) and profiles 32 decode steps after a 16-token prompt (``bench_profile.profile_decode``);
prints the median step and phase times of each, and the median per-round ratio of steps.
"""

from __future__ import annotations

import argparse

import numpy as np

from powerinfer.devtools.harness.bench_profile import DecodeProfile, profile_decode
from powerinfer.native import sparse_layers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("predictor")
    ap.add_argument("rounds", type=int)
    args = ap.parse_args()
    runs: dict[bool, list[DecodeProfile]] = {True: [], False: []}
    for r in range(args.rounds):
        for bundled in ((True, False) if r % 2 == 0 else (False, True)):
            sparse_layers.BUNDLE_GATE_UP = bundled  # read when the decoder builds its sparse layers
            runs[bundled].append(profile_decode(args.model, 2, 16, 32, args.predictor))
    for bundled, profiles in runs.items():
        phases = {k: float(np.median([p.phases_us[k] for p in profiles])) for k in profiles[0].phases_us}
        step = float(np.median([p.step_us for p in profiles]))
        print(f"bundled {bundled}: step {step:.0f} us; " + ", ".join(f"{k} {us:.0f}" for k, us in phases.items() if us > 200))
    ratios = [a.step_us / b.step_us for a, b in zip(runs[False], runs[True])]
    print(f"step apart / bundled, per round: {', '.join(f'{x:.3f}' for x in ratios)}; median {float(np.median(ratios)):.3f}")


if __name__ == "__main__":
    main()
