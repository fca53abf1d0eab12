"""The native libraries' build cache key: every header a C source includes, directly or through
another header, is hashed with it, so an edit to any of them rebuilds the library.

Runs in: the test process (reads the sources; builds nothing).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from powerinfer.native import comm_lib, decoder_lib, sparse_kernel


def _included(source: Path) -> set[Path]:
    """The project headers source includes, transitively (#include "x.h")."""
    seen: set[Path] = set()
    todo = [source]
    while todo:
        for name in re.findall(r'^\s*#include\s+"([^"]+)"', todo.pop().read_text(encoding="utf-8"), re.M):
            h = source.parent / name
            if h not in seen:
                seen.add(h)
                todo.append(h)
    return seen


@pytest.mark.parametrize("source, headers", [
    (decoder_lib.SOURCE, decoder_lib.HEADERS),
    (sparse_kernel.SOURCE, sparse_kernel.HEADERS),
    (comm_lib.COMM_KERNELS / "comm.c", comm_lib.COMM_HEADERS),
], ids=["decoder", "sparse_ffn", "comm"])
def test_every_included_header_is_in_the_cache_key(source: Path, headers: tuple[Path, ...]) -> None:
    missing = sorted(h.name for h in _included(source) - {Path(p) for p in headers})
    assert not missing, f"{source.name} includes {missing}, which its build's cache key leaves out"
