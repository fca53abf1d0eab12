"""The sparse FFN kernel's weight layout: gate, up and down neuron-major in the file's own codes.

Runs in: the processes of the torch executors' sparse FFN shards (native/sparse_kernel.py's
NativeFFN: the in-process torch executor, `--transport zmq` workers, the GPU hybrid's CPU side).
numpy and ctypes only; the torch glue stays in native.py. The layouts and arithmetic are
described in kernels/sparse_ffn.c; these structs mirror its pi_mat and pi_call. (The native
decoder's sparse FFN reads the file's own rows instead: kernels/sparse_rows.h.)
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from powerinfer.quants.grouped import Grouped

MODES = {"all": 0, "gate": 1, "mask": 2, "oracle": 3, "given_gate": 4, "given_h": 5}

class PiMat(ctypes.Structure):
    """pi_mat in sparse_ffn.c: one matrix's codes, float16 scales and zeros."""

    _fields_ = [("codes", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("zero", ctypes.c_void_p),
                ("stride", ctypes.c_int64), ("sstride", ctypes.c_int64), ("bits", ctypes.c_int32), ("group", ctypes.c_int32),
                ("zk", ctypes.c_float)]


class PiCall(ctypes.Structure):
    """pi_call in sparse_ffn.c: one call's arguments."""

    _fields_ = [("x", ctypes.c_void_p), ("y", ctypes.c_void_p), ("active", ctypes.c_void_p), ("mask", ctypes.c_void_p),
                ("given_a", ctypes.c_void_p), ("given_h", ctypes.c_void_p), ("scratch", ctypes.c_void_p), ("gate", PiMat), ("up", PiMat), ("down", PiMat),
                ("T", ctypes.c_int32), ("d", ctypes.c_int32), ("n", ctypes.c_int32), ("act", ctypes.c_int32),
                ("mode", ctypes.c_int32), ("parts", ctypes.c_int32), ("thr", ctypes.c_float), ("act_thr", ctypes.c_float)]


def _pack_codes(q: np.ndarray, bits: int) -> np.ndarray:
    """Codes [n, d] -> uint8 [n, row bytes]. 4-bit: byte b of each 32-chunk = value b | value b + 16 << 4."""
    if bits == 8:
        return np.ascontiguousarray(q, dtype=np.int8).view(np.uint8)
    u = q.astype(np.uint8).reshape(q.shape[0], -1, 2, 16)  # [n, chunks, half, 16]
    return (u[:, :, 0] | (u[:, :, 1] << 4)).reshape(q.shape[0], -1)


def supported(g: Grouped | np.ndarray) -> bool:
    """Whether a decoded matrix has a layout the kernel takes (4-bit group 32, or int8 group 16/32)."""
    return isinstance(g, Grouped) and g.shape[1] % 32 == 0 and (g.group == 32 or (g.bits == 8 and g.group == 16))


@dataclass(frozen=True)
class NeuronMajor:
    """One layer shard's weights in the kernel's layout: three neuron-major matrices.

    gate, up: (codes uint8 [n, row bytes], scale[, zero] float16 [n, d / group]), the file's rows;
    down: (codes uint8 [n, row bytes] (row j = the file's column j), scale[, zero] float16
    [n / group, d]: the file's down scales, one row per unit of `group` neurons). Zeros that are a
    fixed multiple of the scales (:func:`zero_multiple`) are not stored. A matrix the caller
    computes itself (given_* modes) is left out: an empty tuple, and a PiMat with no codes.

    Plain arrays, read as sequential streams, measured fastest (SmolLM2, 30 layers, weights out
    of cache, 2 threads, in-process A/B): one record per neuron holding its gate, up and down
    bytes ran 162 µs a layer against 132; codes rows with their scales appended 167 against 148.
    """

    gate: tuple[np.ndarray, ...]
    up: tuple[np.ndarray, ...]
    down: tuple[np.ndarray, ...]
    mats: tuple[PiMat, PiMat, PiMat]  # gate, up, down pointing into the arrays above

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.gate, *self.up, *self.down))


def _f16(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float16)


# Multiples of the scale that a format's zeros may be: 0 (int8 formats), -8 (Q4_0), -16 (Q5_0), ...
_ZERO_MULTIPLES = (0.0, -8.0, -16.0, -32.0, -4.0, -2.0, -1.0, -64.0, -128.0)


def zero_multiple(scale: np.ndarray, zero: np.ndarray) -> float | None:
    """zk when every float16 zero is exactly zk times its float16 scale (the kernel then derives
    the zeros and never reads them: 10% fewer bytes for Q4_0, the down's per-unit scales halved),
    else None. Powers of two times a float16 are exact, so the values the kernel uses are unchanged."""
    s16 = np.asarray(scale, dtype=np.float16)
    z16 = np.asarray(zero, dtype=np.float16)
    with np.errstate(over="ignore"):
        for zk in _ZERO_MULTIPLES:
            if np.array_equal(z16, (s16.astype(np.float32) * np.float32(zk)).astype(np.float16)):
                return zk
    return None


def _scales(scale: np.ndarray, zero: np.ndarray) -> tuple[tuple[np.ndarray, ...], int, int, float]:
    """(tensors to keep, scale address, zero address (0: derived), zk) for a matrix's scales and zeros."""
    s = _f16(scale)
    zk = zero_multiple(scale, zero)
    if zk is not None:
        return (s,), s.ctypes.data, 0, zk
    z = _f16(zero)
    return (s, z), s.ctypes.data, z.ctypes.data, 0.0


def _row_matrix(m: Grouped) -> tuple[tuple[np.ndarray, ...], PiMat]:
    """gate or up [n, d] (groups along d) -> (codes, scale[, zero]) and the PiMat over them."""
    codes = np.ascontiguousarray(_pack_codes(m.q, m.bits))
    kept, sp, zp, zk = _scales(m.scale, m.zero)
    mat = PiMat(codes.ctypes.data, sp, zp or None, codes.shape[1], m.shape[1] // m.group, m.bits, m.group, zk)
    return (codes, *kept), mat


def _absent(m: Grouped) -> tuple[tuple[np.ndarray, ...], PiMat]:
    return (), PiMat(None, None, None, 0, 0, m.bits, m.group, 0.0)


def pack_layer(gate: Grouped, up: Grouped, down: Grouped, with_gate: bool = True, with_up: bool = True) -> NeuronMajor:
    """gate, up [n, d] (groups along d) and down [d, n] (groups along n), as decoded from the file.

    with_gate / with_up False leave that matrix out (the caller computes it densely and passes its
    activations: modes given_gate, given_h); its PiMat then has no codes and must not be read.
    """
    n, d = gate.shape
    if up.shape != (n, d) or down.shape != (d, n):
        raise ValueError(f"gate {gate.shape}, up {up.shape}, down {down.shape} do not form one FFN")
    g, gmat = _row_matrix(gate) if with_gate else _absent(gate)
    u, umat = _row_matrix(up) if with_up else _absent(up)
    dq = np.ascontiguousarray(_pack_codes(np.ascontiguousarray(down.q.T), down.bits))
    kept, sp, zp, zk = _scales(down.scale.T, down.zero.T)
    dmat = PiMat(dq.ctypes.data, sp, zp or None, dq.shape[1], d, down.bits, down.group, zk)
    return NeuronMajor(g, u, (dq, *kept), (gmat, umat, dmat))
