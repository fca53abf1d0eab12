"""The native pool's shared-memory segment: its layout, creation, mapping and a rank's handle on it.

Runs in: the coordinator (creates and formats the segment, reads the outputs, aborts waits) and
every CPU worker of the native pool (attaches as one rank). numpy, mmap and ctypes only.

One file in /dev/shm (tmpfs), created mode 0600 with O_EXCL by the coordinator and unlinked as
soon as every worker has mapped it, so from then on a killed coordinator leaves nothing behind
(killed while its workers load, it leaves the file; tmpfs forgets it at the next boot). Layout
(offsets in :class:`SegmentLayout`, 64-byte aligned):

    header      comm.h's pi_shm_hdr: abort flag, the step doorbell, per rank a cache line for the
                merges (generation, sleepers) and one for its answer to the step (done, rc, times), pids
    io          [3, max_t] i64: the step's token ids, positions and KV slots (written by the coordinator)
    banks       per rank [2, max_t * width] f32, each rank's pair page-aligned: the all-gather's two
                banks (width: the widest gathered row), written by that rank alone (packed columns),
                so their pages are first touched on the writer's NUMA node and read by its peers
    latency     [n_ranks, LAT_RING] u32: each rank's latest merge latencies in ns (the benchmark reads them)
    hidden      [max_t, d] f32: final-normed hidden states, written by rank 0
    logits      [logit_rows, vocab] f32: each rank writes its head rows' columns

Pages are touched only when written, so the logits area and the banks cost memory only as far as
they are used (a rank's bank: T rows of its columns).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from powerinfer.config import ModelConfig
from powerinfer.cpu_workers.native_lib import COMM_ERRORS, LAT_RING, PiComm
from powerinfer.errors import InvalidArgumentError

SHM_DIR = Path("/dev/shm")
LOGITS_BYTES = 64 << 20  # cap on the logits area: rows of one STEP/LOGITS = this / (vocab * 4)
SPIN_US = 50  # a merge spins this long for a late peer before sleeping on a futex
SLICE_MS = 50  # a sleeping merge wakes this often to check the abort flag and its peers' liveness
DEADLINE_MS = 60_000  # a peer missing this long fails the merge (a backstop: the coordinator aborts first)


PAGE = 65536  # comm.h's PI_PAGE: each rank's banks start on a page of their own (64 KiB pages included)


def _al(n: int, to: int = 64) -> int:
    return (n + to - 1) & ~(to - 1)


@dataclass(frozen=True)
class SegmentLayout:
    n_ranks: int
    max_t: int
    d: int
    vocab: int
    width: int  # floats of the widest gathered row: max(d, n_ff, n_heads * v_head_dim)
    hdr_bytes: int

    @classmethod
    def for_model(cls, cfg: ModelConfig, n_ranks: int, max_t: int, hdr_bytes: int) -> SegmentLayout:
        width = max(cfg.d_model, cfg.n_ff, cfg.n_heads * cfg.v_head_dim)
        return cls(n_ranks, max_t, cfg.d_model, cfg.vocab_size, width, hdr_bytes)

    @property
    def cap(self) -> int:
        """Floats per bank."""
        return self.max_t * self.width

    @property
    def logit_rows(self) -> int:
        return max(1, min(self.max_t, LOGITS_BYTES // (self.vocab * 4)))

    @property
    def banks_off(self) -> int:
        return _al(self.hdr_bytes + 3 * self.max_t * 8, PAGE)

    @property
    def rank_stride(self) -> int:
        """Bytes from one rank's pair of banks to the next (comm.h's pi_shm_rank_stride)."""
        return _al(2 * self.cap * 4, PAGE)

    @property
    def lat_off(self) -> int:
        return _al(self.banks_off + self.n_ranks * self.rank_stride)

    @property
    def hidden_off(self) -> int:
        return _al(self.lat_off + self.n_ranks * LAT_RING * 4)

    @property
    def logits_off(self) -> int:
        return _al(self.hidden_off + self.max_t * self.d * 4)

    @property
    def size(self) -> int:
        return _al(self.logits_off + self.logit_rows * self.vocab * 4)


class Segment:
    """A mapping of the segment (either side); views of its hidden and logits areas."""

    def __init__(self, path: str, layout: SegmentLayout, create: bool) -> None:
        self.path, self.layout = path, layout
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, layout.size)
            elif os.fstat(fd).st_size != layout.size:
                raise InvalidArgumentError(f"shared segment {path} has {os.fstat(fd).st_size} bytes, expected {layout.size}")
            self._map = mmap.mmap(fd, layout.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._buf = np.frombuffer(self._map, dtype=np.uint8)
        self.base = int(self._buf.ctypes.data)
        L = layout
        self.io = self._buf[L.hdr_bytes : L.hdr_bytes + 3 * L.max_t * 8].view(np.int64).reshape(3, L.max_t)
        self.lat = self._buf[L.lat_off : L.lat_off + L.n_ranks * LAT_RING * 4].view(np.uint32).reshape(L.n_ranks, LAT_RING)
        self.hidden = self._buf[L.hidden_off : L.hidden_off + L.max_t * L.d * 4].view(np.float32).reshape(L.max_t, L.d)
        self.logits = self._buf[L.logits_off : L.logits_off + L.logit_rows * L.vocab * 4].view(np.float32).reshape(L.logit_rows, L.vocab)

    def unlink(self) -> None:
        """Remove the file (mappings stay valid): called once every rank has mapped it."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        self.unlink()
        self.hidden = self.logits = self._buf = np.empty(0, dtype=np.float32)
        self.io = np.empty((3, 0), dtype=np.int64)
        self.lat = np.empty((0, LAT_RING), dtype=np.uint32)
        try:
            self._map.close()
        except BufferError:  # a view is still exported somewhere: the mapping goes with it
            pass


def create_segment(lib: ctypes.CDLL, cfg: ModelConfig, n_ranks: int, max_t: int) -> Segment:
    """A fresh, formatted segment for n_ranks ranks of this model, max_t tokens per step."""
    return create_segment_with(lib, SegmentLayout.for_model(cfg, n_ranks, max_t, int(lib.pi_comm_hdr_bytes())))


def create_segment_with(lib: ctypes.CDLL, layout: SegmentLayout) -> Segment:
    """A fresh segment of this layout in /dev/shm (falls back to the temp dir's file system), formatted."""
    n_ranks, max_t = layout.n_ranks, layout.max_t
    where = SHM_DIR if SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK) else Path(os.environ.get("TMPDIR", "/tmp"))
    seg = Segment(str(where / f"powerinfer-{os.getpid()}-{secrets.token_hex(6)}"), layout, create=True)
    if lib.pi_comm_format(seg.base, n_ranks, layout.cap, max_t):
        seg.close()
        raise InvalidArgumentError(f"cannot format a merge segment for {n_ranks} ranks")
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
        return self.lat[: min(n, LAT_RING)].copy()


def merge_latencies_ns(seg: Segment) -> np.ndarray:
    """Every rank's recorded merge latencies (ns; the rings' unused entries are 0)."""
    lat = seg.lat.ravel()
    return lat[lat > 0].copy()


def comm_error(code: int) -> str:
    return COMM_ERRORS.get(code, f"native step failed with code {code}")
