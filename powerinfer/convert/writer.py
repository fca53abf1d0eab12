"""Writing a converted model: tensor types, our GGUF or PowerInfer's PWRI layout, atomically.

Runs in: the CLI process (``powerinfer convert``).

Output types (``--outtype``): ``f32``; ``f16`` (weight matrices F16, vectors F32, as llama.cpp);
``q8_0`` and ``q4_0`` (matrices whose rows are whole blocks of 32 in that type, the head and the
embeddings Q8_0 under q4_0, others F16); a GGUF source is decoded and re-encoded in that type.
PowerInfer's layout (``--powerinfer``) differs in four ways, from its converter:
the magic ``PWRI``; ``blk.N.ffn_down_t.weight`` = down^T [n_ff, d] instead of ``ffn_down`` (in the
output type: an F32 file runs here exactly, while PowerInfer's sparse CPU kernel reads ffn_down_t
as F16 and gives NaN on it, so for PowerInfer write f16 or q4_0; a warning says so); the
predictors ``blk.N.fc1.weight`` [r, d] and ``blk.N.fc2.weight`` [n_ff, r] (F16; F32 under f32) with
``powerinfer.sparse_threshold``; an ``output.weight`` even when the model ties it (its loader needs it).

Tensors are streamed: the header and tensor table first (sizes follow from shapes and types), then
each tensor read, converted and written in turn, so memory holds one tensor at a time. The file is
written beside the output under a temporary name and renamed over it only when complete.
"""

from __future__ import annotations

import logging
import os
import struct
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT, GGUFValueType, GGUFWriter
from gguf.quants import quantize

from powerinfer.convert.families import Converted
from powerinfer.convert.predictors import ResidualPredictors
from powerinfer.errors import DiskWriteError, InvalidArgumentError, ModelFileError, write_failure

log = logging.getLogger(__name__)

OUTTYPES = ("f32", "f16", "q8_0", "q4_0")
PWRI_MAGIC = b"PWRI"
SPARSE_THRESHOLD_KEY = "powerinfer.sparse_threshold"
_MATRIX_TYPES = {"f32": QT.F32, "f16": QT.F16, "q8_0": QT.Q8_0, "q4_0": QT.Q4_0}


@dataclass(frozen=True)
class Planned:
    """One tensor as it will be written: name, numpy shape, GGML type, and its data (converted) when read."""

    name: str
    shape: tuple[int, ...]
    qtype: QT
    read: Callable[[], np.ndarray]


def matrix_type(outtype: str, name: str, cols: int) -> QT:
    qtype = _MATRIX_TYPES[outtype]
    if outtype == "q4_0" and name in ("output.weight", "token_embd.weight"):
        qtype = QT.Q8_0  # the head and embeddings lose the most at 4 bits (llama.cpp keeps them at 6+)
    block = GGML_QUANT_SIZES[qtype][0]
    return qtype if cols % block == 0 else QT.F16


def encode(data: np.ndarray, qtype: QT) -> np.ndarray:
    """float32 [.., cols] in type qtype: float arrays, or the blocks' bytes [.., row bytes]."""
    if qtype == QT.F32:
        return np.ascontiguousarray(data, dtype=np.float32)
    if qtype == QT.F16:
        return np.ascontiguousarray(data, dtype=np.float16)
    return quantize(np.ascontiguousarray(data, dtype=np.float32), qtype)


