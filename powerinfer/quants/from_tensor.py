"""Build a packed linear straight from a GGUF tensor's raw rows, decoding a row chunk at a time.

Runs in: any process (coordinator for the output head, CPU workers for their shards).

Decoding a whole 262144 x 640 Q8_0 embedding at once would hold int8 codes, float32 scales and,
for int8 requantization, a float32 copy (~0.9 GB) at the same time. Here only CHUNK_ROWS rows are
decoded and dequantized at a time, straight into the preallocated packed buffers, so the
transient peak is the packed result plus one chunk (measured on that embedding: int8 result
168 MB, numpy peak 192 MB; Q4_0 -> int4 adds only a 4096-row staging buffer).
"""

from __future__ import annotations

import logging
from typing import Iterator

import numpy as np
from gguf import GGMLQuantizationType as QT

from powerinfer.quants.formats import FLOAT_TYPES, FOUR_BIT_TYPES, decode, raw_rows
from powerinfer.quants.grouped import Grouped
from powerinfer.quants.linear import (
    INT4_GROUP,
    KINDS,
    Int8Packer,
    PackedLinear,
    Part,
    build_linear,
)
from powerinfer.quants.registry import types_where

log = logging.getLogger(__name__)

# 5..8-bit types with group-32 codes: exact as two int4 halves (Q6_K's groups of 16 are not).
SPLIT_TYPES: frozenset[QT] = types_where(int4_split=True)

CHUNK_ROWS = 4096  # raw rows decoded at a time (4096 x 640 Q8_0: ~2.6 MB codes + 10 MB float32 transient)


def _selected_count(n_rows: int, rows: np.ndarray | slice | None) -> int:
    if rows is None:
        return n_rows
    if isinstance(rows, slice):
        return len(range(*rows.indices(n_rows)))
    return int(np.asarray(rows).shape[0])


def _chunks(
    qtype: QT,
    raw2d: np.ndarray,
    n_cols: int,
    rows: np.ndarray | slice | None,
    cols: tuple[int, int] | None,
) -> Iterator[Part]:
    """Decoded pieces of at most CHUNK_ROWS selected rows, column-sliced when ``cols`` is given."""
    if rows is None or isinstance(rows, slice):
        # A slice of the mapped rows is still a zero-copy view; chunks of it are views too.
        src = raw2d if rows is None else raw2d[rows]
        pieces = (src[i : i + CHUNK_ROWS] for i in range(0, src.shape[0], CHUNK_ROWS))
    else:
        idx = np.asarray(rows)
        # Fancy indexing copies only the chunk's rows out of the mapping.
        pieces = (raw2d[idx[i : i + CHUNK_ROWS]] for i in range(0, idx.shape[0], CHUNK_ROWS))
    for piece in pieces:
        part = decode(qtype, piece, n_cols)
        if cols is not None:
            if isinstance(part, Grouped):
                part = part.cols(*cols)
            else:
                part = part[:, cols[0] : cols[1]]
        yield part


def _int8_column_shard(
    qtype: QT, raw2d: np.ndarray, n_cols: int, rows: np.ndarray | slice | None, cols: tuple[int, int], n: int
) -> PackedLinear:
    """int8 of a column range with each row's scale taken from the full row.

    A shard's int8 codes and scales are then exactly the matching columns of the unsharded
    int8 matrix, so summing column shards reproduces the unsharded product (up to float
    summation) instead of adding independent requantization errors (~1% each).
    """
    start, stop = cols
    packer = Int8Packer(n, stop - start)
    for part in _chunks(qtype, raw2d, n_cols, rows, None):
        full = part.dequantize() if isinstance(part, Grouped) else np.asarray(part, dtype=np.float32)
        absmax = np.maximum(full.max(axis=1), -full.min(axis=1))  # [m] over the full row
        shard = np.array(full[:, start:stop], dtype=np.float32)  # owned copy the packer overwrites
        del full, part
        packer.add(shard, absmax)
    return packer.finish()


def linear_from_tensor(
    qtype: QT,
    raw: np.ndarray,
    n_cols: int,
    rows: np.ndarray | slice | None = None,
    cols: tuple[int, int] | None = None,
    kind: str = "auto",
) -> PackedLinear:
    """Pack rows (all when None) and optionally a column range [start, stop) of one GGUF tensor.

    raw is what :func:`powerinfer.quants.decode` takes (a read-only mapped view is fine; it is
    never written). ``auto`` picks int4 for Q4_0/Q4_1/Q4_K, int4x2 for Q5_0/Q5_1/Q5_K/Q8_0, int8 for Q6_K and
    bf16 for float types, as :func:`powerinfer.quants.pack_linear` would on the decoded parts,
    except that int8 column ranges take their row scales from the full rows (see
    ``_int8_column_shard``). Column bounds must be multiples of the format's group (32, or 16 for
    Q6_K).
    """
    raw2d = raw_rows(qtype, raw, n_cols)
    if kind not in KINDS and kind != "auto":
        raise ValueError(f"unknown linear kind {kind!r}; expected one of {KINDS + ('auto',)}")
    k = n_cols
    if cols is not None:
        start, stop = cols
        group = 1 if qtype in FLOAT_TYPES else (16 if qtype == QT.Q6_K else 32)
        if not 0 <= start < stop <= n_cols or start % group or stop % group:
            raise ValueError(f"cols {cols} must lie in 0..{n_cols} on multiples of {qtype.name}'s group {group}")
        k = stop - start
    four_bit = qtype in FOUR_BIT_TYPES and k % INT4_GROUP == 0
    if kind == "int4" and not four_bit:
        raise ValueError(f"int4 needs a 4-bit type with K a multiple of 32, got {qtype.name} with K={k}")
    split = qtype in SPLIT_TYPES and k % INT4_GROUP == 0
    if kind == "auto":
        kind = "int4" if four_bit else "int4x2" if split else "bf16" if qtype in FLOAT_TYPES else "int8"
    n = _selected_count(raw2d.shape[0], rows)
    if n == 0:
        raise ValueError("linear_from_tensor: no rows selected")
    if kind == "int8" and cols is not None and k != n_cols:
        lin: PackedLinear = _int8_column_shard(qtype, raw2d, n_cols, rows, cols, n)
    else:
        lin = build_linear(kind, _chunks(qtype, raw2d, n_cols, rows, cols), n, k)
    log.debug("packed %s tensor rows=%d cols=%d as %s (%d bytes)", qtype.name, n, k, kind, lin.nbytes)
    return lin
