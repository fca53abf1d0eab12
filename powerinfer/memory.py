"""Memory and the OS: giving memory back after loading (packing scratch, file pages we no longer
read), arrays whose pages are committed only where written (KV caches), and weight copies in
2 MiB pages (the native decoder's repacked and neuron-major matrices).

Runs in: the coordinator and every worker process (after loading; when caches are made).
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import threading

import numpy as np

log = logging.getLogger(__name__)


def release_freed_memory() -> None:
    """Hand the heap left over from decoding and packing weights back to the OS (glibc keeps it).

    Measured on SmolLM2 in-process: RSS after load drops from ~600 MB to ~460 MB.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (macOS, musl): nothing to trim
        return
    libc.malloc_trim(0)


def lazy_array(shape: tuple[int, ...], dtype: type[np.generic] = np.float32) -> np.ndarray:
    """An uninitialised array whose pages are committed only as they are written, 4 KiB at a time.

    np.empty does that too, but numpy (>= 1.22 on Linux) advises huge pages for large arrays; with
    transparent huge pages in "madvise" mode the first write then commits 2 MiB. A KV cache
    [slots, Hkv, n_ctx, D] at n_ctx 8192 has 2 MiB per (slot, head) row, so one short request
    in each of 4 slots committed ~1.4 GiB on SmolLM2 instead of a few MiB. Here the memory is
    an anonymous mapping advised MADV_NOHUGEPAGE.
    """
    nbytes = max(1, math.prod(shape) * np.dtype(dtype).itemsize)
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_NOHUGEPAGE", None)  # Linux only
    if advice is not None:
        try:
            mm.madvise(advice)
        except OSError:  # a kernel without transparent huge pages: nothing to turn off
            pass
    return np.frombuffer(mm, dtype=dtype, count=math.prod(shape)).reshape(shape)  # the array keeps mm alive


HUGE_PAGE = 2 << 20  # x86-64's transparent huge page


def weight_array(nbytes: int) -> np.ndarray:
    """An uninitialised uint8 array [nbytes] for a weight copy the decoder reads every step, its
    whole 2 MiB stretches in transparent huge pages.

    Why: a sparse decode step reads ~1 KiB rows scattered over hundreds of MiB, each on a page of
    its own, and a TLB miss inside a VM walks two page tables. np.empty advises huge pages too, but
    its memory starts wherever malloc's mapping does, and the copies the decoder made that way were
    about half in huge pages (measured through /proc/self/pagemap on the 1.1B ReGLU file); here the
    array starts on a 2 MiB boundary of its own anonymous mapping and every whole 2 MiB of it is
    advised MADV_HUGEPAGE. The tail past the last whole 2 MiB is left to 4 KiB pages, and the slack
    before the boundary is never touched, so nothing is committed that np.empty would not commit.
    Below 2 MiB it is a slice of a shared chunk in huge pages (_SmallWeights: the hot neurons' and
    the predictors' copies, ~0.1-1 MiB a layer), whose last touched 2 MiB is committed whole (the
    1.1B sparse engine's RSS: 1138 -> 1142 MiB). Where the OS has no such advice it is np.empty.
    Measured in process on the 1.1B ReGLU file (alternating rounds, both load orders): sparse
    decode 1.05x and 1.08x, dense 1.09x and 1.13x; the small arrays' chunks 1.01-1.04x more.
    """
    if getattr(mmap, "MADV_HUGEPAGE", None) is None:  # not Linux
        return np.empty(nbytes, dtype=np.uint8)
    if nbytes < HUGE_PAGE:  # a slice of the shared pool's chunk
        return _small.take(nbytes)
    return _huge_mapping(nbytes)


def _huge_mapping(nbytes: int) -> np.ndarray:
    """uint8 [nbytes] at a 2 MiB boundary of its own mapping, its whole 2 MiB stretches advised huge."""
    mm = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = np.frombuffer(mm, dtype=np.uint8)  # keeps mm alive, as every view of it does
    off = -whole.ctypes.data % HUGE_PAGE
    try:
        mm.madvise(mmap.MADV_HUGEPAGE, off, nbytes // HUGE_PAGE * HUGE_PAGE)
    except OSError:  # a kernel without transparent huge pages: 4 KiB pages, as np.empty's
        pass
    return whole[off:off + nbytes]


class _SmallWeights:
    """Weight copies under 2 MiB, side by side in chunks of CHUNK bytes (each a _huge_mapping), so
    that they too sit in huge pages. A chunk lives while any array in it does (the arrays are its
    views) and while it is the one being filled."""

    CHUNK = 16 * HUGE_PAGE

    def __init__(self) -> None:
        self._lock = threading.Lock()  # engines may load in threads (the server's model host)
        self._chunk: np.ndarray | None = None
        self._used = 0

    def take(self, nbytes: int) -> np.ndarray:
        step = -(-max(nbytes, 1) // 64) * 64  # each array on its own cache lines
        with self._lock:
            if self._chunk is None or self._used + step > self._chunk.size:
                self._chunk, self._used = _huge_mapping(self.CHUNK), 0
            out = self._chunk[self._used:self._used + nbytes]
            self._used += step
        return out


_small = _SmallWeights()


def weight_copy(a: np.ndarray) -> np.ndarray:
    """a's values in a weight_array (the same shape and dtype, C order)."""
    out = weight_array(a.nbytes).view(a.dtype).reshape(a.shape)
    out[...] = a
    return out
