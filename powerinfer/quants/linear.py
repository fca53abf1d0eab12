"""Packed torch linears (y = x @ W.T) that compute from a compact form of the weight.

Runs in: any process (coordinator for the output head, CPU workers for their shards).

Kinds and where their error comes from (relative output error ||y - y_ref|| / ||y_ref|| against
float64 ``x @ W.T`` with W the exact GGML dequantization; measured on normal(0, 0.05) matrices with
0.1% outliers at 8x and on the SmolLM2 / Gemma-3 GGUF weights; tests/quants/test_linear.py holds
the bounds):

* ``int4``: the GGML codes packed as-is for ``_weight_int4pack_mm_for_cpu`` (group 32). Codes are
  exact; the error is bf16 scales/zeros plus bf16 activations: <= 0.4% (bound 1%).
* ``int4x2``: 5..8-bit GGML codes with group 32 (Q5_0, Q5_1, Q5_K, Q8_0) split exactly into two
  4-bit halves along K (see ``split_nibbles``) and run as one int4 matmul over [x, x]: the file's
  codes, one byte per weight, no requantization; error as for ``int4``.
* ``int8``: weights requantized to int8 with one bf16 scale per output row for
  ``_weight_int8pack_mm``. The per-row requantization dominates: 0.8-1.9% synthetic, 0.8-1.7% on
  the real models (largest for embeddings with outlier rows) (bound 3%).
* ``bf16``: dense bf16 weights and activations: <= 0.35% (bound 1%).
* ``f32``: dense float32: exact up to float32 summation (bound 1e-5).

All kernels are only fast with bf16 activations, so ``__call__`` casts x to bf16 and returns float32.
For M >= 32 rows the int8 kernel is ~2x slower than widening the int8 rows to bf16 and running a
dense bf16 matmul (the per-row scale is applied to the output columns), so int8 does that in row
chunks. The same trick for int4 measured no faster (unpacking nibbles costs as much as it saves),
so int4 always uses its kernel.
"""

from __future__ import annotations

import logging
from typing import Iterable, Iterator, Protocol, Sequence, runtime_checkable

import numpy as np
import torch

from powerinfer.quants.grouped import Grouped, split_nibbles
from powerinfer.quants.int4_layout import unpack_int4

log = logging.getLogger(__name__)

KINDS = ("int4", "int4x2", "int8", "bf16", "f32")
CHUNK_ROWS = 4096  # rows decoded/dequantized at a time while packing: bounds float32 transients
INT4_GROUP = 32  # the only group size whose GGML codes map 1:1 onto the int4 kernel's groups
_INT4_ROW_ALIGN = 16  # _convert_weight_to_int4pack_for_cpu needs N % 16 == 0: pad, then slice output
_INT4_PACK_ROWS = 4096  # rows converted per torch call; a multiple of 64 so chunks pack like the whole
INT8_K_ALIGN = 32
_FAST_M = 32  # int8: from this many input rows on, bf16 widening + dense matmul beats the kernel
_FAST_CHUNK = 4096  # int8 fast path: rows widened to bf16 at a time (keeps the bf16 copy cache-sized)

Part = Grouped | np.ndarray


@runtime_checkable
class PackedLinear(Protocol):
    """y = x @ W.T with W [out_features, in_features] held in a packed form."""

    out_features: int
    in_features: int
    kind: str  # "int4" | "int8" | "bf16" | "f32"
    nbytes: int  # bytes held by the packed weights (for memory reports)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x float [..., K] -> float32 [..., N]."""
        ...

    def dequantized(self) -> torch.Tensor:
        """float32 [N, K]: the weight the kernel actually computes with (for tests)."""
        ...


def _flatten(x: torch.Tensor, k: int) -> tuple[torch.Tensor, tuple[int, ...]]:
    """[..., K] -> bf16 [M, K] plus the leading shape to restore."""
    if x.shape[-1] != k:
        raise ValueError(f"linear expects inputs with {k} features, got shape {list(x.shape)}")
    lead = tuple(x.shape[:-1])
    return x.reshape(-1, k).to(torch.bfloat16), lead


