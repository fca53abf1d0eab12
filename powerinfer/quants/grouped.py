"""The decoded group form of a quantized weight matrix: integer codes plus per-group scale and zero.

Runs in: any process (coordinator or worker); pure numpy, no torch, no global state.

Every supported GGML block format decodes to the same shape of data,
``w[n, k] = q[n, k] * scale[n, k // group] + zero[n, k // group]``, so the packers in
:mod:`powerinfer.quants.linear` never need to know which file format a weight came from.

Code convention (chosen so int4 packing is a plain copy of the codes):

* 4-bit formats (Q4_0, Q4_1, Q4_K) keep the raw unsigned nibble 0..15 and put any offset into
  ``zero`` (Q4_0: ``zero = -8 * d``); ``bits == 4``.
* Every other format stores a code that fits int8: signed where the format is symmetric
  (Q5_0: code - 16, Q8_0, Q6_K: code - 32) and unsigned where it has a min (Q5_1, Q5_K: 0..31,
  the min going to ``zero``); ``bits == 8``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True, eq=False)
class Grouped:
    """w[n, k] = q[n, k] * scale[n, k // group] + zero[n, k // group]."""

    q: np.ndarray  # int8 [N, K]: codes, see the module docstring for signedness per format
    scale: np.ndarray  # float32 [N, K // group]
    zero: np.ndarray  # float32 [N, K // group]; all zeros when the format has no offset
    group: int  # 32 for every format except Q6_K (16)
    bits: int  # 4 when every code is in 0..15, else 8

    def __post_init__(self) -> None:
        # Cheap shape checks only: a mismatch here is a bug in a decoder or a slicing call.
        if self.q.ndim != 2 or self.q.dtype != np.int8:
            raise ValueError(f"Grouped.q must be int8 [N, K], got {self.q.dtype} {self.q.shape}")
        n, k = self.q.shape
        if self.group <= 0 or k % self.group:
            raise ValueError(f"Grouped: K={k} is not a multiple of group={self.group}")
        want = (n, k // self.group)
        if self.scale.shape != want or self.zero.shape != want:
            raise ValueError(f"Grouped: scale {self.scale.shape} / zero {self.zero.shape}, expected {want}")
        if self.bits not in (4, 8):
            raise ValueError(f"Grouped.bits must be 4 or 8, got {self.bits}")

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.q.shape[0]), int(self.q.shape[1]))

    @property
    def nbytes(self) -> int:
        return int(self.q.nbytes + self.scale.nbytes + self.zero.nbytes)

    def dequantize(self) -> np.ndarray:
        """float32 [N, K]. Allocates N*K*4 bytes: callers chunk rows for big matrices."""
        n, k = self.shape
        g = k // self.group
        # [N, G, group] * [N, G, 1] + [N, G, 1], computed in place on the one float32 buffer.
        w = self.q.astype(np.float32).reshape(n, g, self.group)
        w *= self.scale[:, :, None]
        w += self.zero[:, :, None]
        return w.reshape(n, k)

    def rows(self, idx: np.ndarray | slice) -> Grouped:
        """The selected rows (a view for slices, a copy for index arrays)."""
        return Grouped(self.q[idx], self.scale[idx], self.zero[idx], self.group, self.bits)

    def cols(self, start: int, stop: int) -> Grouped:
        """Columns [start, stop); both must be multiples of ``group`` so no group is cut in two."""
        k = self.shape[1]
        if not (0 <= start <= stop <= k) or start % self.group or stop % self.group:
            raise ValueError(f"Grouped.cols({start}, {stop}): bounds must be multiples of {self.group} within 0..{k}")
        g0, g1 = start // self.group, stop // self.group
        return Grouped(self.q[:, start:stop], self.scale[:, g0:g1], self.zero[:, g0:g1], self.group, self.bits)

    def col_groups(self, groups: np.ndarray) -> Grouped:
        """Whole groups of columns, in the given order: ``groups`` [u] group indices (a copy).

        Any set of columns covered by whole groups keeps the file's scales, so its numbers are
        exactly those columns of the matrix (what a neuron set that is not one range needs)."""
        g = np.asarray(groups, dtype=np.int64)
        n_groups = self.shape[1] // self.group
        if g.ndim != 1 or (g.size and (g.min() < 0 or g.max() >= n_groups)):
            raise ValueError(f"Grouped.col_groups: group indices must be a 1-D array within 0..{n_groups - 1}")
        cols = (g[:, None] * self.group + np.arange(self.group)).ravel()
        return Grouped(self.q[:, cols], self.scale[:, g], self.zero[:, g], self.group, self.bits)

    @staticmethod
    def concat_rows(parts: Sequence[Grouped]) -> Grouped:
        """Stack parts along rows (e.g. q/k/v). Same K and group required; mixed bits give bits=8."""
        if not parts:
            raise ValueError("Grouped.concat_rows needs at least one part")
        group, k = parts[0].group, parts[0].shape[1]
        for p in parts:
            if p.group != group or p.shape[1] != k:
                raise ValueError(
                    f"Grouped.concat_rows: part with group={p.group}, K={p.shape[1]} does not match group={group}, K={k}"
                )
        # Codes of both conventions mean the same thing through scale/zero, so mixing them is fine;
        # only the "all codes are 0..15" promise is lost when bits differ.
        bits = 4 if all(p.bits == 4 for p in parts) else 8
        return Grouped(
            np.concatenate([p.q for p in parts], axis=0),
            np.concatenate([p.scale for p in parts], axis=0),
            np.concatenate([p.zero for p in parts], axis=0),
            group,
            bits,
        )


def split_nibbles(g: Grouped) -> Grouped:
    """Rewrite 5..8-bit codes (group 32) as two 4-bit halves: [N, K] -> [N, 2K], exactly.

    A code c in -128..127 is 16 * h + l with l = c & 15 (0..15) and h = c >> 4 (-8..7), so
    w = c * s + z = (l * s + z) + (h + 8 - 8) * 16s. The left half keeps (l, s, z), the right half
    holds codes h + 8 with scale 16s and zero -128s; ``x @ [W_lo | W_hi].T`` with x fed twice is
    then x @ W.T, computed by the int4 kernel from the file's own codes (no requantization).
    """
    if g.group != 32:
        raise ValueError(f"split_nibbles needs group 32, got {g.group}")
    c = g.q.astype(np.int16)
    if c.size and (c.min() < -128 or c.max() > 127):
        raise ValueError("split_nibbles needs codes in -128..127")
    q = np.concatenate([(c & 15), (c >> 4) + 8], axis=1).astype(np.int8)
    scale = np.concatenate([g.scale, g.scale * np.float32(16.0)], axis=1)
    zero = np.concatenate([g.zero, g.scale * np.float32(-128.0)], axis=1)
    return Grouped(q, scale, zero, 32, 4)

