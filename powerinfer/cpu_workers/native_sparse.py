"""Sparse FFNs inside the native decoder: each layer's sparse_ffn.c call and its 8-bit predictor.

Runs in: the process of the in-process executor (the coordinator), next to
:class:`powerinfer.cpu_workers.native_model.NativeDecoder`, which points each layer's ``ffn`` and
``pred`` at what this builds. The weights are packed once by :func:`native.pack_layer` (gate, up
and down neuron-major in the file's own codes; a few seconds for a 1.1B model), and the layer's
wg/wu/wd file rows are then not read at all.

Modes (``PiCall.mode``):
  * ``gate``: act(gate) of every neuron, up and down rows only where |act(gate)| > the layer's
    threshold (the file's ``gate`` mode);
  * ``mask``: the predictor runs first, in 8 bits (fc1 and fc2 quantized to Q8_0 blocks,
    through the decoder's own dot products), and only the neurons whose logit is positive have
    their gate, up and down rows read (the file's ``predictor`` mode, PowerInfer's design);
  * ``all`` (``--no-sparse``-like, every neuron through the sparse layout) and ``oracle`` (the
    true active set: |act(gate) * up| > threshold), for tests and measurements.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf.quants import quantize

from powerinfer.config import ModelConfig
from powerinfer.cpu_workers.native_lib import PiPred, PiWt
from powerinfer.cpu_workers.neuron_major import (
    ACTIVATIONS,
    MODES,
    NeuronMajor,
    PiCall,
    pack_layer,
    supported,
)
from powerinfer.errors import InvalidArgumentError
from powerinfer.gguf_file import GGUFFile
from powerinfer.model.weights import layer_tensor
from powerinfer.quants.formats import decode
from powerinfer.quants.grouped import Grouped
from powerinfer.sparsity.predictor_file import PredictorFile

log = logging.getLogger(__name__)

KERNEL_MODES = ("file", "all", "oracle")  # the file's mode, every neuron, the true active set


@dataclass(frozen=True)
class LayerFFN:
    """One layer's packed weights, its call and (predictor mode) its 8-bit predictor."""

    weights: NeuronMajor
    call: PiCall
    pred: PiPred | None
    keep: tuple[np.ndarray, ...]  # the predictor's arrays pred points into


def _decoded(f: GGUFFile, layer: int, kind: str, rows: tuple[int, int] | None = None) -> Grouped | np.ndarray:
    name = layer_tensor(layer, kind)
    info = f.tensor(name)
    raw = f.raw(name)
    return decode(info.qtype, raw if rows is None else raw[rows[0] : rows[1]], info.n_cols)


def sparse_blocker(f: GGUFFile, cfg: ModelConfig) -> str | None:
    """None when the native decoder can run this model's FFNs sparsely, else why not."""
    if cfg.d_model % 32 or cfg.d_model > 8192:
        return f"model width {cfg.d_model} (the sparse kernel takes multiples of 32 up to 8192)"
    if cfg.activation not in ACTIVATIONS:
        return f"activation {cfg.activation}"
    for kind in ("ffn_gate", "ffn_up", "ffn_down"):
        info = f.tensor(layer_tensor(0, kind))
        if info.qtype not in (QT.Q4_0, QT.Q4_1, QT.Q8_0, QT.Q5_0, QT.Q5_1):
            return f"{kind} is {info.qtype.name} (the sparse kernel reads 4-bit and 8-bit blocks of 32)"
    return None


def _q8(w: np.ndarray) -> tuple[np.ndarray, PiWt]:
    """float32 [rows, cols] (cols % 32 == 0) -> Q8_0 blocks and a PiWt over them."""
    codes = np.ascontiguousarray(quantize(np.ascontiguousarray(w, dtype=np.float32), QT.Q8_0))
    return codes, PiWt(codes.ctypes.data, None, codes.shape[1], int(QT.Q8_0), w.shape[0], w.shape[1])