class Int4Linear:
    """GGML 4-bit codes (group 32) in torch's CPU int4 packed layout."""

    kind = "int4"

    def __init__(self, packed: torch.Tensor, scales_zeros: torch.Tensor, out_features: int, in_features: int, twice: bool = False) -> None:
        self.packed = packed  # uint8 [N_pad, K // 2], N_pad = out_features rounded up to 16
        self.scales_zeros = scales_zeros  # bf16 [K // 32, N_pad, 2]: (scale, zero) with w = (c - 8) * scale + zero
        self.out_features = out_features
        self.in_features = in_features
        # int4x2: the packed matrix is [W_lo | W_hi] over 2K columns and the input is fed twice.
        self.twice = twice
        if twice:
            self.kind = "int4x2"
        self.nbytes = int(packed.nbytes + scales_zeros.nbytes)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xb, lead = _flatten(x, self.in_features)
        if self.twice:
            xb = torch.cat((xb, xb), dim=1)  # [M, 2K]
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, self.packed, INT4_GROUP, self.scales_zeros)
        if y.shape[1] != self.out_features:  # drop the padding rows' outputs
            y = y[:, : self.out_features]
        return y.float().reshape(*lead, self.out_features)

    def codes(self) -> torch.Tensor:
        """uint8 [N, K] codes 0..15 unpacked from torch's layout (for tests and dequantized()); 2K for int4x2."""
        n, k = self.packed.shape[0], self.packed.shape[1] * 2
        return unpack_int4(self.packed, n, k)[: self.out_features]

    def dequantized(self) -> torch.Tensor:
        n, k = self.out_features, self.packed.shape[1] * 2
        sz = self.scales_zeros[:, :n].float()  # [G, N, 2]
        scale = sz[..., 0].T.reshape(n, k // INT4_GROUP, 1)
        zero = sz[..., 1].T.reshape(n, k // INT4_GROUP, 1)
        c = self.codes().float().reshape(n, k // INT4_GROUP, INT4_GROUP)
        w = ((c - 8.0) * scale + zero).reshape(n, k)
        return w[:, : k // 2] + w[:, k // 2 :] if self.twice else w


class Int8Linear:
    """int8 weights with one bf16 scale per output row."""

    kind = "int8"

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor) -> None:
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        # torch's int8 kernel reads K in blocks of 32 and crashes (SIGSEGV, torch 2.13) on other
        # widths with M > 1; such matrices get zero columns, their inputs zero features
        self.pad = -self.in_features % INT8_K_ALIGN
        if self.pad:
            weight = torch.nn.functional.pad(weight, (0, self.pad))
        self.weight = weight  # int8 [N, K + pad]
        self.scales = scales  # bf16 [N]
        self.scales_f32 = scales.float()  # float32 [N], same values, for the prefill path
        self.nbytes = int(weight.nbytes + scales.nbytes + self.scales_f32.nbytes)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xb, lead = _flatten(x, self.in_features)
        if self.pad:
            xb = torch.nn.functional.pad(xb, (0, self.pad))
        if xb.shape[0] < _FAST_M:
            y = torch.ops.aten._weight_int8pack_mm(xb, self.weight, self.scales).float()
        else:
            # Prefill: int8 -> bf16 is exact (|q| <= 127), so x @ q.T in bf16 then times the row
            # scale computes the same product as the kernel, about twice as fast for large M.
            y = torch.empty(xb.shape[0], self.out_features, dtype=torch.float32)
            for i in range(0, self.out_features, _FAST_CHUNK):
                j = min(i + _FAST_CHUNK, self.out_features)
                y[:, i:j] = xb @ self.weight[i:j].to(torch.bfloat16).T  # bf16 [M, j - i] -> float32
            y *= self.scales_f32  # the row scales, applied in float32 to the output columns
        return y.reshape(*lead, self.out_features)

    def dequantized(self) -> torch.Tensor:
        return self.weight[:, : self.in_features].float() * self.scales.float()[:, None]


class DenseLinear:
    """Plain bf16 (or float32) weight; bf16 casts activations to bf16 like the int kernels."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight  # bf16 or float32 [N, K]
        self.kind = "f32" if weight.dtype == torch.float32 else "bf16"
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        self.nbytes = int(weight.nbytes)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"linear expects inputs with {self.in_features} features, got shape {list(x.shape)}")
        y = x.to(self.weight.dtype) @ self.weight.T
        return y.float()

    def dequantized(self) -> torch.Tensor:
        return self.weight.float()


# --- packing -----------------------------------------------------------------------------------------


def _n_cols(part: Part) -> int:
    return part.shape[1]


def _row_chunks(parts: Iterable[Part]) -> Iterator[Part]:
    """Split parts into pieces of at most CHUNK_ROWS rows (views, no copies)."""
    for part in parts:
        n = part.shape[0]
        for i in range(0, n, CHUNK_ROWS):
            sl = slice(i, min(i + CHUNK_ROWS, n))
            yield part.rows(sl) if isinstance(part, Grouped) else part[sl]


def _as_f32(chunk: Part) -> np.ndarray:
    """Writable C-contiguous float32 [n, K] of one chunk (a view of float32 input when allowed)."""
    if isinstance(chunk, Grouped):
        return chunk.dequantize()
    f = np.ascontiguousarray(chunk, dtype=np.float32)
    # torch.from_numpy warns on read-only arrays (mapped files): copy this chunk instead.
    return f if f.flags.writeable else np.array(f)


def _build_int4(chunks: Iterable[Part], n: int, k: int) -> Int4Linear:
    """Stream codes through a staging buffer of _INT4_PACK_ROWS rows that torch packs when full.

    Peak memory is the packed result plus one staging buffer (uint8 + its int32 copy), not a
    full uint8 code matrix.
    """
    n_pad = -(-n // _INT4_ROW_ALIGN) * _INT4_ROW_ALIGN
    g = k // INT4_GROUP
    packed = torch.empty(n_pad, k // 2, dtype=torch.uint8)
    # Padding rows: code 8, scale 0, zero 0 -> weight 0; their outputs are sliced off anyway.
    sz = torch.zeros(g, n_pad, 2, dtype=torch.bfloat16)
    stage = np.empty((min(_INT4_PACK_ROWS, n_pad), k), dtype=np.uint8)  # uint8 [S, K] codes
    done = 0  # rows already packed
    fill = 0  # rows waiting in stage

    def flush(rows: int) -> None:
        nonlocal done, fill
        # Full stages are a multiple of 64 rows, so each packs exactly like that slice of the whole
        # matrix (the layout is per block of at most 64 rows: quants/int4_layout.py); only the final
        # flush may hold a partial block.
        codes = torch.from_numpy(stage[:rows]).to(torch.int32)
        packed[done : done + rows] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        done += rows
        fill = 0

    r = 0
    for c in chunks:
        if not isinstance(c, Grouped) or c.bits != 4 or c.group != INT4_GROUP:
            raise ValueError("int4 packing needs 4-bit Grouped parts with group 32")
        # torch computes w = (c - 8) * s + z_t, GGML w = c * s + zero, so z_t = zero + 8 * s
        # (taken before rounding s to bf16, which keeps the rounding error proportional to |c - 8|).
        sz[:, r : r + c.shape[0], 0] = torch.from_numpy(c.scale.T)
        sz[:, r : r + c.shape[0], 1] = torch.from_numpy((c.zero + np.float32(8.0) * c.scale).T)
        r += c.shape[0]
        codes = c.q.view(np.uint8)  # [m, K], 0..15
        i = 0
        while i < codes.shape[0]:
            take = min(stage.shape[0] - fill, codes.shape[0] - i)
            stage[fill : fill + take] = codes[i : i + take]
            fill += take
            i += take
            if fill == stage.shape[0]:
                flush(fill)
    if r != n:
        raise ValueError(f"int4 packing got {r} rows, expected {n}")
    if done + fill < n_pad:
        pad = n_pad - done - fill
        stage[fill : fill + pad] = 8
        fill += pad
    if fill:
        flush(fill)
    return Int4Linear(packed, sz, n, k)


class Int8Packer:
    """Fills an int8 [N, K] matrix and its bf16 row scales from float32 row chunks, in order."""

    def __init__(self, n: int, k: int) -> None:
        self.weight = np.empty((n, k), dtype=np.int8)
        self.scales = torch.empty(n, dtype=torch.bfloat16)
        self.rows = 0

    def add(self, f: np.ndarray, absmax: np.ndarray | None = None) -> None:
        """Requantize float32 [m, K] rows, which this call overwrites (pass a buffer you own).

        absmax [m] overrides each row's max |w| (the scale is absmax / 127): column shards pass
        the full row's so they quantize exactly like the unsharded matrix.
        """
        m = f.shape[0]
        # max |w| per row without an |f| temporary: max(max, -min).
        amax = np.maximum(f.max(axis=1), -f.min(axis=1)) if absmax is None else absmax
        # Round the scale to bf16 first and quantize against the rounded value, so the kernel's
        # q * scale_bf16 is what we aimed for; clipping absorbs a scale that rounded down.
        s = torch.from_numpy(np.asarray(amax / np.float32(127.0), dtype=np.float32)).to(torch.bfloat16)
        s32 = s.float().numpy()
        inv = np.divide(1.0, s32, out=np.zeros_like(s32), where=s32 > 0)  # all-zero rows get q = 0
        # In place on the chunk's own float32 buffer: no further [m, K] temporaries.
        np.multiply(f, inv[:, None], out=f)
        np.rint(f, out=f)
        np.clip(f, -127, 127, out=f)
        self.weight[self.rows : self.rows + m] = f
        self.scales[self.rows : self.rows + m] = s
        self.rows += m

    def finish(self) -> Int8Linear:
        if self.rows != self.weight.shape[0]:
            raise ValueError(f"int8 packing got {self.rows} rows, expected {self.weight.shape[0]}")
        return Int8Linear(torch.from_numpy(self.weight), self.scales)


def _build_int8(chunks: Iterable[Part], n: int, k: int) -> Int8Linear:
    """Requantize row chunks to int8 with a bf16 scale per row (max-abs / 127)."""
    packer = Int8Packer(n, k)
    for c in chunks:
        # float32 [m, K] that the packer may overwrite (float input is copied: it is the caller's).
        packer.add(c.dequantize() if isinstance(c, Grouped) else np.array(c, dtype=np.float32))
        del c  # free this chunk before the generator decodes the next one
    return packer.finish()


def _build_dense(chunks: Iterable[Part], n: int, k: int, dtype: torch.dtype) -> DenseLinear:
    weight = torch.empty(n, k, dtype=dtype)
    r = 0
    for c in chunks:
        f = _as_f32(c)
        weight[r : r + f.shape[0]] = torch.from_numpy(f)
        r += f.shape[0]
        del f, c  # free this chunk before the generator decodes the next one
    return DenseLinear(weight)


def choose_kind(parts: Sequence[Part], kind: str = "auto") -> str:
    """The kind ``pack_linear`` uses for these parts (see its docstring)."""
    if kind not in KINDS and kind != "auto":
        raise ValueError(f"unknown linear kind {kind!r}; expected one of {KINDS + ('auto',)}")
    grouped = [p for p in parts if isinstance(p, Grouped)]
    int4_ok = (
        len(grouped) == len(parts)
        and all(p.bits == 4 and p.group == INT4_GROUP for p in grouped)
        and _n_cols(parts[0]) % INT4_GROUP == 0
    )
    if kind == "int4" and not int4_ok:
        raise ValueError("int4 needs only 4-bit Grouped parts with group 32 and K a multiple of 32")
    split_ok = (
        len(grouped) == len(parts)
        and all(p.group == INT4_GROUP for p in grouped)
        and _n_cols(parts[0]) % INT4_GROUP == 0
    )
    if kind == "int4x2" and not split_ok:
        raise ValueError("int4x2 needs Grouped parts with group 32 and K a multiple of 32")
    if kind != "auto":
        return kind
    if int4_ok:
        return "int4"
    if split_ok:
        return "int4x2"
    return "int8" if grouped else "bf16"


def build_linear(kind: str, chunks: Iterable[Part], n: int, k: int) -> PackedLinear:
    """Pack ``n`` rows of ``k`` columns arriving as row chunks into a linear of an explicit kind."""
    if kind == "int4":
        return _build_int4(chunks, n, k)
    if kind == "int4x2":
        lin = _build_int4((split_nibbles(c) for c in chunks if isinstance(c, Grouped)), n, 2 * k)
        return Int4Linear(lin.packed, lin.scales_zeros, n, k, twice=True)
    if kind == "int8":
        return _build_int8(chunks, n, k)
    return _build_dense(chunks, n, k, torch.float32 if kind == "f32" else torch.bfloat16)


def pack_linear(parts: Sequence[Part], kind: str = "auto") -> PackedLinear:
    """One linear whose weight is the rows of all parts concatenated (fused q/k/v or gate/up).

    parts: Grouped or float arrays [n_i, K]. ``auto`` picks int4 when every part is 4-bit with
    group 32 (the codes are kept exactly), int8 per-row requantization for other quantized parts
    and bf16 for float parts; ``int8``/``bf16``/``f32`` can be forced for any parts.
    Row chunks of CHUNK_ROWS are converted at a time, never a float32 copy of the whole matrix.
    """
    if not parts:
        raise ValueError("pack_linear needs at least one part")
    k = _n_cols(parts[0])
    for p in parts:
        if isinstance(p, np.ndarray) and p.ndim != 2:
            raise ValueError(f"pack_linear: float parts must be 2-D, got shape {list(p.shape)}")
        if _n_cols(p) != k:
            raise ValueError(f"pack_linear: parts have different column counts ({_n_cols(p)} vs {k})")
    chosen = choose_kind(parts, kind)
    n = sum(p.shape[0] for p in parts)
    lin = build_linear(chosen, _row_chunks(parts), n, k)
    log.debug("packed %d x %d linear as %s (%d bytes)", n, k, chosen, lin.nbytes)
    return lin
