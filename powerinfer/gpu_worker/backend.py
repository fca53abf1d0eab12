"""The GPU worker's device interface, its memory ledger, and the CPU backend that runs it on numpy.

Runs in: the GPU worker process (or the coordinator, for the in-process GPU worker).

:class:`Backend` is the narrow waist between the GPU runtime (:mod:`powerinfer.gpu_worker.model`,
which knows layers) and a device: buffers, copies, and one method per CUDA kernel with exactly the
kernel's arguments (flat buffers, element offsets through :meth:`Backend.view`, leading dimensions,
counts). Two implementations:

* :class:`CpuBackend` (here): buffers are numpy arrays and each kernel is its numpy oracle from
  :mod:`powerinfer.gpu_worker.kernels`. It lets CI run every line of the runtime, the placement and
  the merge without a GPU, and it is the reference the CUDA backend is checked against.
* ``CudaBackend`` (:mod:`powerinfer.gpu_worker.cuda_backend`): pycuda, kernels compiled at run time.

Both account every allocation in a :class:`MemoryLedger` against the VRAM budget, with the same
byte counts (the same dtypes and shapes are allocated), and refuse a budget the card cannot hold.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from numpy.typing import DTypeLike

from powerinfer.gpu_worker import kernels as K
from powerinfer.gpu_worker.errors import over_budget, over_card

log = logging.getLogger(__name__)

Buf = Any  # a backend's device buffer: numpy array (CPU) or DeviceBuffer (CUDA); 1-D, typed


@dataclass
class MemoryLedger:
    """Bytes allocated on the device against the budget; an allocation past it is refused."""

    budget: int
    used: int = 0
    peak: int = 0

    def take(self, nbytes: int, what: str) -> None:
        if self.used + nbytes > self.budget:
            raise over_budget(what, nbytes, self.used, self.budget)
        self.used += nbytes
        self.peak = max(self.peak, self.used)

    def give(self, nbytes: int) -> None:
        self.used -= nbytes


class PendingRead(Protocol):
    def result(self) -> np.ndarray:
        """Wait for the device-to-host copy; an owned array."""
        ...


def disagreement(got: np.ndarray, ref: np.ndarray) -> float:
    """max |got - ref| / max |ref| over the entries where ref is finite (0 when both are zero; inf
    when got is not finite where ref is, or ref is zero where got is not): how a new kernel path
    is held against the one it replaces on a card's first use (cuda_backend GEMV, GpuModel.layers)."""
    ok = np.isfinite(ref)
    if not np.array_equal(np.isfinite(got), ok):
        return float("inf")
    scale = float(np.max(np.abs(ref[ok]))) if ok.any() else 0.0
    diff = float(np.max(np.abs(got[ok].astype(np.float64) - ref[ok]))) if ok.any() else 0.0
    return diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))


class PendingRows:
    """Chunks of a [T, d] result still being computed / copied back (GpuModel's *_begin)."""

    def __init__(self, parts: list[PendingRead], d: int) -> None:
        self.parts, self.d = parts, d

    def result(self) -> np.ndarray:
        outs = [p.result().reshape(-1, self.d) for p in self.parts]
        return outs[0] if len(outs) == 1 else np.concatenate(outs)

    def abandon(self) -> None:
        """Finish the copies anyway: they write into buffers the next call reuses."""
        for p in self.parts:
            p.result()


