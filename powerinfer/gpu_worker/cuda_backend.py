"""The CUDA backend: our kernels compiled at run time with pycuda, on one stream.

Runs in: the GPU worker process (or the coordinator, for the in-process GPU worker). pycuda is
imported only when this backend is built (the optional ``gpu`` extra), never at module import.

* Kernels: every source in :data:`powerinfer.gpu_worker.kernels.SOURCES` becomes a
  ``SourceModule`` (nvcc at first use, then pycuda's on-disk cache) for the current device's
  architecture; launches are *prepared* calls with the argument types of :data:`SIGNATURES`.
* Memory: plain ``cuMemAlloc`` allocations (no managed memory), each accounted in the ledger
  before it is made; a budget larger than the card's free memory, or a driver out-of-memory, is a
  :class:`GpuMemoryError` that says to lower ``--vram-budget`` / ``-ngl``.
* Copies: host-to-device through a pinned staging ring, device-to-host into pinned buffers, both
  asynchronous on the worker's stream; a read's ``result()`` waits on an event recorded after
  its copy, so the host (the CPU shards, in-process) works while the GPU computes.
* GEMV: two kernels per weight type (quant_ops.cuh): ``gemv_<t>`` decodes whole blocks per lane,
  ``gemv_lanes_<t>`` (the first kernel, 4-16% of an H200's bandwidth) a weight per lane. In mode
  "auto" (the default; ``POWERINFER_GPU_GEMV`` or the ``gemv`` argument choose "blocks" or
  "lanes") the first GEMV of each type runs both on its real inputs and keeps the block kernel only
  if the two agree (GEMV_AGREE), else warns and keeps the lane kernel: the block kernel was checked
  on the host CPU (tests/gpu_worker/gemv_host.cu), and a GPU check per card is cheap insurance.
  Calls too large for the scratch, or whose output is all zero, run the lane kernel and leave the
  choice to a later call. What this cannot catch is a kernel that faults: that ends the CUDA
  context (the worker dies and the request fails), which is why the host harness also runs the
  kernels under an alignment check.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np
from numpy.typing import DTypeLike

from powerinfer.gpu_worker import kernels as K
from powerinfer.gpu_worker.backend import MemoryLedger, disagreement
from powerinfer.errors import InvalidArgumentError
from powerinfer.gpu_worker.errors import ADVICE, GpuMemoryError, GpuUnavailableError, gib, over_card

log = logging.getLogger(__name__)

STAGING_BYTES = 64 << 20  # pinned host ring for host-to-device copies (a call's inputs are a few MB)
ALIGN = 256
GEMV_MODES = ("auto", "blocks", "lanes")
GEMV_ENV = "POWERINFER_GPU_GEMV"
GEMV_AGREE = 1e-4  # "auto": max |blocks - lanes| over max |lanes| within which the block kernel is kept
GEMV_CHECK_FLOATS = 1 << 20  # "auto" compares on calls whose output fits this scratch (decode calls; prefill waits)
GEMV_CHECK_TRIES = 32  # calls with an all-zero output (nothing to compare) before a type settles on the lane kernel


# pycuda prepared-call argument types (struct codes: P pointer, q int64, i int32, f float32),
# in the order of each kernel's parameters in its .cu file (tests/gpu_worker checks they agree).
SIGNATURES: dict[str, str] = {
    **{f"{kind}_{s}": "PqPPiPiiPi" for s in K.SUFFIX.values() for kind in ("gemv", "gemv_lanes")},
    **{f"axpy_{s}": "PqPPiPiiiPi" for s in K.SUFFIX.values()},
    "rms_norm": "PiiiiPf",
    "rope": "PiPiiiiP",
    "kv_store": "PiiiPPiiiiPPi",
    "attend": "PiPPiiiiiPPiifP",
    "bias_act": "PiPiii",
    "act_mul": "PPPiiiffPP",
    "act_inplace": "Piif",
    "compact": "PifiPP",
    "gather_mul": "PPPiPPi",
    "gather_add": "PPPPi",
    "rms_norm_rows": "PiPiiiPf",
    "add_rows": "PiPiii",
}


class DeviceBuffer:
    """A typed 1-D span of device memory; views share the allocation they came from."""

    __slots__ = ("ptr", "size", "dtype", "alloc")

    def __init__(self, ptr: int, size: int, dtype: np.dtype[Any], alloc: Any) -> None:
        self.ptr, self.size, self.dtype, self.alloc = ptr, size, dtype, alloc

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize


def _p(buf: DeviceBuffer | None) -> int:
    return 0 if buf is None else buf.ptr


def _blocks(n: int, per: int = K.BLOCK) -> int:
    return max(1, -(-n // per))


class _CudaPending:
    def __init__(self, backend: "CudaBackend", host: np.ndarray, n: int, event: Any) -> None:
        self.backend, self.host, self.n, self.event = backend, host, n, event

    def result(self) -> np.ndarray:
        self.event.synchronize()
        out = np.array(self.host[: self.n])
        self.backend._release(self.host)
        return out


class CudaBackend:
    name = "cuda"

    def __init__(self, budget: int, device: int = 0, gemv: str | None = None) -> None:
        self.use_gemv(gemv or os.environ.get(GEMV_ENV) or "auto")
        try:
            import pycuda.driver as cuda  # type: ignore[import-not-found]
        except ImportError:
            raise GpuUnavailableError("the CUDA backend needs pycuda: pip install 'powerinfer[gpu]' on a CUDA machine") from None
        self.cuda = cuda
        try:
            cuda.init()
            self.device = cuda.Device(device)
            self.ctx = self.device.make_context()
        except cuda.Error as e:
            raise GpuUnavailableError(f"CUDA initialisation failed: {e}") from None
        try:
            free, _total = cuda.mem_get_info()
            if budget > free:
                raise over_card(budget, free, self.device.name())
            self.ledger = MemoryLedger(budget)
            self.stream = cuda.Stream()
            self.funcs = self._compile()
            self.staging = cuda.pagelocked_empty(STAGING_BYTES, np.uint8)
            self._stage = 0
            self._pinned: dict[tuple[int, str], list[np.ndarray]] = {}
            self._allocs: list[Any] = []
        except BaseException:
            self.ctx.pop()
            self.ctx.detach()
            raise

    def _compile(self) -> dict[str, Any]:
        from pycuda.compiler import SourceModule  # type: ignore[import-not-found]

        funcs = {}
        for src in K.SOURCES:
            # no --use_fast_math: expf/tanhf/rsqrtf as in the numpy oracles the check compares with
            mod = SourceModule((K.KERNEL_DIR / src.file).read_text(), options=["-O3", "-std=c++17"],
                               include_dirs=[str(K.KERNEL_DIR)], no_extern_c=True)
            for name in src.functions:
                fn = mod.get_function(name)
                fn.prepare(SIGNATURES[name])
                funcs[name] = fn
        log.info("compiled %d CUDA kernels for %s", len(funcs), self.device.name())
        return funcs

    def _launch(self, name: str, grid: tuple[int, ...], block: int, *args: Any) -> None:
        g = grid if len(grid) == 2 else (grid[0], 1)
        self.funcs[name].prepared_async_call(g, (block, 1, 1), self.stream, *args)

    # -- memory ------------------------------------------------------------------------------------

    def alloc(self, n: int, dtype: DTypeLike, what: str) -> DeviceBuffer:
        dt = np.dtype(dtype)
        nbytes = n * dt.itemsize
        self.ledger.take(nbytes, what)
        try:
            a = self.cuda.mem_alloc(max(nbytes, 1))
        except self.cuda.MemoryError:
            self.ledger.give(nbytes)
            raise GpuMemoryError(f"the GPU ran out of memory allocating {what} ({gib(nbytes)}) with {gib(self.ledger.used)} "
                                 f"of the budget in use; {ADVICE}") from None
        self._allocs.append(a)
        self.cuda.memset_d8(a, 0, max(nbytes, 1))
        return DeviceBuffer(int(a), n, dt, a)

    def upload(self, arr: np.ndarray, what: str) -> DeviceBuffer:
        flat = np.ascontiguousarray(arr).reshape(-1)
        buf = self.alloc(flat.size, flat.dtype, what)
        if flat.size:
            self.cuda.memcpy_htod(buf.ptr, flat)
        return buf

    def view(self, buf: DeviceBuffer, offset: int, n: int) -> DeviceBuffer:
        if offset < 0 or offset + n > buf.size:
            raise ValueError(f"view [{offset}, {offset + n}) outside a buffer of {buf.size}")
        return DeviceBuffer(buf.ptr + offset * buf.dtype.itemsize, n, buf.dtype, buf.alloc)

    def write(self, buf: DeviceBuffer, arr: np.ndarray) -> None:
        src = np.ascontiguousarray(arr, dtype=buf.dtype).reshape(-1).view(np.uint8)
        nb = src.size
        if nb > self.staging.size:
            raise ValueError(f"a {nb}-byte copy exceeds the {self.staging.size}-byte staging ring")
        if self._stage + nb > self.staging.size:
            self.stream.synchronize()  # every earlier copy out of the ring is done: reuse it
            self._stage = 0
        part = self.staging[self._stage : self._stage + nb]
        part[:] = src
        self.cuda.memcpy_htod_async(buf.ptr, part, self.stream)
        self._stage = -(-(self._stage + nb) // ALIGN) * ALIGN

    def zero(self, buf: DeviceBuffer) -> None:
        self.cuda.memset_d8_async(buf.ptr, 0, buf.nbytes, self.stream)

    def _pinned_out(self, n: int, dtype: np.dtype[Any]) -> np.ndarray:
        pool = self._pinned.setdefault((n, dtype.str), [])
        return pool.pop() if pool else self.cuda.pagelocked_empty(n, dtype)

    def _release(self, host: np.ndarray) -> None:
        self._pinned.setdefault((host.size, host.dtype.str), []).append(host)

    def read(self, buf: DeviceBuffer, n: int) -> _CudaPending:
        host = self._pinned_out(buf.size, buf.dtype)
        self.cuda.memcpy_dtoh_async(host[:n], buf.ptr, self.stream)
        ev = self.cuda.Event()
        ev.record(self.stream)
        return _CudaPending(self, host, n, ev)

    def synchronize(self) -> None:
        self.stream.synchronize()
        self._stage = 0

    def close(self) -> None:
        if getattr(self, "ctx", None) is None:
            return
        self.stream.synchronize()
        for a in self._allocs:
            a.free()
        self._allocs.clear()
        # pinned host buffers belong to this context too: free them before it goes
        for pool in self._pinned.values():
            for host in pool:
                host.base.free()
        self._pinned.clear()
        self.staging.base.free()
        self.ledger.used = 0
        self.ctx.pop()
        self.ctx.detach()
        self.ctx = None

    # -- kernels -----------------------------------------------------------------------------------

    def use_gemv(self, mode: str) -> None:
        """Which GEMV kernels to launch from now on: "auto", "blocks" or "lanes" (module docstring)."""
        if mode not in GEMV_MODES:
            raise InvalidArgumentError(f"GEMV kernels must be one of {', '.join(GEMV_MODES)} (${GEMV_ENV}), got {mode!r}")
        self.gemv_mode = mode
        self._gemv_kernel: dict[str, str] = {}  # suffix -> the kernel chosen for it
        self._gemv_tries: dict[str, int] = {}  # suffix -> uninformative comparisons so far

    def gemv(self, suffix: str, w: DeviceBuffer, row_bytes: int, rows: DeviceBuffer | None, n_dev: DeviceBuffer | None, n: int,
             x: DeviceBuffer, k: int, t: int, y: DeviceBuffer, ldy: int) -> None:
        # one warp per output row: 32 * n threads
        args = (w.ptr, row_bytes, _p(rows), _p(n_dev), n, x.ptr, k, t)
        name = self._gemv_kernel.get(suffix) or self._choose_gemv(suffix, args, n, t * ldy, ldy)
        self._launch(name, (_blocks(32 * n),), K.BLOCK, *args, y.ptr, ldy)

    def _choose_gemv(self, suffix: str, args: tuple[int, ...], n: int, size: int, ldy: int) -> str:
        blocks, lanes = f"gemv_{suffix}", f"gemv_lanes_{suffix}"
        if self.gemv_mode != "auto":
            self._gemv_kernel[suffix] = blocks if self.gemv_mode == "blocks" else lanes
            return self._gemv_kernel[suffix]
        if size > GEMV_CHECK_FLOATS:
            return lanes  # this call only: compare on a smaller one
        outs, floats = [], max(size, 1)
        for name in (blocks, lanes):  # both on this call's inputs, into zeroed scratch [size] (<= 4 MB: outside the ledger)
            try:
                buf = self.cuda.mem_alloc(floats * 4)
            except self.cuda.MemoryError:
                log.warning("no GPU memory to compare the GEMV kernels for %s; using the weight-per-lane kernel", suffix)
                self._gemv_kernel[suffix] = lanes
                return lanes
            try:
                self.cuda.memset_d32_async(buf, 0, floats, self.stream)
                self._launch(name, (_blocks(32 * n),), K.BLOCK, *args, int(buf), ldy)
                self.stream.synchronize()
                host = np.empty(floats, np.float32)
                self.cuda.memcpy_dtoh(host, buf)
                outs.append(host)
            finally:
                buf.free()
        if not np.any(outs[1]):  # nothing written or all zero (a device count of 0, x = 0): nothing learned
            tries = self._gemv_tries[suffix] = self._gemv_tries.get(suffix, 0) + 1
            if tries < GEMV_CHECK_TRIES:
                return lanes  # this call only
            log.info("GEMV %s: %d calls gave nothing to compare the kernels on; using the weight-per-lane kernel", suffix, tries)
            self._gemv_kernel[suffix] = lanes
            return lanes
        err = disagreement(outs[0], outs[1])
        if err <= GEMV_AGREE:
            log.info("GEMV %s: the block kernel agrees with the weight-per-lane kernel (%.1e); using it", suffix, err)
            self._gemv_kernel[suffix] = blocks
        else:
            log.warning("GEMV %s: the block kernel differs from the weight-per-lane kernel by %.2e of the output's scale; "
                        "using the weight-per-lane kernel (slower; please report this card)", suffix, err)
            self._gemv_kernel[suffix] = lanes
        return self._gemv_kernel[suffix]

    def axpy(self, suffix: str, w: DeviceBuffer, row_bytes: int, rows: DeviceBuffer | None, n_dev: DeviceBuffer | None, n: int,
             h: DeviceBuffer, ldh: int, k: int, t: int, y: DeviceBuffer) -> None:
        grid = (_blocks(k), _blocks(n, K.AXPY_CHUNK))  # columns x row chunks
        self._launch(f"axpy_{suffix}", grid, K.BLOCK, w.ptr, row_bytes, _p(rows), _p(n_dev), n, h.ptr, ldh, k, t, y.ptr, K.AXPY_CHUNK)

    def rms_norm(self, x: DeviceBuffer, ld: int, t: int, h: int, d: int, w: DeviceBuffer, eps: float) -> None:
        self._launch("rms_norm", (h, t), K.BLOCK, x.ptr, ld, t, h, d, w.ptr, np.float32(eps))

    def rope(self, x: DeviceBuffer, ld: int, pos: DeviceBuffer, t: int, h: int, d: int, rope_dim: int, inv_freq: DeviceBuffer) -> None:
        self._launch("rope", (_blocks(t * h * (rope_dim // 2)),), K.BLOCK, x.ptr, ld, pos.ptr, t, h, d, rope_dim, inv_freq.ptr)

    def kv_store(self, qkv: DeviceBuffer, ld: int, k_off: int, v_off: int, pos: DeviceBuffer, slots: DeviceBuffer, t: int,
                 hkv: int, d: int, dv: int, k_cache: DeviceBuffer, v_cache: DeviceBuffer, n_ctx: int) -> None:
        self._launch("kv_store", (hkv, t), K.BLOCK, qkv.ptr, ld, k_off, v_off, pos.ptr, slots.ptr, t, hkv, d, dv,
                     k_cache.ptr, v_cache.ptr, n_ctx)

    def attend(self, qkv: DeviceBuffer, ld: int, pos: DeviceBuffer, slots: DeviceBuffer, t: int, hq: int, hkv: int, d: int,
               dv: int, k_cache: DeviceBuffer, v_cache: DeviceBuffer, n_ctx: int, window: int, scale: float,
               out: DeviceBuffer) -> None:
        if max(d, dv) > K.MAX_HEAD_DIM:
            raise ValueError(f"head size {max(d, dv)} exceeds the attention kernel's {K.MAX_HEAD_DIM}")
        self._launch("attend", (hq, t), 128, qkv.ptr, ld, pos.ptr, slots.ptr, t, hq, hkv, d, dv, k_cache.ptr, v_cache.ptr,
                     n_ctx, window, np.float32(scale), out.ptr)

    def bias_act(self, y: DeviceBuffer, ld: int, b: DeviceBuffer, t: int, n: int, relu: int) -> None:
        self._launch("bias_act", (_blocks(t * n),), K.BLOCK, y.ptr, ld, b.ptr, t, n, relu)

    def rms_norm_rows(self, x: DeviceBuffer, ldx: int, y: DeviceBuffer, ldy: int, t: int, d: int, w: DeviceBuffer,
                      eps: float) -> None:
        self._launch("rms_norm_rows", (t,), 32, x.ptr, ldx, y.ptr, ldy, t, d, w.ptr, np.float32(eps))  # a warp per token

    def add_rows(self, y: DeviceBuffer, ldy: int, x: DeviceBuffer, ldx: int, t: int, n: int) -> None:
        self._launch("add_rows", (_blocks(t * n),), K.BLOCK, y.ptr, ldy, x.ptr, ldx, t, n)

    def act_mul(self, g: DeviceBuffer, u: DeviceBuffer | None, h: DeviceBuffer, t: int, n: int, kind: int, athr: float, thr: float,
                logits: DeviceBuffer | None, n_dev: DeviceBuffer | None = None) -> None:
        self._launch("act_mul", (_blocks(t * n),), K.BLOCK, g.ptr, _p(u), h.ptr, t, n, kind, np.float32(athr), np.float32(thr), _p(logits),
                     _p(n_dev))

    def act_inplace(self, g: DeviceBuffer, n: int, kind: int, athr: float) -> None:
        self._launch("act_inplace", (_blocks(n),), K.BLOCK, g.ptr, n, kind, np.float32(athr))

    def compact(self, v: DeviceBuffer, n: int, thr: float, use_abs: int, idx: DeviceBuffer, count: DeviceBuffer) -> None:
        self._launch("compact", (1,), 1024, v.ptr, n, np.float32(thr), use_abs, idx.ptr, count.ptr)

    def gather_mul(self, a: DeviceBuffer, idx: DeviceBuffer, count: DeviceBuffer, n: int, u: DeviceBuffer | None, h: DeviceBuffer,
                   kind: int) -> None:
        self._launch("gather_mul", (_blocks(n),), K.BLOCK, a.ptr, idx.ptr, count.ptr, n, _p(u), h.ptr, kind)

    def gather_add(self, y: DeviceBuffer, b: DeviceBuffer, idx: DeviceBuffer, count: DeviceBuffer, n: int) -> None:
        self._launch("gather_add", (_blocks(n),), K.BLOCK, y.ptr, b.ptr, idx.ptr, count.ptr, n)
