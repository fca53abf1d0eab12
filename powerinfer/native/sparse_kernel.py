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
import logging
import os
from pathlib import Path

import numpy as np
import torch

from powerinfer.config import ACT_CODES
from powerinfer.native.neuron_major import MODES, PiCall, pack_layer
from powerinfer.model.reference import activation as reference_activation, up_value
from powerinfer.native.build import load_library
from powerinfer.quants.grouped import Grouped

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels") / "sparse_ffn.c"  # includes kernels/pi_rows.h
HEADERS = (SOURCE.with_name("pi_rows.h"), SOURCE.with_name("half.h"), SOURCE.with_name("exp8.h"), SOURCE.with_name("act.h"))
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11")

@functools.lru_cache(maxsize=1)
def native_lib() -> ctypes.CDLL | None:
    """The loaded kernel library, or None (no compiler, build failure, or POWERINFER_NATIVE=0)."""
    if os.environ.get("POWERINFER_NATIVE", "1") == "0":
        log.info("native sparse kernel disabled by POWERINFER_NATIVE=0")
        return None
    try:
        lib = load_library(SOURCE, HEADERS, FLAGS, "sparse_ffn")
        lib.pi_call_size.restype = ctypes.c_int
        if lib.pi_call_size() != ctypes.sizeof(PiCall):  # a source newer than this module (upgraded mid-run)
            raise OSError(f"kernel struct size {lib.pi_call_size()} != {ctypes.sizeof(PiCall)}")
    except OSError as e:
        log.warning("native sparse kernel unavailable (%s): sparse FFNs use the slower torch path", e)
        return None
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    lib.pi_ffn.argtypes = [ctypes.POINTER(PiCall)]
    lib.pi_ffn.restype = i32
    lib.pi_ffn_acts.argtypes = [ptr, i32, i32, i32, ptr, ptr, i32, ctypes.c_float, ptr, ptr, ptr]
    lib.pi_ffn_acts.restype = None
    lib.pi_ffn_scratch.argtypes = [i32, i32, i32]
    lib.pi_ffn_scratch.restype = ctypes.c_int64
    return lib


