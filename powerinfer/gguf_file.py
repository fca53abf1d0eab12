"""Memory-mapped, bounds-checked GGUF reader.

Runs in: the coordinator and every worker process (each maps the same file read-only, so the OS
page cache holds one copy of the weights for all of them).

Why not ``gguf.GGUFReader``: it parses every element of every metadata array into numpy views one
by one, which takes ~12 s for Gemma 3's 262,144-token vocabulary; this reader takes well under a
second. It reuses the ``gguf`` package's constants (value types, quant block sizes) so the two
never disagree, and it distrusts the file: every count, length, offset and size is checked against
the file's size before anything is allocated from it (GGUF parsers that trusted these fields have
shipped CVEs). A problem is a :class:`ModelFileError` naming what is wrong and where.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from powerinfer.errors import ModelFileError, UnsupportedModelError, quoted

log = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4
# Longest string (metadata value or key, tensor name) accepted; chat templates are a few KiB.
MAX_STRING_BYTES = 16 << 20
MAX_ARRAY_DEPTH = 2

# Fixed-size scalar value types: struct format and size.
_SCALAR_FMT: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
_SCALAR_NP: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "<u1",
    GGUFValueType.INT8: "<i1",
    GGUFValueType.UINT16: "<u2",
    GGUFValueType.INT16: "<i2",
    GGUFValueType.UINT32: "<u4",
    GGUFValueType.INT32: "<i4",
    GGUFValueType.FLOAT32: "<f4",
    GGUFValueType.BOOL: "<u1",
    GGUFValueType.UINT64: "<u8",
    GGUFValueType.INT64: "<i8",
    GGUFValueType.FLOAT64: "<f8",
}
# numpy dtype of the elements of unquantized tensors; bf16 is exposed as its raw uint16 bits.
_FLOAT_NP: dict[GGMLQuantizationType, str] = {
    GGMLQuantizationType.F32: "<f4",
    GGMLQuantizationType.F16: "<f2",
    GGMLQuantizationType.BF16: "<u2",
}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's header entry; ``shape`` is in numpy order (rows..., cols)."""

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def n_rows(self) -> int:
        return int(np.prod(self.shape[:-1], dtype=np.int64)) if len(self.shape) > 1 else 1

    @property
    def n_cols(self) -> int:
        return self.shape[-1]

    @property
    def row_bytes(self) -> int:
        block, type_size = GGML_QUANT_SIZES[self.qtype]
        return self.n_cols // block * type_size


