"""Packed torch linears built from a model's tensors (fused rows, column shards).

Runs in: CPU worker processes, or the coordinator for the in-process executor.
"""

from __future__ import annotations

from gguf import GGMLQuantizationType

from powerinfer.gguf_file import GGUFFile
from powerinfer.model.weights import Rows, load_matrix
from powerinfer.quants import PackedLinear, linear_from_tensor, pack_linear


def load_linear(f: GGUFFile, names_rows: list[tuple[str, Rows]], cols: tuple[int, int] | None = None, kind: str = "auto") -> PackedLinear:
    """One packed linear from row ranges of one or more tensors (fused q/k/v or gate/up).

    A single tensor is packed a row chunk at a time (the 262144-row Gemma head never exists as one
    decoded array), and a column range keeps the scales of the full rows, so the shards of a
    matrix are exactly its columns and splitting a layer does not change its numbers. An F32 file's
    matrices stay float32 (``auto``): who stores float32 asks for exact numbers, not bf16's speed.
    """
    if kind == "auto" and all(f.tensor(name).qtype == GGMLQuantizationType.F32 for name, _ in names_rows):
        kind = "f32"
    if len(names_rows) == 1:
        name, rows = names_rows[0]
        info = f.tensor(name)
        return linear_from_tensor(info.qtype, f.raw(name), info.n_cols, rows=rows, cols=cols, kind=kind)
    return pack_linear([load_matrix(f, name, rows, cols) for name, rows in names_rows], kind)