class NativeFFN:
    """One shard's gate, up and down in the kernel's layout, and the calls into it."""

    def __init__(self, lib: ctypes.CDLL, gate: Grouped, up: Grouped, down: Grouped, activation: str, with_gate: bool = True,
                 with_up: bool = True, act_threshold: float = 0.0) -> None:
        """gate, up [n, d] and down [d, n] as decoded from the file (see :func:`supported`);
        with_gate / with_up False when the caller computes that matrix itself (given_* modes);
        activation and act_threshold as ModelConfig has them."""
        self.lib = lib
        self.with_gate, self.with_up = with_gate, with_up
        self.weights = pack_layer(gate, up, down, with_gate, with_up)
        self.n, self.d = gate.shape
        self.down_group = down.group
        self.act, self.act_thr = ACT_CODES[activation], float(act_threshold)
        g, u, dn = self.weights.mats
        self._call = PiCall(gate=g, up=u, down=dn, d=self.d, n=self.n, act=self.act, act_thr=self.act_thr)
        self._call_ref = ctypes.byref(self._call)
        # per (T, parts) for decode-sized calls: (scratch, active [T] int32) and their addresses;
        # taking a numpy array's address costs ~2 µs, a torch tensor's 0.1 µs, at 30+ calls a token
        self._bufs: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, int, int]] = {}

    @property
    def nbytes(self) -> int:
        return self.weights.nbytes

    def _buffers(self, T: int, parts: int) -> tuple[np.ndarray, np.ndarray, int, int]:
        bufs = self._bufs.get((T, parts))
        if bufs is None:
            scratch = np.empty(int(self.lib.pi_ffn_scratch(T, self.d, parts)), dtype=np.float32)
            active = np.empty(T, dtype=np.int32)
            bufs = (scratch, active, scratch.ctypes.data, active.ctypes.data)
            if T <= 16:  # decode and batched decode reuse theirs; prefill chunks allocate per call
                self._bufs[(T, parts)] = bufs
        return bufs

    @staticmethod
    def _f32(t: torch.Tensor, shape: tuple[int, int], name: str) -> torch.Tensor:
        """t as a contiguous float32 tensor of `shape` (its own memory when it already is one)."""
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape}")
        return t.detach().to(torch.float32).contiguous()

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
        T = x.shape[0]
        xc = self._f32(x, (T, self.d), "x")  # a local: the buffers must outlive the call
        parts = max(1, torch.get_num_threads())
        y = torch.empty(T, self.d)
        _scratch, active, scratch_ptr, active_ptr = self._buffers(T, parts)  # _scratch: a local the buffer outlives the call by
        c = self._call
        c.x, c.y, c.active, c.scratch = xc.data_ptr(), y.data_ptr(), active_ptr, scratch_ptr
        c.T, c.mode, c.parts, c.thr = T, MODES[mode], parts, threshold
        m = ga = gh = None  # locals: the buffers must outlive the call
        if mode == "mask":
            if mask is None or tuple(mask.shape) != (T, self.n):
                raise ValueError(f"mode 'mask' needs a mask of shape {(T, self.n)}")
            m = mask.to(torch.uint8).contiguous()
            c.mask = m.data_ptr()
        if not needs_gate:
            if given_a is None:
                raise ValueError(f"mode {mode!r} needs given_a")
            ga = self._f32(given_a, (T, self.n), "given_a")
            c.given_a = ga.data_ptr()
            if mode == "given_h":
                if given_h is None:
                    raise ValueError("mode 'given_h' needs given_h")
                gh = self._f32(given_h, (T, self.n), "given_h")
                c.given_h = gh.data_ptr()
        if self.lib.pi_ffn(self._call_ref) != 0:
            raise ValueError(f"native FFN kernel refused shapes d={self.d}, n={self.n}, down group {self.down_group}")
        return y, active.copy()

    def activations(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, d] -> (act(gate) [T, n], act(gate) * up [T, n]) for every neuron."""
        if not (self.with_gate and self.with_up):
            raise ValueError("activations() needs the gate and up weights")
        x = x.float().contiguous()
        T = x.shape[0]
        g, h = torch.empty(T, self.n), torch.empty(T, self.n)
        scratch = torch.empty(T * self.d)
        c = self._call
        self.lib.pi_ffn_acts(x.data_ptr(), T, self.d, self.n, ctypes.byref(c.gate), ctypes.byref(c.up), self.act, ctypes.c_float(self.act_thr), g.data_ptr(),
                             h.data_ptr(), scratch.data_ptr())
        return g, h


def reference_ffn(x: np.ndarray, gate: Grouped, up: Grouped, down: Grouped, activation: str, mode: str, threshold: float = 0.0,
                  mask: np.ndarray | None = None, given_a: np.ndarray | None = None,
                  given_h: np.ndarray | None = None, act_threshold: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
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
        out: np.ndarray = np.einsum("tng,ng,tg->tn", per, s, xd_g) + np.einsum("ng,tg->tn", z, xs)
        return out

    if given_a is not None:
        a = np.asarray(given_a, dtype=np.float64)
        h = np.asarray(given_h, dtype=np.float64) if mode == "given_h" else a * up_value(dots(up), activation)
    else:
        a = reference_activation(dots(gate), activation, act_threshold)
        h = a * up_value(dots(up), activation)
    chosen = {"all": np.ones_like(h, dtype=bool), "gate": np.abs(a) > threshold, "oracle": np.abs(h) > threshold,
              "given_gate": np.abs(a) > threshold, "given_h": np.abs(a) > threshold}.get(mode)
    if chosen is None:
        assert mask is not None
        chosen = np.asarray(mask, dtype=bool)
    # down, per (token, unit of `group` neurons): h as int16 codes with one scale, as the kernel
    # holds it (hq = rint(h / hs), hs = max |h| / 32767), times the codes; the file's scales
    # once per unit; the zeros times the exact sum of h
    hc = np.where(chosen, h, 0.0).astype(np.float32)  # [T, n]
    n, g = hc.shape[1], down.group
    hu = hc.reshape(T, n // g, g)
    hs = (np.abs(hu).max(axis=2) / np.float32(32767.0)).astype(np.float32)  # [T, units]
    hinv = np.where(hs > 0, np.float32(1.0) / np.where(hs > 0, hs, 1), 0).astype(np.float32)
    hq = np.rint(hu * hinv[:, :, None]).astype(np.float64)  # [T, units, g]
    q = down.q.astype(np.float64).reshape(d, n // g, g)  # [d, units, g]
    s = down.scale.astype(np.float16).astype(np.float64)  # [d, units]
    z = down.zero.astype(np.float16).astype(np.float64)
    y = np.einsum("dug,tug,du,tu->td", q, hq, s, hs.astype(np.float64)) + np.einsum("du,tu->td", z, hu.astype(np.float64).sum(axis=2))
    return y, chosen.sum(axis=1)