class Backend(Protocol):
    name: str
    ledger: MemoryLedger

    # -- memory ------------------------------------------------------------------------------------
    def alloc(self, n: int, dtype: DTypeLike, what: str) -> Buf: ...
    def upload(self, arr: np.ndarray, what: str) -> Buf: ...
    def view(self, buf: Buf, offset: int, n: int) -> Buf: ...
    def write(self, buf: Buf, arr: np.ndarray) -> None: ...
    def zero(self, buf: Buf) -> None: ...
    def read(self, buf: Buf, n: int) -> PendingRead: ...
    def synchronize(self) -> None: ...
    def close(self) -> None: ...

    # -- kernels (powerinfer/gpu_worker/kernels/*.cu; oracles in kernels.py) --------------------------
    def gemv(self, suffix: str, w: Buf, row_bytes: int, rows: Buf | None, n_dev: Buf | None, n: int,
             x: Buf, k: int, t: int, y: Buf, ldy: int) -> None: ...
    def axpy(self, suffix: str, w: Buf, row_bytes: int, rows: Buf | None, n_dev: Buf | None, n: int,
             h: Buf, ldh: int, k: int, t: int, y: Buf) -> None: ...
    def rms_norm(self, x: Buf, ld: int, t: int, h: int, d: int, w: Buf, eps: float) -> None: ...
    def rope(self, x: Buf, ld: int, pos: Buf, t: int, h: int, d: int, rope_dim: int, inv_freq: Buf) -> None: ...
    def kv_store(self, qkv: Buf, ld: int, k_off: int, v_off: int, pos: Buf, slots: Buf, t: int, hkv: int, d: int,
                 dv: int, k_cache: Buf, v_cache: Buf, n_ctx: int) -> None: ...
    def attend(self, qkv: Buf, ld: int, pos: Buf, slots: Buf, t: int, hq: int, hkv: int, d: int, dv: int,
               k_cache: Buf, v_cache: Buf, n_ctx: int, window: int, scale: float, out: Buf) -> None: ...
    def bias_act(self, y: Buf, ld: int, b: Buf, t: int, n: int, relu: int) -> None: ...
    def rms_norm_rows(self, x: Buf, ldx: int, y: Buf, ldy: int, t: int, d: int, w: Buf, eps: float) -> None: ...
    def add_rows(self, y: Buf, ldy: int, x: Buf, ldx: int, t: int, n: int) -> None: ...
    def act_mul(self, g: Buf, u: Buf | None, h: Buf, t: int, n: int, kind: int, athr: float, thr: float, logits: Buf | None,
                n_dev: Buf | None = None) -> None: ...
    def act_inplace(self, g: Buf, n: int, kind: int, athr: float) -> None: ...
    def compact(self, v: Buf, n: int, thr: float, use_abs: int, idx: Buf, count: Buf) -> None: ...
    def gather_mul(self, a: Buf, idx: Buf, count: Buf, n: int, u: Buf | None, h: Buf, kind: int) -> None: ...
    def gather_add(self, y: Buf, b: Buf, idx: Buf, count: Buf, n: int) -> None: ...


def host_memory() -> int:
    import psutil

    return int(psutil.virtual_memory().total)


@dataclass(frozen=True)
class _Ready:
    value: np.ndarray

    def result(self) -> np.ndarray:
        return self.value


