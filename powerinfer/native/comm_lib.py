"""The segment's comm code as a small library of its own (kernels/comm.c): for the GPU worker serving as a rank.

Runs in: the GPU worker process when it serves as a rank of the native pool (gpu_worker/rank.py).
The CPU workers and the coordinator use the same functions from the decoder library
(cpu_workers/native_lib.py compiles decoder.c with this directory's headers), so both sides of a
hand-off run one implementation.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

from powerinfer.native.cbuild import load_library

log = logging.getLogger(__name__)

COMM_KERNELS = Path(__file__).with_name("kernels")
COMM_HEADERS = (COMM_KERNELS / "comm.h", COMM_KERNELS / "handoff.h")
FLAGS = ("-O2", "-shared", "-fPIC", "-std=gnu11")


@functools.cache
def comm_lib() -> ctypes.CDLL:
    """The library, built once per machine (raises BuildError without a C compiler)."""
    lib = load_library(COMM_KERNELS / "comm.c", COMM_HEADERS, FLAGS, "comm")
    ptr, i32, i64, u32 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_uint32
    lib.pi_comm_hdr_bytes.restype = i64
    lib.pi_gpu_attach.argtypes = [ptr, i32]
    lib.pi_gpu_attach.restype = u32
    lib.pi_gpu_next.argtypes = [ptr, u32, ctypes.POINTER(u32), i32, i32]
    lib.pi_gpu_next.restype = i32
    lib.pi_gpu_task.argtypes = [ptr, ptr]
    lib.pi_gpu_task.restype = None
    lib.pi_gpu_answer.argtypes = [ptr, u32, i32]
    lib.pi_gpu_answer.restype = None
    return lib
