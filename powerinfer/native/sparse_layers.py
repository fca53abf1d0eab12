"""Sparse FFNs inside the native decoder: each layer's rule and its 8-bit neuron predictor.

Runs in: the process of the in-process executor (the coordinator) and each rank of the native
pool, next to :class:`powerinfer.native.decoder.NativeDecoder`, which points each
layer's ``sp`` and ``pred`` at what this builds. numpy and ctypes only (ranks import no torch).

The weights are the file's own (kernels/sparse_rows.h reads the chosen gate and up rows in place
and runs the dense down projection on the mostly-zero hidden state); what this adds per layer is
the rule (mode and threshold, from the predictor file) and, in predictor mode, the predictor's
fc1 [r, d] and fc2 [n, r] quantized to Q8_0 blocks so that the decoder's own dot products run it
(r padded to a multiple of 32; fc2 by sign on AVX-512 VNNI: pred_sign.py). Modes (``set_mode``): ``file`` (the predictor file's rule: gate
threshold, or the predictor), ``all`` (every neuron through the sparse path) and ``oracle``
(the true active set, |act(gate) * up| > threshold), the last two for tests and measurements.
"""

from __future__ import annotations

import ctypes
import logging
import os

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf.quants import quantize

from powerinfer.config import ModelConfig
from powerinfer.native.decoder_lib import ISA_IDS, PiPred, PiSparse, PiWt, repack_x8
from powerinfer.native.pred_sign import sign_layout, sign_width
from powerinfer.errors import InvalidArgumentError
from powerinfer.memory import weight_array, weight_copy
from powerinfer.model.weights import layer_tensor
from powerinfer.quants.formats import dequantize_rows
from powerinfer.gguf_file import GGUFFile
from powerinfer.predictors.predictor_file import PredictorFile

log = logging.getLogger(__name__)

MODES = {"all": 0, "gate": 1, "mask": 2, "oracle": 3}  # sparse_rows.h's PI_SP_*
KERNEL_MODES = ("file", "all", "oracle")
# A layer whose calibrated share of active neurons exceeds this runs dense: a chosen row is read
# at about a quarter of a streamed row's speed on this CPU (kernels/sparse_rows.h), so skipping
# pays only well below ~25% active, and above it the dense layer is as fast and exact.
MAX_SPARSE_SHARE = 0.25
DOWN_MAX_SHARE = 0.15  # sparse_down.h's PI_DT_MAX: decode's sparse down projection up to this share active
# A prefill batch of at least this many tokens runs a predictor-mode layer dense: prefill computes
# every gate and up value with the tiled dense kernels and masks them, so the predictor only adds
# time (~6-10% of a 1.1B prefill), and the union of a batch's predicted sets does not make whole
# blocks of rows skippable in the file's neuron order (the 1.1B ReGLU file: by calibrate's
# frequencies 256 tokens fire ~46% of the neurons, spread over every block of 16). That prompt's
# FFN outputs are then the dense model's. Shorter batches keep the rule as decode applies it: a
# --lookup step's drafts and a chat's short turns are generated text, the same with or without them.
# set_masked_prefill(True) keeps the rule for every batch.
PREFILL_DENSE_FROM = 128
# Hot neurons: one that fires for at least this share of tokens (calibrate's act_freq) is computed
# in every decode step, with the hot block's other rows, by the dense eight-row kernel, then kept
# only where the rule chose it: a chosen row dotted alone cost ~4.5 rows of the dense kernel on the
# machines first measured (~5.5 GB/s against ~24.7 on the Zen 4 with slow memory, 16-20 against ~79
# on the first: docs/sparsity.md), so computing a neuron always paid from 0.22; on the Zen 4 with the
# bundled rows the chosen rows ran at ~8 GB/s against the hot block's ~25 (in-process phases of the
# 1.1B ReGLU file), ~3.1 rows, so from ~0.32: 0.30 decoded 1.034x 0.22 (median of 12 alternating
# pool rounds, 8 faster; in process the step took 0.909x at 0.33, 8 rounds of fresh loads).
HOT_FREQ = 0.30
# In predictor mode a chosen neuron's gate and up rows are both read: side by side in one copy, a
# neuron is one contiguous read of 2 rows (2304 bytes at d = 2048, Q4_0), which arrives faster than
# two reads of one row apiece (scripts/membench/gather.c here: 13.3 against 9-10 GB/s; "LLM in a
# flash" calls this bundling).
BUNDLE_GATE_UP = True


