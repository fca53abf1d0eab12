"""GGUF at the byte level for the fuzzer: a field scanner and a raw writer that validates nothing.

Runs in: the fuzzing parent process (it builds and mutates the case files); never in the engine.

``scan`` walks a *well-formed* base file and records where every field starts (header counts,
each key/value and its type, array headers and elements, each tensor-info field), so mutations can
aim at the places where parsing happens. ``build`` writes whatever it is given (any magic,
version, counts, type ids, offsets, alignment), which is how the malformed cases are made:
``gguf.GGUFWriter`` refuses most of them.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

from gguf import GGUFValueType as VT

# Fixed sizes of the scalar value types (GGUF ids), as the format defines them.
SCALAR_SIZES: dict[int, int] = {
    VT.UINT8: 1, VT.INT8: 1, VT.UINT16: 2, VT.INT16: 2, VT.UINT32: 4, VT.INT32: 4, VT.FLOAT32: 4,
    VT.BOOL: 1, VT.UINT64: 8, VT.INT64: 8, VT.FLOAT64: 8,
}
_SCALAR_FMT: dict[int, str] = {
    VT.UINT8: "<B", VT.INT8: "<b", VT.UINT16: "<H", VT.INT16: "<h", VT.UINT32: "<I", VT.INT32: "<i",
    VT.FLOAT32: "<f", VT.BOOL: "<B", VT.UINT64: "<Q", VT.INT64: "<q", VT.FLOAT64: "<d",
}


@dataclass
class KV:
    """One metadata entry: its key, value type id and serialized value (what follows the type)."""

    key: bytes
    vtype: int
    value: bytes
    start: int = 0  # span of the whole entry in the scanned file
    end: int = 0


@dataclass
class TensorEntry:
    """One tensor-info entry; ``dims`` in file order (ne[0] first), ``offset`` relative to the data."""

    name: bytes
    dims: list[int]
    ttype: int
    offset: int
    start: int = 0
    end: int = 0


@dataclass
class Layout:
    """Where everything is in a scanned file."""

    version: int
    kvs: list[KV]
    tensors: list[TensorEntry]
    info_end: int  # end of the last tensor info (before the alignment padding)
    data_start: int
    alignment: int
    fields: list[int] = field(default_factory=list)  # starts of structural fields (not array elements)
    elements: list[int] = field(default_factory=list)  # starts of array elements

    def kv(self, key: str) -> KV:
        return next(kv for kv in self.kvs if kv.key == key.encode())


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def take(self, fmt: str) -> int:
        (value,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return int(value) if not isinstance(value, float) else value  # type: ignore[return-value]

    def skip_string(self) -> None:
        n = self.take("<Q")
        if self.pos + n > len(self.data):
            raise ValueError("string runs past the end")
        self.pos += n


def _skip_value(r: _Reader, vtype: int, lay: Layout, depth: int = 0) -> None:
    if vtype in SCALAR_SIZES:
        r.pos += SCALAR_SIZES[vtype]
    elif vtype == VT.STRING:
        r.skip_string()
    elif vtype == VT.ARRAY and depth < 2:
        lay.fields.append(r.pos)
        etype = r.take("<I")
        lay.fields.append(r.pos)
        count = r.take("<Q")
        if etype in SCALAR_SIZES:
            size = SCALAR_SIZES[etype]
            # a sample of element starts is enough for huge scalar arrays (scores, token types)
            lay.elements.extend(range(r.pos, r.pos + count * size, size * max(1, count // 4096)))
            r.pos += count * size
            return
        for _ in range(count):
            lay.elements.append(r.pos)
            _skip_value(r, etype, lay, depth + 1)
    else:
        raise ValueError(f"cannot scan value type {vtype}")
    if r.pos > len(r.data):
        raise ValueError("value runs past the end")


def _marked_string(r: _Reader, lay: Layout, data: bytes) -> bytes:
    """A GGUF string at r (u64 length, then its bytes), marking where its length and its end are."""
    lay.fields.append(r.pos)
    n = r.take("<Q")
    text = data[r.pos : r.pos + n]
    r.pos += n
    lay.fields.append(r.pos)
    return text


def scan(data: bytes) -> Layout:
    """The layout of a well-formed GGUF (or PWRI) file; ValueError when it is not one."""
    r = _Reader(data)
    if data[:4] not in (b"GGUF", b"PWRI"):
        raise ValueError("not a GGUF file")
    r.pos = 4
    lay = Layout(version=r.take("<I"), kvs=[], tensors=[], info_end=0, data_start=0, alignment=32)
    lay.fields += [0, 4, 8, 16]
    n_tensors, n_kv = r.take("<Q"), r.take("<Q")
    for _ in range(n_kv):
        start = r.pos
        key = _marked_string(r, lay, data)
        vtype = r.take("<I")
        lay.fields.append(r.pos)
        value_start = r.pos
        _skip_value(r, vtype, lay)
        lay.kvs.append(KV(key, vtype, data[value_start : r.pos], start, r.pos))
        if key == b"general.alignment" and vtype in _SCALAR_FMT:
            lay.alignment = struct.unpack_from(_SCALAR_FMT[vtype], data, value_start)[0]
    for _ in range(n_tensors):
        start = r.pos
        name = _marked_string(r, lay, data)
        n_dims = r.take("<I")
        dims = []
        for _ in range(n_dims):
            lay.fields.append(r.pos)
            dims.append(r.take("<Q"))
        lay.fields.append(r.pos)
        ttype = r.take("<I")
        lay.fields.append(r.pos)
        offset = r.take("<Q")
        lay.tensors.append(TensorEntry(name, dims, ttype, offset, start, r.pos))
    lay.info_end = r.pos
    lay.data_start = -(-r.pos // lay.alignment) * lay.alignment
    lay.fields.append(lay.info_end)
    return lay


# -- writing ---------------------------------------------------------------------------------


def enc_string(text: str | bytes, length: int | None = None) -> bytes:
    """A GGUF string; ``length`` overrides the length field (to lie about it)."""
    raw = text.encode("utf-8", "surrogateescape") if isinstance(text, str) else text
    return struct.pack("<Q", len(raw) if length is None else length) + raw


def enc_scalar(vtype: int, value: float | int | bool) -> bytes:
    fmt = _SCALAR_FMT[vtype]
    if fmt in ("<f", "<d"):
        return struct.pack(fmt, float(value))
    return struct.pack(fmt, int(value))


def enc_array(etype: int, items: Sequence[bytes], count: int | None = None) -> bytes:
    """An array of already-encoded ``items``; ``count`` overrides the element count field."""
    return struct.pack("<IQ", etype, len(items) if count is None else count) + b"".join(items)


def enc_value(vtype: int, value: object) -> bytes:
    """Encode a Python value as ``vtype`` (scalars, str; arrays as (etype, [values]))."""
    if vtype == VT.STRING:
        return enc_string(value)  # type: ignore[arg-type]
    if vtype == VT.ARRAY:
        etype, values = value  # type: ignore[misc]
        return enc_array(etype, [enc_value(etype, v) for v in values])
    return enc_scalar(vtype, value)  # type: ignore[arg-type]


def enc_kv(key: str | bytes, vtype: int, value: bytes) -> bytes:
    return enc_string(key) + struct.pack("<I", vtype) + value


def enc_tensor_info(name: str | bytes, dims: Sequence[int], ttype: int, offset: int, n_dims: int | None = None) -> bytes:
    out = enc_string(name) + struct.pack("<I", len(dims) if n_dims is None else n_dims)
    out += b"".join(struct.pack("<Q", d & (2**64 - 1)) for d in dims)
    return out + struct.pack("<IQ", ttype, offset & (2**64 - 1))


def build(
    kvs: Sequence[KV], tensors: Sequence[TensorEntry], data: bytes, *, alignment: int = 32, version: int = 3,
    magic: bytes = b"GGUF", n_kv: int | None = None, n_tensors: int | None = None,
) -> bytes:
    """Serialize exactly what it is given: header, kvs, tensor infos, padding to ``alignment``, data."""
    out = bytearray(magic)
    out += struct.pack("<IQQ", version, len(tensors) if n_tensors is None else n_tensors, len(kvs) if n_kv is None else n_kv)
    for kv in kvs:
        out += enc_kv(kv.key, kv.vtype, kv.value)
    for t in tensors:
        out += enc_tensor_info(t.name, t.dims, t.ttype, t.offset)
    if alignment > 0:
        out += bytes(-len(out) % alignment)
    return bytes(out + data)


def rebuild(data: bytes, lay: Layout, kvs: Sequence[KV] | None = None, tensors: Sequence[TensorEntry] | None = None,
            **kwargs: int | bytes) -> bytes:
    """The scanned file with its kvs and/or tensor infos replaced; the tensor data is kept."""
    alignment = int(kwargs.pop("alignment", lay.alignment))  # type: ignore[arg-type]
    return build(lay.kvs if kvs is None else kvs, lay.tensors if tensors is None else tensors,
                 data[lay.data_start:], alignment=alignment, version=int(kwargs.pop("version", lay.version)),  # type: ignore[arg-type]
                 **kwargs)  # type: ignore[arg-type]
