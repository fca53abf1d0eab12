"""Readers for PowerInfer's own files, so its users can bring the files they already have.

Runs in: the CLI process, the coordinator and CPU workers (wherever a predictor or GPU split is
read).

What PowerInfer (SJTU-IPADS/PowerInfer, the llama.cpp-based v1) writes, from its sources
(``convert-hf-to-powerinfer-gguf.py``, ``powerinfer-py/powerinfer/export_split.py``,
``gguf-py/gguf/constants.py``, ``llama.cpp``, ``ggml.c``, ``ggml-cuda.cu``):

* **Model + predictor GGUF** (``*.powerinfer.gguf``): an ordinary GGUF v3 whose first 4 bytes are
  ``PWRI`` instead of ``GGUF`` (patched in after writing; ``gguf_init_from_file`` takes either
  magic and flags the file for sparse inference). Beside the model tensors, each layer has the
  predictor ``blk.N.fc1.weight`` [r_N, d] and ``blk.N.fc2.weight`` [n_ff, r_N] (numpy order;
  ReluMLP with ``bias=False``, r_N may differ per layer; F16 by default) and the down projection
  is stored transposed as ``blk.N.ffn_down_t.weight`` [n_ff, d] (no ``ffn_down``). The optional
  float32 key ``powerinfer.sparse_threshold`` (default 0) is a cut-off on the predictor's
  *output*: a neuron is computed iff ``fc2(relu(fc1(x))) >= threshold`` (the kernels skip rows
  where ``idx[row] < threshold``). For llama the predictor reads ``ffn_inp``, the residual
  stream *before* ``ffn_norm``, while up/gate read the normed input.
* **GPU split** (``<model>.generated.gpuidx``): a GGUF with the ``PWRI`` magic (version 3),
  architecture ``generic.gpu_index`` (``moe.gpu_idx`` for MoE models), keys
  ``generic.gpu_index.block_count`` and ``split.vram_capacity`` (uint64, bytes), and per layer
  ``blk.N.gpu_idx`` (int32 [n_ff], 1 = neuron on the GPU) then ``blk.N.gpu_bucket`` (int32, the
  sorted indices of those neurons; absent for MoE). Written by PowerInfer's bundled gguf-py,
  whose type table predates upstream's: I8/I16/I32 are type ids 16/17/18 (upstream: 24/25/26).

Our reader (:class:`PowerInferGGUFFile`) accepts ``PWRI`` by parsing a copy-on-write mapping
whose first page has the magic rewritten (only that page is ever copied), maps the legacy
integer type ids, and tolerates PowerInfer's empty tensors (a layer with no GPU neurons has a
zero-length ``gpu_bucket``).
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from powerinfer.errors import ModelFileError, UnsupportedModelError, quoted
from powerinfer.gguf_file import GGUF_MAGIC, GGUFFile
from powerinfer.predictors.predictor_types import CalibrationValue, LayerPredictor, PredictorFile, validate_predictor

log = logging.getLogger(__name__)

PWRI_MAGIC = b"PWRI"
SPARSE_THRESHOLD_KEY = "powerinfer.sparse_threshold"
VRAM_CAPACITY_KEY = "split.vram_capacity"
GPU_INDEX_ARCHITECTURES = ("generic.gpu_index", "moe.gpu_idx")
# PowerInfer's ggml numbers its integer types after Q8_K (15); upstream later moved them to 24..26.
_LEGACY_TYPES = {16: GGMLQuantizationType.I8, 17: GGMLQuantizationType.I16, 18: GGMLQuantizationType.I32}
_FC1_NAME = re.compile(r"blk\.(\d+)\.fc1\.weight")


class PowerInferGGUFFile(GGUFFile):
    """:class:`GGUFFile` that also reads PowerInfer's ``PWRI`` files (plain GGUF files too).

    ``powerinfer`` says which magic the file had; ``empty_tensors`` names zero-length tensors,
    which PowerInfer writes and plain GGUF readers reject (they have no data and no view).
    """

    def __init__(self, path: str | Path) -> None:
        self.powerinfer = False
        self.empty_tensors: set[str] = set()
        super().__init__(path)

    def _parse(self) -> None:
        if bytes(self._map[:4]) == PWRI_MAGIC:
            self.powerinfer = True
            try:
                # MAP_PRIVATE: writing the magic copies one page into this process; every other
                # page stays shared with the page cache, and the file itself is never modified.
                cow = np.memmap(self.path, dtype=np.uint8, mode="c")
            except OSError as e:
                raise ModelFileError(f"{self.path}: cannot read: {e.strerror or e}") from None
            cow[:4] = np.frombuffer(GGUF_MAGIC, dtype=np.uint8)
            cow.flags.writeable = False
            self._map = cow
        super()._parse()

    def _add_tensor(
        self, name: str, qtype: int, dims: tuple[int, ...], offset: int, data_start: int, alignment: int
    ) -> None:
        if self.powerinfer:
            qtype = int(_LEGACY_TYPES.get(qtype, qtype))
            if any(d == 0 for d in dims):
                if name in self.tensors or name in self.empty_tensors:
                    raise ModelFileError(f"{self.path}: malformed GGUF: tensor {quoted(name)} appears twice")
                self.empty_tensors.add(name)
                return
        super()._add_tensor(name, qtype, dims, offset, data_start, alignment)


def is_powerinfer_file(path: str | Path) -> bool:
    """True when the file starts with PowerInfer's ``PWRI`` magic (False if unreadable)."""
    try:
        with open(path, "rb") as fh:
            return fh.read(4) == PWRI_MAGIC
    except OSError:
        return False


