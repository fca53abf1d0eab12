"""Giving memory back to the OS after loading (packing scratch, file pages we no longer read).

Runs in: the coordinator and every worker process, once after loading.
"""

from __future__ import annotations

import ctypes
import logging

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
