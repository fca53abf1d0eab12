"""The native pool's shared-memory segment: its layout and a mapping of it.

Runs in: the coordinator (creates the segment, reads the outputs), every CPU worker of the native
pool and the GPU worker serving as its rank (each maps it). numpy and mmap only; the formatting
and the waits are native code (kernels/comm.h, kernels/handoff.h; native/comm.py and
comm_lib.py load them).

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
    handoff     [max_t, d] f32, only with a GPU rank: the stream handed to it and back around a run
                of GPU layers (kernels/handoff.h)

Pages are touched only when written, so the logits area and the banks cost memory only as far as
they are used (a rank's bank: T rows of its columns).
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass

import numpy as np

from powerinfer.config import ModelConfig
from powerinfer.errors import InvalidArgumentError

LOGITS_BYTES = 64 << 20  # cap on the logits area: rows of one STEP/LOGITS = this / (vocab * 4)
LAT_RING = 8192  # comm.h's PI_LAT_RING: latencies kept per rank
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
    gpu: bool = False  # a GPU rank takes part (the hand-off area follows the logits)

    @classmethod
    def for_model(cls, cfg: ModelConfig, n_ranks: int, max_t: int, hdr_bytes: int, gpu: bool = False) -> SegmentLayout:
        width = max(cfg.d_model, cfg.n_ff, cfg.n_heads * cfg.v_head_dim)
        return cls(n_ranks, max_t, cfg.d_model, cfg.vocab_size, width, hdr_bytes, gpu)

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
    def handoff_off(self) -> int:
        return _al(self.logits_off + self.logit_rows * self.vocab * 4)

    @property
    def size(self) -> int:
        return _al(self.handoff_off + (self.max_t * self.d * 4 if self.gpu else 0))


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
        n = L.max_t * L.d if L.gpu else 0
        self.handoff = self._buf[L.handoff_off : L.handoff_off + n * 4].view(np.float32).reshape(-1, L.d)

    def unlink(self) -> None:
        """Remove the file (mappings stay valid): called once every rank has mapped it."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        self.unlink()
        self.hidden = self.logits = self.handoff = np.empty((0, 0), dtype=np.float32)
        self._buf = np.empty(0, dtype=np.uint8)
        self.io = np.empty((3, 0), dtype=np.int64)
        self.lat = np.empty((0, LAT_RING), dtype=np.uint32)
        try:
            self._map.close()
        except BufferError:  # a view is still exported somewhere: the mapping goes with it
            pass