def open_powerinfer_gguf(path: str | Path) -> PowerInferGGUFFile:
    """Parse a PowerInfer ``PWRI`` file (or a plain GGUF) with our bounds-checked reader."""
    return PowerInferGGUFFile(path)


# -- model + predictor file ---------------------------------------------------------------------


def _dense(f: GGUFFile, name: str) -> np.ndarray:
    """Tensor ``name`` as float32 in numpy order (F32: a zero-copy view; other types decoded)."""
    info = f.tensor(name)
    raw = f.raw(name)
    if info.qtype == GGMLQuantizationType.F32:
        out = raw
    elif info.qtype == GGMLQuantizationType.F16:
        out = raw.astype(np.float32)
    elif info.qtype == GGMLQuantizationType.BF16:
        out = (raw.astype(np.uint32) << 16).view(np.float32)  # raw holds bf16 bit patterns
    else:
        try:
            out = dequantize(np.asarray(raw), info.qtype).astype(np.float32, copy=False)
        except (NotImplementedError, ValueError) as e:
            raise UnsupportedModelError(
                f"{f.path}: tensor {name!r} has type {info.qtype.name}, which we cannot decode: {e}") from None
    return out.reshape(info.shape)


def _optional_vector(f: GGUFFile, name: str, n: int) -> np.ndarray | None:
    if name not in f.tensors:
        return None
    v = _dense(f, name)
    if v.shape != (n,):
        raise ModelFileError(f"{f.path}: tensor {name!r} has shape {list(v.shape)}, expected [{n}]")
    return v


def _norm_weights(f: GGUFFile, n_layers: int, d: int) -> list[np.ndarray] | None:
    """Every layer's ffn_norm weights [d] when the predictors can be folded onto the normed input.

    PowerInfer's llama predictor reads x = ffn_inp; our FFN (and its predictor) sees
    n = x / c * w with c = sqrt(mean(x^2) + eps) > 0 and w = ffn_norm.weight. Without biases the
    predictor is positively homogeneous: W2 relu(W1 x) = c * W2 relu((W1 / w) n), so the sign of
    every logit, and so the active set at threshold 0, is the same with W1' = W1 / w on n.
    None when any layer lacks the norm, has a zero or non-finite norm weight, or has a bias.
    """
    out = []
    for i in range(n_layers):
        p = f"blk.{i}."
        if p + "fc1.bias" in f.tensors or p + "fc2.bias" in f.tensors or p + "ffn_norm.weight" not in f.tensors:
            return None
        w = _dense(f, p + "ffn_norm.weight").reshape(-1)
        if w.shape != (d,) or not np.isfinite(w).all() or (w == 0).any():
            return None
        out.append(w)
    return out