def layer_reads(predictor: bool, share: float, n: int, d: int, rows: tuple[int, int, int], down_row: int,
                pred_bytes: int = 0, rows_share: float | None = None) -> tuple[float, float]:
    """(streamed, scattered) FFN weight bytes a decode step reads in one sparse layer of n neurons
    with share of them chosen: the gate rows (every one streamed in gate mode; the computed ones,
    plus the predictor's pred_bytes streamed, in predictor mode), the computed up rows (rows_share
    of the neurons: the hot block and the chosen others; None: share), and the down projection (the
    chosen neurons' rows of the neuron-major copy, down_row bytes each (Q8_0 or Q4_0), at most
    DOWN_MAX_SHARE chosen; else the file's d rows streamed). rows: bytes of one gate, up and down
    row in the file. (The hot block's rows count as scattered: one stream in fact.)"""
    g, u, dn = rows
    r = share if rows_share is None else rows_share
    streamed, scattered = (pred_bytes, r * n * (g + u)) if predictor else (n * g, r * n * u)
    if share <= DOWN_MAX_SHARE + 1e-9:
        scattered += share * n * down_row
    else:
        streamed += d * dn
    return streamed, scattered


def _q8(w: np.ndarray) -> tuple[np.ndarray, PiWt]:
    """float32 [rows, cols] (cols % 32 == 0) -> Q8_0 blocks and a PiWt over them."""
    return _quant(w, QT.Q8_0)


def _quant(w: np.ndarray, qtype: QT) -> tuple[np.ndarray, PiWt]:
    """float32 [rows, cols] (cols % 32 == 0) -> qtype blocks (Q8_0 or Q4_0) and a PiWt over them."""
    codes = weight_copy(quantize(np.ascontiguousarray(w, dtype=np.float32), qtype))  # read every step: 2 MiB pages
    return codes, PiWt(codes.ctypes.data, None, codes.shape[1], int(qtype), w.shape[0], w.shape[1])


