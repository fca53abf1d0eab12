"""Running PowerInfer's own model files (``*.powerinfer.gguf``, magic ``PWRI``) with ``-m``.

Runs in: the process that opens a model (the CLI, the server, the API's LLM); workers then open
the plain file this writes, like any other.

A PWRI file is a GGUF whose FFN down projection is stored transposed (``ffn_down_t`` [n_ff, d]:
neuron-major, for PowerInfer's sparse axpy) and which carries a predictor per layer (``fc1``,
``fc2``) and ``powerinfer.sparse_threshold``. Its architecture fixes the activation (PowerInfer
hard-codes it): ``llama`` runs ReLU (ReGLU), ``bamboo`` dReLU, ``opt`` its ReLU MLP. OPT's predictors
read the residual stream before a LayerNorm, which cannot be folded onto the normed input (the norm
subtracts each token's mean): they stay predictors of the residual stream (input ``residual``),
which the native decoder feeds them.

The first open writes, once, into the cache folder (``$POWERINFER_CACHE`` or the user cache, under
``pwri/``), keyed by the file's path, size and modification time:

* ``NAME-KEY.gguf``: the same model as a plain GGUF our engine reads: every tensor's bytes as they
  are, but ``ffn_down`` [d, n_ff] = ffn_down_t transposed (F32 / F16 exactly; a quantized
  ffn_down_t is widened to F16, whose rounding is 2^-11 of each value, instead of requantized),
  the predictors left out, and our activation key saying ReLU;
* ``NAME-KEY.predictor``: the predictors in our format, folded onto the normed FFN input
  (exact at threshold 0: :func:`powerinfer_formats.read_powerinfer_predictor`; OPT's as they are,
  reading the residual stream); with PowerInfer's
  GPU index beside the file (``FILE.generated.gpuidx``), its GPU neurons as the layers' activation
  mass, which our placement solver serves first (the key covers that file too).

Both are written under temporary names and renamed into place, so concurrent first opens are safe.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import struct
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT, GGUFValueType, GGUFWriter
from gguf.quants import dequantize

from powerinfer.config import ACTIVATION_KEY
from powerinfer.errors import DiskWriteError, ModelFileError, UnsupportedModelError, quoted, write_failure
from powerinfer.phase import phase
from powerinfer.gguf_file import GGUFFile
from powerinfer.predictors.powerinfer_formats import (
    SPARSE_THRESHOLD_KEY,
    GpuSplit,
    is_powerinfer_file,
    open_powerinfer_gguf,
    read_gpuidx,
    read_powerinfer_predictor,
)
from powerinfer.predictors.predictor_file import PredictorFile, model_fingerprint, write_predictor

log = logging.getLogger(__name__)

FORMAT = 4  # bump when what is written changes: old cache entries are then not reused
ACTIVATION_OF = {"llama": "relu", "bamboo": "drelu", "opt": "relu"}  # what PowerInfer's sparse graph computes for each architecture
_SKIPPED_KEYS = ("general.alignment", "GGUF.", SPARSE_THRESHOLD_KEY)


@dataclass(frozen=True)
class PwriModel:
    """A PowerInfer file made runnable: the plain GGUF to load and the predictor that came inside."""

    source: Path
    model: Path
    predictor: Path
    sparse_threshold: float


def _cache_root() -> Path:
    from platformdirs import user_cache_dir

    return Path(os.environ.get("POWERINFER_CACHE") or user_cache_dir("powerinfer")) / "pwri"


def _key(path: Path, gpuidx: Path | None) -> str:
    parts = [str(FORMAT)]
    for p in (path, gpuidx):
        if p is not None:
            st = p.stat()
            parts += [str(p.resolve()), str(st.st_size), str(st.st_mtime_ns)]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def gpuidx_beside(path: Path) -> Path | None:
    """PowerInfer's GPU index for the model file, where its llama.cpp looks: FILE.generated.gpuidx."""
    p = path.with_name(path.name + ".generated.gpuidx")
    return p if p.is_file() else None


def _with_gpu_index(pf: PredictorFile, split: GpuSplit, where: Path) -> PredictorFile:
    """PowerInfer's GPU neurons as each layer's activation mass (shared equally among them): our
    placement solver then puts those first, under our own byte costs and budget. act_freq stays 0,
    so the CPU side's choice of sparse layers is not changed by it."""
    if len(split.layers) != pf.n_layers or split.n_ff != pf.n_ff:
        raise ModelFileError(f"{where}: a GPU index for {len(split.layers)} layers of {split.n_ff} neurons; the model has "
                             f"{pf.n_layers} layers of {pf.n_ff}")
    layers = []
    for lp, idx in zip(pf.layers, split.layers):
        mass = np.zeros(pf.n_ff, np.float32)
        if len(idx):
            mass[idx] = 1.0 / len(idx)
        layers.append(replace(lp, act_mass=mass))
    log.info("%s: PowerInfer's GPU index puts %d of %d neurons on the GPU first", where, sum(len(i) for i in split.layers),
             pf.n_layers * pf.n_ff)
    return replace(pf, layers=tuple(layers))