def _predictor(pf: PredictorFile, layer: int, d: int, neurons: tuple[int, int]) -> tuple[PiPred, tuple[np.ndarray, ...]]:
    """fc1 [r, d], fc2 [n, r] (the rows of neurons [n0, n1)) in Q8_0 with r padded to a multiple of
    32 (zero rows and columns: relu(0 + 0) = 0 adds nothing), float biases."""
    lp = pf.layers[layer]
    n0, n1 = neurons
    r = lp.rank
    if r == 0:
        raise InvalidArgumentError(f"layer {layer} of the predictor has no predictor (rank 0) but the file's mode is 'predictor'")
    rp = -(-r // 32) * 32
    n = n1 - n0
    if rp > n:  # the decoder holds the predictor's hidden [T, r] in its [T, n_ff] buffer
        raise InvalidArgumentError(f"layer {layer}'s predictor rank {r} exceeds the layer's {n} neurons")
    fc1 = np.zeros((rp, d), dtype=np.float32)
    fc1[:r] = lp.fc1_w
    b1 = np.zeros(rp, dtype=np.float32)
    b1[:r] = lp.fc1_b
    fc2 = np.zeros((n, rp), dtype=np.float32)
    fc2[:, :r] = lp.fc2_w[n0:n1]
    b2 = np.ascontiguousarray(lp.fc2_b[n0:n1], dtype=np.float32)
    c1, w1 = _q8(fc1)
    c2, w2 = _q8(fc2)
    return PiPred(w1, w2, b1.ctypes.data, b2.ctypes.data), (c1, c2, b1, b2)


class NativeSparseFFNs:
    """Every layer's sparse FFN for the native decoder (in process, one rank)."""

    def __init__(self, f: GGUFFile, cfg: ModelConfig, pf: PredictorFile, neurons: tuple[int, int] | None = None, ranks: int = 1) -> None:
        """neurons [n0, n1): a rank's range (whole groups of 32) of every layer; ranks: how many
        share the FFNs (their partial outputs are summed in the decoder)."""
        why = sparse_blocker(f, cfg)
        if why is not None:
            raise InvalidArgumentError(f"the native decoder cannot run this model's FFNs sparsely: {why}")
        if pf.d_model != cfg.d_model or pf.n_ff != cfg.n_ff or pf.n_layers != cfg.n_layers:
            raise InvalidArgumentError("the predictor was made for another model shape")
        self.cfg, self.file_mode, self.ranks = cfg, pf.mode, ranks
        n0, n1 = neurons or (0, cfg.n_ff)
        self.n = n1 - n0
        self._attached: ctypes.Array | None = None  # type: ignore[type-arg]  # the decoder's PiLayer array
        self.layers: list[LayerFFN] = []
        for i in range(cfg.n_layers):
            gate, up = (_decoded(f, i, k, (n0, n1)) for k in ("ffn_gate", "ffn_up"))
            down = _decoded(f, i, "ffn_down")
            if not all(isinstance(m, Grouped) and supported(m) for m in (gate, up, down)):
                raise InvalidArgumentError(f"layer {i}'s FFN has no layout the sparse kernel takes")
            assert isinstance(gate, Grouped) and isinstance(up, Grouped) and isinstance(down, Grouped)
            if n0 % down.group or self.n % down.group or down.group > 64:
                raise InvalidArgumentError(f"layer {i}: neurons [{n0}, {n1}) are not whole groups of {down.group}")
            weights = pack_layer(gate, up, down.cols(n0, n1) if (n0, n1) != (0, cfg.n_ff) else down)
            g, u, dn = weights.mats
            call = PiCall(gate=g, up=u, down=dn, d=cfg.d_model, n=self.n, act=ACTIVATIONS[cfg.activation],
                          thr=float(pf.layers[i].threshold))
            pred, keep = _predictor(pf, i, cfg.d_model, (n0, n1)) if pf.mode == "predictor" else (None, ())
            self.layers.append(LayerFFN(weights, call, pred, keep))
        self.set_mode("file")
        self.active = np.zeros(cfg.n_layers, dtype=np.int64)  # neurons computed per layer (the decoder adds to it)

    def set_mode(self, mode: str) -> None:
        """``file`` (the predictor file's mode), ``all`` or ``oracle`` (see the module docstring)."""
        if mode not in KERNEL_MODES:
            raise InvalidArgumentError(f"sparse mode must be one of {KERNEL_MODES}, got {mode!r}")
        kmode = {"gate": "gate", "predictor": "mask"}[self.file_mode] if mode == "file" else mode
        for L in self.layers:
            L.call.mode = MODES[kmode]
        self.mode = mode
        if self._attached is not None:
            self._point()

    @property
    def uses_predictor(self) -> bool:
        return self.mode == "file" and self.file_mode == "predictor"

    def attach(self, layers: ctypes.Array) -> None:  # type: ignore[type-arg]
        """Point each PiLayer's ffn and pred at this object's structures (they must outlive the decoder's use)."""
        self._attached = layers
        self._point()

    def _point(self) -> None:
        for L, ffn in zip(self._attached, self.layers):
            L.ffn = ctypes.addressof(ffn.call)
            L.pred = ctypes.addressof(ffn.pred) if ffn.pred is not None and self.uses_predictor else None

    @property
    def nbytes(self) -> int:
        return sum(L.weights.nbytes + sum(a.nbytes for a in L.keep) for L in self.layers)

    def bytes_per_token(self, tokens: int) -> tuple[float, float]:
        """(FFN weight bytes read per token, of the dense FFN's) from the active counts since the
        last reset: a computed neuron reads its gate (unless gate mode reads every gate row), up
        and down rows; the predictor's bytes are added in predictor mode."""
        if tokens <= 0:
            raise InvalidArgumentError("bytes per token need at least one token")
        n = self.n
        total = 0.0
        dense = 0.0
        for L, act in zip(self.layers, self.active):
            g, u, dn = (sum(t.nbytes for t in part) for part in (L.weights.gate, L.weights.up, L.weights.down))
            share = act / (tokens * n)
            gate_share = 1.0 if L.call.mode == MODES["gate"] or L.call.mode == MODES["all"] or L.call.mode == MODES["oracle"] else share
            total += g * gate_share + (u + dn) * share
            if L.pred is not None and self.uses_predictor:
                total += sum(a.nbytes for a in L.keep)
            dense += g + u + dn
        return total, dense
