"""The stages' layer ranges: contiguous, sized by the nodes' memory, every stage a layer at least.

Runs in: the test process (no Ray, no model).
"""

from __future__ import annotations

import pytest

from powerinfer.coordinator.cluster.plan import split_layers
from powerinfer.errors import InvalidArgumentError

GIB = 1 << 30


def test_equal_nodes_get_equal_shares_of_the_layers() -> None:
    ranges = split_layers([10] * 30, 50, 50, [GIB, GIB])
    assert [(r.first, r.stop) for r in ranges] == [(0, 15), (15, 30)]
    assert [r.weight_bytes for r in ranges] == [150 + 50, 150 + 50]


def test_a_bigger_node_holds_more_layers_and_the_ends_keep_a_layer_each() -> None:
    ranges = split_layers([10] * 40, 0, 0, [3 * GIB, GIB])
    assert [(r.first, r.stop) for r in ranges] == [(0, 30), (30, 40)]
    # a vocabulary larger than every layer together still leaves each end stage its share of the layers
    ranges = split_layers([10] * 18, 1000, 1000, [10 * GIB] * 3)
    assert [(r.first, r.stop) for r in ranges] == [(0, 6), (6, 12), (12, 18)]
    assert all(r.stop > r.first for r in split_layers([1] * 3, 0, 0, [100, 1, 1]))


def test_what_cannot_be_split_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="at most one stage per layer"):
        split_layers([10] * 2, 0, 0, [GIB] * 3)
    with pytest.raises(InvalidArgumentError, match="stage 0 holds layers 0..1 .* more than its node"):
        split_layers([GIB] * 4, 0, 0, [GIB, GIB])
