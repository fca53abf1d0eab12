"""The native pool's shared-memory segment: its layout, creation, mapping and a rank's handle on it.

Runs in: the coordinator (creates and formats the segment, reads the outputs, aborts waits) and
every CPU worker of the native pool (attaches as one rank). numpy, mmap and ctypes only.

The layout and the mapping: powerinfer/native/segment.py. Here: creating and formatting it
(native code: native/kernels/comm.h through the decoder library), a rank's merge handle, the latencies.
"""

from __future__ import annotations

import ctypes
import os
import secrets
from pathlib import Path

import numpy as np

from powerinfer.config import ModelConfig
from powerinfer.native.decoder_lib import COMM_ERRORS, PiComm
from powerinfer.errors import InvalidArgumentError
from powerinfer.native.segment import LAT_RING, Segment, SegmentLayout

SHM_DIR = Path("/dev/shm")
SPIN_US = 50  # a merge spins this long for a late peer before sleeping on a futex
SLICE_MS = 50  # a sleeping merge wakes this often to check the abort flag and its peers' liveness
DEADLINE_MS = 60_000  # a peer missing this long fails the merge (a backstop: the coordinator aborts first)


def create_segment(lib: ctypes.CDLL, cfg: ModelConfig, n_ranks: int, max_t: int, gpu: bool = False) -> Segment:
    """A fresh, formatted segment for n_ranks CPU ranks of this model (and a GPU rank when gpu),
    max_t tokens per step."""
    return create_segment_with(lib, SegmentLayout.for_model(cfg, n_ranks, max_t, int(lib.pi_comm_hdr_bytes()), gpu))


def create_segment_with(lib: ctypes.CDLL, layout: SegmentLayout) -> Segment:
    """A fresh segment of this layout in /dev/shm (falls back to the temp dir's file system), formatted."""
    n_ranks, max_t = layout.n_ranks, layout.max_t
    where = SHM_DIR if SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK) else Path(os.environ.get("TMPDIR", "/tmp"))
    seg = Segment(str(where / f"powerinfer-{os.getpid()}-{secrets.token_hex(6)}"), layout, create=True)
    if lib.pi_comm_format(seg.base, n_ranks, layout.cap, max_t):
        seg.close()
        raise InvalidArgumentError(f"cannot format a merge segment for {n_ranks} ranks")
    if layout.gpu:
        lib.pi_gpu_setup(seg.base, layout.handoff_off, layout.d)
    return seg


class RankComm:
    """One rank's handle (comm.h's pi_comm) and its latency ring in the segment; ``ptr`` goes into pi_model.comm."""

    def __init__(self, lib: ctypes.CDLL, seg: Segment, rank: int, spin_us: int = SPIN_US) -> None:
        self.comm = PiComm()
        self.lat = seg.lat[rank]
        if lib.pi_comm_attach(ctypes.byref(self.comm), seg.base, rank, spin_us, SLICE_MS, DEADLINE_MS, self.lat.ctypes.data):
            raise InvalidArgumentError(f"rank {rank} cannot attach to the merge segment {seg.path}")
        self.ptr = ctypes.addressof(self.comm)

    def latencies_ns(self) -> np.ndarray:
        """The latest (up to LAT_RING) merge latencies, ns."""
        n = int(self.comm.n_syncs)
        return np.array(self.lat[: min(n, LAT_RING)])


def merge_latencies_ns(seg: Segment) -> np.ndarray:
    """Every rank's recorded merge latencies (ns; the rings' unused entries are 0)."""
    lat = seg.lat.ravel()
    return lat[lat > 0].copy()


def comm_error(code: int) -> str:
    return COMM_ERRORS.get(code, f"native step failed with code {code}")