def nbytes(shape: Sequence[int], qtype: QT) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    return rows * (shape[-1] // block) * size


def plan(model: Converted, outtype: str, predictors: ResidualPredictors | None, powerinfer: bool) -> list[Planned]:
    """Every tensor of the output, in order: the model's (down transposed for PowerInfer), then the predictors."""
    if outtype not in OUTTYPES:
        raise InvalidArgumentError(f"--outtype must be one of {', '.join(OUTTYPES)}, got {outtype!r}")
    if powerinfer and outtype == "f32":
        log.warning("an f32 PowerInfer file runs here, but PowerInfer's CPU build reads ffn_down_t as F16 and gives NaN "
                    "logits on it: for PowerInfer itself use --outtype f16 or q4_0")
    out: list[Planned] = []
    names = {t.name for t in model.tensors}
    for t in model.tensors:
        if powerinfer and t.name.endswith(".ffn_down.weight"):
            d, n_ff = t.shape
            qtype = matrix_type(outtype, t.name, d)
            out.append(Planned(t.name.replace(".ffn_down.", ".ffn_down_t."), (n_ff, d), qtype, lambda t=t: t.read().T))
            continue
        qtype = matrix_type(outtype, t.name, t.shape[-1]) if t.matrix else QT.F32
        out.append(Planned(t.name, t.shape, qtype, t.read))
        # PowerInfer's llama graph reads output.weight; its opt graph the embeddings (an extra tensor there is an error)
        if powerinfer and t.name == "token_embd.weight" and "output.weight" not in names and model.arch != "opt":
            out.append(Planned("output.weight", t.shape, matrix_type(outtype, "output.weight", t.shape[-1]), t.read))
    if predictors is not None:
        fc_type = QT.F32 if outtype == "f32" else QT.F16
        for i, (fc1, fc2) in enumerate(zip(predictors.fc1, predictors.fc2)):
            out.append(Planned(f"blk.{i}.fc1.weight", fc1.shape, fc_type, lambda a=fc1: a))
            out.append(Planned(f"blk.{i}.fc2.weight", fc2.shape, fc_type, lambda a=fc2: a))
    return out


def _add_value(w: GGUFWriter, key: str, value: Any) -> None:
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):  # the narrowest usual type that holds it (a copied key may be 64-bit or negative)
        if value >= 0:
            w.add_uint32(key, value) if value < 2**32 else w.add_uint64(key, value)
        else:
            w.add_int32(key, value) if value >= -(2**31) else w.add_int64(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    elif isinstance(value, (list, tuple)):
        if value and all(isinstance(v, bool) for v in value):
            w.add_array(key, list(value))
        elif key == "tokenizer.ggml.token_type":
            w.add_key_value(key, list(value), GGUFValueType.ARRAY, GGUFValueType.INT32)
        elif value and all(isinstance(v, float) for v in value):
            w.add_key_value(key, list(value), GGUFValueType.ARRAY, GGUFValueType.FLOAT32)
        else:
            w.add_array(key, list(value))
    else:
        raise ModelFileError(f"metadata {key}: cannot write a {type(value).__name__}")


def write_model(path: str | Path, model: Converted, metadata: dict[str, Any], outtype: str,
                predictors: ResidualPredictors | None = None, powerinfer: bool = False) -> Path:
    """Write the converted model to ``path`` (atomically); returns the path."""
    path = Path(path)
    tensors = plan(model, outtype, predictors, powerinfer)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise DiskWriteError(f"cannot write {path}: {write_failure(e, path.parent)}") from None
    os.close(fd)
    try:
        w = GGUFWriter(None, model.arch)  # type: ignore[arg-type]  # path given to write_header_to_file
        w.add_name(model.name)
        w.add_file_type({"f32": 0, "f16": 1, "q8_0": 7, "q4_0": 2}[outtype])
        for key, value in {**model.metadata, **metadata}.items():
            try:
                _add_value(w, key, value)
            except (struct.error, OverflowError, ValueError, TypeError) as e:  # a value copied from a hostile file
                raise ModelFileError(f"metadata {key!r} cannot be written as GGUF: {e}") from None
        if predictors is not None and powerinfer and predictors.threshold:
            w.add_float32(SPARSE_THRESHOLD_KEY, predictors.threshold)
        for t in tensors:
            dtype = np.float32 if t.qtype == QT.F32 else np.float16 if t.qtype == QT.F16 else np.uint8
            shape = t.shape if dtype != np.uint8 else (*t.shape[:-1], t.shape[-1] // GGML_QUANT_SIZES[t.qtype][0] * GGML_QUANT_SIZES[t.qtype][1])
            w.add_tensor_info(t.name, shape, np.dtype(dtype), nbytes(t.shape, t.qtype), raw_dtype=t.qtype)
        w.write_header_to_file(path=Path(tmp))
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for i, t in enumerate(tensors):
            w.write_tensor_data(encode(t.read(), t.qtype))
            log.debug("wrote %s (%s) %d/%d", t.name, t.qtype.name, i + 1, len(tensors))
        w.close()
        if powerinfer:
            with open(tmp, "r+b") as fh:
                fh.write(PWRI_MAGIC)  # PowerInfer's files are GGUF with this magic (its convert.py does the same)
        os.replace(tmp, path)
    except OSError as e:
        raise DiskWriteError(f"cannot write {path}: {write_failure(e, path.parent)}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path