class CpuBackend:
    """numpy buffers, numpy oracles: the GPU worker without a GPU (CI, and the kernels' reference).

    ``capacity`` plays the card's free memory (default: this machine's RAM), so a budget larger
    than it is refused exactly as the CUDA backend refuses one larger than the card.
    """

    name = "cpu"

    def __init__(self, budget: int, capacity: int | None = None) -> None:
        cap = host_memory() if capacity is None else capacity
        if budget > cap:
            raise over_card(budget, cap, "the CPU backend's simulated device")
        self.capacity = cap
        self.ledger = MemoryLedger(budget)

    # -- memory ------------------------------------------------------------------------------------
    def alloc(self, n: int, dtype: DTypeLike, what: str) -> np.ndarray:
        dt = np.dtype(dtype)
        self.ledger.take(n * dt.itemsize, what)
        return np.zeros(n, dtype=dt)

    def upload(self, arr: np.ndarray, what: str) -> np.ndarray:
        flat = np.ascontiguousarray(arr).reshape(-1)
        buf = self.alloc(flat.size, flat.dtype, what)
        buf[:] = flat
        return buf

    def view(self, buf: np.ndarray, offset: int, n: int) -> np.ndarray:
        if offset < 0 or offset + n > buf.size:
            raise ValueError(f"view [{offset}, {offset + n}) outside a buffer of {buf.size}")
        return buf[offset : offset + n]

    def write(self, buf: np.ndarray, arr: np.ndarray) -> None:
        flat = np.asarray(arr, dtype=buf.dtype).reshape(-1)
        buf[: flat.size] = flat

    def zero(self, buf: np.ndarray) -> None:
        buf[:] = 0

    def read(self, buf: np.ndarray, n: int) -> _Ready:
        return _Ready(np.array(buf[:n]))

    def synchronize(self) -> None:
        pass

    def close(self) -> None:
        self.ledger.used = 0

    # -- kernels -----------------------------------------------------------------------------------
    def gemv(self, suffix: str, w: np.ndarray, row_bytes: int, rows: np.ndarray | None, n_dev: np.ndarray | None, n: int,
             x: np.ndarray, k: int, t: int, y: np.ndarray, ldy: int) -> None:
        vals = K.ref_gemv(suffix, w, row_bytes, rows, n_dev, n, x, k, t)  # [t, count]
        for i in range(t):
            y[i * ldy : i * ldy + vals.shape[1]] = vals[i]

    def axpy(self, suffix: str, w: np.ndarray, row_bytes: int, rows: np.ndarray | None, n_dev: np.ndarray | None, n: int,
             h: np.ndarray, ldh: int, k: int, t: int, y: np.ndarray) -> None:
        y[: t * k] += K.ref_axpy(suffix, w, row_bytes, rows, n_dev, n, h, ldh, k, t).reshape(-1)

    def rms_norm(self, x: np.ndarray, ld: int, t: int, h: int, d: int, w: np.ndarray, eps: float) -> None:
        K.ref_rms_norm(x, ld, t, h, d, w, eps)

    def rope(self, x: np.ndarray, ld: int, pos: np.ndarray, t: int, h: int, d: int, rope_dim: int, inv_freq: np.ndarray) -> None:
        K.ref_rope(x, ld, pos, t, h, d, rope_dim, inv_freq)

    def kv_store(self, qkv: np.ndarray, ld: int, k_off: int, v_off: int, pos: np.ndarray, slots: np.ndarray, t: int,
                 hkv: int, d: int, dv: int, k_cache: np.ndarray, v_cache: np.ndarray, n_ctx: int) -> None:
        K.ref_kv_store(qkv, ld, k_off, v_off, pos, slots, t, hkv, d, dv, k_cache, v_cache, n_ctx)

    def attend(self, qkv: np.ndarray, ld: int, pos: np.ndarray, slots: np.ndarray, t: int, hq: int, hkv: int, d: int,
               dv: int, k_cache: np.ndarray, v_cache: np.ndarray, n_ctx: int, window: int, scale: float,
               out: np.ndarray) -> None:
        out[: t * hq * dv] = K.ref_attend(qkv, ld, pos, slots, t, hq, hkv, d, dv, k_cache, v_cache, n_ctx, window, scale).reshape(-1)

    def bias_act(self, y: np.ndarray, ld: int, b: np.ndarray, t: int, n: int, relu: int) -> None:
        K.ref_bias_act(y, ld, b, t, n, relu)

    def rms_norm_rows(self, x: np.ndarray, ldx: int, y: np.ndarray, ldy: int, t: int, d: int, w: np.ndarray, eps: float) -> None:
        out = K.ref_rms_norm_rows(x, ldx, t, d, w, eps)
        for r in range(t):
            y[r * ldy : r * ldy + d] = out[r]

    def add_rows(self, y: np.ndarray, ldy: int, x: np.ndarray, ldx: int, t: int, n: int) -> None:
        K.ref_add_rows(y, ldy, x, ldx, t, n)

    def act_mul(self, g: np.ndarray, u: np.ndarray | None, h: np.ndarray, t: int, n: int, kind: int, athr: float, thr: float,
                logits: np.ndarray | None, n_dev: np.ndarray | None = None) -> None:
        vals = K.ref_act_mul(g, u, t, n, kind, athr, thr, logits, n_dev)
        h[: vals.size] = vals

    def act_inplace(self, g: np.ndarray, n: int, kind: int, athr: float) -> None:
        g[:n] = K.act(g[:n], kind, athr).astype(np.float32)

    def compact(self, v: np.ndarray, n: int, thr: float, use_abs: int, idx: np.ndarray, count: np.ndarray) -> None:
        sel = K.ref_compact(v, n, thr, use_abs)
        idx[: sel.size] = sel
        count[0] = sel.size

    def gather_mul(self, a: np.ndarray, idx: np.ndarray, count: np.ndarray, n: int, u: np.ndarray | None, h: np.ndarray, kind: int) -> None:
        vals = K.ref_gather_mul(a, idx, count, n, u, kind)
        h[: vals.size] = vals

    def gather_add(self, y: np.ndarray, b: np.ndarray, idx: np.ndarray, count: np.ndarray, n: int) -> None:
        K.ref_gather_add(y, b, idx, count, n)