def predictor_q8(pf: PredictorFile, layer: int, d: int, neurons: tuple[int, int],
                 lib: ctypes.CDLL | None = None) -> tuple[PiPred, tuple[np.ndarray, ...]]:
    """fc1 [r, d] and fc2's rows of neurons [n0, n1) in Q8_0, r padded to a multiple of 32 (zero
    rows and columns: relu(0 + 0) = 0 adds nothing), float biases; and the arrays to keep. With lib
    both are also repacked eight rows at a time (qx8.h) where the build has that kernel, and on
    AVX-512 VNNI fc2 is instead in pred_sign.py's layout, r wide, the decoder taking only the sign
    of its logits (the 1.1B file's: 8.4 -> 6.2 MB a step, 0.61 -> 0.40-0.46 ms). A
    low-rank predictor (lowrank.py: fc1 = [V; -V], fc2 = [P, -P], no fc1 bias) is folded to the
    linear P (V x), exactly the same logits in half the width (pi_pred's linear): the 1.1B file's
    96-wide predictors read 64-wide (k = 48 padded to 64), 17.2 -> 11.5 MB a step."""
    lp = pf.layers[layer]
    n0, n1 = neurons
    fc1_w, fc1_b, fc2_w = lp.fc1_w, lp.fc1_b, lp.fc2_w
    linear = low_rank_pairs(fc1_w, fc1_b, fc2_w)
    if linear:
        k = lp.rank // 2
        fc1_w, fc1_b, fc2_w = fc1_w[:k], fc1_b[:k], fc2_w[:, :k]
    r = fc1_w.shape[0]
    if r == 0:
        raise InvalidArgumentError(f"layer {layer} of the predictor has no predictor (rank 0) but the file's mode is 'predictor'")
    rp = -(-r // 32) * 32
    if rp > n1 - n0:  # the decoder holds the predictor's hidden [T, r] in its [T, n_ff] buffer
        raise InvalidArgumentError(f"layer {layer}'s predictor rank {r} exceeds the {n1 - n0} neurons it chooses among")
    fc1 = np.zeros((rp, d), dtype=np.float32)
    fc1[:r] = fc1_w
    b1 = np.zeros(rp, dtype=np.float32)
    b1[:r] = fc1_b
    fc2 = np.zeros((n1 - n0, rp), dtype=np.float32)
    fc2[:, :r] = fc2_w[n0:n1]
    b2 = np.ascontiguousarray(lp.fc2_b[n0:n1], dtype=np.float32)
    c1, w1 = _q8(fc1)
    if lib is not None and lib.pi_isa() == ISA_IDS["vnni"]:  # fc2 by sign (kernels/pred_sign.h): k wide, not rp
        sg, packed = sign_layout(fc2, r), tuple(p for p in (repack_x8(lib, w1),) if p is not None)
        return (PiPred(w1, PiWt(), b1.ctypes.data, b2.ctypes.data, int(pf.reads_residual), int(linear), sg.ctypes.data, sign_width(r)),
                (c1, sg, b1, b2, *packed))
    c2, w2 = _q8(fc2)
    packed = tuple(p for p in (repack_x8(lib, w1), repack_x8(lib, w2)) if p is not None) if lib is not None else ()
    return PiPred(w1, w2, b1.ctypes.data, b2.ctypes.data, int(pf.reads_residual), int(linear)), (c1, c2, b1, b2, *packed)


def low_rank_pairs(fc1_w: np.ndarray, fc1_b: np.ndarray, fc2_w: np.ndarray) -> bool:
    """Whether a predictor is fc2(relu(fc1 x)) with fc1 = [V; -V], no fc1 bias and fc2 = [P, -P]
    (lowrank.py's): then relu(z) - relu(-z) = z makes it the linear P (V x), exactly."""
    r = fc1_w.shape[0]
    if r % 2 or r == 0 or np.any(fc1_b):
        return False
    k = r // 2
    return bool(np.array_equal(fc1_w[k:], -fc1_w[:k]) and np.array_equal(fc2_w[:, k:], -fc2_w[:, :k]))


def split_rows(lib: ctypes.CDLL, f: GGUFFile, name: str, r0: int, r1: int) -> np.ndarray | None:
    """Rows [r0, r1) of a matrix in qsplit.h's layout (the file's bytes moved: scales first), or
    None where this build or type has no such kernel."""
    info = f.tensor(name)
    if not lib.pi_split_supported(int(info.qtype)) or info.n_cols > 8192:  # qsplit.h's PI_SPLIT_MAX_COLS
        return None
    raw = np.ascontiguousarray(f.raw(name)[r0:r1])
    out = weight_array(raw.nbytes).reshape(raw.shape)
    if lib.pi_split_repack(raw.ctypes.data, raw.shape[1], int(info.qtype), info.n_cols, raw.shape[0], out.ctypes.data):
        return None
    return out


# File types of the down projection whose neuron-major copy is Q4_0 (else Q8_0): a 4-bit file's
# copy in 8 bits read 1.89x the file's bytes per chosen neuron (2176 against 1152 at d = 2048), the
# largest scattered read of a sparse step; requantized in 4 bits (as PowerInfer's ffn_down_t is) each
# value moves by up to half a step of its new block (docs/sparsity.md: the perplexity this costs).
DOWN_T_4BIT = frozenset({QT.Q4_0, QT.Q4_1, QT.Q4_K})
DOWN_T_TYPES = {"q8_0": QT.Q8_0, "q4_0": QT.Q4_0}


def down_t_type(file_qtype: int) -> QT:
    """The type of a down projection's neuron-major copy, given the file's type of ffn_down:
    ``POWERINFER_DOWN_T`` (q8_0, q4_0) where set, else Q4_0 for a 4-bit file (DOWN_T_4BIT), Q8_0 otherwise."""
    want = os.environ.get("POWERINFER_DOWN_T", "auto").lower()
    if want == "auto":
        return QT.Q4_0 if file_qtype in DOWN_T_4BIT else QT.Q8_0
    if want not in DOWN_T_TYPES:
        raise InvalidArgumentError(f"POWERINFER_DOWN_T must be auto, {', '.join(DOWN_T_TYPES)}; got {want!r}")
    return DOWN_T_TYPES[want]


def down_t_row_bytes(d: int, file_qtype: int) -> int:
    """Bytes of one neuron's row of the neuron-major copy of a down projection d outputs wide."""
    return -(-d // 32) * (18 if down_t_type(file_qtype) == QT.Q4_0 else 34)


def down_t_rows(f: GGUFFile, layer: int, d0: int, d1: int, order: np.ndarray | None = None) -> tuple[np.ndarray, PiWt]:
    """Rows [d0, d1) of the layer's down projection [d, n_ff], neuron-major: [n_ff, d1 - d0 padded
    to 32] in down_t_type (row p = neuron order[p]'s output direction; order None: neuron p's).
    Requantized from the file's values: each 32 outputs of a neuron get their own scale (Q8_0:
    within 1/254 of the block's largest value; Q4_0: 1/16), so a neuron's row is one contiguous
    read and the sparse sum skips whole rows."""
    name = layer_tensor(layer, "ffn_down")
    info = f.tensor(name)
    w = dequantize_rows(info.qtype, f.raw(name)[d0:d1], info.n_cols)  # [d1 - d0, n_ff]
    cols = -(-(d1 - d0) // 32) * 32
    wt = np.zeros((w.shape[1], cols), dtype=np.float32)
    wt[:, : d1 - d0] = w.T if order is None else w.T[order]
    return _quant(wt, down_t_type(info.qtype))


def hot_first(act_freq: np.ndarray) -> np.ndarray:
    """order [n] int32: neurons by calibrated firing frequency, most frequent first, ties in neuron order."""
    return np.argsort(-np.asarray(act_freq, dtype=np.float64), kind="stable").astype(np.int32)


def hot_rows(lib: ctypes.CDLL, f: GGUFFile, name: str, rows: np.ndarray) -> tuple[PiWt, list[np.ndarray]]:
    """The file's rows of a matrix copied together, in the file's layout and, where this build has
    the kernel, repacked eight at a time: a PiWt over them and the arrays to keep."""
    info = f.tensor(name)
    raw = np.ascontiguousarray(f.raw(name)[rows])  # [rows, row_bytes] bytes, or [rows, cols] floats for a float type
    w = PiWt(raw.ctypes.data, None, info.row_bytes, int(info.qtype), len(rows), info.n_cols)
    packed = repack_x8(lib, w)
    return w, [raw] + ([packed] if packed is not None else [])


class NativeSparseFFNs:
    """Every layer's sparse rule (and predictor) for one NativeDecoder (in process, or one rank)."""

    def __init__(self, lib: ctypes.CDLL, f: GGUFFile, cfg: ModelConfig, pf: PredictorFile, neurons: tuple[int, int] | None = None,
                 rows: tuple[int, int] | None = None, max_share: float = MAX_SPARSE_SHARE, only: frozenset[int] | None = None,
                 hot_block: bool = True) -> None:
        """neurons [n0, n1): a rank's range of every layer (the predictor's fc2 rows it needs);
        rows [d0, d1): the rank's output rows of the down projection (its down_t columns);
        only: the layers its decoder builds (the others get no sparse structures); hot_block:
        whether decode computes the hot neurons as a block (HOT_FREQ; off in a pool with a GPU
        rank, whose tests' logits moved with it: not traced)."""
        if pf.d_model != cfg.d_model or pf.n_ff != cfg.n_ff or pf.n_layers != cfg.n_layers:
            raise InvalidArgumentError("the predictor was made for another model shape")
        self.cfg, self.file_mode = cfg, pf.mode
        n0, n1 = neurons or (0, cfg.n_ff)
        self.n = n1 - n0
        self.rules = (PiSparse * cfg.n_layers)()
        self.preds: list[PiPred | None] = []
        self._pred_keep: list[tuple[np.ndarray, ...]] = []  # per layer: the predictor's Q8_0 fc1, fc2 and biases
        self._down_t: list[np.ndarray] = []  # each layer's neuron-major Q8_0 / Q4_0 down (decode's sparse down projection)
        self._split: list[np.ndarray] = []  # up / gate rows in the split layout (kernels/qsplit.h), and the hot blocks
        self._perm: list[np.ndarray] = []  # the rules' hot, is_hot and dperm arrays
        self.hot = [0] * cfg.n_layers  # per layer: this rank's hot neurons, which decode computes every step
        self.computed = np.zeros(cfg.n_layers, dtype=np.int64)  # gate / up rows decode computed per layer (the decoder adds to it)
        self.quality = np.zeros((cfg.n_layers, 3), dtype=np.int64)  # while tracked: decode's true positives, false negatives, false positives
        self.pred_s = np.zeros(cfg.n_layers, dtype=np.float64)  # while tracked: seconds the predictor took per layer
        d0, d1 = rows or (0, cfg.d_model)
        # decided on the whole layer's statistics, so that every rank of a pool decides alike
        built = [only is None or i in only for i in range(cfg.n_layers)]
        self.sparse_layers = tuple(built[i] and float(np.mean(pf.layers[i].act_freq)) <= max_share for i in range(cfg.n_layers))
        for i in range(cfg.n_layers):
            self.rules[i].thr = float(pf.layers[i].threshold)
            self.rules[i].dense_from = PREFILL_DENSE_FROM if pf.mode == "predictor" else 0
            if not self.sparse_layers[i]:
                self.preds.append(None)
                self._pred_keep.append(())
                self._down_t.append(np.zeros((0, 0), dtype=np.uint8))
                continue
            # down_t's rows hot first over the whole layer (every rank sums the same rows in the same order)
            dperm = hot_first(pf.layers[i].act_freq)
            codes, self.rules[i].down_t = down_t_rows(f, i, d0, d1, dperm)
            self._down_t.append(codes)
            self._perm += [dperm]
            self.rules[i].dperm = dperm.ctypes.data
            # decode dots the chosen up (and, with a predictor, gate) rows one by one: split layout where the build has it
            # (OPT: no up rows; its fc1, ffn_up, is the gate the kernel reads)
            fields = [(kind, field) for kind, field in ((("ffn_up", "up_split"),) if cfg.gated_ffn else ()) + ((cfg.gate_part, "gate_split"),)
                      if field != "gate_split" or pf.mode == "predictor"]
            splits = {field: split_rows(lib, f, layer_tensor(i, kind), n0, n1) for kind, field in fields}
            gs, us = splits.get("gate_split"), splits.get("up_split")
            if BUNDLE_GATE_UP and gs is not None and us is not None and gs.shape == us.shape:
                # a neuron's gate and up rows side by side [n, 2 row_bytes]: one contiguous read of both
                both = weight_copy(np.concatenate([gs, us], axis=1))
                self._split.append(both)
                self.rules[i].gate_split, self.rules[i].up_split = both.ctypes.data, both.ctypes.data + gs.shape[1]
                self.rules[i].split_stride = both.shape[1]
            else:
                for field, split in splits.items():
                    if split is not None:
                        self._split.append(split)
                        setattr(self.rules[i], field, split.ctypes.data)
            # the hot block: this rank's neurons that fire for HOT_FREQ of the tokens, decided on the whole layer's
            # frequencies so that a neuron is computed by the same kernel on every rank
            hot = np.flatnonzero(np.asarray(pf.layers[i].act_freq[n0:n1], dtype=np.float64) >= HOT_FREQ).astype(np.int32)
            if len(hot) and hot_block:
                is_hot = np.zeros(n1 - n0, dtype=np.uint8)
                is_hot[hot] = 1
                self._perm += [hot, is_hot]
                rule = self.rules[i]
                rule.hot, rule.is_hot, rule.n_hot = hot.ctypes.data, is_hot.ctypes.data, len(hot)
                for kind, field in fields:
                    w, copies = hot_rows(lib, f, layer_tensor(i, kind), n0 + hot)
                    self._split += copies
                    setattr(rule, "hot_gate" if field == "gate_split" else "hot_up", w)
                self.hot[i] = len(hot)
            self.rules[i].computed = self.computed[i:].ctypes.data
            pred, keep = predictor_q8(pf, i, cfg.d_model, (n0, n1), lib) if pf.mode == "predictor" else (None, ())
            self.preds.append(pred)
            self._pred_keep.append(keep)
        dense = [i for i, sp in enumerate(self.sparse_layers) if built[i] and not sp]
        if dense:
            log.info("%d of %d layers run dense: their calibrated share of active neurons exceeds %.0f%%, where skipping "
                     "stops paying on this CPU (layers %s)", len(dense), sum(built), 100 * max_share, dense)
        # bytes a neuron's gate and up rows take in the file (the per-token figures below)
        self.row_bytes = [(f.tensor(layer_tensor(i, cfg.gate_part)).row_bytes, f.tensor(layer_tensor(i, "ffn_up")).row_bytes if cfg.gated_ffn else 0,
                           f.tensor(layer_tensor(i, "ffn_down")).row_bytes) for i in range(cfg.n_layers)]
        self.active = np.zeros(cfg.n_layers, dtype=np.int64)  # neurons computed per layer (the decoder adds to it)
        self._attached: ctypes.Array | None = None  # type: ignore[type-arg]  # the decoder's PiLayer array
        self.mode = "file"
        self.set_mode("file")

    def set_masked_prefill(self, on: bool) -> None:
        """on: prefill batches apply the predictor's rule as decode does (tests, measurements);
        off (the default): they run the predictor-mode layers dense (PREFILL_DENSE_FROM)."""
        for rule in self.rules:
            rule.dense_from = 0 if on or self.file_mode != "predictor" else PREFILL_DENSE_FROM

    def track(self, quality: bool, timing: bool) -> None:
        """Measurement: count decode's predictor against the true active set (each step then computes
        every neuron once more) into quality [tp, fn, fp], and time the predictor into pred_s."""
        for i, rule in enumerate(self.rules):
            rule.quality = self.quality[i:].ctypes.data if quality else None
            rule.pred_s = self.pred_s[i:].ctypes.data if timing else None

    def reads_file_rows(self, layer: int, field: str) -> bool:
        """Whether decode dots layer's chosen rows of ``wu`` / ``wg`` from the file's layout (no
        split copy of them: a non-VNNI build, or a type qsplit.h does not take)."""
        if field == "wu":
            return not self.rules[layer].up_split
        return field == "wg" and not self.gate_dense and not self.rules[layer].gate_split

    @property
    def gate_dense(self) -> bool:
        """Whether the rule computes every neuron's gate (all but the predictor's)."""
        return not self.uses_predictor

    @property
    def uses_predictor(self) -> bool:
        return self.mode == "file" and self.file_mode == "predictor"

    def set_mode(self, mode: str) -> None:
        """``file`` (the predictor file's rule), ``all`` or ``oracle`` (see the module docstring)."""
        if mode not in KERNEL_MODES:
            raise InvalidArgumentError(f"sparse mode must be one of {KERNEL_MODES}, got {mode!r}")
        kmode = {"gate": "gate", "predictor": "mask"}[self.file_mode] if mode == "file" else mode
        for rule in self.rules:
            rule.mode = MODES[kmode]
        self.mode = mode
        if self._attached is not None:
            self._point()

    def set_flags(self, dense: bool | None = None, oracle: bool | None = None) -> None:
        """An executor's set_sparse: every neuron (dense=True), the true active set (oracle=True),
        or the file's rule (either False); None leaves that flag as it is."""
        mode = self.mode
        if dense is not None:
            mode = "all" if dense else ("oracle" if mode == "oracle" else "file")
        if oracle is not None and mode != "all":
            mode = "oracle" if oracle else "file"
        self.set_mode(mode)

    def attach(self, layers: ctypes.Array) -> None:  # type: ignore[type-arg]
        """Point each PiLayer's sp and pred at this object's structures (they must outlive the decoder's use)."""
        self._attached = layers
        self._point()

    def _point(self) -> None:
        assert self._attached is not None
        for i, L in enumerate(self._attached):
            L.sp = ctypes.addressof(self.rules[i]) if self.sparse_layers[i] else None
            pred = self.preds[i]
            L.pred = ctypes.addressof(pred) if pred is not None and self.uses_predictor else None

    @property
    def nbytes(self) -> int:
        """Bytes the predictors, the neuron-major down projections and the split rows take (the rest is the file's)."""
        return sum(a.nbytes for a in (*(a for k in self._pred_keep for a in k), *self._down_t, *self._split))

    def bytes_per_token(self, tokens: int) -> tuple[float, float]:
        """(FFN weight bytes a decode step reads, the dense FFNs' bytes), estimated from the active
        counts since the last reset: gate rows (all of them unless the predictor chooses), the
        chosen up rows, the down projection (the chosen neurons' rows of its neuron-major copy at most DOWN_MAX_SHARE
        active, else the whole file matrix), the predictor's Q8_0 bytes; dense layers in full."""
        if tokens <= 0:
            raise InvalidArgumentError("bytes per token need at least one token")
        d = self.cfg.d_model
        total = dense = 0.0
        for i, (act, rows) in enumerate(zip(self.active, self.row_bytes)):
            full = self.n * (rows[0] + rows[1]) + d * rows[2]
            dense += full
            if not self.sparse_layers[i]:
                total += full
                continue
            pred = sum(a.nbytes for a in self._pred_keep[i][:2]) if self.uses_predictor else 0
            computed = self.computed[i] / (tokens * self.n) if self.computed[i] else None  # decode's rows (0: prefill only)
            total += sum(layer_reads(self.uses_predictor, act / (tokens * self.n), self.n, d, rows, self._down_t[i].shape[1], pred, computed))
        return total, dense

    def share(self, tokens: int) -> float:
        """Share of FFN neurons computed per token since the last reset (dense layers: all)."""
        if tokens <= 0:
            return 1.0
        per_layer = [act / (tokens * self.n) if sp else 1.0 for act, sp in zip(self.active, self.sparse_layers)]
        return float(np.mean(per_layer))
