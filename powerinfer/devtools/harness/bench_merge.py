"""`powerinfer bench --merge`: the shared-memory merge alone, and the GPU rank's hand-off, between real rank processes.

Runs in: the user's process (creates the segment, starts one process per rank, reads their
latency rings) and, with ``python -m powerinfer.devtools.harness.bench_merge``, each rank process (pins itself
to one CPU, attaches, runs ``pi_comm_bench``: back-to-back gathers of a [1, width] row whose
columns the ranks split, the shape of a decode step's merges). Reports median, p99 and mean
latency per sync over every rank's syncs; no work between syncs, so this is the merge's own cost.
The hand-off: the CPU ranks run ``pi_gpu_bench`` (a [1, width] stream handed to the GPU rank and
back, a one-column merge between runs) against a stand-in GPU rank process that answers each run
with no compute, through the GPU worker's own Python loop (``gpu_worker/rank.py``'s calls): what a
run of GPU layers costs beyond its compute.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import time
from dataclasses import dataclass, replace

import numpy as np

from powerinfer.native.decoder_lib import decoder_lib
from powerinfer.native.comm import RankComm, create_segment_with, merge_latencies_ns
from powerinfer.errors import PowerInferError
from powerinfer.native.segment import Segment, SegmentLayout


WARMUP = 200  # hand-off runs not counted: the stand-in GPU rank process may still be starting
TIMEOUT_S = 120  # a benchmark's processes all end well within this; past it they are killed


@dataclass(frozen=True)
class MergeBench:
    ranks: int
    width: int
    syncs: int
    median_us: float
    p99_us: float
    mean_us: float
    wall_s: float
    kind: str = "merge"  # or "handoff": syncs are runs handed to the GPU rank, latencies their round trips

    def report(self) -> str:
        if self.kind == "handoff":
            return (f"GPU rank hand-off (stream to the GPU rank and back, no compute), {self.ranks} CPU rank processes and a stand-in "
                    f"GPU rank process, a [1, {self.width}] f32 stream, {self.syncs} runs (the first {WARMUP} not counted):\n"
                    f"  round trip per run: median {self.median_us:.2f} us, p99 {self.p99_us:.2f} us, mean {self.mean_us:.2f} us "
                    f"({self.wall_s:.2f} s in all)")
        return (f"merge (shared-memory all-gather), {self.ranks} rank processes, a [1, {self.width}] f32 row per sync, "
                f"{self.syncs} syncs per rank back to back:\n"
                f"  latency per sync: median {self.median_us:.2f} us, p99 {self.p99_us:.2f} us, mean {self.mean_us:.2f} us "
                f"({self.wall_s:.2f} s in all)")


def bench_merge(ranks: int = 2, width: int = 576, syncs: int = 20000) -> MergeBench:
    """Start `ranks` processes that merge `syncs` times; their latencies from the segment's rings."""
    args = [str(ranks), str(width), str(syncs)]
    roles = [[str(r), "{seg}", *args] for r in range(ranks)]
    return _run(SegmentLayout(ranks, 1, width, 8, width, 0), roles, syncs, "merge")


def bench_handoff(ranks: int = 2, width: int = 576, runs: int = 5000) -> MergeBench:
    """`ranks` CPU rank processes hand a [1, width] stream to a stand-in GPU rank process `runs`
    times; the round trips as the CPU ranks saw them (MergeBench's fields: syncs = runs per rank)."""
    args = ["{seg}", str(ranks), str(width), str(runs)]
    roles = [["handoff", str(r), *args] for r in range(ranks)] + [["gpu", "-1", *args]]
    return _run(SegmentLayout(ranks, 1, width, 8, width, 0, gpu=True), roles, runs, "handoff")


def _run(shape: SegmentLayout, roles: list[list[str]], n: int, kind: str) -> MergeBench:
    """One process per role (its arguments; "{seg}" is the segment's path, and each gets a CPU of
    its own, in order, as its last argument) on a fresh segment of this shape; their latencies."""
    lib = decoder_lib()
    if lib is None:
        raise PowerInferError("--merge needs the native library (a C compiler, POWERINFER_NATIVE not 0)")
    layout = replace(shape, hdr_bytes=int(lib.pi_comm_hdr_bytes()))
    seg = create_segment_with(lib, layout)
    try:  # the segment's file goes whatever happens (Ctrl+C included)
        cpus = sorted(os.sched_getaffinity(0))
        procs = [subprocess.Popen([sys.executable, "-m", "powerinfer.devtools.harness.bench_merge", *(a.replace("{seg}", seg.path) for a in role),
                                   str(cpus[i % len(cpus)])]) for i, role in enumerate(roles)]
        t0 = time.perf_counter()
        codes = _wait_all(lib, seg, procs)
        wall = time.perf_counter() - t0
        lat = merge_latencies_ns(seg) / 1e3
    finally:
        seg.close()
    if any(codes):
        raise PowerInferError(f"a {kind} rank failed (exit codes {codes})")
    return MergeBench(layout.n_ranks, layout.width, n, float(np.median(lat)), float(np.percentile(lat, 99)), float(lat.mean()), wall, kind)


