"""Named access to a model's tensors, decoding only the rows and columns a shard needs (numpy).

Runs in: the coordinator (embeddings, norms, a few output-head rows) and CPU workers (their
shards). numpy only, so the coordinator needs no torch; packing into torch linears is in
powerinfer/model/linears.py. Nothing here keeps a float32 copy of a weight matrix: only vectors
and the handful of rows asked for become float32.
"""

from __future__ import annotations

import numpy as np

from powerinfer.errors import ModelFileError
from powerinfer.gguf_file import GGUFFile
from powerinfer.quants import Grouped, decode, dequantize_rows

Rows = slice | np.ndarray | None


def layer_tensor(layer: int, part: str) -> str:
    return f"blk.{layer}.{part}.weight"


def layer_bias(layer: int, part: str) -> str:
    return f"blk.{layer}.{part}.bias"


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


def load_vector(f: GGUFFile, name: str, expected: int | None = None) -> np.ndarray:
    """A float32 vector (norm weights, biases) as an owned, writable array."""
    info = f.tensor(name)
    if expected is not None and info.shape[-1] != expected:
        raise ModelFileError(f"{f.path}: tensor {name!r} has length {info.shape[-1]}, expected {expected}")
    return np.array(dequantize_rows(info.qtype, f.raw(name), info.n_cols).reshape(-1), dtype=np.float32)


def embed_rows(f: GGUFFile, ids: np.ndarray, name: str = "token_embd.weight") -> np.ndarray:
    """Float32 rows [T, d] of a token-indexed matrix (embeddings, output head), decoding only those."""
    info = f.tensor(name)
    return dequantize_rows(info.qtype, f.read_rows(name, ids), info.n_cols).astype(np.float32, copy=False)


def decode_weight_bytes(f: GGUFFile, n_layers: int, tied_embeddings: bool) -> int:
    """Bytes of the file's matrices that one decode step reads: every layer's seven projections
    (six: OPT has no gate) and the output head (the embedding row and the norms are a few KiB)."""
    parts = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    names = [layer_tensor(i, p) for i in range(n_layers) for p in parts if p != "ffn_gate" or layer_tensor(i, p) in f.tensors]
    names.append("token_embd.weight" if tied_embeddings else "output.weight")
    return sum(f.tensor(n).nbytes for n in names)