def _value_type(value: object) -> tuple[GGUFValueType, GGUFValueType | None]:
    if isinstance(value, (bool, np.bool_)):
        return GGUFValueType.BOOL, None
    if isinstance(value, (str, bytes)):
        return GGUFValueType.STRING, None
    if isinstance(value, (float, np.floating)):
        return GGUFValueType.FLOAT32, None
    if isinstance(value, (int, np.integer)):
        return _int_type(int(value), int(value)), None
    raise ModelFileError(f"metadata value of type {type(value).__name__} cannot be copied")


def _raw(v: object) -> bytes:
    if isinstance(v, bytes):
        return v
    if isinstance(v, str):
        return v.encode("utf-8", "surrogateescape")
    raise ModelFileError(f"metadata array mixes strings with {type(v).__name__}")


def _int_type(lo: int, hi: int) -> GGUFValueType:
    """The narrowest of the writer's usual integer types that holds every value in [lo, hi]."""
    if lo >= 0:
        return GGUFValueType.UINT32 if hi < 2**32 else GGUFValueType.UINT64
    return GGUFValueType.INT32 if -(2**31) <= lo and hi < 2**31 else GGUFValueType.INT64


def _copy_metadata(src: GGUFFile, w: GGUFWriter) -> None:
    """Every key of src but the layout's own, with its GGUF type as near as the writer allows."""
    for key, value in src.metadata.items():
        if key.startswith(_SKIPPED_KEYS) or key == "general.architecture":
            continue
        if isinstance(value, np.ndarray):
            if value.dtype.kind == "b":
                sub = GGUFValueType.BOOL
            elif value.dtype.kind == "f":
                sub = GGUFValueType.FLOAT64 if value.dtype.itemsize == 8 else GGUFValueType.FLOAT32
            elif value.dtype.kind in "iu":
                sub = _int_type(int(value.min()), int(value.max())) if value.size else GGUFValueType.INT32
            else:
                raise ModelFileError(f"{src.path}: metadata {quoted(key)} is an array of {value.dtype}, which cannot be copied")
            w.add_key_value(key, value.tolist(), GGUFValueType.ARRAY, sub)
        elif isinstance(value, list):
            sub = _value_type(value[0])[0] if value else GGUFValueType.STRING
            if sub == GGUFValueType.STRING:  # the bytes as the file had them (the reader keeps invalid UTF-8 as surrogates)
                value = [_raw(v) for v in value]
            w.add_key_value(key, value, GGUFValueType.ARRAY, sub)
        elif isinstance(value, (str, bytes)):
            w.add_key_value(key, _raw(value), GGUFValueType.STRING)
        else:
            vtype, _ = _value_type(value)
            w.add_key_value(key, value.item() if isinstance(value, np.generic) else value, vtype)


def _down(f: GGUFFile, name: str) -> tuple[np.ndarray, QT]:
    """ffn_down_t [n_ff, d] as ffn_down [d, n_ff]: exact for float types, F16 for quantized ones."""
    info = f.tensor(name)
    raw = np.asarray(f.raw(name))
    if info.qtype in (QT.F32, QT.F16):
        return np.ascontiguousarray(raw.T), info.qtype
    if info.qtype == QT.BF16:
        return np.ascontiguousarray(((raw.astype(np.uint32) << 16).view(np.float32)).T.astype(np.float16)), QT.F16
    values = dequantize(raw, info.qtype).reshape(info.shape)
    return np.ascontiguousarray(values.T.astype(np.float16)), QT.F16


