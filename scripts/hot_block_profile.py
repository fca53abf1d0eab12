"""Phase times of sparse decode with and without the hot block, alternating in one run.

Runs in: a developer's shell, outside the product (docs/sparsity.md, "Hot neurons through the
dense kernel"): ``python scripts/hot_block_profile.py MODEL PREDICTOR ROUNDS HOT_FREQS``, e.g.
``python scripts/hot_block_profile.py reglu-1b-q4_0.gguf reglu-1b-lr.predictor 5 0.22,2.0``
(2.0: no neuron is hot). Each round loads the in-process sparse decoder once per value of
``sparse_layers.HOT_FREQ`` and profiles 32 decode steps after a 16-token prompt
(``bench_profile.profile_decode``); prints the median step and phase times per value.
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
    ap.add_argument("hot_freqs", help="comma-separated HOT_FREQ values, alternated")
    args = ap.parse_args()
    values = [float(v) for v in args.hot_freqs.split(",")]
    runs: dict[float, list[DecodeProfile]] = {v: [] for v in values}
    for _ in range(args.rounds):
        for v in values:
            sparse_layers.HOT_FREQ = v  # read when the decoder builds its sparse layers
            runs[v].append(profile_decode(args.model, 2, 16, 32, args.predictor))
    for v, profiles in runs.items():
        phases = {k: float(np.median([p.phases_us[k] for p in profiles])) for k in profiles[0].phases_us}
        step = float(np.median([p.step_us for p in profiles]))
        print(f"HOT_FREQ {v}: step {step:.0f} us; " + ", ".join(f"{k} {us:.0f}" for k, us in phases.items() if us > 200))


if __name__ == "__main__":
    main()
