"""The ``.predictor`` file: per-layer neuron predictors, thresholds and statistics for one model.

Runs in: the CLI process (``calibrate`` writes it), the coordinator and every CPU worker (each
reads it next to the model it serves).

A predictor file is a GGUF container (so our bounds-checked reader guards it the same way it
guards models), written with ``gguf.GGUFWriter``. Metadata keys:

=====================================  ========  ===============================================
``general.architecture``               string    ``"powerinfer-predictor"``
``powerinfer.predictor.version``       uint32    format version, :data:`FORMAT_VERSION` (1)
``powerinfer.predictor.mode``          string    ``"predictor"`` or ``"gate"`` (see below)
``powerinfer.predictor.model_name``    string    ``general.name`` of the model it was made for
``powerinfer.predictor.fingerprint``   string    :func:`model_fingerprint` of that model's GGUF
``powerinfer.predictor.n_layers``      uint32    layers of the model
``powerinfer.predictor.d_model``       uint32    FFN input width d
``powerinfer.predictor.n_ff``          uint32    FFN neurons per layer
``powerinfer.predictor.rank``          uint32    largest predictor hidden width r over the layers
``powerinfer.predictor.target_sparsity`` float32 fraction of neurons meant to be skipped, 0..1
``powerinfer.predictor.input``         string    what fc1 reads: ``"normed"`` (the FFN's normed input;
                                                 the default when absent) or ``"residual"`` (the
                                                 residual stream before the FFN norm)
``powerinfer.predictor.calibration.K`` str/i64/f64  calibration setting K (source, tokens, seed...)
=====================================  ========  ===============================================

Tensors, all F32, for each layer i (shapes in numpy order):
``blk.{i}.fc1.weight`` [r, d], ``blk.{i}.fc1.bias`` [r], ``blk.{i}.fc2.weight`` [n_ff, r],
``blk.{i}.fc2.bias`` [n_ff], ``blk.{i}.threshold`` [1], ``blk.{i}.act_freq`` [n_ff],
``blk.{i}.act_mass`` [n_ff]. A layer's four ``fc`` tensors are all present or all absent; they
may be absent (r = 0, fc2_b zeros) only in ``gate`` mode, where the predictor is not used. Layers may have
different r (PowerInfer's own predictors do); ``rank`` is the largest.

Modes: ``predictor`` skips the gate, up and down rows of neurons the low-rank MLP
(Linear(d, r) -> ReLU -> Linear(r, n_ff), active where the logit > 0) predicts cold; ``gate``
computes the gate densely and reads up/down rows only where |act(gate)| > the layer's threshold.

PowerInfer's own files (``PWRI`` magic, see :mod:`powerinfer.predictors.powerinfer_formats`) are
read transparently by :func:`read_predictor`.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import tempfile
from pathlib import Path
from types import MappingProxyType

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

from powerinfer.config import config_from_gguf
from powerinfer.errors import DiskWriteError, ModelFileError, file_mode, quoted, write_failure
from powerinfer.gguf_file import GGUFFile
from powerinfer.predictors.powerinfer_formats import is_powerinfer_file, read_powerinfer_predictor
from powerinfer.predictors.predictor_types import (INPUTS, MODES, CalibrationValue, LayerPredictor, PredictorFile, refuse_residual_input,
                                                   validate_predictor)

__all__ = ["MODES", "CalibrationValue", "LayerPredictor", "PredictorFile", "model_fingerprint", "read_predictor", "refuse_residual_input",
           "validate_predictor", "write_predictor"]

log = logging.getLogger(__name__)

ARCHITECTURE = "powerinfer-predictor"
FORMAT_VERSION = 1
KEY = "powerinfer.predictor."
CALIBRATION_KEY = KEY + "calibration."
# Bytes hashed from each end of every tensor: two pages, so a fingerprint touches ~8 KiB per tensor.
FINGERPRINT_SAMPLE = 4096
_FC_PARTS = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")
_LAYER_PARTS = (*_FC_PARTS, "threshold", "act_freq", "act_mass")


# -- fingerprint ------------------------------------------------------------------------------


def model_fingerprint(f: GGUFFile) -> str:
    """sha256 hex over the architecture, every tensor's (name, type, shape) in file order, and
    the first and last 4 KiB of every tensor's bytes.

    Cheap (only those pages are read: ~2 ms for a 250 MB file in the page cache, two page reads
    per tensor from disk) yet it changes when any tensor is renamed, reshaped or requantized, or
    when the weights differ (another checkpoint differs in every sampled page). A change confined
    to the middle of one tensor goes unnoticed, and so does an edit to metadata other than the
    architecture (tokenizer, chat template), which does not change what the predictor sees.
    """
    h = hashlib.sha256()
    h.update(b"powerinfer-fingerprint-v1\0")
    h.update(str(f.get("general.architecture", "")).encode("utf-8", "surrogateescape") + b"\0")
    for info in f.tensors.values():
        h.update(f"{info.name}\0{int(info.qtype)}\0{','.join(map(str, info.shape))}\n".encode("utf-8", "surrogateescape"))
        data = f.raw(info.name).reshape(-1).view(np.uint8)  # zero-copy view of the mapped bytes
        h.update(data[:FINGERPRINT_SAMPLE].tobytes())
        h.update(data[-FINGERPRINT_SAMPLE:].tobytes())
    return h.hexdigest()


# -- writing ----------------------------------------------------------------------------------


def write_predictor(path: str | Path, pf: PredictorFile) -> None:
    """Validate ``pf`` (ValueError) and write it atomically: a temp file in the same directory,
    fsynced, then renamed over ``path``, so readers never see a half-written file.

    A failed write (disk full, no permission) removes the temp file, leaves an existing ``path``
    as it was and raises DiskWriteError ("no space left on device" when that is the cause)."""
    validate_predictor(pf)
    path = Path(os.path.realpath(path))  # through a symlink: the link stays, its target gets the file
    try:
        fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise DiskWriteError(f"could not write the predictor file {path}: {write_failure(e, path.parent)}") from None
    os.close(fd)
    tmp = Path(tmp_name)
    w: GGUFWriter | None = None
    try:
        w = GGUFWriter(tmp, ARCHITECTURE)
        w.add_uint32(KEY + "version", FORMAT_VERSION)
        # add_key_value, not add_string: add_string silently drops "" (an unknown fingerprint)
        w.add_key_value(KEY + "mode", pf.mode, GGUFValueType.STRING)
        w.add_key_value(KEY + "model_name", pf.model_name, GGUFValueType.STRING)
        w.add_key_value(KEY + "fingerprint", pf.fingerprint, GGUFValueType.STRING)
        w.add_uint32(KEY + "n_layers", pf.n_layers)
        w.add_uint32(KEY + "d_model", pf.d_model)
        w.add_uint32(KEY + "n_ff", pf.n_ff)
        w.add_uint32(KEY + "rank", pf.rank)
        w.add_float32(KEY + "target_sparsity", float(pf.target_sparsity))
        w.add_key_value(KEY + "input", pf.input, GGUFValueType.STRING)
        for key, value in pf.calibration.items():
            # int64/float64 so every Python int (within 64 bits) and float round-trips exactly
            if isinstance(value, str):
                w.add_key_value(CALIBRATION_KEY + key, value, GGUFValueType.STRING)
            elif isinstance(value, int):
                w.add_int64(CALIBRATION_KEY + key, value)
            else:
                w.add_float64(CALIBRATION_KEY + key, float(value))
        for i, lp in enumerate(pf.layers):
            p = f"blk.{i}."
            if lp.rank > 0:  # GGUF has no zero-sized tensors: a rank-0 layer stores no fc tensors
                for part, a in zip(_FC_PARTS, (lp.fc1_w, lp.fc1_b, lp.fc2_w, lp.fc2_b)):
                    w.add_tensor(p + part, np.ascontiguousarray(a, dtype=np.float32))
            w.add_tensor(p + "threshold", np.array([lp.threshold], dtype=np.float32))
            w.add_tensor(p + "act_freq", np.ascontiguousarray(lp.act_freq, dtype=np.float32))
            w.add_tensor(p + "act_mass", np.ascontiguousarray(lp.act_mass, dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        w = None
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.chmod(tmp, file_mode(path))  # mkstemp makes it 0600: readable by no other user, such as a server's
        os.replace(tmp, path)
    except BaseException as e:
        if w is not None:  # release the temp file; its flush fails again on a full disk
            with contextlib.suppress(OSError, ValueError):
                w.close()
        tmp.unlink(missing_ok=True)  # nothing half-written stays behind; an older `path` is untouched
        if isinstance(e, OSError):  # disk full (ENOSPC, or numpy's errno-less short write), permissions
            raise DiskWriteError(f"could not write the predictor file {path}: {write_failure(e, path.parent)}") from e
        raise
    log.info("wrote %s: %s mode, %d layers, rank %d", path, pf.mode, pf.n_layers, pf.rank)


# -- reading ----------------------------------------------------------------------------------


def _meta_int(f: GGUFFile, key: str, minimum: int) -> int:
    value = f.require(key, int)
    if value < minimum:
        raise ModelFileError(f"{f.path}: metadata {key!r} is {value}, expected >= {minimum}")
    return int(value)


def _tensor_f32(f: GGUFFile, name: str, shape: tuple[int, ...]) -> np.ndarray:
    info = f.tensor(name)  # ModelFileError when missing
    if info.qtype != GGMLQuantizationType.F32:
        raise ModelFileError(f"{f.path}: tensor {name!r} has type {info.qtype.name}, expected F32")
    if info.shape != shape:
        raise ModelFileError(f"{f.path}: tensor {name!r} has shape {list(info.shape)}, expected {list(shape)}")
    return f.raw(name).reshape(shape)  # zero-copy, read-only view of the map


def _read_calibration(f: GGUFFile) -> dict[str, CalibrationValue]:
    out: dict[str, CalibrationValue] = {}
    for key, value in f.metadata.items():
        if not key.startswith(CALIBRATION_KEY):
            continue
        if isinstance(value, (np.integer, np.floating)):
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise ModelFileError(f"{f.path}: metadata {key!r} has type {type(value).__name__}, expected a string or number")
        out[key[len(CALIBRATION_KEY):]] = value
    return out


def _read_own(f: GGUFFile) -> PredictorFile:
    arch = f.get("general.architecture")
    if not isinstance(arch, str) or arch != ARCHITECTURE:  # isinstance first: `array != str` is elementwise
        hint = " (this looks like a model file, not a predictor)" if f"{arch}.block_count" in f.metadata else ""
        raise ModelFileError(
            f"{f.path}: not a predictor file: general.architecture is {quoted(arch)}, expected {ARCHITECTURE!r}{hint}")
    version = f.require(KEY + "version", int)
    if version != FORMAT_VERSION:
        raise ModelFileError(f"{f.path}: predictor format version {version} is not supported (this build reads {FORMAT_VERSION})")
    mode = f.require(KEY + "mode", str)
    if mode not in MODES:
        raise ModelFileError(f"{f.path}: unknown predictor mode {quoted(mode)} (expected one of {', '.join(MODES)})")
    n_layers, d, n_ff = (_meta_int(f, KEY + k, 1) for k in ("n_layers", "d_model", "n_ff"))
    rank = _meta_int(f, KEY + "rank", 0)
    sparsity = float(f.require(KEY + "target_sparsity", (int, float)))
    fc_input = f.require(KEY + "input", str) if KEY + "input" in f.metadata else "normed"
    if fc_input not in INPUTS:
        raise ModelFileError(f"{f.path}: unknown predictor input {quoted(fc_input)} (expected one of {', '.join(INPUTS)})")
    expected: set[str] = set()
    layers = []
    for i in range(n_layers):
        p = f"blk.{i}."
        present = [part for part in _FC_PARTS if p + part in f.tensors]
        if present and len(present) < len(_FC_PARTS):
            missing = next(part for part in _FC_PARTS if part not in present)
            raise ModelFileError(f"{f.path}: required tensor {p + missing!r} is missing")
        if not present and mode == "predictor":
            raise ModelFileError(f"{f.path}: required tensor {p + 'fc1.weight'!r} is missing")
        r = f.tensor(p + "fc1.weight").shape[0] if present else 0
        if r > rank:
            raise ModelFileError(f"{f.path}: tensor {p + 'fc1.weight'!r} has rank {r}, more than the file's rank {rank}")
        # The statistics first: their shapes check n_ff and d against the file's own tensors before
        # any array is sized by those metadata values (a uint32 max n_ff would be a 16 GiB zeros).
        threshold = float(_tensor_f32(f, p + "threshold", (1,))[0])
        act_freq, act_mass = _tensor_f32(f, p + "act_freq", (n_ff,)), _tensor_f32(f, p + "act_mass", (n_ff,))
        if present:
            fc = [_tensor_f32(f, p + part, s) for part, s in zip(_FC_PARTS, ((r, d), (r,), (n_ff, r), (n_ff,)))]
        else:
            fc = [np.zeros((0, d), np.float32), np.zeros(0, np.float32),
                  np.zeros((n_ff, 0), np.float32), np.zeros(n_ff, np.float32)]
        layers.append(LayerPredictor(*fc, threshold=threshold, act_freq=act_freq, act_mass=act_mass))
        expected.update(p + part for part in _LAYER_PARTS)
    unexpected = [name for name in f.tensors if name not in expected]
    if unexpected:
        raise ModelFileError(f"{f.path}: unexpected tensor {quoted(unexpected[0])} (the file declares {n_layers} layers)")
    fingerprint = f.require(KEY + "fingerprint", str)
    if fingerprint and not re.fullmatch(r"[0-9a-f]{64}", fingerprint):  # it is shown in errors: no raw bytes
        raise ModelFileError(f"{f.path}: metadata {KEY + 'fingerprint'!r} is {quoted(fingerprint)}, not a sha256 hex digest")
    pf = PredictorFile(mode=mode, model_name=f.require(KEY + "model_name", str), fingerprint=fingerprint,
                       n_layers=n_layers, d_model=d, n_ff=n_ff, rank=rank, target_sparsity=sparsity,
                       calibration=MappingProxyType(_read_calibration(f)), layers=tuple(layers), input=fc_input)
    try:
        validate_predictor(pf)
    except ValueError as e:
        raise ModelFileError(f"{f.path}: {e}") from None
    return pf


def check_against_model(pf: PredictorFile, model: GGUFFile, where: str | Path) -> None:
    """Refuse (ModelFileError, one line) a predictor made for another model or another shape."""
    cfg = config_from_gguf(model)
    ours = quoted(pf.model_name)
    theirs = f"{quoted(cfg.name)} ({model.path})"
    if pf.fingerprint:
        fp = model_fingerprint(model)
        if fp != pf.fingerprint:
            raise ModelFileError(
                f"{where}: predictor was made for model {ours} (fingerprint {pf.fingerprint[:12]}), "
                f"not for model {theirs} (fingerprint {fp[:12]}); calibrate one for this model"
            )
    else:
        log.warning("%s: predictor has no model fingerprint (made by PowerInfer?); checking only its shapes against %s",
                    where, model.path)
    for what, have, want in (("layers", pf.n_layers, cfg.n_layers), ("FFN neurons (n_ff)", pf.n_ff, cfg.n_ff),
                             ("model width (d_model)", pf.d_model, cfg.d_model)):
        if have != want:
            raise ModelFileError(f"{where}: predictor for {ours} has {have} {what}, but model {theirs} has {want}")


def read_predictor(path: str | Path, model: GGUFFile | None = None) -> PredictorFile:
    """Read and validate a predictor file (ours, or PowerInfer's ``PWRI`` model file).

    With ``model``, also refuse a predictor made for another model (fingerprint) or whose layer
    count, n_ff or d_model differ from the model's. Every problem is a one-line ModelFileError.
    """
    path = Path(path)
    if is_powerinfer_file(path):
        pf = read_powerinfer_predictor(path)
    else:
        pf = _read_own(GGUFFile(path))
    if model is not None:
        check_against_model(pf, model, path)
    log.info("read %s: %s mode, %d layers, rank %d, made for %r", path, pf.mode, pf.n_layers, pf.rank, pf.model_name)
    return pf