def read_powerinfer_predictor(path: str | Path, fold_ffn_norm: bool = True) -> PredictorFile:
    """The predictors inside a PowerInfer ``PWRI`` model file, as a ``predictor``-mode PredictorFile.

    PowerInfer's output cut-off (``powerinfer.sparse_threshold``, default 0) is folded into
    ``fc2_b`` (``fc2_b = bias - threshold``), so ``predict`` (logit > 0) selects what PowerInfer
    selects (logit >= threshold; they differ only on exact ties); it is also kept as
    ``calibration["sparse_threshold"]``. Each layer's activation ``threshold`` is 0: PowerInfer's
    models are ReLU models, where a neuron is active iff its activation is > 0.

    With ``fold_ffn_norm`` (default), fc1 is rewritten for the normed FFN input our engine feeds
    predictors (see :func:`_norm_weights`); exact for threshold 0 and bias-free predictors, which is
    what PowerInfer ships. The result's ``input`` says which input it
    expects: ``"normed"`` or ``"residual"`` (ffn_inp, before ffn_norm: folding was off, or
    impossible, as for OPT's LayerNorm, whose mean subtraction does not fold).
    PowerInfer has no calibration statistics: act_freq / act_mass are zeros; target_sparsity is
    unknown, 0; the fingerprint is "" (unknown), so read_predictor(model=...) checks only shapes.
    """
    f = open_powerinfer_gguf(path)
    arch = f.require("general.architecture", str)
    layer_ids = sorted(int(m.group(1)) for name in f.tensors if (m := _FC1_NAME.fullmatch(name)))
    if not layer_ids:
        raise ModelFileError(f"{f.path}: no PowerInfer predictor tensors (blk.N.fc1.weight) in this file")
    n_layers = f.require(f"{arch}.block_count", int) if f"{arch}.block_count" in f.metadata else layer_ids[-1] + 1
    # The first layer without a predictor, found without building range(n_layers): block_count comes
    # from the file and may be 2**64 - 1 (a set of that range never finishes).
    have = set(layer_ids)
    missing = next((i for i in range(n_layers) if i not in have), None)
    if missing is not None or layer_ids[-1] >= n_layers:
        what = (f"layer {missing} has no predictor" if missing is not None
                else f"predictor for layer {layer_ids[-1]} beyond {n_layers} layers")
        raise ModelFileError(f"{f.path}: {what} (blk.N.fc1.weight)")
    t = f.require(SPARSE_THRESHOLD_KEY, (int, float)) if SPARSE_THRESHOLD_KEY in f.metadata else 0.0
    if not math.isfinite(t):
        raise ModelFileError(f"{f.path}: metadata {SPARSE_THRESHOLD_KEY!r} is not finite")
    d, n_ff = f.tensor("blk.0.fc1.weight").shape[-1], f.tensor("blk.0.fc2.weight").shape[0]
    for key, want in ((f"{arch}.embedding_length", d), (f"{arch}.feed_forward_length", n_ff)):
        have = f.get(key)
        if isinstance(have, int) and have != want:
            raise ModelFileError(f"{f.path}: predictors map {d} -> {n_ff}, but {key} is {have}")
    # A LayerNorm (OPT) subtracts each token's mean, which does not fold: such predictors keep
    # reading the residual stream (input "residual"), which the native decoder feeds them.
    layer_norm = "blk.0.ffn_norm.bias" in f.tensors
    norms = _norm_weights(f, n_layers, d) if fold_ffn_norm and not layer_norm else None
    fcs = []
    for i in range(n_layers):
        p = f"blk.{i}."
        fc1_w, fc2_w = _dense(f, p + "fc1.weight"), _dense(f, p + "fc2.weight")
        r = fc1_w.shape[0] if fc1_w.ndim == 2 else 0
        fcs.append((fc1_w, fc2_w, _optional_vector(f, p + "fc1.bias", r), _optional_vector(f, p + "fc2.bias", n_ff)))
    if fold_ffn_norm and norms is None and not layer_norm:
        log.warning("%s: PowerInfer's predictors read the FFN input before ffn_norm and cannot be folded onto "
                    "the normed input (missing/zero norm weights or biases); they expect the residual input", f.path)
    return powerinfer_predictor(str(f.get("general.name", f.path.stem)), fcs, t, norms, str(f.path))


