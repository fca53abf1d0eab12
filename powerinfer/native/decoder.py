"""The native decoder (kernels/decoder.c and the headers it includes): describe a model's tensors
to it in place, own its KV cache, rotary tables and scratch.

Runs in: the process of the in-process executor, and each CPU worker of the native pool, which
holds one rank's shard (:class:`powerinfer.model.sharding.RankShard`) of every layer (numpy and
ctypes only: no torch needed). The library itself: native/decoder_lib.py.

The weights are never copied: each matrix is a pointer into the memory-mapped GGUF file with its
GGML type, and the C side reads the file's blocks directly (qdot.h); a rank's slice of a matrix
is a pointer and a length into the same rows. Types with an eight-row layout (qx8.h) are
repacked once, each rank only its own slice, and the file pages dropped.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

from powerinfer.config import ACT_CODES, ModelConfig
from powerinfer.native.decoder_lib import PHASES, TYPES, PiLayer, PiModel, PiWt, repack_x8
from powerinfer.errors import InvalidArgumentError, UnsupportedModelError
from powerinfer.gguf_file import GGUFFile
from powerinfer.memory import lazy_array
from powerinfer.model.sharding import RankShard
from powerinfer.model.weights import layer_bias, layer_tensor, load_vector

if TYPE_CHECKING:
    from powerinfer.native.sparse_layers import NativeSparseFFNs

log = logging.getLogger(__name__)

PART_ATTN, PART_FFN = 1, 2  # model.h's PI_PART_*: a layer's attention / some of its neurons live on the GPU rank

def weight(f: GGUFFile, name: str, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None) -> PiWt:
    """A matrix of the file, in place: a pointer into the mapping, its type and shape; rows / cols
    [a, b) take a slice (columns on whole blocks: the rows keep the file's stride)."""
    info = f.tensor(name)
    if info.qtype not in TYPES or len(info.shape) != 2:
        raise UnsupportedModelError(f"the native decoder has no kernel for {name} ({info.qtype.name}, shape {list(info.shape)})")
    blk = TYPES[info.qtype]
    if info.n_cols % blk:
        raise UnsupportedModelError(f"{name}: {info.n_cols} columns are not whole {info.qtype.name} blocks")
    r0, r1 = rows or (0, info.n_rows)
    c0, c1 = cols or (0, info.n_cols)
    if not (0 <= r0 <= r1 <= info.n_rows and 0 <= c0 < c1 <= info.n_cols) or c0 % blk or c1 % blk:
        raise UnsupportedModelError(f"{name}: slice rows [{r0}, {r1}) cols [{c0}, {c1}) is not whole {info.qtype.name} blocks of it")
    raw = f.raw(name)
    stride = raw.strides[0]
    col_bytes = c0 * raw.itemsize if info.qtype in (QT.F32, QT.F16, QT.BF16) else c0 // blk * (info.row_bytes // (info.n_cols // blk))
    return PiWt(raw.ctypes.data + r0 * stride + col_bytes, None, stride, int(info.qtype), r1 - r0, c1 - c0)


def supports(f: GGUFFile, cfg: ModelConfig) -> str | None:
    """None when the native decoder can run this model, else why not."""
    names = [layer_tensor(i, p) for i in range(cfg.n_layers)
             for p in ("attn_q", "attn_k", "attn_v", "attn_output", *cfg.ffn_parts, "ffn_down")]
    names.append("token_embd.weight" if cfg.tied_embeddings else "output.weight")
    for name in names:
        info = f.tensor(name)
        if info.qtype not in TYPES or len(info.shape) != 2 or info.n_cols % TYPES[info.qtype]:
            return f"{name} is {info.qtype.name} with {info.n_cols} columns"
    if cfg.n_heads % cfg.n_kv_heads or cfg.n_heads // cfg.n_kv_heads > 64 or cfg.rope_dim % 2 or cfg.rope_dim > cfg.head_dim:
        return "head layout (grouped-query ratio or rope width) it does not handle"
    return None


def rope_tables(cfg: ModelConfig, base: float, scale: float, n_ctx: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin float32 [n_ctx, rope_dim / 2] of pos * theta_i, as model/ops.RopeTable computes them."""
    inv = scale / (base ** (np.arange(0, cfg.rope_dim, 2, dtype=np.float64) / cfg.rope_dim))
    angles = np.arange(n_ctx, dtype=np.float64)[:, None] * inv[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


class NativeDecoder:
    """One model for the native decoder: forward passes over up to max_t tokens, KV cache per slot."""

    def __init__(self, lib: ctypes.CDLL, f: GGUFFile, cfg: ModelConfig, n_ctx: int, n_slots: int, n_threads: int, max_t: int,
                 shard: RankShard | None = None, sparse: NativeSparseFFNs | None = None, only: frozenset[int] | None = None,
                 gpu_attn: frozenset[int] = frozenset(), hot: Sequence[np.ndarray] = (), with_head: bool = True) -> None:
        """shard: this process is one rank of the native pool and holds that part of every layer.
        sparse: every layer's FFN runs through it instead of wg/wu/wd (a rank's: its neuron range).
        only: build just these layers (the GPU hybrid's CPU-only layers), run by :meth:`forward_range`.
        gpu_attn, hot (a rank of a pool with a GPU rank in neuron split, kernels/handoff.h): these
        layers' attention, and per layer these neurons (global indices), live on the GPU rank; the
        attention is not built here and the hot neurons are never computed here. with_head False:
        the output head is never run here (a pipeline stage before the last), so it is not repacked."""
        if hot and len(hot) != cfg.n_layers:
            raise InvalidArgumentError(f"hot neurons for {len(hot)} layers, the model has {cfg.n_layers}")
        self.lib, self.cfg, self.f = lib, cfg, f
        self.sparse = sparse
        sh = shard or RankShard(0, cfg.n_heads, 0, cfg.n_kv_heads, 0, cfg.n_ff, 0, cfg.d_model, 0, cfg.vocab_size)
        self.shard = sh
        n_kv = sh.kv1 - sh.kv0
        self._keep: list[np.ndarray] = []  # arrays the C structs point into
        D, Dv, d = cfg.head_dim, cfg.v_head_dim, cfg.d_model
        ropes: dict[tuple[float, float], tuple[np.ndarray, np.ndarray]] = {}
        self.k_cache: list[np.ndarray] = []
        self.v_cache: list[np.ndarray] = []
        layers = (PiLayer * cfg.n_layers)()
        self.only = only
        for i in range(cfg.n_layers):
            if only is not None and i not in only:  # left zeroed: never run (forward_range checks)
                self.k_cache.append(np.empty((0,), dtype=np.float32))
                self.v_cache.append(np.empty((0,), dtype=np.float32))
                continue
            L = layers[i]
            self._gpu_part(L, i, i in gpu_attn, np.asarray(hot[i]) if hot else None, f)
            # OPT's fc1 (ffn_up) sits where a gate would, and wu stays empty (pi_model.gateless)
            mats: tuple[tuple[str, str], ...] = ((("wg", "ffn_gate"), ("wu", "ffn_up"), ("wd", "ffn_down")) if cfg.gated_ffn
                                                 else (("wg", "ffn_up"), ("wd", "ffn_down")))
            if i not in gpu_attn:
                mats = (("wq", "attn_q"), ("wk", "attn_k"), ("wv", "attn_v"), ("wo", "attn_output")) + mats
            for field, part in mats:
                rows, cols = _slices(field, sh, D, Dv)
                if field == "wd" and L.down_col0:  # the GPU's leading neurons: their columns are not read here
                    cols = (L.down_col0, cfg.n_ff)
                w = weight(f, layer_tensor(i, part), rows, cols)
                # sparse: where decode reads the chosen up (and, with a predictor, gate) rows in the
                # file's layout, those matrices stay as they are (one copy resident); where it reads
                # them from a split copy, the eight-row repack is what prefill's dense matmul runs on
                # (prefill 256 tokens on the 1.1B ReGLU file: 0.70x dense without it)
                keep_rows = sparse is not None and sparse.sparse_layers[i] and sparse.reads_file_rows(i, field)
                packed = None if keep_rows else repack_x8(lib, w)
                if packed is not None:
                    self._keep.append(packed)
                setattr(L, field, w)
            L.attn_norm = self._vec(f, layer_tensor(i, "attn_norm"), d)
            L.ffn_norm = self._vec(f, layer_tensor(i, "ffn_norm"), d)
            if cfg.norm == "layer":
                L.attn_norm_b = self._vec(f, layer_bias(i, "attn_norm"), d)
                L.ffn_norm_b = self._vec(f, layer_bias(i, "ffn_norm"), d)
            if cfg.proj_bias:  # whole [d] vectors: every rank adds them to the gathered sums alike
                L.bo = self._vec(f, layer_bias(i, "attn_output"), d)
                L.bd = self._vec(f, layer_bias(i, "ffn_down"), d)
                L.bg = self._vec(f, layer_bias(i, "ffn_up"), cfg.n_ff, (sh.n0, sh.n1))
            if cfg.post_norms:
                L.post_attn_norm = self._vec(f, layer_tensor(i, "post_attention_norm"), d)
                L.post_ffn_norm = self._vec(f, layer_tensor(i, "post_ffw_norm"), d)
            if i in gpu_attn:  # no weights, biases or KV cache: the GPU rank computes this attention
                self.k_cache.append(np.empty((0,), dtype=np.float32))
                self.v_cache.append(np.empty((0,), dtype=np.float32))
                continue
            if cfg.qk_norm:
                L.q_norm = self._vec(f, layer_tensor(i, "attn_q_norm"), D)
                L.k_norm = self._vec(f, layer_tensor(i, "attn_k_norm"), D)
            if cfg.qkv_bias:
                L.bq = self._vec(f, layer_bias(i, "attn_q"), cfg.n_heads * D, (sh.q0 * D, sh.q1 * D))
                L.bk = self._vec(f, layer_bias(i, "attn_k"), cfg.n_kv_heads * D, (sh.kv0 * D, sh.kv1 * D))
                L.bv = self._vec(f, layer_bias(i, "attn_v"), cfg.n_kv_heads * Dv, (sh.kv0 * Dv, sh.kv1 * Dv))
            # float32 caches [slots, Hkv, n_ctx, D], committed 4 KiB at a time as positions are written
            k = lazy_array((n_slots, n_kv, n_ctx, D))
            v = lazy_array((n_slots, n_kv, n_ctx, Dv))
            self.k_cache.append(k)
            self.v_cache.append(v)
            L.k_cache, L.v_cache = k.ctypes.data, v.ctypes.data
            key = cfg.layer_rope(i)
            if key not in ropes:
                ropes[key] = rope_tables(cfg, key[0], key[1], n_ctx)
                self._keep.extend(ropes[key])
            L.rope_cos, L.rope_sin = ropes[key][0].ctypes.data, ropes[key][1].ctypes.data
            L.window = 0 if cfg.global_layers[i] else cfg.sliding_window
        self.layers = layers
        head = "token_embd.weight" if cfg.tied_embeddings else "output.weight"
        self.head = weight(f, head, (sh.v0, sh.v1))
        packed = repack_x8(lib, self.head) if with_head else None
        if packed is not None:
            self._keep.append(packed)
        self.embeddings = weight(f, "token_embd.weight")  # the head's own rows when tied (its file layout)
        self._row = np.empty(max(cfg.d_model, self.head.cols), dtype=np.float32)  # pi_refine's dequantized row
        self._cand = np.empty(self.head.rows, dtype=np.int32)  # pi_decode_logits' candidates
        self._x = np.empty((max_t, cfg.d_model), dtype=np.float32)  # pi_step's residual stream
        self._step_args: tuple[object, ...] | None = None
        self._io = np.zeros((3, max_t), dtype=np.int64)
        self.embed_scale = float(cfg.embed_scale)
        # The repacked matrices' file pages were read once; unmapping them keeps RSS to one copy
        # (the file's other pages fault back in on use).
        f.drop_pages()
        self.model = PiModel(cfg.n_layers, d, sh.n1 - sh.n0, sh.q1 - sh.q0, n_kv, D, Dv, cfg.rope_dim, int(cfg.rope_style == "neox"),
                             ACT_CODES[cfg.activation], n_ctx, n_slots, n_threads, max_t, cfg.norm_eps, cfg.attn_scale, cfg.act_threshold,
                             self._vec(f, "output_norm.weight", d), self.head, layers, None, sh.q0, sh.kv0, cfg.gqa_group, cfg.n_heads,
                             cfg.n_ff, sh.n0, sh.d0)
        if cfg.norm == "layer":
            self.model.layernorm, self.model.out_norm_b = 1, self._vec(f, "output_norm.bias", d)
        self.model.gateless = int(not cfg.gated_ffn)
        if cfg.learned_pos:
            table = load_vector(f, "position_embd.weight").reshape(-1, d)  # float32 [rows, d]
            self._keep.append(table)
            self.model.pos_embd, self.model.pos_rows, self.model.pos_offset = table.ctypes.data, table.shape[0], cfg.pos_offset
        if sparse is not None:
            self.model.sparse = 1
            sparse.attach(layers)
            self.model.ffn_active = sparse.active.ctypes.data
        self.scratch = np.empty(int(lib.pi_scratch_bytes(ctypes.byref(self.model), max_t)), dtype=np.uint8)
        self.max_t = max_t

    def _gpu_part(self, L: PiLayer, i: int, attn: bool, hot: np.ndarray | None, f: GGUFFile) -> None:
        """Layer i's share with a GPU rank (model.h's gpu_part, cold mask over this rank's neurons,
        and down_col0: the whole blocks of down-projection columns that only the GPU's neurons use)."""
        sh = self.shard
        L.gpu_part = int(attn) * PART_ATTN
        if hot is None or not hot.size:
            return
        if hot.min() < 0 or hot.max() >= self.cfg.n_ff:
            raise InvalidArgumentError(f"layer {i}: hot neurons outside its {self.cfg.n_ff}")
        cold: np.ndarray = np.ones(sh.n1 - sh.n0, dtype=np.uint8)  # [this rank's neurons]: 1 computed here, 0 on the GPU rank
        mine = hot[(hot >= sh.n0) & (hot < sh.n1)]
        cold[mine - sh.n0] = 0
        pad = np.ones(-len(cold) % 16, dtype=np.uint8)
        blocks = np.asarray(np.concatenate([cold, pad]).reshape(-1, 16).any(axis=1), dtype=np.uint8)  # [blocks of 16]: 0 when all hot
        self._keep += [cold, blocks]
        L.cold, L.cold_blocks = cold.ctypes.data, blocks.ctypes.data
        L.gpu_part |= PART_FFN
        hs = np.unique(hot)
        lead = int(np.argmax(hs != np.arange(len(hs)))) if (hs != np.arange(len(hs))).any() else len(hs)  # hot [0, lead)
        blk = max(32, TYPES[f.tensor(layer_tensor(i, "ffn_down")).qtype])  # floats too: the SIMD lanes stay where they were
        L.down_col0 = lead // blk * blk if lead < self.cfg.n_ff else 0

    def _vec(self, f: GGUFFile, name: str, n: int, part: tuple[int, int] | None = None) -> int:
        v = load_vector(f, name, n)
        if part is not None:
            v = np.ascontiguousarray(v[part[0] : part[1]])
        self._keep.append(v)
        return int(v.ctypes.data)

    @property
    def weight_bytes(self) -> int:
        mats = [getattr(L, n) for L in self.layers for n in ("wq", "wk", "wv", "wo", "wg", "wu", "wd")] + [self.head]
        # the bytes a pass reads: a column slice (down_col0) reads part of each row of the file
        return int(sum(m.rows * (m.cols // GGML_QUANT_SIZES[QT(m.type)][0] * GGML_QUANT_SIZES[QT(m.type)][1]) for m in mats if m.rows) + (
            self.sparse.nbytes if self.sparse is not None else 0))

    def profile(self, on: bool = True) -> np.ndarray:
        """Start (or stop) accumulating seconds per layer phase (PHASES) into the returned array."""
        self._profile = np.zeros(len(PHASES), dtype=np.float64)
        self.model.profile = self._profile.ctypes.data if on else None
        return self._profile

    @property
    def cache_bytes(self) -> int:
        return sum(a.nbytes for a in self.k_cache + self.v_cache)

    def forward(self, x: np.ndarray, positions: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """x [T, d] float32 embeddings (scaled) -> final-normed hidden [T, d]; T > max_t runs in chunks.

        A C-ordered float32 x is updated in place and returned (the engine hands over its own)."""
        return self._run(0, self.cfg.n_layers, True, x, positions, slots)

    def forward_range(self, first: int, stop: int, x: np.ndarray, positions: np.ndarray, slots: np.ndarray,
                      final_norm: bool = False) -> np.ndarray:
        """x [T, d] float32, the residual stream entering layer `first` -> leaving layer stop - 1 (not
        normed, unless final_norm: the model's last layers, then its final norm), in place as
        :meth:`forward`; every layer of the range must be built (``only``)."""
        if self.only is not None and not all(i in self.only for i in range(first, stop)):
            raise InvalidArgumentError(f"layers {first}..{stop - 1} are not all built in this native decoder")
        if final_norm and stop != self.cfg.n_layers:
            raise InvalidArgumentError(f"the final norm follows the last layer ({self.cfg.n_layers - 1}), not layer {stop - 1}")
        return self._run(first, stop, final_norm, x, positions, slots)

    def _run(self, first: int, stop: int, out_norm: bool, x: np.ndarray, positions: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Layers [first, stop) (then the final norm when out_norm) over x [T, d], max_t tokens a call."""
        if x.dtype != np.float32 or not x.flags.c_contiguous or not x.flags.writeable:
            x = np.array(x, dtype=np.float32, order="C")
        pos = np.ascontiguousarray(positions, dtype=np.int64)
        sl = np.ascontiguousarray(slots, dtype=np.int64)
        for a in range(0, x.shape[0], self.max_t):
            b = min(a + self.max_t, x.shape[0])
            rc = self.lib.pi_forward_range(ctypes.byref(self.model), x[a:b].ctypes.data, pos[a:b].ctypes.data, sl[a:b].ctypes.data, b - a,
                                           self.scratch.ctypes.data, first, stop, int(out_norm))
            if rc:
                raise InvalidArgumentError(f"native forward refused its input (code {rc}: layers {first}..{stop - 1}, positions "
                                           f"{pos[a]}..{pos[b - 1]}, slots {sorted(set(sl[a:b].tolist()))})")
        return x

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """hidden [T, d] -> logits [T, vocab] float32 from the output head."""
        return matmul(self.lib, self.model, self.scratch, self.head, hidden)

    def decode_logits(self, hidden: np.ndarray, margin: float, k: int) -> np.ndarray:
        """hidden [T, d] -> logits [T, vocab]: the head, then each row's candidates within margin of
        its best (at most k) recomputed in float32 (the engine's decode rule, in one native call)."""
        h = np.ascontiguousarray(hidden, dtype=np.float32)
        if h.ndim != 2 or h.shape[1] != self.head.cols or not 1 <= h.shape[0] <= self.max_t:
            raise InvalidArgumentError(f"decode logits expect [1..{self.max_t}, {self.head.cols}], got {list(h.shape)}")
        out = np.empty((h.shape[0], self.head.rows), dtype=np.float32)
        if self.lib.pi_decode_logits(ctypes.byref(self.model), h.ctypes.data, h.shape[0], out.ctypes.data, margin, k,
                                     self.scratch.ctypes.data, self._cand.ctypes.data, self._row.ctypes.data):
            raise InvalidArgumentError("the native head refused its input")
        return out

    def step(self, ids: Sequence[int] | np.ndarray, positions: Sequence[int] | np.ndarray, slots: Sequence[int] | np.ndarray, each: bool,
             margin: float, k: int) -> np.ndarray:
        """Embed ids [T] (T <= max_t), run every layer, return the decode logits of the last row
        [1, vocab] or of each row [T, vocab] (see decode_logits): one native call per step."""
        T = len(ids)
        if not 1 <= T <= self.max_t or len(positions) != T or len(slots) != T:
            raise InvalidArgumentError(f"a native step takes 1..{self.max_t} tokens with one position and slot each")
        io = self._io  # [3, max_t] int64: ids, positions, slots, filled in place (no new arrays per step)
        io[0, :T] = ids
        io[1, :T] = positions
        io[2, :T] = slots
        out = np.empty((T if each else 1, self.head.rows), dtype=np.float32)
        if self._step_args is None:  # the constant arguments, converted once (a decode step is ~100 µs of Python)
            self._step_args = (ctypes.byref(self.model), ctypes.byref(self.embeddings), self.embed_scale, _addr(io[0]), _addr(io[1]),
                               _addr(io[2]), self._x.ctypes.data, self.scratch.ctypes.data, self._cand.ctypes.data, self._row.ctypes.data)
        model, embd, scale, p_ids, p_pos, p_sl, x, scratch, cand, row = self._step_args
        rc = self.lib.pi_step(model, embd, scale, p_ids, p_pos, p_sl, T, int(each), x, _addr(out), margin, k, scratch, cand, row)
        if rc:
            raise InvalidArgumentError(f"native step refused its input (code {rc}: {T} tokens, positions {io[1, :T].min()}.."
                                       f"{io[1, :T].max()}, slots {sorted(set(io[2, :T].tolist()))})")
        return out

    def embed(self, ids: np.ndarray) -> np.ndarray:
        """Embedding rows [T, d] float32 of token ids [T] (ids checked by the engine and here)."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        out = np.empty((ids.size, self.embeddings.cols), dtype=np.float32)
        if self.lib.pi_rows(ctypes.byref(self.embeddings), ids.ctypes.data, ids.size, out.ctypes.data):
            raise InvalidArgumentError(f"token ids outside the embedding table of {self.embeddings.rows} rows")
        return out

    def refine(self, logits: np.ndarray, hidden: np.ndarray, idx: np.ndarray) -> None:
        """logits [T, V] (float32, C order) at idx [T, R] := hidden [T, d] . those head rows in float32."""
        if logits.dtype != np.float32 or not logits.flags.c_contiguous:
            raise InvalidArgumentError("refine needs C-ordered float32 logits")
        h = np.ascontiguousarray(hidden, dtype=np.float32)
        ix = np.ascontiguousarray(idx, dtype=np.int64)
        if self.lib.pi_refine(ctypes.byref(self.head), h.ctypes.data, h.shape[0], ix.ctypes.data, ix.shape[1], logits.ctypes.data,
                              logits.shape[1], self._row.ctypes.data):
            raise InvalidArgumentError("head rows to refine are outside the vocabulary")


def _slices(field: str, sh: RankShard, D: int, Dv: int) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
    """(rows, cols) of a layer matrix that shard sh holds (None: all)."""
    return {"wq": ((sh.q0 * D, sh.q1 * D), None), "wk": ((sh.kv0 * D, sh.kv1 * D), None), "wv": ((sh.kv0 * Dv, sh.kv1 * Dv), None),
            "wo": ((sh.d0, sh.d1), None), "wg": ((sh.n0, sh.n1), None), "wu": ((sh.n0, sh.n1), None), "wd": ((sh.d0, sh.d1), None)}[field]


def _addr(a: np.ndarray) -> int:
    """The data address of an array (cheaper than a.ctypes.data)."""
    return int(a.__array_interface__["data"][0])


def matmul(lib: ctypes.CDLL, model: PiModel, scratch: np.ndarray, w: PiWt, x: np.ndarray) -> np.ndarray:
    """x [T, w.cols] float32 -> x @ W.T [T, w.rows] float32 through the type's dot product
    (scratch sized for model.max_t tokens of model's widths; longer inputs run in chunks)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != w.cols:
        raise InvalidArgumentError(f"matmul expects [T, {w.cols}], got {list(x.shape)}")
    y = np.empty((x.shape[0], w.rows), dtype=np.float32)
    for a in range(0, x.shape[0], model.max_t):
        b = min(a + model.max_t, x.shape[0])
        if lib.pi_matmul(ctypes.byref(model), ctypes.byref(w), x[a:b].ctypes.data, b - a, y[a:b].ctypes.data, scratch.ctypes.data):
            raise InvalidArgumentError(f"native matmul refused type {w.type} with {w.cols} columns")
    return y


class NativeMatmul:
    """x @ W.T for one matrix of a file, alone (the tests hold every type to numpy through this)."""

    def __init__(self, lib: ctypes.CDLL, f: GGUFFile, name: str, n_threads: int = 1, max_t: int = 64, x8: bool = False) -> None:
        self.lib, self.w = lib, weight(f, name)
        self.packed = repack_x8(lib, self.w) if x8 else None
        k = self.w.cols
        self.model = PiModel(n_layers=0, d=k, n_ff=k, n_head=1, n_kv=1, D=k, Dv=k, rope_dim=0, n_ctx=1, n_slots=1,
                             n_threads=n_threads, max_t=max_t)
        self.scratch = np.empty(int(lib.pi_scratch_bytes(ctypes.byref(self.model), max_t)), dtype=np.uint8)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return matmul(self.lib, self.model, self.scratch, self.w, x)
