"""powerinfer.memory: arrays committed only where written (the KV caches).

Runs in: the test process.
"""

from __future__ import annotations

import numpy as np

from powerinfer.memory import lazy_array


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