def powerinfer_predictor(model_name: str, fcs: list[tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]],
                         threshold: float, norms: list[np.ndarray] | None, where: str) -> PredictorFile:
    """PowerInfer's per-layer predictors (fc1 [r, d], fc2 [n_ff, r], optional biases) as our
    ``predictor``-mode PredictorFile: the output cut-off ``threshold`` folded into fc2's bias and,
    with ``norms`` (each layer's ffn_norm weights), fc1 folded onto the normed input (see
    :func:`read_powerinfer_predictor`). ``where`` names the source in errors."""
    t = threshold
    n_layers = len(fcs)
    d, n_ff = fcs[0][0].shape[-1], fcs[0][1].shape[0]
    layers = []
    for i, (fc1_w, fc2_w, fc1_b, fc2_b) in enumerate(fcs):
        if fc1_w.ndim != 2 or fc2_w.ndim != 2 or fc2_w.shape[1] != fc1_w.shape[0]:
            raise ModelFileError(f"{where}: layer {i}: fc1 {list(fc1_w.shape)} and fc2 {list(fc2_w.shape)} do not chain")
        if (fc1_w.shape[1], fc2_w.shape[0]) != (d, n_ff):
            raise ModelFileError(
                f"{where}: layer {i}: predictor maps {fc1_w.shape[1]} -> {fc2_w.shape[0]}, layer 0 maps {d} -> {n_ff}")
        r = fc1_w.shape[0]
        zeros = np.zeros(n_ff, np.float32)
        # inf/nan from odd norms or thresholds: no warnings here, validate_predictor refuses the result
        with np.errstate(over="ignore", invalid="ignore"):
            if norms is not None:
                fc1_w = fc1_w / norms[i][None, :]  # [r, d]: column j scaled by 1 / ffn_norm.weight[j]
            fc2_b = ((zeros if fc2_b is None else fc2_b) - np.float32(t)).astype(np.float32)
        layers.append(LayerPredictor(
            fc1_w=np.asarray(fc1_w, dtype=np.float32),
            fc1_b=np.zeros(r, np.float32) if fc1_b is None else np.asarray(fc1_b, dtype=np.float32),
            fc2_w=np.asarray(fc2_w, dtype=np.float32), fc2_b=fc2_b, threshold=0.0, act_freq=zeros, act_mass=zeros))
    input_kind = "normed" if norms is not None else "residual"
    if norms is not None and t != 0.0:
        log.warning("%s: %s = %g is applied to the folded (normed-input) logits; that is exact only for 0",
                    where, SPARSE_THRESHOLD_KEY, t)
    calibration: dict[str, CalibrationValue] = {"source": "powerinfer", "sparse_threshold": float(t)}
    pf = PredictorFile(
        mode="predictor", model_name=model_name, fingerprint="",
        n_layers=n_layers, d_model=d, n_ff=n_ff, rank=max(lp.rank for lp in layers), target_sparsity=0.0,
        calibration=MappingProxyType(calibration), layers=tuple(layers), input=input_kind)
    try:
        validate_predictor(pf)
    except ValueError as e:
        raise ModelFileError(f"{where}: {e}") from None
    log.info("read PowerInfer predictors from %s: %d layers, d %d, n_ff %d, ranks %d..%d, input %s",
             where, n_layers, d, n_ff, min(lp.rank for lp in layers), pf.rank, input_kind)
    return pf