def _wait_all(lib: ctypes.CDLL, seg: Segment, procs: list[subprocess.Popen[bytes]]) -> list[int]:
    """The processes' exit codes. One that fails aborts the segment's waits (its peers then fail at
    once instead of at their deadline); past TIMEOUT_S every process left is killed."""
    deadline = time.monotonic() + TIMEOUT_S
    while any(p.poll() is None for p in procs):
        if any(p.returncode for p in procs) or time.monotonic() > deadline:
            lib.pi_comm_abort(seg.base)
            if time.monotonic() > deadline + 5:
                for p in procs:
                    p.kill()
        time.sleep(0.01)
    return [int(p.returncode) for p in procs]


def _handoff_main(role: str, rank: int, path: str, ranks: int, width: int, runs: int, cpu: int) -> int:
    """A CPU rank (role "handoff") or the stand-in GPU rank ("gpu") of bench_handoff."""
    try:
        os.sched_setaffinity(0, {cpu})
    except OSError:
        pass
    if role == "gpu":  # the GPU worker's loop (gpu_worker/rank.py) without the layers
        from powerinfer.native.comm_lib import comm_lib

        clib = comm_lib()
        seg = Segment(path, SegmentLayout(ranks, 1, width, 8, width, int(clib.pi_comm_hdr_bytes()), gpu=True), create=False)
        want, control = int(clib.pi_gpu_attach(seg.base, os.getpid())) + 1, ctypes.c_uint32(0)
        for _ in range(runs):
            idle = 0
            while (rc := clib.pi_gpu_next(seg.base, want, ctypes.byref(control), 0, 1000)) != 0:
                idle += 1
                if rc != 1 or idle > TIMEOUT_S:  # aborted, or the CPU ranks are gone
                    return 1
            seg.handoff[:1] += 1.0  # "the layers"
            clib.pi_gpu_answer(seg.base, want, 0)
            want += 1
        return 0
    lib = decoder_lib()
    assert lib is not None
    seg = Segment(path, SegmentLayout(ranks, 1, width, 8, width, int(lib.pi_comm_hdr_bytes()), gpu=True), create=False)
    comm = RankComm(lib, seg, rank)
    x = np.zeros(width, dtype=np.float32)
    lat = np.zeros(runs, dtype=np.uint32)
    rc = lib.pi_gpu_bench(ctypes.byref(comm.comm), x.ctypes.data, width, runs, lat.ctypes.data)
    kept = lat[min(WARMUP, runs - 1):]  # the first runs wait for the GPU process to start
    n = min(kept.size, seg.lat.shape[1])
    seg.lat[rank, :n] = kept[-n:]  # where the caller reads latencies
    return 0 if rc == 0 and np.all(x == runs) else 1


def _rank_main(rank: int, path: str, ranks: int, width: int, syncs: int, cpu: int) -> int:
    lib = decoder_lib()
    assert lib is not None
    try:
        os.sched_setaffinity(0, {cpu})
    except OSError:
        pass
    layout = SegmentLayout(ranks, 1, width, 8, width, int(lib.pi_comm_hdr_bytes()))
    seg = Segment(path, layout, create=False)
    comm = RankComm(lib, seg, rank)
    x = np.zeros(width, dtype=np.float32)
    c0, c1 = width * rank // ranks, width * (rank + 1) // ranks
    rc = lib.pi_comm_bench(ctypes.byref(comm.comm), width, c0, c1, syncs, x.ctypes.data)
    want = np.concatenate([np.full(width * (r + 1) // ranks - width * r // ranks, r + 1, np.float32) for r in range(ranks)])
    return 0 if rc == 0 and np.array_equal(x, want) else 1


if __name__ == "__main__":
    if sys.argv[1] in ("handoff", "gpu"):
        sys.exit(_handoff_main(sys.argv[1], int(sys.argv[2]), sys.argv[3], *(int(a) for a in sys.argv[4:8])))  # type: ignore[arg-type]
    sys.exit(_rank_main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])))
