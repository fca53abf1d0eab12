"""Tensor operations of the forward pass (powerinfer/model/ops.py) on small random inputs."""

from __future__ import annotations

import torch

from powerinfer.model.ops import RopeTable


def test_rope_grows_from_the_largest_position_of_a_batch() -> None:
    """A batched decode step holds one token per sequence in slot order: an older, longer sequence
    may come first. Its position (past the table's first 256 rows) must not index past the table."""
    torch.manual_seed(0)
    x = torch.randn(3, 2, 8)
    positions = torch.tensor([300, 5, 17])  # the largest is not the last
    batched = RopeTable(8, 10000.0, 1.0).apply(x, positions)
    for i, p in enumerate(positions.tolist()):
        alone = RopeTable(8, 10000.0, 1.0).apply(x[i : i + 1], torch.tensor([p]))
        torch.testing.assert_close(batched[i : i + 1], alone, rtol=0, atol=0)


def test_rope_rotation_is_position_times_frequency() -> None:
    table = RopeTable(4, 100.0, 1.0)
    x = torch.tensor([[[1.0, 0.0, 1.0, 0.0]]])  # [T=1, H=1, D=4]: two unit complex numbers
    out = table.apply(x, torch.tensor([1000]))[0, 0]
    inv = [1.0, 100.0 ** -0.5]
    for j, f in enumerate(inv):
        angle = torch.tensor(1000 * f, dtype=torch.float64)
        assert abs(float(out[2 * j]) - float(torch.cos(angle))) < 1e-4
        assert abs(float(out[2 * j + 1]) - float(torch.sin(angle))) < 1e-4
