"""The native decoder's library: build kernels/decoder.c per instruction set, load it with ctypes,
declare its entry points and the C structs they take (mirrors of kernels/model.h and native/kernels/comm.h).

Runs in: every process that computes with the native decoder (the in-process executor's
coordinator, the native pool's CPU workers) and the coordinator of that pool (refinement, the
shared-memory segment). numpy and ctypes only: no torch.

The library is built once per machine for the best instruction set the CPU has (AVX-512 VNNI,
AVX2, or portable C), or the one ``POWERINFER_ISA`` names (``vnni``, ``avx2``, ``scalar``: tests
run every path this machine can). ``POWERINFER_NATIVE=0`` or no C compiler: :func:`decoder_lib`
is None and callers fall back to their torch paths.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import time
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType

from powerinfer.native.build import load_library
from powerinfer.native.comm_lib import COMM_KERNELS, declare_handoff
from powerinfer.errors import InvalidArgumentError
from powerinfer.memory import weight_array
from powerinfer.quants.registry import REGISTRY

log = logging.getLogger(__name__)

KERNELS = Path(__file__).with_name("kernels")
SOURCE = KERNELS / "decoder.c"
# every header of the folder goes into the build's cache key: a list by hand missed qsplit.h (an edit
# to it kept the old library), and the comm headers (the segment's merge and hand-off) live there too
HEADERS = tuple(sorted(KERNELS.glob("*.h")))
BASE_FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=gnu11", f"-I{COMM_KERNELS}")
ISA_FLAGS = {
    "vnni": ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512vnni", "-DPI_AVX2", "-DPI_VNNI"),
    "avx2": ("-mavx2", "-mfma", "-mf16c", "-DPI_AVX2"),
    "scalar": (),
}
ISA_CPU_FLAGS = {"vnni": {"avx2", "fma", "f16c", "avx512f", "avx512vl", "avx512bw", "avx512_vnni"}, "avx2": {"avx2", "fma", "f16c"}, "scalar": set()}
ISA_IDS = {"scalar": 0, "avx2": 1, "vnni": 2}
# GGML types the dot products cover (qdot.h's registry), with the row length their blocks need.
TYPES = {q: t.native_align for q, t in REGISTRY.items() if t.native_align is not None}


class PiWt(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("x8", ctypes.c_void_p), ("row_bytes", ctypes.c_int64), ("type", ctypes.c_int32), ("rows", ctypes.c_int32),
                ("cols", ctypes.c_int32)]


class PiLayer(ctypes.Structure):
    _fields_ = [  # type: ignore[assignment]  # comprehensions: mypy cannot see ctypes types in the concatenated list
        (n, PiWt) for n in ("wq", "wk", "wv", "wo", "wg", "wu", "wd")] + [
        (n, ctypes.c_void_p) for n in ("attn_norm", "ffn_norm", "post_attn_norm", "post_ffn_norm", "q_norm", "k_norm", "bq", "bk", "bv",
                                       "k_cache", "v_cache", "rope_cos", "rope_sin")
    ] + [("window", ctypes.c_int32), ("pad", ctypes.c_int32), ("sp", ctypes.c_void_p), ("pred", ctypes.c_void_p),
         ("cold", ctypes.c_void_p), ("cold_blocks", ctypes.c_void_p), ("gpu_part", ctypes.c_int32), ("down_col0", ctypes.c_int32)] + [
        (n, ctypes.c_void_p) for n in ("attn_norm_b", "ffn_norm_b", "bo", "bd", "bg")]


class PiSparse(ctypes.Structure):
    """model.h's pi_sparse: a layer's sparse rule (sparse_rows.h's PI_SP_* mode, threshold, neuron-major Q8_0 down)."""

    _fields_ = [("mode", ctypes.c_int32), ("thr", ctypes.c_float), ("down_t", PiWt), ("up_split", ctypes.c_void_p),
                ("gate_split", ctypes.c_void_p), ("dense_from", ctypes.c_int32), ("hot", ctypes.c_void_p), ("dperm", ctypes.c_void_p),
                ("is_hot", ctypes.c_void_p), ("n_hot", ctypes.c_int32), ("computed", ctypes.c_void_p), ("hot_up", PiWt), ("hot_gate", PiWt),
                ("split_stride", ctypes.c_int64), ("quality", ctypes.c_void_p), ("pred_s", ctypes.c_void_p)]


class PiPred(ctypes.Structure):
    """model.h's pi_pred: a layer's neuron predictor (8-bit fc1 [r, d], fc2 [n_ff, r], float biases;
    residual 1: fc1 reads the residual stream before the FFN norm, 0: the normed input; linear 1: no
    relu, a low-rank predictor folded; sg: fc2 in pred_sign.py's layout, sg_k columns, or NULL)."""

    _fields_ = [("fc1", PiWt), ("fc2", PiWt), ("b1", ctypes.c_void_p), ("b2", ctypes.c_void_p), ("residual", ctypes.c_int32),
                ("linear", ctypes.c_int32), ("sg", ctypes.c_void_p), ("sg_k", ctypes.c_int32)]


class PiModel(ctypes.Structure):
    _fields_ = [  # type: ignore[assignment]  # as PiLayer's
        (n, ctypes.c_int32) for n in ("n_layers", "d", "n_ff", "n_head", "n_kv", "D", "Dv", "rope_dim", "neox", "act", "n_ctx",
                                               "n_slots", "n_threads", "max_t")] + [
        ("eps", ctypes.c_float), ("attn_scale", ctypes.c_float), ("act_thr", ctypes.c_float), ("out_norm", ctypes.c_void_p), ("head", PiWt),
        ("layers", ctypes.POINTER(PiLayer)), ("profile", ctypes.c_void_p),
        *[(n, ctypes.c_int32) for n in ("q0", "kv0", "grp", "n_head_all", "n_ff_all", "n0", "d0", "sparse")], ("comm", ctypes.c_void_p),
        ("ffn_active", ctypes.c_void_p), ("on_gpu", ctypes.c_void_p), ("out_norm_b", ctypes.c_void_p), ("pos_embd", ctypes.c_void_p),
        *[(n, ctypes.c_int32) for n in ("layernorm", "gateless", "pos_rows", "pos_offset", "first", "stop")], ("stream_in", ctypes.c_void_p)]


class PiComm(ctypes.Structure):
    """comm.h's pi_comm: one rank's private handle on the pool's shared segment."""

    _fields_ = [("hdr", ctypes.c_void_p), ("bufs", ctypes.c_void_p), ("rank", ctypes.c_int32), ("spin_us", ctypes.c_int32),
                ("slice_ms", ctypes.c_int32), ("deadline_ms", ctypes.c_int32), ("gen", ctypes.c_uint32), ("err", ctypes.c_int32),
                ("n_syncs", ctypes.c_uint64), ("wait_ns", ctypes.c_uint64), ("handoffs", ctypes.c_uint32), ("pad", ctypes.c_uint32),
                ("gpu_ns", ctypes.c_uint64), ("lat", ctypes.c_void_p)]


STEP_STREAM = 4  # step.h's PI_STEP_STREAM: a step's mode flag, the residual stream comes in through the segment (a pipeline stage)


class PiRankCtx(ctypes.Structure):
    """step.h's pi_rank_ctx: what a serving rank's steps need besides the doorbell's inputs."""

    _fields_ = [  # type: ignore[assignment]  # as PiLayer's
        (n, ctypes.c_void_p) for n in ("m", "embd", "x", "logits", "hidden", "scratch")] + [
        ("ld", ctypes.c_int64), ("logit_rows", ctypes.c_int64), ("embed_scale", ctypes.c_float), ("pad", ctypes.c_int32),
        ("last_gen", ctypes.c_uint32), ("last_control", ctypes.c_uint32)]


COMM_ERRORS = {10: "aborted by the coordinator (a rank died)", 11: "a peer rank died", 12: "a peer rank did not arrive in time",
               13: "more floats than the segment holds", 14: "the GPU worker failed its part of the step (its log says why)",
               15: "the segment has no GPU rank for this model's GPU layers"}


# decoder.c's profile phases, in its order (pi_phases() of them)
PHASES = ("norm", "qkv", "rope+cache", "attention", "out_proj", "ffn_norm", "gate+up", "act", "down")


X8_BYTES = {q: t.x8_group_bytes for q, t in REGISTRY.items() if t.x8_group_bytes is not None}  # qx8.h's PI_X8_BYTES: one block of eight rows


def repack_x8(lib: ctypes.CDLL, w: PiWt) -> np.ndarray | None:
    """Rows [0, rows // 8 * 8) of w repacked eight at a time (qx8.h) when this build computes them
    so; w then points at the copy (the caller keeps it alive). None: w stays as it is."""
    qt = GGMLQuantizationType(w.type)
    if qt not in X8_BYTES or w.rows < 8 or not lib.pi_x8_supported(int(qt)):
        return None
    groups = w.rows // 8
    buf = weight_array(groups * (w.cols // 32) * X8_BYTES[qt])  # read every step: in 2 MiB pages (memory.py)
    lib.pi_x8_repack(w.data, w.row_bytes, int(qt), w.cols, 0, groups, buf.ctypes.data)
    w.x8 = buf.ctypes.data
    return buf


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def best_isa(flags: set[str] | None = None) -> str:
    flags = cpu_flags() if flags is None else flags
    return next(isa for isa in ("vnni", "avx2", "scalar") if ISA_CPU_FLAGS[isa] <= flags)


def requested_isa() -> str:
    want = os.environ.get("POWERINFER_ISA", "auto").lower()
    if want == "auto":
        return best_isa()
    if want not in ISA_FLAGS:
        raise InvalidArgumentError(f"POWERINFER_ISA must be auto, {', '.join(ISA_FLAGS)}; got {want!r}")
    if not ISA_CPU_FLAGS[want] <= cpu_flags():
        raise InvalidArgumentError(f"POWERINFER_ISA={want}: this CPU lacks {sorted(ISA_CPU_FLAGS[want] - cpu_flags())}")
    return want


@functools.cache
def _load(isa: str) -> ctypes.CDLL | None:
    try:
        lib = load_library(SOURCE, HEADERS, (*BASE_FLAGS, *ISA_FLAGS[isa]), f"decoder-{isa}")
    except OSError as e:
        log.warning("native decoder unavailable (%s): the in-process executor uses its torch path", e)
        return None
    for fn in (lib.pi_model_size, lib.pi_layer_size, lib.pi_sparse_size, lib.pi_pred_size):
        fn.restype = ctypes.c_int
    if (lib.pi_model_size(), lib.pi_layer_size(), lib.pi_sparse_size(), lib.pi_pred_size()) != (
            ctypes.sizeof(PiModel), ctypes.sizeof(PiLayer), ctypes.sizeof(PiSparse), ctypes.sizeof(PiPred)):
        log.warning("native decoder struct layout differs from native/decoder_lib.py: not used")
        return None
    ptr = ctypes.c_void_p
    lib.pi_scratch_bytes.argtypes = [ctypes.POINTER(PiModel), ctypes.c_int]
    lib.pi_scratch_bytes.restype = ctypes.c_int64
    lib.pi_forward_range.argtypes = [ctypes.POINTER(PiModel), ptr, ptr, ptr, ctypes.c_int, ptr, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    lib.pi_forward_range.restype = ctypes.c_int
    lib.pi_matmul.argtypes = [ctypes.POINTER(PiModel), ctypes.POINTER(PiWt), ptr, ctypes.c_int, ptr, ptr]
    lib.pi_matmul.restype = ctypes.c_int
    lib.pi_isa.restype = ctypes.c_int
    lib.pi_phases.restype = ctypes.c_int
    if lib.pi_phases() != len(PHASES):
        log.warning("native decoder phases differ from native/decoder_lib.py: not used")
        return None
    lib.pi_rows.argtypes = [ctypes.POINTER(PiWt), ptr, ctypes.c_int, ptr]
    lib.pi_rows.restype = ctypes.c_int
    lib.pi_refine.argtypes = [ctypes.POINTER(PiWt), ptr, ctypes.c_int, ptr, ctypes.c_int, ptr, ctypes.c_int64, ptr]
    lib.pi_refine.restype = ctypes.c_int
    lib.pi_decode_logits.argtypes = [ctypes.POINTER(PiModel), ptr, ctypes.c_int, ptr, ctypes.c_float, ctypes.c_int, ptr, ptr, ptr]
    lib.pi_decode_logits.restype = ctypes.c_int
    lib.pi_step.argtypes = [ctypes.POINTER(PiModel), ctypes.POINTER(PiWt), ctypes.c_float, ptr, ptr, ptr, ctypes.c_int, ctypes.c_int, ptr, ptr,
                            ctypes.c_float, ctypes.c_int, ptr, ptr, ptr]
    lib.pi_step.restype = ctypes.c_int
    lib.pi_qtype_facts.argtypes = [ctypes.c_int, ptr]
    lib.pi_qtype_facts.restype = ctypes.c_int
    lib.pi_x8_supported.argtypes = [ctypes.c_int]
    lib.pi_x8_supported.restype = ctypes.c_int
    lib.pi_x8_repack.argtypes = [ptr, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ptr]
    lib.pi_x8_repack.restype = None
    lib.pi_split_supported.argtypes = [ctypes.c_int]
    lib.pi_split_supported.restype = ctypes.c_int
    lib.pi_split_repack.argtypes = [ptr, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int, ptr]
    lib.pi_split_repack.restype = ctypes.c_int
    lib.pi_read_sum.argtypes = [ptr, ctypes.c_int64, ctypes.c_int]
    lib.pi_read_sum.restype = ctypes.c_double
    i64, i32 = ctypes.c_int64, ctypes.c_int
    lib.pi_rank_step.argtypes = [ctypes.POINTER(PiModel), ctypes.POINTER(PiWt), ctypes.c_float, ptr, ptr, ptr, i32, i32, ptr, ptr, i64, ptr, ptr]
    lib.pi_rank_step.restype = i32
    lib.pi_refine_best.argtypes = [ctypes.POINTER(PiWt), ptr, i32, ptr, ctypes.c_float, i32, ptr, ptr]
    lib.pi_refine_best.restype = i32
    lib.pi_comm_hdr_bytes.restype = i64
    lib.pi_comm_banks_off.argtypes = [i64]
    lib.pi_comm_banks_off.restype = i64
    lib.pi_comm_rank_stride.argtypes = [i64]
    lib.pi_comm_rank_stride.restype = i64
    lib.pi_comm_size.restype = i32
    lib.pi_comm_format.argtypes = [ptr, i32, i64, i64]
    lib.pi_comm_format.restype = i32
    lib.pi_comm_attach.argtypes = [ptr, ptr, i32, i32, i32, i32, ptr]
    lib.pi_comm_attach.restype = i32
    lib.pi_comm_abort.argtypes = [ptr]
    lib.pi_comm_abort.restype = None
    lib.pi_comm_bench.argtypes = [ptr, i32, i32, i32, i32, ptr]
    lib.pi_comm_bench.restype = i32
    u32 = ctypes.c_uint32
    lib.pi_door_post.argtypes = [ptr, u32, i32, i32]
    lib.pi_door_post.restype = None
    lib.pi_door_control.argtypes = [ptr]
    lib.pi_door_control.restype = None
    lib.pi_door_wait.argtypes = [ptr, u32, i32, ptr]
    lib.pi_door_wait.restype = i32
    lib.pi_rank_serve.argtypes = [ctypes.POINTER(PiRankCtx), i32, i32]
    lib.pi_rank_serve.restype = i32
    lib.pi_rank_ctx_size.restype = i32
    declare_handoff(lib)  # the GPU rank's hand-off (handoff.h), as the GPU rank's own library declares it
    if lib.pi_comm_size() != ctypes.sizeof(PiComm) or lib.pi_rank_ctx_size() != ctypes.sizeof(PiRankCtx):
        log.warning("native decoder comm layout differs from native/decoder_lib.py: not used")
        return None
    return lib


def decoder_lib(isa: str | None = None) -> ctypes.CDLL | None:
    """The decoder built for isa (default: POWERINFER_ISA or the CPU's best), or None."""
    if os.environ.get("POWERINFER_NATIVE", "1") == "0":
        return None
    return _load(isa or requested_isa())


def read_bandwidth_gbs(lib: ctypes.CDLL, n_threads: int, n_bytes: int = 512 << 20, repeat: int = 5) -> float:
    """Streaming-read bandwidth with n_threads threads (best of repeat passes over n_bytes), GB/s."""
    buf = np.ones(n_bytes // 4, dtype=np.float32)  # written once here, so every page is resident
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        total = lib.pi_read_sum(buf.ctypes.data, buf.size, n_threads)
        best = min(best, time.perf_counter() - t)
    if abs(total - buf.size) > 1e-3 * buf.size:  # the sum proves every byte was read
        raise RuntimeError(f"read test summed {total}, expected {buf.size}")
    return n_bytes / best / 1e9


