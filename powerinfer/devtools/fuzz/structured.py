"""Hand-built malformed files: the classes llama.cpp's ``tests/test-gguf.cpp`` covers, and more.

Runs in: the fuzzing parent process (and the test process, which checks each class in-process).

Each generator takes a random source and a small base file and returns the bytes of one case and
what opening it must do: ``EXPECT_OK`` (the GGUF itself is well formed; later stages may still
refuse it cleanly), ``EXPECT_ERROR`` (any clean error), a regex the error must match, or
``EXPECT_ANY`` (either). Header, key/value, alignment, tensor-info, data and truncation classes
follow llama.cpp's handcrafted files; the ``meta.*`` and ``template.*`` classes are well-formed
GGUF whose *values* are hostile (wrong types, absurd numbers, odd strings, unsafe templates),
which is what the config, tokenizer, chat template and predictor readers must survive.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Callable
from dataclasses import replace

from gguf import GGML_QUANT_SIZES
from gguf import GGUFValueType as VT

from powerinfer.devtools.fuzz.bases import Base
from powerinfer.devtools.fuzz.gguf_layout import (
    KV,
    SCALAR_SIZES,
    TensorEntry,
    build,
    enc_array,
    enc_scalar,
    enc_string,
    enc_value,
    rebuild,
)
from powerinfer.devtools.fuzz.hostile_values import hostile_string, hostile_template, hostile_value, numeric_keys, read_keys

EXPECT_OK, EXPECT_ERROR, EXPECT_ANY = "ok", "error", "any"
Generated = tuple[bytes, str]
Generator = Callable[[random.Random, Base], Generated]
_U64 = 2**64 - 1


def _patch(data: bytes, at: int, fmt: str, value: int) -> bytes:
    buf = bytearray(data)
    struct.pack_into(fmt, buf, at, value)
    return bytes(buf)


def _rebuild(b: Base, kvs: list[KV] | None = None, tensors: list[TensorEntry] | None = None, **kw: int | bytes) -> bytes:
    return rebuild(b.head, b.layout, kvs, tensors, **kw)


def _with_kv(b: Base, key: bytes, vtype: int, value: bytes) -> bytes:
    """The base with ``key`` set (replaced where present, else appended)."""
    kvs = [kv for kv in b.layout.kvs if kv.key != key]
    return _rebuild(b, [*kvs, KV(key, vtype, value)])


def _kv_field(kv: KV) -> int:
    """Offset of the value type field of ``kv`` in the base."""
    return kv.start + 8 + len(kv.key)


def _tensor_fields(t: TensorEntry) -> tuple[int, int, int, int]:
    """Offsets of (n_dims, first dim, type, offset) of tensor info ``t``."""
    n_dims_at = t.start + 8 + len(t.name)
    type_at = n_dims_at + 4 + 8 * len(t.dims)
    return n_dims_at, n_dims_at + 4, type_at, type_at + 4


def _nbytes(t: TensorEntry) -> int:
    block, size = GGML_QUANT_SIZES[t.ttype]  # type: ignore[index]
    n = 1
    for d in t.dims:
        n *= d
    return n // block * size


def _relayout(b: Base, alignment: int) -> bytes:
    """Re-pack the tensor data for ``alignment`` (offsets recomputed, each tensor's bytes kept)."""
    data = b.head[b.layout.data_start:]
    out, tensors = bytearray(), []
    for t in b.layout.tensors:
        out += bytes(-len(out) % alignment)
        tensors.append(replace(t, offset=len(out)))
        out += data[t.offset : t.offset + _nbytes(t)]
    kvs = [kv for kv in b.layout.kvs if kv.key != b"general.alignment"]
    kvs.append(KV(b"general.alignment", VT.UINT32, enc_scalar(VT.UINT32, alignment)))
    return build(kvs, tensors, bytes(out), alignment=alignment, version=b.layout.version, magic=b.head[:4])


# -- header ------------------------------------------------------------------------------------


def bad_magic(rng: random.Random, b: Base) -> Generated:
    magic = rng.choice((b"GGML", b"GGJT", b"FUGG", b"\0\0\0\0", b"ggUF", rng.randbytes(4)))
    magic = magic if magic not in (b"GGUF", b"PWRI") else b"GGUG"
    return magic + b.head[4:], r"not a GGUF file"


def bad_version(rng: random.Random, b: Base) -> Generated:
    version = rng.choice((0, 1, 4, 5, 99, 2**31, 2**32 - 1, 0x03000000, 0x02000000))
    return _patch(b.head, 4, "<I", version), r"unsupported GGUF version|big-endian"


def huge_n_tensors(rng: random.Random, b: Base) -> Generated:
    n = rng.choice((_U64, 2**63, 2**40, len(b.layout.tensors) + rng.randrange(1, 1000)))
    return _patch(b.head, 8, "<Q", n), EXPECT_ERROR


def huge_n_kv(rng: random.Random, b: Base) -> Generated:
    n = rng.choice((_U64, 2**63, 2**40, len(b.layout.kvs) + rng.randrange(1, 1000)))
    return _patch(b.head, 16, "<Q", n), EXPECT_ERROR


def empty_header(rng: random.Random, b: Base) -> Generated:
    return struct.pack("<4sIQQ", b"GGUF", 3, 0, 0) + bytes(rng.choice((0, 8, 32))), EXPECT_OK


# -- key/value pairs ----------------------------------------------------------------------------


def key_len_huge(rng: random.Random, b: Base) -> Generated:
    kv = rng.choice(b.layout.kvs)
    n = rng.choice((_U64, 2**63, 2**40, 17 << 20, len(b.head) - kv.start))
    return _patch(b.head, kv.start, "<Q", n), r"implausibly large|past the end"


def string_len_past_end(rng: random.Random, b: Base) -> Generated:
    kvs = [kv for kv in b.layout.kvs if kv.vtype == VT.STRING]
    kv = rng.choice(kvs)
    n = rng.choice((_U64, 2**63, 2**32, len(b.head), len(b.head) - _kv_field(kv) - 12 + rng.randrange(1, 64)))
    return _patch(b.head, _kv_field(kv) + 4, "<Q", n), r"implausibly large|past the end|runs past"


def array_len_huge(rng: random.Random, b: Base) -> Generated:
    kvs = [kv for kv in b.layout.kvs if kv.vtype == VT.ARRAY] or b.layout.kvs
    kv = rng.choice(kvs)
    if kv.vtype != VT.ARRAY:  # give the file an array to lie about
        return _with_kv(b, b"fuzz.array", VT.ARRAY, struct.pack("<IQ", VT.UINT8, _U64)), r"more than the file holds"
    n = rng.choice((_U64, 2**63, 2**62, 2**61 + 1, 2**32, len(b.head)))
    return _patch(b.head, _kv_field(kv) + 8, "<Q", n), r"more than the file holds|past the end"


def bad_value_type(rng: random.Random, b: Base) -> Generated:
    kv = rng.choice(b.layout.kvs)
    vtype = rng.choice((13, 14, 100, 2**31, 2**32 - 1))
    return _patch(b.head, _kv_field(kv), "<I", vtype), r"unknown value type"


def bad_array_elem_type(rng: random.Random, b: Base) -> Generated:
    etype = rng.choice((13, 99, 2**32 - 1))
    return _with_kv(b, b"fuzz.array", VT.ARRAY, struct.pack("<IQ", etype, 1) + b"\0" * 8), r"unknown element type"


def deep_nesting(rng: random.Random, b: Base) -> Generated:
    depth = rng.choice((3, 4, 64, 10000))
    value = struct.pack("<IQ", VT.UINT8, 0)
    for _ in range(depth - 1):
        value = struct.pack("<IQ", VT.ARRAY, 1) + value
    return _with_kv(b, b"fuzz.nested", VT.ARRAY, value), r"nests arrays too deeply"


def duplicate_key(rng: random.Random, b: Base) -> Generated:
    kvs = list(b.layout.kvs)
    kv = rng.choice(kvs)
    twin = kv if rng.random() < 0.5 else replace(kv, vtype=VT.STRING, value=enc_string("x"))
    kvs.insert(rng.randrange(len(kvs) + 1), twin)
    return _rebuild(b, kvs), r"duplicate metadata key"


def random_kvs(rng: random.Random, b: Base) -> Generated:
    """llama.cpp's KV_SUCCESS: extra keys of every type (arrays of each element type) must load."""
    kvs = list(b.layout.kvs)
    for i in range(rng.randrange(1, 40)):
        vtype = rng.choice(list(VT))
        if vtype == VT.ARRAY:
            etype = rng.choice([t for t in VT if t != VT.ARRAY])
            items = [enc_string(rng.randbytes(rng.randrange(5)).hex()) if etype == VT.STRING
                     else rng.randbytes(SCALAR_SIZES[etype]) for _ in range(rng.randrange(17))]
            value = enc_array(etype, items)
        elif vtype == VT.STRING:
            value = enc_string(rng.randbytes(rng.randrange(64)))
        else:
            value = rng.randbytes(SCALAR_SIZES[vtype])
        kvs.insert(rng.randrange(len(kvs) + 1), KV(f"my_key_{i}".encode(), vtype, value))
    return _rebuild(b, kvs), EXPECT_OK


# -- alignment --------------------------------------------------------------------------------


def bad_alignment(rng: random.Random, b: Base) -> Generated:
    value = rng.choice((0, 3, 6, 13, 48, 100, 2**32 - 1))
    return _with_kv(b, b"general.alignment", VT.UINT32, enc_scalar(VT.UINT32, value)), r"alignment"


def alignment_wrong_type(rng: random.Random, b: Base) -> Generated:
    vtype, value = rng.choice(((VT.STRING, enc_string("32")), (VT.FLOAT32, enc_scalar(VT.FLOAT32, 32.0)),
                               (VT.INT8, enc_scalar(VT.INT8, -32)), (VT.ARRAY, enc_value(VT.ARRAY, (VT.UINT32, [32]))),
                               (VT.INT64, enc_scalar(VT.INT64, -(2**62)))))
    return _with_kv(b, b"general.alignment", vtype, value), r"alignment"


def custom_alignment(rng: random.Random, b: Base) -> Generated:
    return _relayout(b, rng.choice((1, 2, 8, 64, 128, 4096))), EXPECT_OK


def huge_alignment(rng: random.Random, b: Base) -> Generated:
    value = rng.choice((2**31, 2**40, 2**63))
    vtype = VT.UINT32 if value < 2**32 else VT.UINT64
    return _with_kv(b, b"general.alignment", vtype, enc_scalar(vtype, value)), r"past the end|alignment"


# -- tensor infos ------------------------------------------------------------------------------


def _tensor(rng: random.Random, b: Base) -> TensorEntry:
    return rng.choice(b.layout.tensors)


def tensor_name_len_huge(rng: random.Random, b: Base) -> Generated:
    t = _tensor(rng, b)
    return _patch(b.head, t.start, "<Q", rng.choice((_U64, 2**63, 17 << 20, len(b.head)))), r"implausibly large|past the end"


def tensor_bad_n_dims(rng: random.Random, b: Base) -> Generated:
    t = _tensor(rng, b)
    return _patch(b.head, _tensor_fields(t)[0], "<I", rng.choice((0, 5, 8, 1000, 2**32 - 1))), r"dimensions"


def _set_dims(rng: random.Random, b: Base, make: Callable[[TensorEntry], list[int]]) -> bytes:
    tensors = list(b.layout.tensors)
    i = rng.randrange(len(tensors))
    tensors[i] = replace(tensors[i], dims=make(tensors[i]))
    return _rebuild(b, tensors=tensors)


def tensor_zero_dim(rng: random.Random, b: Base) -> Generated:
    def zero_one(t: TensorEntry) -> list[int]:
        k = rng.randrange(len(t.dims))
        return [0 if i == k else d for i, d in enumerate(t.dims)]

    return _set_dims(rng, b, zero_one), r"zero dimension"


def tensor_negative_dim(rng: random.Random, b: Base) -> Generated:
    return _set_dims(rng, b, lambda t: [*t.dims[:-1], -1 & _U64]), r"larger than the file"


def tensor_ne_too_big(rng: random.Random, b: Base) -> Generated:
    dims = rng.choice(([2**32, 2**32], [2**63, 2], [4 * (2**31 - 1)] * 2, [2**62, 4, 4, 4], [256, 2**56]))
    return _set_dims(rng, b, lambda t: dims), r"larger than the file"


def tensor_bad_type(rng: random.Random, b: Base) -> Generated:
    t = _tensor(rng, b)
    ttype = rng.choice((4, 5, 31, 32, 33, 36, 37, 38, 42, 43, 100, 2**31, 2**32 - 1))
    return _patch(b.head, _tensor_fields(t)[2], "<I", ttype), r"unknown tensor type id"


def tensor_unsupported_type(rng: random.Random, b: Base) -> Generated:
    t = _tensor(rng, b)
    ttype = rng.choice((9, 10, 11, 15, 16, 19, 20, 23, 24, 26, 27, 28, 29, 34, 35, 39))
    return _patch(b.head, _tensor_fields(t)[2], "<I", ttype), EXPECT_ANY


def tensor_offset_past_end(rng: random.Random, b: Base) -> Generated:
    t = _tensor(rng, b)
    data_len = len(b.head) - b.layout.data_start
    offset = rng.choice((_U64 - 31, 2**63, 2**40, -(-data_len // 32) * 32, data_len + 32 * rng.randrange(1, 100)))
    return _patch(b.head, _tensor_fields(t)[3], "<Q", offset), r"past the end|not aligned"


def tensor_offset_misaligned(rng: random.Random, b: Base) -> Generated:
    t = _tensor(rng, b)
    return _patch(b.head, _tensor_fields(t)[3], "<Q", t.offset + rng.randrange(1, 32)), r"not aligned"


def tensor_size_past_end(rng: random.Random, b: Base) -> Generated:
    last = max(b.layout.tensors, key=lambda t: t.offset)
    tensors = [replace(t, dims=[*t.dims[:-1], t.dims[-1] * rng.choice((2, 3, 1000))]) if t is last else t
               for t in b.layout.tensors]
    return _rebuild(b, tensors=tensors), r"past the end|larger than the file"


def tensor_duplicate_name(rng: random.Random, b: Base) -> Generated:
    tensors = list(b.layout.tensors)
    i, j = rng.sample(range(len(tensors)), 2)
    tensors[j] = replace(tensors[j], name=tensors[i].name)
    return _rebuild(b, tensors=tensors), r"appears twice"


def tensor_ne0_not_block(rng: random.Random, b: Base) -> Generated:
    quant = [t for t in b.layout.tensors if GGML_QUANT_SIZES.get(t.ttype, (1, 1))[0] > 1]  # type: ignore[call-overload]
    if not quant:  # make one: a quantized type over a float tensor's shape
        t = _tensor(rng, b)
        return _patch(b.head, _tensor_fields(t)[2], "<I", 8), r"not a multiple|past the end"
    t = rng.choice(quant)
    block = GGML_QUANT_SIZES[t.ttype][0]  # type: ignore[index]
    bad = t.dims[0] + rng.choice((1, block // 2, block - 1, -1))
    return _patch(b.head, _tensor_fields(t)[1], "<Q", max(bad, 1)), r"not a multiple"


def tensor_overlap(rng: random.Random, b: Base) -> Generated:
    """Two tensors sharing bytes: accepted (read-only views), unlike llama.cpp's stricter layout check."""
    tensors = list(b.layout.tensors)
    i, j = rng.sample(range(len(tensors)), 2)
    tensors[j] = replace(tensors[j], offset=tensors[i].offset)
    return _rebuild(b, tensors=tensors), EXPECT_ANY


def tensor_long_name(rng: random.Random, b: Base) -> Generated:
    tensors = list(b.layout.tensors)
    i = rng.randrange(len(tensors))
    tensors[i] = replace(tensors[i], name=hostile_string(rng, long=True).encode("utf-8", "surrogateescape"))
    return _rebuild(b, tensors=tensors), EXPECT_ANY


# -- data and truncation -------------------------------------------------------------------------


def data_not_enough(rng: random.Random, b: Base) -> Generated:
    return b.head[: len(b.head) - rng.choice((1, 2, 31, 32, 4096))], r"past the end|too small"


def truncate_at_boundary(rng: random.Random, b: Base) -> Generated:
    return b.head[: rng.choice(b.layout.fields[:-1])], EXPECT_ERROR


# -- hostile values in a well-formed file ------------------------------------------------------


def _meta_expect(key: str) -> str:
    """Well-formed files open, except that general.alignment is the reader's own business."""
    return EXPECT_ANY if key == "general.alignment" else EXPECT_OK


def meta_type_confusion(rng: random.Random, b: Base) -> Generated:
    key = rng.choice(read_keys(b))
    vtype, value = hostile_value(rng, any_type=True)
    return _with_kv(b, key.encode(), vtype, value), _meta_expect(key)


def meta_bad_numbers(rng: random.Random, b: Base) -> Generated:
    key = rng.choice(numeric_keys(b))
    vtype, value = hostile_value(rng, any_type=False)
    return _with_kv(b, key.encode(), vtype, value), _meta_expect(key)


def meta_strings(rng: random.Random, b: Base) -> Generated:
    key = rng.choice(read_keys(b))
    return _with_kv(b, key.encode(), VT.STRING, enc_string(hostile_string(rng, long=rng.random() < 0.2))), _meta_expect(key)


def template_hostile(rng: random.Random, b: Base) -> Generated:
    return _with_kv(b, b"tokenizer.chat_template", VT.STRING, enc_string(hostile_template(rng))), EXPECT_OK


STRUCTURED: dict[str, Generator] = {
    "header.bad_magic": bad_magic, "header.bad_version": bad_version, "header.huge_n_tensors": huge_n_tensors,
    "header.huge_n_kv": huge_n_kv, "header.empty": empty_header,
    "kv.key_len_huge": key_len_huge, "kv.string_len_past_end": string_len_past_end, "kv.array_len_huge": array_len_huge,
    "kv.bad_value_type": bad_value_type, "kv.bad_array_elem_type": bad_array_elem_type, "kv.deep_nesting": deep_nesting,
    "kv.duplicate_key": duplicate_key, "kv.random_kvs": random_kvs,
    "align.bad_value": bad_alignment, "align.wrong_type": alignment_wrong_type, "align.custom": custom_alignment,
    "align.huge": huge_alignment,
    "tensor.name_len_huge": tensor_name_len_huge, "tensor.bad_n_dims": tensor_bad_n_dims,
    "tensor.zero_dim": tensor_zero_dim, "tensor.negative_dim": tensor_negative_dim, "tensor.ne_too_big": tensor_ne_too_big,
    "tensor.bad_type": tensor_bad_type, "tensor.unsupported_type": tensor_unsupported_type,
    "tensor.offset_past_end": tensor_offset_past_end, "tensor.offset_misaligned": tensor_offset_misaligned,
    "tensor.size_past_end": tensor_size_past_end, "tensor.duplicate_name": tensor_duplicate_name,
    "tensor.ne0_not_block": tensor_ne0_not_block, "tensor.overlap": tensor_overlap, "tensor.long_name": tensor_long_name,
    "data.not_enough": data_not_enough, "truncate.boundary": truncate_at_boundary,
    "meta.type_confusion": meta_type_confusion, "meta.bad_numbers": meta_bad_numbers, "meta.strings": meta_strings,
    "template.hostile": template_hostile,
}
