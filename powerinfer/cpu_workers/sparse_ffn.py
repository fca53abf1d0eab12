"""Sparse FFN shard: compute only the neurons predicted (or gated) to be active.

Runs in: a CPU worker process (or the coordinator for the in-process executor).

Where it can, the shard runs the native kernel (:mod:`powerinfer.native.sparse_kernel`): gate, up
and down all neuron-major in the file's own codes, each active neuron's bytes read in place, one
call per layer, for any set of neurons (a set that is not one range of whole down groups is
covered by whole groups, see :meth:`SparseFFNShard._load_native`). The torch path below is the
fallback: no C compiler, a matrix the kernel has no layout for (float tensors, formats that do
not decode to 4-bit group-32 or 8-bit group-16/32 codes, d_model not a multiple of 32), or a
scattered set whose cover would hold much more memory than the set (``MAX_COVER_BYTES``); both
paths compute the same modes.

Torch path: gate and up rows stay packed as in the dense shard (the file's own 4-bit codes); the down
projection is kept transposed and neuron-major in float16, down_t [n, d] (row i is neuron i's
output direction), so any subset of neurons is a row gather and a step reads only the selected
rows of down_t:

* ``gate`` mode: gate and up are computed for every neuron (one fused matmul, exactly the dense
  model's numbers); neurons with |act(gate)| above the layer's threshold get their down rows.
* ``predictor`` mode: a low-rank MLP on x [1, d] predicts the active set; gate and up rows of the
  others are never read either (int8 neuron-major copies, gathered), nor their down rows.

Prefill (T > 1 tokens) computes every activation and sums each token's active down rows, the
same per-token computation as decode. ``force_dense`` sums all rows (``--no-sparse``); ``oracle``
uses the true active set.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
import torch.nn.functional as F

from powerinfer.config import ModelConfig
from powerinfer.native.sparse_kernel import NativeFFN, native_lib
from powerinfer.native.neuron_major import supported
from powerinfer.gguf_file import GGUFFile
from powerinfer.model.linears import load_linear
from powerinfer.model.ops import activation, ffn_hidden, ffn_up_bias, up_value
from powerinfer.model.sharding import down_columns, packs_as_columns
from powerinfer.model.weights import layer_tensor
from powerinfer.quants import Int8Linear, PackedLinear
from powerinfer.quants.grouped import Grouped
from powerinfer.quants.formats import decode
from powerinfer.predictors.predictor_file import LayerPredictor

log = logging.getLogger(__name__)


# A scattered neuron set runs on the native kernel while its cover holds at most this many times
# the bytes the torch path would (SmolLM2, random hot sets: native 1.5-2.8x faster per layer; the
# cover is the whole layer from ~5% of the neurons hot, 1.15x the torch path's bytes at 50% hot,
# 5.3x at 90%)
MAX_COVER_BYTES = 1.25


def _int8_rows(lin: PackedLinear) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [N, K padded to a multiple of 32], float32 scales [N]) of a linear, requantized per row
    when it is not int8 already (see :func:`_int8_per_row` for the padding)."""
    if isinstance(lin, Int8Linear):
        w = lin.weight[:, : lin.in_features]
        return _pad_to(w, -(-w.shape[1] // 32) * 32).contiguous(), lin.scales.float()
    q, scale = _int8_per_row(lin.dequantized().numpy())  # [N, K] float32, one matrix at a time
    return q, scale.float()


def _int8_per_row(w: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 [m, k] -> (int8 [m, k padded to a multiple of 32 with zeros], bfloat16 scales [m]):
    round(w / scale), scale = max |row| / 127 (rounded to bfloat16 first, as the int8 kernel
    applies it). torch's int8 kernel reads past a k that is not a multiple of 16 (measured: NaN
    outputs, and a crash), so the inputs are zero-padded to match (:func:`_pad_to`)."""
    scale = torch.from_numpy(np.maximum(np.abs(w).max(axis=1, initial=0.0), 1e-30).astype(np.float32) / np.float32(127.0)).bfloat16()
    q = np.zeros((w.shape[0], -(-w.shape[1] // 32) * 32), dtype=np.int8)
    q[:, : w.shape[1]] = np.clip(np.rint(w / scale.float().numpy()[:, None]), -127, 127)
    return torch.from_numpy(q), scale


def _pad_to(x: torch.Tensor, k: int) -> torch.Tensor:
    """x [T, j] zero-padded to [T, k] (k >= j)."""
    return x if x.shape[1] == k else F.pad(x, (0, k - x.shape[1]))


_ZERO_OFFSET = torch.zeros(1, dtype=torch.long)  # embedding_bag offsets of a single bag


def _rows(w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Rows idx of w: index_select is ~25x faster than w[idx] on int8 (measured 120 µs vs 3 ms for
    3122 of 5632 rows of 2048)."""
    return torch.index_select(w, 0, idx)


class SparseFFNShard:
    """A set of neurons of one layer (a range, or any sorted set: the cold neurons next to a GPU
    worker's hot ones), computed sparsely at decode time."""

    def __init__(self, f: GGUFFile, cfg: ModelConfig, layer: int, neurons: np.ndarray, pred: LayerPredictor, mode: str,
                 native: bool = True, reads_residual: bool = False) -> None:
        """reads_residual: the predictor's input is the residual stream before the FFN norm (forward's
        resid), not the normed x (PredictorFile.input)."""
        if mode not in ("predictor", "gate"):
            raise ValueError(f"unknown sparse mode {mode!r}")
        self.cfg, self.layer, self.mode = cfg, layer, mode
        self.reads_residual = reads_residual and mode == "predictor"
        idx = np.asarray(neurons, dtype=np.int64)
        if idx.size == 0 or np.any(np.diff(idx) <= 0):
            raise ValueError("a sparse FFN shard is a non-empty sorted set of distinct neurons")
        start, stop = int(idx[0]), int(idx[-1]) + 1
        self.start, self.n = start, len(idx)
        contiguous = packs_as_columns(f, layer, idx)
        rows: slice | np.ndarray = slice(start, stop) if contiguous else idx
        self.force_dense = False
        self.oracle = False
        self.track_quality = False  # multi-token calls also count true/false positives (perplexity)
        self.last_active = 0.0  # share of this shard's neurons computed in the last call
        # quality counters over multi-token calls: true positives, false positives, false negatives,
        # (token, neuron) pairs seen, pairs computed; "true" = |act(gate) * up| > threshold
        self.counts = np.zeros(5, dtype=np.int64)
        self.decode_calls, self.decode_active = 0, 0.0  # decode steps and the sum of their active shares
        # native kernel over `covered` neurons (a range, or the whole down groups that hold the set);
        # mine [n_covered] marks this shard's neurons among them when the cover holds others too
        self.mine: torch.Tensor | None = None
        self.native: NativeFFN | None = None
        covered: slice | np.ndarray = rows
        # OPT's gate-less FFN (act(up + b), cfg.gated_ffn False) runs on the torch path: the kernel
        # here has gate and up rows; the native decoder (the default executors) has its own sparse FFN
        self.bias = ffn_up_bias(f, cfg, layer, idx)
        if native and cfg.gated_ffn:
            loaded = self._load_native(f, layer, idx, contiguous)
            if loaded is not None:
                self.native, covered = loaded
        self._load_predictor(pred, covered)
        if self.native is None:
            self._load_torch(f, layer, idx, rows, contiguous)

    def _load_native(self, f: GGUFFile, layer: int, idx: np.ndarray, contiguous: bool) -> tuple[NativeFFN, slice | np.ndarray] | None:
        """(kernel, the neurons it covers), or None where the kernel cannot take this layer.

        A set that is not one range of whole down groups (the cold neurons beside a GPU worker's
        hot ones) is covered by the down groups that hold any of its neurons: the kernel's down
        keeps one file scale per group of neurons, so whole groups keep the file's exact numbers.
        The cover's other neurons get all-zero gate rows (act(0) = 0): never active, they add
        nothing in any mode, and mode "mask" is narrowed to the set. They cost their gate bytes'
        reads and memory (at most group - 1 extra neurons per group touched)."""
        lib = native_lib()
        if lib is None:
            return None
        down_name = layer_tensor(layer, "ffn_down")
        info = f.tensor(down_name)
        down = decode(info.qtype, f.raw(down_name), info.n_cols)
        if not isinstance(down, Grouped) or not supported(down) or self.cfg.d_model % 32:
            return None
        start, stop = int(idx[0]), int(idx[-1]) + 1
        if contiguous:
            if start % down.group or (stop - start) % down.group:
                return None
            covered: slice | np.ndarray = slice(start, stop)
            down = down.cols(start, stop)
        else:
            groups = np.unique(idx // down.group)
            covered = (groups[:, None] * down.group + np.arange(down.group)).ravel()
            down = down.col_groups(groups)

        def dec(kind: str) -> Grouped | np.ndarray:
            name = layer_tensor(layer, kind)
            t = f.tensor(name)
            return decode(t.qtype, f.raw(name)[covered], t.n_cols)

        gate, up = dec("ffn_gate"), dec("ffn_up")
        if not (isinstance(gate, Grouped) and isinstance(up, Grouped) and supported(gate) and supported(up)):
            return None
        if not contiguous:
            assert isinstance(covered, np.ndarray)
            mine = np.isin(covered, idx)
            others = ~mine
            gate = Grouped(gate.q.copy(), gate.scale.copy(), gate.zero.copy(), gate.group, gate.bits)
            gate.scale[others] = 0  # every weight of those rows is scale * code + zero = 0
            gate.zero[others] = 0
        kernel = NativeFFN(lib, gate, up, down, self.cfg.activation, act_threshold=self.cfg.act_threshold)
        if not contiguous:
            # scattered hot neurons leave almost every group with a cold one, so the cover is about
            # the whole layer; past a point that holds more than the torch path would (its gate and
            # up rows in the file's format, down_t in float16: ~2 bytes a weight, for the set only)
            d = self.cfg.d_model
            row = sum(f.tensor(layer_tensor(layer, k)).row_bytes for k in ("ffn_gate", "ffn_up"))
            torch_bytes = len(idx) * (row + 2 * d + (2 * d if self.mode == "predictor" else 0))
            if kernel.nbytes > MAX_COVER_BYTES * torch_bytes:
                log.info("layer %d: %d of %d neurons cover %d; the torch path holds less", layer, len(idx), self.cfg.n_ff, len(covered))
                return None
            self.mine = torch.from_numpy(mine)
        return kernel, covered

    def _load_predictor(self, pred: LayerPredictor, rows: slice | np.ndarray) -> None:
        self.threshold = float(pred.threshold)
        # int8 with one scale per output row, bfloat16 activations: a decode step's predictor reads
        # a quarter of float32's bytes and runs on torch's int8 kernel (1.1B-shaped layer, rank 256:
        # 959 -> 114 µs); near-zero logits may flip, which the calibrated recall margin absorbs
        self.fc1_w, self.fc1_s = _int8_per_row(np.asarray(pred.fc1_w, dtype=np.float32))  # [r, d (padded)], [r]
        self.fc1_b = torch.from_numpy(np.array(pred.fc1_b, dtype=np.float32))
        self.fc2_w, self.fc2_s = _int8_per_row(np.asarray(pred.fc2_w[rows], dtype=np.float32))  # [n, r (padded)]: this shard's (covered) neurons
        self.fc2_b = torch.from_numpy(np.array(pred.fc2_b[rows], dtype=np.float32))

    def _load_torch(self, f: GGUFFile, layer: int, idx: np.ndarray, rows: slice | np.ndarray, contiguous: bool) -> None:
        start, stop = int(idx[0]), int(idx[-1]) + 1
        mode = self.mode
        # gate and up rows packed like the dense shard (the file's own codes): act(gate) and up are
        # then exactly the dense model's numbers. Gate mode computes both for every neuron (one
        # fused int4 matmul) and skips the down rows of the inactive ones; predictor mode keeps
        # int8 neuron-major copies so it can also skip the gate and up rows of unpredicted neurons.
        self.gate_up: PackedLinear = load_linear(f, [(layer_tensor(layer, part), rows) for part in self.cfg.ffn_parts])
        self.gate_w = self.gate_s = self.up_w = self.up_s = None
        if mode == "predictor":
            self.gate_w, self.gate_s = _int8_rows(load_linear(f, [(layer_tensor(layer, self.cfg.gate_part), rows)], kind="int8"))  # [n, d], [n]
            if self.cfg.gated_ffn:
                self.up_w, self.up_s = _int8_rows(load_linear(f, [(layer_tensor(layer, "ffn_up"), rows)], kind="int8"))
        # down [d, n] -> neuron-major down_t [n, d] in float16: row i is neuron i's output direction.
        # The down matrix's quantization groups run along n, so one int8 scale per neuron would
        # span many groups' scales and lose the small ones (measured +2.45% perplexity on SmolLM2);
        # float16 keeps every 4-bit value to ~5e-4. A step then sums the active rows weighted by
        # their activations in one gather-multiply-add (embedding_bag): 115 µs for 1000 of 1536
        # rows of 576 vs 290 µs for the dense int4 down matmul and 608 µs for gather + bf16 matmul.
        if contiguous:
            down_t = load_linear(f, [(layer_tensor(layer, "ffn_down"), None)], cols=(start, stop), kind="f32")
            self.down_t = down_t.dequantized().T.contiguous().half()
            del down_t
        else:
            self.down_t = torch.from_numpy(np.ascontiguousarray(down_columns(f, layer, idx)[0].T)).half()

    @property
    def nbytes(self) -> int:
        pred = sum(t.nbytes for t in (self.fc1_w, self.fc1_s, self.fc2_w, self.fc2_s))
        if self.native is not None:
            return self.native.nbytes + pred
        tensors = [self.down_t] + [t for t in (self.gate_w, self.gate_s, self.up_w, self.up_s) if t is not None]
        return sum(t.nbytes for t in tensors) + self.gate_up.nbytes + pred

    # -- pieces ----------------------------------------------------------------------------------

    def _mm(self, x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """x [T, d] @ (w [m, d'] int8 * s [m]).T -> [T, m] float32 (d' >= d: w's zero-padded columns)."""
        return torch.ops.aten._weight_int8pack_mm(_pad_to(x, w.shape[1]).to(torch.bfloat16), w, s.to(torch.bfloat16)).float()

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, d] -> bool [T, n]: neurons predicted active."""
        if self.fc1_w.shape[0] == 0:
            raise ValueError("this layer has no predictor (rank 0, a 'gate' mode file)")
        h = torch.relu(self._mm(x, self.fc1_w, self.fc1_s) + self.fc1_b)  # [T, r]
        return (self._mm(h, self.fc2_w, self.fc2_s) + self.fc2_b) > 0

    def _down(self, h: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """h [T, n] activations, mask [T, n] (None: all) -> [T, d]: each token's sum of its active
        neurons' down rows weighted by their activations, one embedding_bag call for all tokens."""
        T = h.shape[0]
        if mask is None:
            mask = torch.ones_like(h, dtype=torch.bool)
        tok, idx = torch.nonzero(mask, as_tuple=True)  # pairs in token order
        if idx.numel() == 0:
            return torch.zeros(T, self.cfg.d_model)
        offsets = torch.searchsorted(tok, torch.arange(T))  # where each token's rows start
        y = F.embedding_bag(idx, self.down_t, offsets, mode="sum", per_sample_weights=h[tok, idx].to(self.down_t.dtype))
        return y.float()

    # -- forward ---------------------------------------------------------------------------------

    def dense_activations(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(act(gate) [T, n], act(gate) * up [T, n]) for every neuron, as the dense FFN computes them
        (OPT: act(up + b) twice)."""
        return ffn_hidden(self.gate_up(x), self.cfg, self.bias)  # gate_up: [T, 2n] (OPT: [T, n])

    def _pred_input(self, x: torch.Tensor, resid: torch.Tensor | None) -> torch.Tensor:
        """What the predictor reads: the normed x, or the residual stream it was normed from."""
        if not self.reads_residual:
            return x
        if resid is None:
            raise ValueError("this shard's predictor reads the residual stream: forward needs resid")
        return resid

    def set_mode(self, dense: bool | None, oracle: bool | None) -> None:
        """Every neuron (dense), the true active set (oracle) or the rule; None leaves a flag as it is."""
        if dense is not None:
            self.force_dense = dense
        if oracle is not None:
            self.oracle = oracle

    def active_mask(self, x: torch.Tensor, g: torch.Tensor | None, h: torch.Tensor | None) -> torch.Tensor:
        """bool [T, n]: the neurons to compute (x: the predictor's input; g, h: act(gate) and the hidden state)."""
        if self.oracle and h is not None:
            return h.abs() > self.threshold
        if self.mode == "gate":
            assert g is not None
            return g.abs() > self.threshold
        return self.predict(x)

    def forward(self, x: torch.Tensor, resid: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, d] (already normed) -> partial output [T, d]; resid [T, d]: the residual stream x was
        normed from (read by a predictor that reads it, else unused).

        Every path computes a token's output the same way (its active neurons' down rows summed in
        one embedding_bag), so prefill, decode and batched decode agree to the bit.
        """
        px = self._pred_input(x, resid)
        if self.native is not None:
            return self._forward_native(x, px)
        T = x.shape[0]
        if self.force_dense:
            self.last_active = 1.0
            return self._down(self.dense_activations(x)[1], None)
        if self.mode == "predictor" and T == 1 and not self.oracle:
            # decode: the predictor picks the neurons; gate and up rows of the others are never read
            assert self.gate_w is not None and self.gate_s is not None
            idx = torch.nonzero(self.predict(px)[0]).flatten()
            self._count_decode(len(idx))
            if len(idx) == 0:
                return torch.zeros(T, self.cfg.d_model)
            pre = self._mm(x, _rows(self.gate_w, idx), self.gate_s[idx])
            g = activation(pre if self.bias is None else pre + self.bias[idx], self.cfg.activation, self.cfg.act_threshold)
            if self.up_w is None or self.up_s is None:  # OPT: no up
                h = g
            else:
                h = g * up_value(self._mm(x, _rows(self.up_w, idx), self.up_s[idx]), self.cfg.activation)  # [1, k]
            return F.embedding_bag(idx, self.down_t, _ZERO_OFFSET, mode="sum",
                                   per_sample_weights=h[0].to(self.down_t.dtype)).float()
        g, h = self.dense_activations(x)
        if T == 1 and self.mode == "gate" and not self.oracle:
            # decode: one token's active rows straight to embedding_bag (the general path's 2-D
            # nonzero and offsets cost ~30 µs a layer); same rows, same order, same sum
            idx = torch.nonzero(g[0].abs() > self.threshold).flatten()
            self._count_decode(len(idx))
            if len(idx) == 0:
                return torch.zeros(1, self.cfg.d_model)
            return F.embedding_bag(idx, self.down_t, _ZERO_OFFSET, mode="sum", per_sample_weights=h[0, idx].to(self.down_t.dtype)).float()
        mask = self.active_mask(px, g, h)
        if T == 1:
            self._count_decode(int(mask.sum()))
        else:
            true = h.abs() > self.threshold
            self.counts += np.array([int((mask & true).sum()), int((mask & ~true).sum()), int((~mask & true).sum()),
                                     mask.numel(), int(mask.sum())])
            self.last_active = float(mask.float().mean())
        return self._down(h, mask)

    def _forward_native(self, x: torch.Tensor, px: torch.Tensor) -> torch.Tensor:
        """One kernel call for all T tokens: per token, the same computation whatever T is."""
        assert self.native is not None
        T = x.shape[0]
        mask = None
        if self.force_dense:
            kmode = "all"
        elif self.oracle:
            kmode = "oracle"
        elif self.mode == "gate":
            kmode = "gate"
        else:
            kmode, mask = "mask", self.predict(px)
            if self.mine is not None:
                mask &= self.mine  # the cover's other neurons are never computed here
        y, active = self.native.forward(x, kmode, self.threshold, mask)
        if kmode == "all" and self.mine is not None:
            active -= len(self.mine) - self.n  # the cover's other neurons were "computed" as zeros
        if T == 1:
            self._count_decode(int(active[0]))
        else:
            self.last_active = float(active.sum()) / (T * self.n)
            if self.track_quality:
                g, h = self.native.activations(x)
                true = h.abs() > self.threshold
                chosen = {"all": torch.ones_like(true), "oracle": true, "gate": g.abs() > self.threshold}.get(kmode, mask)
                assert chosen is not None
                if self.mine is not None:  # count this shard's neurons only
                    true, chosen = true[:, self.mine], chosen[:, self.mine]
                self.counts += np.array([int((chosen & true).sum()), int((chosen & ~true).sum()), int((~chosen & true).sum()),
                                         chosen.numel(), int(active.sum())])
        return y

    def _count_decode(self, active: int) -> None:
        self.last_active = active / self.n
        self.decode_calls += 1
        self.decode_active += self.last_active
