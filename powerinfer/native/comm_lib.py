"""The segment's comm code as a small library of its own (kernels/comm.c): for the GPU worker serving as a rank.

Runs in: the GPU worker process when it serves as a rank of the native pool (gpu_worker/rank.py).
The CPU workers and the coordinator use the same functions from the decoder library
(native/decoder_lib.py compiles decoder.c with this directory's headers), so both sides of a
hand-off run one implementation.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

from powerinfer.native.build import load_library

log = logging.getLogger(__name__)

COMM_KERNELS = Path(__file__).with_name("kernels")
COMM_HEADERS = (COMM_KERNELS / "comm.h", COMM_KERNELS / "handoff.h")
FLAGS = ("-O2", "-shared", "-fPIC", "-std=gnu11")


@functools.cache
def comm_lib() -> ctypes.CDLL:
    """The library, built once per machine (raises BuildError without a C compiler)."""
    lib = load_library(COMM_KERNELS / "comm.c", COMM_HEADERS, FLAGS, "comm")
    lib.pi_comm_hdr_bytes.restype = ctypes.c_int64
    declare_handoff(lib)
    return lib


def declare_handoff(lib: ctypes.CDLL) -> None:
    """The C signatures of handoff.h's entry points, in this library or the decoder (which includes it too)."""
    ptr, i32, i64, u32 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_uint32
    for name, args, res in (("pi_gpu_setup", [ptr, i64, i64], None), ("pi_gpu_control", [ptr], None), ("pi_gpu_attach", [ptr, i32], u32),
                            ("pi_gpu_next", [ptr, u32, ctypes.POINTER(u32), i32, i32], i32), ("pi_gpu_task", [ptr, ptr], None),
                            ("pi_gpu_answer", [ptr, u32, i32], None), ("pi_gpu_bench", [ptr, ptr, i32, i32, ptr], i32)):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
