"""The native sparse FFN kernel (kernels/sparse_ffn.c): build on first use, load, pack weights for it.

Runs in: a CPU worker process, or the coordinator for the in-process executor.

The C file is compiled once per machine with the system C compiler (``-O3 -march=native
-fopenmp``, under a second) into the user cache directory, keyed by a hash of the source, the
flags and the compiler, and loaded with ctypes. Its OpenMP calls resolve to the runtime torch
already loaded (checked: the kernel sees torch.set_num_threads), so the two never fight over cores.
Without a compiler, or with ``POWERINFER_NATIVE=0``, :func:`native_lib` returns None and the
sparse shard falls back to its torch path, with one warning.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from powerinfer.quants.grouped import Grouped

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels") / "sparse_ffn.c"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11")
MODES = {"all": 0, "gate": 1, "mask": 2, "oracle": 3, "given_gate": 4, "given_h": 5}
ACTIVATIONS = {"silu": 0, "gelu": 1}


class PiMat(ctypes.Structure):
    """pi_mat in sparse_ffn.c: one matrix's codes, float16 scales and zeros."""

    _fields_ = [("codes", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("zero", ctypes.c_void_p),
                ("stride", ctypes.c_int64), ("sstride", ctypes.c_int64), ("bits", ctypes.c_int32), ("group", ctypes.c_int32)]


class PiCall(ctypes.Structure):
    """pi_call in sparse_ffn.c: one call's arguments."""

    _fields_ = [("x", ctypes.c_void_p), ("y", ctypes.c_void_p), ("active", ctypes.c_void_p), ("mask", ctypes.c_void_p),
                ("given_a", ctypes.c_void_p), ("given_h", ctypes.c_void_p), ("scratch", ctypes.c_void_p), ("gate", PiMat), ("up", PiMat), ("down", PiMat),
                ("T", ctypes.c_int32), ("d", ctypes.c_int32), ("n", ctypes.c_int32), ("act", ctypes.c_int32),
                ("mode", ctypes.c_int32), ("parts", ctypes.c_int32), ("thr", ctypes.c_float)]


def _cache_dir() -> Path:
    from platformdirs import user_cache_dir

    return Path(os.environ.get("POWERINFER_CACHE") or user_cache_dir("powerinfer")) / "native"


def _compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def _build(cc: str, out: Path) -> None:
    """Compile SOURCE to out atomically (a concurrent build by another worker writes its own temp file)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        res = subprocess.run([cc, *FLAGS, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True, timeout=120)
        if res.returncode != 0:
            raise OSError(f"{cc} failed: {res.stderr.strip()[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.lru_cache(maxsize=1)
def native_lib() -> ctypes.CDLL | None:
    """The loaded kernel library, or None (no compiler, build failure, or POWERINFER_NATIVE=0)."""
    if os.environ.get("POWERINFER_NATIVE", "1") == "0":
        log.info("native sparse kernel disabled by POWERINFER_NATIVE=0")
        return None
    cc = _compiler()
    if cc is None:
        log.warning("no C compiler found: sparse FFNs use the slower torch path")
        return None
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
        key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode() + version.encode()).hexdigest()[:16]
        path = _cache_dir() / f"sparse_ffn-{key}.so"
        if not path.exists():
            log.info("compiling the native sparse FFN kernel with %s", cc)
            _build(cc, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("native sparse kernel unavailable (%s): sparse FFNs use the slower torch path", e)
        return None
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    lib.pi_ffn.argtypes = [ctypes.POINTER(PiCall)]
    lib.pi_ffn.restype = i32
    lib.pi_ffn_acts.argtypes = [ptr, i32, i32, i32, ptr, ptr, i32, ptr, ptr, ptr]
    lib.pi_ffn_acts.restype = None
    lib.pi_ffn_scratch.argtypes = [i32, i32, i32]
    lib.pi_ffn_scratch.restype = ctypes.c_int64
    return lib


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
class NeuronRecords:
    """One layer shard's weights in the kernel's layout.

    records uint8 [n, rec]: per neuron, [gate codes |] up codes | down codes (the file's column) |
    [gate scales | gate zeros |] up scales | up zeros (float16), padded to 64 bytes, so an active
    neuron is one contiguous run of memory. Gate mode reads every gate row, so there the gate rows
    stay a separate dense matrix (gate uint8 [n, row] and its scales) that streams sequentially;
    predictor mode reads only chosen neurons' gates, so they go into the records. down_scale,
    down_zero float16 [n / group, d]: the file's down scales, one row per unit of `group` neurons.
    """

    records: torch.Tensor
    gate: tuple[torch.Tensor, ...]  # (codes, scale, zero) when the gate is separate, else ()
    down_scale: torch.Tensor
    down_zero: torch.Tensor
    mats: tuple[PiMat, PiMat, PiMat]  # gate, up, down pointing into the tensors above

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.records, *self.gate, self.down_scale, self.down_zero))


def _f16_bytes(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float16).view(np.uint8)


def pack_layer(gate: Grouped, up: Grouped, down: Grouped, gate_in_records: bool = True, with_gate: bool = True,
               with_up: bool = True) -> NeuronRecords:
    """gate, up [n, d] (groups along d) and down [d, n] (groups along n), as decoded from the file.

    with_gate / with_up False leave that matrix out (the caller computes it densely and passes its
    activations: modes given_gate, given_h); its PiMat then has no codes and must not be read.
    """
    n, d = gate.shape
    if up.shape != (n, d) or down.shape != (d, n):
        raise ValueError(f"gate {gate.shape}, up {up.shape}, down {down.shape} do not form one FFN")
    named = [("dq", _pack_codes(np.ascontiguousarray(down.q.T), down.bits))]
    if with_up:
        named += [("uq", _pack_codes(up.q, up.bits)), ("us", _f16_bytes(up.scale)), ("uz", _f16_bytes(up.zero))]
    if with_gate and gate_in_records:
        named += [("gq", _pack_codes(gate.q, gate.bits)), ("gs", _f16_bytes(gate.scale)), ("gz", _f16_bytes(gate.zero))]
    offsets, off = {}, 0
    for name, part in named:
        offsets[name] = off
        off += part.shape[1]
    rec = -(-off // 64) * 64
    records = np.zeros((n, rec), dtype=np.uint8)  # numpy advises huge pages for big arrays: fewer TLB misses
    for name, part in named:
        records[:, offsets[name] : offsets[name] + part.shape[1]] = part
    t = torch.from_numpy(records)
    ds = torch.from_numpy(np.ascontiguousarray(down.scale.T, dtype=np.float16))
    dz = torch.from_numpy(np.ascontiguousarray(down.zero.T, dtype=np.float16))
    base = t.data_ptr()
    sep: tuple[torch.Tensor, ...] = ()
    if not with_gate:
        gmat = PiMat(None, None, None, 0, 0, gate.bits, gate.group)
    elif gate_in_records:
        gmat = PiMat(base + offsets["gq"], base + offsets["gs"], base + offsets["gz"], rec, rec // 2, gate.bits, gate.group)
    else:
        gq = np.empty((n, _pack_codes(gate.q[:1], gate.bits).shape[1]), dtype=np.uint8)
        gq[:] = _pack_codes(gate.q, gate.bits)
        sep = (torch.from_numpy(gq), torch.from_numpy(np.ascontiguousarray(gate.scale, dtype=np.float16)),
               torch.from_numpy(np.ascontiguousarray(gate.zero, dtype=np.float16)))
        gmat = PiMat(sep[0].data_ptr(), sep[1].data_ptr(), sep[2].data_ptr(), gq.shape[1], d // gate.group, gate.bits, gate.group)
    mats = (
        gmat,
        PiMat(base + offsets["uq"], base + offsets["us"], base + offsets["uz"], rec, rec // 2, up.bits, up.group) if with_up
        else PiMat(None, None, None, 0, 0, up.bits, up.group),
        PiMat(base + offsets["dq"], ds.data_ptr(), dz.data_ptr(), rec, d, down.bits, down.group),
    )
    return NeuronRecords(t, sep, ds, dz, mats)


class NativeFFN:
    """One shard's gate, up and down in the kernel's layout, and the calls into it."""

    def __init__(self, lib: ctypes.CDLL, gate: Grouped, up: Grouped, down: Grouped, activation: str, gate_in_records: bool = True,
                 with_gate: bool = True, with_up: bool = True) -> None:
        """gate, up [n, d] and down [d, n] as decoded from the file (see :func:`supported`);
        gate_in_records=False for gate mode, which reads every gate row (see NeuronRecords);
        with_gate / with_up False when the caller computes that matrix itself (given_* modes)."""
        self.lib = lib
        self.with_gate, self.with_up = with_gate, with_up
        self.weights = pack_layer(gate, up, down, gate_in_records, with_gate, with_up)
        self.n, self.d = gate.shape
        self.down_group = down.group
        self.act = ACTIVATIONS[activation]
        g, u, dn = self.weights.mats
        self._call = PiCall(gate=g, up=u, down=dn, d=self.d, n=self.n, act=self.act)
        self._call_ref = ctypes.byref(self._call)
        self._scratch: dict[tuple[int, int], np.ndarray] = {}  # (T, parts) -> buffer, kept for decode-sized calls

    @property
    def nbytes(self) -> int:
        return self.weights.nbytes

    def _scratch_for(self, T: int, parts: int) -> np.ndarray:
        buf = self._scratch.get((T, parts))
        if buf is None:
            buf = np.empty(int(self.lib.pi_ffn_scratch(T, self.d, parts)), dtype=np.float32)
            if T <= 16:  # decode and batched decode reuse theirs; prefill chunks allocate per call
                self._scratch[(T, parts)] = buf
        return buf

    def forward(self, x: torch.Tensor, mode: str, threshold: float = 0.0, mask: torch.Tensor | None = None,
                given_a: torch.Tensor | None = None, given_h: torch.Tensor | None = None) -> tuple[torch.Tensor, np.ndarray]:
        """x [T, d] -> (y [T, d] float32, active [T] int32: neurons computed per token).

        mask [T, n] for mode "mask"; given_a [T, n] (act(gate)) for "given_gate" and "given_h",
        given_h [T, n] (act(gate) * up) for "given_h".
        """
        needs_gate = mode not in ("given_gate", "given_h")
        needs_up = mode != "given_h"
        if (needs_gate and not self.with_gate) or (needs_up and not self.with_up):
            raise ValueError(f"mode {mode!r} needs weights this kernel instance was built without")
        xn = np.ascontiguousarray(x.detach().numpy(), dtype=np.float32)
        T = xn.shape[0]
        parts = max(1, torch.get_num_threads())
        # numpy buffers: np.empty costs ~0.2 µs where torch.empty costs ~3 µs, at 30+ calls a token
        y = np.empty((T, self.d), dtype=np.float32)
        active = np.empty(T, dtype=np.int32)
        c = self._call
        c.x, c.y, c.active = xn.ctypes.data, y.ctypes.data, active.ctypes.data
        scratch = self._scratch_for(T, parts)  # a local: the buffer must outlive the call
        c.scratch = scratch.ctypes.data
        c.T, c.mode, c.parts, c.thr = T, MODES[mode], parts, threshold
        m = ga = gh = None  # locals: the buffers must outlive the call
        if mode == "mask":
            assert mask is not None and tuple(mask.shape) == (T, self.n)
            m = np.ascontiguousarray(mask.numpy(), dtype=np.uint8)
            c.mask = m.ctypes.data
        if not needs_gate:
            assert given_a is not None and tuple(given_a.shape) == (T, self.n)
            ga = np.ascontiguousarray(given_a.detach().numpy(), dtype=np.float32)
            c.given_a = ga.ctypes.data
            if mode == "given_h":
                assert given_h is not None and tuple(given_h.shape) == (T, self.n)
                gh = np.ascontiguousarray(given_h.detach().numpy(), dtype=np.float32)
                c.given_h = gh.ctypes.data
        if self.lib.pi_ffn(self._call_ref) != 0:
            raise ValueError(f"native FFN kernel refused shapes d={self.d}, n={self.n}, down group {self.down_group}")
        return torch.from_numpy(y), active

    def activations(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, d] -> (act(gate) [T, n], act(gate) * up [T, n]) for every neuron."""
        if not (self.with_gate and self.with_up):
            raise ValueError("activations() needs the gate and up weights")
        x = x.float().contiguous()
        T = x.shape[0]
        g, h = torch.empty(T, self.n), torch.empty(T, self.n)
        scratch = torch.empty(T * self.d)
        c = self._call
        self.lib.pi_ffn_acts(x.data_ptr(), T, self.d, self.n, ctypes.byref(c.gate), ctypes.byref(c.up), self.act, g.data_ptr(),
                             h.data_ptr(), scratch.data_ptr())
        return g, h


def reference_ffn(x: np.ndarray, gate: Grouped, up: Grouped, down: Grouped, activation: str, mode: str, threshold: float = 0.0,
                  mask: np.ndarray | None = None, given_a: np.ndarray | None = None,
                  given_h: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Vectorized numpy statement of what pi_ffn computes, in float64, which tests hold the kernel to.

    x [T, d]; gate, up [n, d] and down [d, n] as decoded from the file; returns (y [T, d], active [T]).
    The row dots see x as the kernel does: int16 codes with one scale per 32 values (round half
    to even), while the zeros multiply x's exact float group sums.
    """
    x = np.asarray(x, dtype=np.float32)
    T, d = x.shape
    xb = x.reshape(T, d // 32, 32)
    xd = (np.abs(xb).max(axis=2) / np.float32(32767.0)).astype(np.float32)  # [T, d / 32]
    inv = np.where(xd > 0, np.float32(1.0) / np.where(xd > 0, xd, 1), 0).astype(np.float32)
    xq = np.rint(xb * inv[:, :, None]).reshape(T, d).astype(np.float64)

    def dots(m: Grouped) -> np.ndarray:  # [T, n]
        n, g = m.q.shape[0], m.group
        s = m.scale.astype(np.float16).astype(np.float64)
        z = m.zero.astype(np.float16).astype(np.float64)
        per = np.einsum("ngk,tgk->tng", m.q.astype(np.float64).reshape(n, d // g, g), xq.reshape(T, d // g, g))
        xd_g = np.repeat(xd.astype(np.float64), 32 // g, axis=1)  # each group's x scale
        xs = x.reshape(T, d // g, g).astype(np.float64).sum(axis=2)
        return np.einsum("tng,ng,tg->tn", per, s, xd_g) + np.einsum("ng,tg->tn", z, xs)

    if given_a is not None:
        a = np.asarray(given_a, dtype=np.float64)
        h = np.asarray(given_h, dtype=np.float64) if mode == "given_h" else a * dots(up)
    else:
        gv = dots(gate)
        a = gv / (1 + np.exp(-gv)) if activation == "silu" else 0.5 * gv * (1 + np.tanh(0.7978845608028654 * (gv + 0.044715 * gv**3)))
        h = a * dots(up)
    chosen = {"all": np.ones_like(h, dtype=bool), "gate": np.abs(a) > threshold, "oracle": np.abs(h) > threshold,
              "given_gate": np.abs(a) > threshold, "given_h": np.abs(a) > threshold}.get(mode)
    if chosen is None:
        assert mask is not None
        chosen = np.asarray(mask, dtype=bool)
    w = (down.q.astype(np.float64).reshape(d, -1, down.group) * down.scale.astype(np.float16).astype(np.float64)[:, :, None]
         + down.zero.astype(np.float16).astype(np.float64)[:, :, None]).reshape(d, -1)  # [d, n]
    return np.where(chosen, h, 0.0) @ w.T, chosen.sum(axis=1)
