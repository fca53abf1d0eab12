"""powerinfer.memory: arrays committed only where written (the KV caches), weight copies in 2 MiB pages.

Runs in: the test process.
"""

from __future__ import annotations

import numpy as np

from powerinfer.memory import HUGE_PAGE, lazy_array, weight_array, weight_copy


def _rss_mib() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * 4096 / 2**20


def test_a_lazy_array_commits_only_the_pages_written() -> None:
    """120 caches of [4 slots, 3 heads, 8192 positions, 64] (SmolLM2's k and v at n_ctx 8192), 8
    positions written in each row: np.empty committed ~1.3 GiB here (a 2 MiB huge page per row
    under numpy's huge-page advice), the lazy arrays a few MiB."""
    base = _rss_mib()
    caches = [lazy_array((4, 3, 8192, 64)) for _ in range(120)]
    for c in caches:
        assert c.flags.writeable and c.dtype == np.float32 and c.shape == (4, 3, 8192, 64)
        c[:, :, :8] = 1.0
    assert _rss_mib() - base < 100
    assert float(caches[-1][3, 2, 7].sum()) == 64.0
    assert lazy_array((0, 5)).shape == (0, 5)


def _vma(addr: int) -> tuple[int, int, set[str]]:
    """(start, end, VmFlags) of this process's mapping holding addr."""
    start = end = -1
    with open("/proc/self/smaps") as fh:
        for line in fh:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                start, end = (int(x, 16) for x in head.split("-"))
            elif head == "VmFlags:" and start <= addr < end:
                return start, end, set(line.split()[1:])
    raise AssertionError(f"no mapping holds {addr:#x}")


def test_a_weight_array_starts_on_2mib_and_advises_its_whole_2mib_stretches_huge() -> None:
    n = 5 * HUGE_PAGE + 123
    a = weight_array(n)
    assert a.dtype == np.uint8 and a.shape == (n,) and a.flags.writeable and a.ctypes.data % HUGE_PAGE == 0
    a[:] = 7
    start, end, flags = _vma(a.ctypes.data)
    assert "hg" in flags and start == a.ctypes.data and end == a.ctypes.data + 5 * HUGE_PAGE  # MADV_HUGEPAGE
    assert "hg" not in _vma(a.ctypes.data + n - 1)[2]  # the tail: 4 KiB pages, nothing committed past the data
    assert int(a[::4096].sum()) == 7 * len(a[::4096])
    small = weight_array(1000)
    assert small.shape == (1000,) and small.dtype == np.uint8


def test_a_weight_copy_keeps_shape_type_and_values() -> None:
    src = np.arange(3 * HUGE_PAGE // 4, dtype=np.float32).reshape(-1, 1024)[:, ::2]  # not C-contiguous
    out = weight_copy(src)
    assert out.shape == src.shape and out.dtype == src.dtype and out.flags.c_contiguous and np.array_equal(out, src)
    assert out.ctypes.data % HUGE_PAGE == 0


def test_small_weight_arrays_share_a_chunk_in_huge_pages() -> None:
    """Copies under 2 MiB are slices of one chunk advised huge, each on its own cache lines."""
    a, b = weight_array(1000), weight_array(300_000)
    assert a.shape == (1000,) and b.shape == (300_000,)
    assert a.ctypes.data % 64 == 0 and b.ctypes.data % 64 == 0
    assert b.ctypes.data - a.ctypes.data == 1024 or b.ctypes.data % HUGE_PAGE == 0  # right after a, or a new chunk's start
    for arr in (a, b):
        arr[:] = 3
        assert "hg" in _vma(arr.ctypes.data)[2]
    assert int(a.sum()) == 3000 and int(b[:10].sum()) == 30
