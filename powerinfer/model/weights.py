"""Named access to a model's tensors, decoding only the rows and columns a shard needs.

Runs in: the coordinator (embeddings, norms, output head) and CPU workers (their shards).
Nothing here keeps a float32 copy of a weight matrix: matrices go from the memory-mapped file
to a decoded group form and from there to a packed torch linear; only vectors become float32.
"""

from __future__ import annotations

import numpy as np
import torch

from powerinfer.errors import ModelFileError
from powerinfer.gguf_file import GGUFFile
from powerinfer.quants import Grouped, PackedLinear, decode, dequantize_rows, linear_from_tensor, pack_linear

Rows = slice | np.ndarray | None


def layer_tensor(layer: int, part: str) -> str:
    return f"blk.{layer}.{part}.weight"


def layer_bias(layer: int, part: str) -> str:
    return f"blk.{layer}.{part}.bias"


def check_shape(f: GGUFFile, name: str, shape: tuple[int, ...]) -> None:
    actual = f.tensor(name).shape
    if actual != shape:
        raise ModelFileError(f"{f.path}: tensor {name!r} has shape {list(actual)}, expected {list(shape)}")


def load_matrix(f: GGUFFile, name: str, rows: Rows = None, cols: tuple[int, int] | None = None) -> Grouped | np.ndarray:
    """Decode rows (all when None) of a 2-D weight; cols=(start, stop) then keeps a column range."""
    info = f.tensor(name)
    raw = f.raw(name)
    if rows is not None:
        raw = raw[rows]
    part = decode(info.qtype, raw, info.n_cols)
    if cols is None or cols == (0, info.n_cols):
        return part
    if isinstance(part, Grouped):
        return part.cols(*cols)
    return np.ascontiguousarray(part[:, cols[0] : cols[1]])


def load_linear(f: GGUFFile, names_rows: list[tuple[str, Rows]], cols: tuple[int, int] | None = None) -> PackedLinear:
    """One packed linear from row ranges of one or more tensors (fused q/k/v or gate/up).

    A single tensor is packed a row chunk at a time (the 262144-row Gemma head never exists as one
    decoded array), and a column range keeps the scales of the full rows, so the shards of a
    matrix are exactly its columns and splitting a layer does not change its numbers.
    """
    if len(names_rows) == 1:
        name, rows = names_rows[0]
        info = f.tensor(name)
        return linear_from_tensor(info.qtype, f.raw(name), info.n_cols, rows=rows, cols=cols)
    return pack_linear([load_matrix(f, name, rows, cols) for name, rows in names_rows])


def load_vector(f: GGUFFile, name: str, expected: int | None = None) -> torch.Tensor:
    info = f.tensor(name)
    if expected is not None and info.shape[-1] != expected:
        raise ModelFileError(f"{f.path}: tensor {name!r} has length {info.shape[-1]}, expected {expected}")
    values = dequantize_rows(info.qtype, f.raw(name), info.n_cols).reshape(-1)
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


def embed_rows(f: GGUFFile, ids: np.ndarray, name: str = "token_embd.weight") -> torch.Tensor:
    """Float32 rows [T, d] of a token-indexed matrix (embeddings, output head), decoding only those."""
    info = f.tensor(name)
    raw = f.raw(name)[ids]
    return torch.from_numpy(dequantize_rows(info.qtype, raw, info.n_cols).astype(np.float32, copy=False))
