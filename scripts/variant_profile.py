"""Phase times of sparse decode under two variants of one choice, alternating in one run.

Runs in: a developer's shell, outside the product (docs/sparsity.md, "A 4-bit down copy, a folded
predictor, bundled rows"): ``python scripts/variant_profile.py MODEL PREDICTOR ROUNDS VARIANT``,
VARIANT ``bundle`` (``sparse_layers.BUNDLE_GATE_UP`` on / off) or ``down_t`` (``POWERINFER_DOWN_T``
auto / q8_0). Each round loads the in-process sparse decoder once per side, the order alternating
between rounds (the second decoder loaded in a process measured 5-10% faster), and profiles 32
decode steps after a 16-token prompt (``bench_profile.profile_decode``); prints each side's median
step and phase times and the median per-round ratio of steps.
"""

from __future__ import annotations

import argparse
import os

import numpy as np

from powerinfer.devtools.harness.bench_profile import DecodeProfile, profile_decode
from powerinfer.native import sparse_layers


def _set(variant: str, first: bool) -> None:
    """first: the product's default (bundled rows; the file's choice of down copy)."""
    if variant == "bundle":
        sparse_layers.BUNDLE_GATE_UP = first  # read when the decoder builds its sparse layers
    else:
        os.environ["POWERINFER_DOWN_T"] = "auto" if first else "q8_0"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("predictor")
    ap.add_argument("rounds", type=int)
    ap.add_argument("variant", choices=("bundle", "down_t"))
    args = ap.parse_args()
    runs: dict[bool, list[DecodeProfile]] = {True: [], False: []}
    for r in range(args.rounds):
        for side in ((True, False) if r % 2 == 0 else (False, True)):
            _set(args.variant, side)
            runs[side].append(profile_decode(args.model, 2, 16, 32, args.predictor))
    names = {"bundle": ("bundled", "apart"), "down_t": ("default copy", "Q8_0 copy")}[args.variant]
    for side, profiles in runs.items():
        phases = {k: float(np.median([p.phases_us[k] for p in profiles])) for k in profiles[0].phases_us}
        step = float(np.median([p.step_us for p in profiles]))
        print(f"{names[0 if side else 1]}: step {step:.0f} us; " + ", ".join(f"{k} {us:.0f}" for k, us in phases.items() if us > 200))
    ratios = [a.step_us / b.step_us for a, b in zip(runs[False], runs[True])]
    print(f"step {names[1]} / {names[0]}, per round: {', '.join(f'{x:.3f}' for x in ratios)}; median {float(np.median(ratios)):.3f}")


if __name__ == "__main__":
    main()