# -- GPU split (.gpuidx) ---------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuSplit:
    """PowerInfer's GPU neuron placement: which FFN neurons of each layer live on the GPU."""

    layers: tuple[np.ndarray, ...]  # per layer: sorted, unique int32 neuron indices [k_i] on the GPU
    n_ff: int  # neurons per layer
    vram_capacity: int  # bytes PowerInfer's solver planned for (split.vram_capacity)

    def mask(self, layer: int) -> np.ndarray:
        """bool [n_ff]: True for the neurons of ``layer`` placed on the GPU."""
        out = np.zeros(self.n_ff, dtype=bool)
        out[self.layers[layer]] = True
        return out


def _int32_vector(f: PowerInferGGUFFile, name: str) -> np.ndarray:
    if name in f.empty_tensors:
        return np.zeros(0, np.int32)
    info = f.tensor(name)
    if info.qtype != GGMLQuantizationType.I32 or len(info.shape) != 1:
        raise ModelFileError(f"{f.path}: tensor {name!r} is {info.qtype.name} {list(info.shape)}, expected a 1-D I32 vector")
    return f.raw(name).reshape(-1).view("<i4")


def read_gpuidx(path: str | Path) -> GpuSplit:
    """Read PowerInfer's ``.gpuidx`` GPU split; every inconsistency is a one-line ModelFileError."""
    f = open_powerinfer_gguf(path)
    arch = f.get("general.architecture")
    if not isinstance(arch, str) or arch not in GPU_INDEX_ARCHITECTURES:  # `array in (...)` would raise
        raise ModelFileError(f"{f.path}: not a PowerInfer GPU index: general.architecture is {quoted(arch)}, "
                             f"expected one of {', '.join(map(repr, GPU_INDEX_ARCHITECTURES))}")
    idx_names = [n for n in (*f.tensors, *f.empty_tensors) if n.endswith(".gpu_idx")]
    n_layers = f.require(f"{arch}.block_count", int) if f"{arch}.block_count" in f.metadata else len(idx_names)
    if n_layers <= 0:
        raise ModelFileError(f"{f.path}: the GPU index has no layers")
    vram = f.require(VRAM_CAPACITY_KEY, int) if VRAM_CAPACITY_KEY in f.metadata else 0
    expected: set[str] = set()
    layers, n_ff = [], -1
    for i in range(n_layers):
        idx_name, bucket_name = f"blk.{i}.gpu_idx", f"blk.{i}.gpu_bucket"
        expected.update((idx_name, bucket_name))
        idx = _int32_vector(f, idx_name)
        if n_ff < 0:
            n_ff = len(idx)
        if len(idx) != n_ff or n_ff == 0:
            raise ModelFileError(f"{f.path}: {idx_name!r} has {len(idx)} neurons, layer 0 has {n_ff}")
        if ((idx != 0) & (idx != 1)).any():
            raise ModelFileError(f"{f.path}: {idx_name!r} holds values other than 0 and 1")
        on_gpu = np.flatnonzero(idx).astype(np.int32)
        if bucket_name in f.tensors or bucket_name in f.empty_tensors:
            bucket = _int32_vector(f, bucket_name)
            if not np.array_equal(bucket, on_gpu):
                raise ModelFileError(f"{f.path}: {bucket_name!r} ({len(bucket)} neurons) disagrees with {idx_name!r} "
                                     f"({len(on_gpu)} neurons on the GPU)")
        layers.append(on_gpu)
    unexpected = [n for n in (*f.tensors, *f.empty_tensors) if n not in expected]
    if unexpected:
        raise ModelFileError(f"{f.path}: unexpected tensor {quoted(unexpected[0])} (the index declares {n_layers} layers)")
    log.info("read GPU split %s: %d layers, %d of %d neurons on the GPU", f.path, n_layers, sum(map(len, layers)),
             n_layers * n_ff)
    return GpuSplit(layers=tuple(layers), n_ff=n_ff, vram_capacity=int(vram))