class _Cursor:
    """Sequential little-endian reader over a buffer with bounds checks."""

    def __init__(self, buf: memoryview, path: Path) -> None:
        self.buf = buf
        self.pos = 0
        self.path = path

    def fail(self, what: str) -> ModelFileError:
        return ModelFileError(f"{self.path}: malformed GGUF: {what} (at byte {self.pos})")

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise self.fail(f"{what} runs past the end of the file (truncated?)")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def scalar(self, fmt: str, what: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        n = self.scalar("<Q", f"{what} length")
        if n > MAX_STRING_BYTES:
            raise self.fail(f"{what} length {n} is implausibly large")
        raw = self.take(n, what)
        try:
            return bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            # llama.cpp accepts invalid UTF-8 in token texts; keep the bytes visible rather than fail.
            return bytes(raw).decode("utf-8", errors="surrogateescape")

    def value(self, vtype: int, what: str, depth: int = 0) -> Any:
        try:
            vt = GGUFValueType(vtype)
        except ValueError:
            raise self.fail(f"{what} has unknown value type {vtype}") from None
        if vt in _SCALAR_FMT:
            return self.scalar(_SCALAR_FMT[vt], what)
        if vt == GGUFValueType.STRING:
            return self.string(what)
        # ARRAY: element type, count, elements.
        if depth >= MAX_ARRAY_DEPTH:
            raise self.fail(f"{what} nests arrays too deeply")
        etype = self.scalar("<I", f"{what} element type")
        count = self.scalar("<Q", f"{what} element count")
        remaining = len(self.buf) - self.pos
        try:
            et = GGUFValueType(etype)
        except ValueError:
            raise self.fail(f"{what} has unknown element type {etype}") from None
        if et in _SCALAR_NP:
            itemsize = np.dtype(_SCALAR_NP[et]).itemsize
            if count * itemsize > remaining:
                raise self.fail(f"{what} claims {count} elements, more than the file holds")
            arr = np.frombuffer(self.take(count * itemsize, what), dtype=_SCALAR_NP[et]).copy()
            return arr.astype(bool) if et == GGUFValueType.BOOL else arr
        # Strings take at least 8 bytes each, nested arrays at least 12: bound the count first.
        if count * 8 > remaining:
            raise self.fail(f"{what} claims {count} elements, more than the file holds")
        if et == GGUFValueType.STRING:
            return self._string_array(count, what)
        return [self.value(etype, what, depth + 1) for _ in range(count)]

    def _string_array(self, count: int, what: str) -> list[str]:
        # Hot path for vocabularies (262k entries): avoid per-element method-call overhead.
        buf, pos, end = self.buf, self.pos, len(self.buf)
        unpack = struct.Struct("<Q").unpack_from
        out: list[str] = []
        append = out.append
        for _ in range(count):
            if pos + 8 > end:
                self.pos = pos
                raise self.fail(f"{what} runs past the end of the file (truncated?)")
            (n,) = unpack(buf, pos)
            pos += 8
            if n > MAX_STRING_BYTES or pos + n > end:
                self.pos = pos
                raise self.fail(f"{what} element runs past the end of the file")
            append(str(buf[pos : pos + n], "utf-8", "surrogateescape"))
            pos += n
        self.pos = pos
        return out


class GGUFFile:
    """A parsed GGUF header plus a read-only memory map of the tensor data.

    ``metadata`` holds plain Python values (str, int, float, bool) and numpy arrays or lists for
    arrays. ``tensors`` maps names to :class:`TensorInfo`; :meth:`raw` returns zero-copy views.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise ModelFileError(f"{self.path}: no such file")
        if self.path.is_dir():
            raise ModelFileError(f"{self.path}: is a directory, expected a .gguf file")
        try:
            self.size = self.path.stat().st_size
            if self.size < 24:
                raise ModelFileError(f"{self.path}: too small to be a GGUF file ({self.size} bytes)")
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        except OSError as e:
            raise ModelFileError(f"{self.path}: cannot read: {e.strerror or e}") from None
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, TensorInfo] = {}
        self._fd: int | None = None  # opened lazily by read_rows
        self._parse()

    # -- parsing -------------------------------------------------------------------------------

    def _parse(self) -> None:
        cur = _Cursor(memoryview(self._map), self.path)
        magic = bytes(cur.take(4, "magic"))
        if magic != GGUF_MAGIC:
            raise ModelFileError(f"{self.path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
        version = cur.scalar("<I", "version")
        if version not in SUPPORTED_VERSIONS:
            if int.from_bytes(version.to_bytes(4, "little"), "big") in SUPPORTED_VERSIONS:
                raise ModelFileError(f"{self.path}: big-endian GGUF files are not supported")
            raise ModelFileError(f"{self.path}: unsupported GGUF version {version} (supported: 2, 3)")
        n_tensors = cur.scalar("<Q", "tensor count")
        n_kv = cur.scalar("<Q", "metadata count")
        # Each kv needs >= 12 bytes and each tensor info >= 24: reject absurd counts before looping.
        if n_kv * 12 + n_tensors * 24 > self.size:
            raise cur.fail(f"header claims {n_kv} metadata entries and {n_tensors} tensors, more than fit")
        for _ in range(n_kv):
            key = cur.string("metadata key")
            vtype = cur.scalar("<I", f"type of {quoted(key)}")
            if key in self.metadata:
                raise cur.fail(f"duplicate metadata key {quoted(key)}")
            self.metadata[key] = cur.value(vtype, f"metadata {quoted(key)}")
        infos: list[tuple[str, int, tuple[int, ...], int]] = []
        for _ in range(n_tensors):
            name = cur.string("tensor name")
            n_dims = cur.scalar("<I", f"dims of tensor {quoted(name)}")
            if not 1 <= n_dims <= MAX_DIMS:
                raise cur.fail(f"tensor {quoted(name)} has {n_dims} dimensions (1..{MAX_DIMS} allowed)")
            dims = tuple(cur.scalar("<Q", f"shape of {quoted(name)}") for _ in range(n_dims))
            qtype = cur.scalar("<I", f"type of tensor {quoted(name)}")
            offset = cur.scalar("<Q", f"offset of tensor {quoted(name)}")
            infos.append((name, qtype, dims, offset))
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        # bool is an int subclass: `true` must not pass for an alignment of 1 (llama.cpp wants a uint32)
        if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise cur.fail(f"general.alignment {quoted(alignment)} is not a power of two")
        data_start = -(-cur.pos // alignment) * alignment
        for name, qtype, dims, offset in infos:
            self._add_tensor(name, qtype, dims, offset, data_start, alignment)
        log.debug("%s: %d metadata keys, %d tensors", self.path, len(self.metadata), len(self.tensors))

    def _add_tensor(
        self, name: str, qtype: int, dims: tuple[int, ...], offset: int, data_start: int, alignment: int
    ) -> None:
        where = f"{self.path}: malformed GGUF: tensor {quoted(name)}"
        if name in self.tensors:
            raise ModelFileError(f"{where} appears twice")
        try:
            qt = GGMLQuantizationType(qtype)
        except ValueError:
            raise ModelFileError(f"{where} has unknown tensor type id {qtype}") from None
        if any(d == 0 for d in dims):
            raise ModelFileError(f"{where} has a zero dimension {list(dims)}")
        n_elems = 1
        for d in dims:
            n_elems *= d
            if n_elems > self.size * 8:  # no type packs more than 8 elements per byte
                raise ModelFileError(f"{where} shape {list(dims)} is larger than the file")
        block, type_size = GGML_QUANT_SIZES[qt]
        if dims[0] % block:
            raise ModelFileError(f"{where}: row length {dims[0]} is not a multiple of {qt.name}'s block {block}")
        nbytes = n_elems // block * type_size
        if offset % alignment:
            raise ModelFileError(f"{where}: data offset {offset} is not aligned to {alignment}")
        start = data_start + offset
        if start + nbytes > self.size:
            raise ModelFileError(f"{where}: data ({nbytes} bytes at {start}) runs past the end of the file (truncated?)")
        self.tensors[name] = TensorInfo(name, qt, tuple(reversed(dims)), start, nbytes)

    # -- access --------------------------------------------------------------------------------

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str, kind: type | tuple[type, ...]) -> Any:
        """A metadata value that must exist and have the given Python type."""
        if key not in self.metadata:
            raise ModelFileError(f"{self.path}: required metadata key {quoted(key)} is missing")
        value = self.metadata[key]
        if isinstance(value, (np.integer, np.floating)):
            value = value.item()
        if not isinstance(value, kind) or (isinstance(value, bool) and kind in (int, float)):
            raise ModelFileError(f"{self.path}: metadata {quoted(key)} has type {type(value).__name__}")
        return value

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise ModelFileError(f"{self.path}: required tensor {quoted(name)} is missing") from None

    def raw(self, name: str) -> np.ndarray:
        """Zero-copy read-only view: [rows, row_bytes] uint8 for quantized types, [rows, cols] floats otherwise."""
        info = self.tensor(name)
        flat = self._map[info.offset : info.offset + info.nbytes]
        if info.qtype in _FLOAT_NP:
            return flat.view(_FLOAT_NP[info.qtype]).reshape(info.n_rows, info.n_cols)
        if info.qtype not in GGML_QUANT_SIZES:
            raise UnsupportedModelError(f"{self.path}: tensor {quoted(name)} has unsupported type {info.qtype.name}")
        return flat.reshape(info.n_rows, info.row_bytes)

    def read_rows(self, name: str, ids: np.ndarray) -> np.ndarray:
        """Copies of rows ``ids`` of a tensor, read with pread instead of through the map.

        The coordinator reads a few embedding / output-head rows per token; through the map each
        touched page would stay in its RSS (up to the whole 30-170 MB table over a long run).
        Same shape and dtype as ``raw(name)[ids]``.
        """
        info = self.tensor(name)
        view = self.raw(name)  # only for shape/dtype; no page of it is touched
        row_nbytes = view.shape[1] * view.dtype.itemsize
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= view.shape[0]):
            raise IndexError(f"row index out of range for tensor {name!r} with {view.shape[0]} rows")
        buf = bytearray(row_nbytes * ids.size)
        mv = memoryview(buf)
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        for k, i in enumerate(ids.tolist()):
            got = os.preadv(self._fd, [mv[k * row_nbytes : (k + 1) * row_nbytes]], info.offset + i * row_nbytes)
            if got != row_nbytes:
                raise ModelFileError(f"{self.path}: short read of tensor {name!r} row {i} (file changed on disk?)")
        return np.frombuffer(buf, dtype=view.dtype).reshape(ids.size, view.shape[1])

    def drop_pages(self) -> None:
        """Unmap the resident file pages from this process (they stay in the OS page cache).

        A worker reads its shard of the file once, to pack it; afterwards the pages only inflate
        its RSS. Later reads (none expected) would simply fault them back in.
        """
        mm = getattr(self._map, "_mmap", None)
        if mm is not None and hasattr(mm, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
            mm.madvise(mmap.MADV_DONTNEED)

    def __iter__(self) -> Iterator[TensorInfo]:
        return iter(self.tensors.values())
