"""The budget search's allocation of sparsity levels over layers (powerinfer/sparsity/allocation.py).

Runs in: the pytest process; numpy only, on made-up damage tables (no model), each test instant.
"""

from __future__ import annotations

import numpy as np

from powerinfer.sparsity.allocation import MAX_LEVEL, STEP, allocate
from powerinfer.sparsity.budget import MIN_LEVEL


def test_allocate_reaches_the_target_cheapest_layers_first() -> None:
    levels = np.round(np.arange(0.0, MAX_LEVEL + 1e-9, STEP), 4)
    # layer 0 is fragile (damage grows fast), layer 1 tolerant, layer 2 in between
    damage = np.stack([levels * 5.0, levels * 0.1, levels * 1.0])
    for target in (0.1, 0.3, 0.5):
        alloc = allocate(levels, damage, target)
        assert alloc.mean() >= target - 1e-9 and alloc.mean() < target + STEP
        assert alloc[1] >= alloc[2] >= alloc[0]
    assert (allocate(levels, damage, 0.0) == 0).all()
    assert allocate(levels, damage, 1.0).max() <= MAX_LEVEL


def test_allocate_with_a_least_level_jumps_there_and_never_stops_below_it() -> None:
    levels = np.round(np.arange(0.0, MAX_LEVEL + 1e-9, STEP), 4)
    # layer 0 is cheap until 0.5 and then expensive, layer 1 grows evenly, layer 2 is fragile
    damage = np.stack([np.where(levels <= 0.5, levels * 0.01, 0.005 + (levels - 0.5) * 10.0), levels * 0.2, levels * 5.0])
    assert list(allocate(levels, damage, 0.1)) == [0.3, 0.0, 0.0]  # without a least level the cheap start of layer 0 is taken
    for target in (0.05, 0.3, 0.6, 0.9):
        alloc = allocate(levels, damage, target, MIN_LEVEL)
        assert alloc.mean() >= target - 1e-9
        assert all(v == 0 or v >= MIN_LEVEL - 1e-9 for v in alloc), alloc
    # with the jump counted per unit of sparsity, the evenly growing layer goes first, the fragile one last
    first = allocate(levels, damage, 0.05, MIN_LEVEL)
    assert first[1] >= MIN_LEVEL and first[0] == first[2] == 0
    assert allocate(levels, damage, 0.9, MIN_LEVEL)[2] <= allocate(levels, damage, 0.9, MIN_LEVEL)[1]


def test_allocate_never_takes_a_layer_past_its_ceiling() -> None:
    levels = np.round(np.arange(0.0, MAX_LEVEL + 1e-9, STEP), 4)
    damage = np.stack([levels * 0.1, levels * 0.2, levels * 0.01])  # layer 2 the cheapest: without a ceiling it goes furthest
    ceiling = np.array([0.85, 0.9, 0.7])  # layer 2's ceiling lies below the least sparse level: it stays dense
    for target in (0.3, 0.6, 0.9):
        alloc = allocate(levels, damage, target, MIN_LEVEL, ceiling)
        assert (alloc <= ceiling + 1e-9).all() and alloc[2] == 0, alloc
    assert list(allocate(levels, damage, 0.9, MIN_LEVEL, ceiling)) == [0.85, 0.9, 0.0]  # the mean stops short of the target
    assert allocate(levels, damage, 0.9, MIN_LEVEL)[2] == MAX_LEVEL