def _write_plain(f: GGUFFile, arch: str, out: Path) -> None:
    names = [n for n in f.tensors if not (".fc1." in n or ".fc2." in n)]
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    os.close(fd)
    try:
        w = GGUFWriter(None, arch)  # type: ignore[arg-type]
        _copy_metadata(f, w)
        if ACTIVATION_KEY not in f.metadata:
            w.add_string(ACTIVATION_KEY, ACTIVATION_OF[arch])
        for name in names:  # the table first: a down projection's shape and size follow without computing it
            info = f.tensor(name)
            if name.endswith(".ffn_down_t.bias"):  # PowerInfer's OPT converter renames fc2's bias with its weight
                raw = f.raw(name)
                w.add_tensor_info(name.replace(".ffn_down_t.", ".ffn_down."), raw.shape, raw.dtype, raw.nbytes, raw_dtype=info.qtype)
            elif ".ffn_down_t." in name:
                n_ff, d = info.shape
                qtype = info.qtype if info.qtype in (QT.F32, QT.F16) else QT.F16
                dtype = np.dtype(np.float32 if qtype == QT.F32 else np.float16)
                w.add_tensor_info(name.replace(".ffn_down_t.", ".ffn_down."), (d, n_ff), dtype, d * n_ff * dtype.itemsize, raw_dtype=qtype)
            else:
                raw = f.raw(name)
                w.add_tensor_info(name, raw.shape, raw.dtype, raw.nbytes, raw_dtype=info.qtype)
        w.write_header_to_file(path=Path(tmp))
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for name in names:  # one transposed down projection in memory at a time
            w.write_tensor_data(_down(f, name)[0] if name.endswith(".ffn_down_t.weight") else np.asarray(f.raw(name)))
        w.close()
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _check_layers(f: GGUFFile, arch: str) -> None:
    n = f.require(f"{arch}.block_count", int)
    for i in range(n):
        for part in ("ffn_down_t.weight", "fc1.weight", "fc2.weight"):
            if f"blk.{i}.{part}" not in f.tensors:
                raise ModelFileError(f"{f.path}: a PowerInfer model file without blk.{i}.{part}")
        info = f.tensor(f"blk.{i}.ffn_down_t.weight")
        if info.qtype not in (QT.F32, QT.F16, QT.BF16) and info.qtype not in GGML_QUANT_SIZES:
            raise UnsupportedModelError(f"{f.path}: blk.{i}.ffn_down_t.weight has type {info.qtype.name}")


def prepare_pwri(path: str | Path, cache: Path | None = None) -> PwriModel:
    """The runnable form of PowerInfer's model file at path (made once, then reused from the cache;
    ``cache``: another folder than the user cache's ``pwri/``)."""
    path = Path(path)
    f = open_powerinfer_gguf(path)
    arch = f.require("general.architecture", str)
    if arch not in ACTIVATION_OF:
        raise UnsupportedModelError(f"{path}: PowerInfer model of architecture {quoted(arch)} is not supported "
                                    f"(supported: {', '.join(ACTIVATION_OF)})")
    _check_layers(f, arch)
    root = cache if cache is not None else _cache_root()
    stem = path.name.removesuffix(".gguf").removesuffix(".powerinfer")[:60]
    gpuidx = gpuidx_beside(path)
    key = _key(path, gpuidx)
    model, pred = root / f"{stem}-{key}.gguf", root / f"{stem}-{key}.predictor"
    threshold = f.get(SPARSE_THRESHOLD_KEY, 0.0)
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not math.isfinite(threshold):
        raise ModelFileError(f"{path}: metadata {SPARSE_THRESHOLD_KEY} must be a finite number, got {quoted(threshold)}")
    threshold = float(threshold)
    if model.exists() and pred.exists():
        return PwriModel(path, model, pred, threshold)
    pf = read_powerinfer_predictor(path)  # validated before anything is written
    if gpuidx is not None:
        pf = _with_gpu_index(pf, read_gpuidx(gpuidx), gpuidx)
    try:
        root.mkdir(parents=True, exist_ok=True)
        phase.info("PowerInfer model file %s: writing its runnable form to %s (once)", path, model)
        _write_plain(f, arch, model)
        # the runnable model is known exactly: its fingerprint makes later loads check the pairing
        write_predictor(pred, replace(pf, fingerprint=model_fingerprint(GGUFFile(model))))
    except (struct.error, ValueError, OverflowError) as e:  # a value the writer cannot hold (a hostile file)
        raise ModelFileError(f"{path}: cannot rewrite its metadata as GGUF: {e}") from None
    except OSError as e:
        raise DiskWriteError(f"cannot write the runnable form of {path} to {root}: {write_failure(e, root)}") from None
    return PwriModel(path, model, pred, threshold)


def runnable_model(path: str | Path) -> tuple[Path, PwriModel | None]:
    """(the GGUF file to open, the PowerInfer model it came from or None) for a model path."""
    path = Path(path)
    if is_powerinfer_file(path):
        pw = prepare_pwri(path)
        return pw.model, pw
    return path, None
