"""GGUF reader: metadata and tensor views on good files, one clear error on bad ones."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from powerinfer.config import config_from_gguf
from powerinfer.errors import ModelFileError, UnsupportedModelError
from powerinfer.gguf_file import GGUFFile


def test_reads_metadata_and_tensor_views(make_model: Callable[..., Path]) -> None:
    f = GGUFFile(make_model(qtype=QT.Q8_0))
    assert f.metadata["general.architecture"] == "llama"
    assert len(f.metadata["tokenizer.ggml.tokens"]) == 258
    info = f.tensor("blk.0.ffn_down.weight")
    assert info.shape == (64, 160) and info.qtype == QT.Q8_0
    raw = f.raw("blk.0.ffn_down.weight")
    assert raw.shape == (64, 160 // 32 * 34) and raw.dtype == np.uint8
    assert not raw.flags.writeable  # a view into the read-only map, not a copy
    assert f.raw("blk.0.attn_norm.weight").dtype == np.float32


def test_config_from_metadata(make_model: Callable[..., Path]) -> None:
    cfg = config_from_gguf(GGUFFile(make_model(arch="gemma3", n_layers=6)))
    assert (cfg.n_layers, cfg.d_model, cfg.n_ff, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (6, 64, 160, 4, 2, 16)
    assert cfg.global_layers == (False,) * 5 + (True,)
    assert cfg.rope_base_local == 10000.0 and cfg.sliding_window == 8 and cfg.tied_embeddings
    assert cfg.embed_scale == pytest.approx(8.0) and cfg.activation == "gelu_tanh" and cfg.rope_style == "neox"


def test_missing_path_and_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match="no such file"):
        GGUFFile(tmp_path / "nope.gguf")
    with pytest.raises(ModelFileError, match="is a directory"):
        GGUFFile(tmp_path)


def _corrupt(src: Path, dst: Path, edit: Callable[[bytearray], bytearray]) -> Path:
    dst.write_bytes(bytes(edit(bytearray(src.read_bytes()))))
    return dst


def _header_end(data: bytes) -> int:
    """Offset just past magic, version, n_tensors, n_kv."""
    return 4 + 4 + 8 + 8


@pytest.mark.parametrize(
    "name,edit,message",
    [
        ("magic", lambda b: bytearray(b"GGML") + b[4:], "not a GGUF file"),
        ("version", lambda b: b[:4] + struct.pack("<I", 99) + b[8:], "unsupported GGUF version 99"),
        ("bigendian", lambda b: b[:4] + struct.pack(">I", 3) + b[8:], "big-endian"),
        ("tensors", lambda b: b[:8] + struct.pack("<Q", 2**40) + b[16:], "more than fit"),
        ("kvs", lambda b: b[:16] + struct.pack("<Q", 2**50) + b[24:], "more than fit"),
        ("truncated_header", lambda b: b[:200], "past the end|more than fit"),
        ("truncated_kv", lambda b: b[:2000], "past the end|more than the file holds"),
        ("truncated_vocab", lambda b: b[:1500], "past the end|more than the file holds"),
        ("truncated_data", lambda b: b[: len(b) - 1000], "past the end of the file"),
        ("empty", lambda b: bytearray(), "too small"),
        ("keylen", lambda b: b[:24] + struct.pack("<Q", 2**62) + b[32:], "implausibly large"),
    ],
)
def test_malformed_files_give_one_clear_error(make_model: Callable[..., Path], tmp_path: Path, name: str, edit, message: str) -> None:  # type: ignore[no-untyped-def]
    bad = _corrupt(make_model(), tmp_path / f"{name}.gguf", edit)
    with pytest.raises(ModelFileError, match=message) as e:
        GGUFFile(bad)
    assert "\n" not in str(e.value)


def test_unknown_tensor_type_and_zero_dim(make_model: Callable[..., Path], tmp_path: Path) -> None:
    src = make_model()
    data = src.read_bytes()
    name = b"blk.0.attn_norm.weight"
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    # tensor info: n_dims u32, dims u64 * n, type u32, offset u64
    n_dims = struct.unpack_from("<I", data, at)[0]
    type_at = at + 4 + 8 * n_dims
    bad = bytearray(data)
    bad[type_at : type_at + 4] = struct.pack("<I", 250)
    (tmp_path / "t.gguf").write_bytes(bytes(bad))
    with pytest.raises(ModelFileError, match="unknown tensor type id 250"):
        GGUFFile(tmp_path / "t.gguf")
    bad = bytearray(data)
    bad[at + 4 : at + 12] = struct.pack("<Q", 0)
    (tmp_path / "z.gguf").write_bytes(bytes(bad))
    with pytest.raises(ModelFileError, match="zero dimension"):
        GGUFFile(tmp_path / "z.gguf")


def test_unsupported_architecture(make_model: Callable[..., Path], tmp_path: Path) -> None:
    data = make_model().read_bytes()
    # same length as "llama" so offsets stay valid
    bad = data.replace(b"\x05\x00\x00\x00\x00\x00\x00\x00llama", b"\x05\x00\x00\x00\x00\x00\x00\x00mamba", 1)
    (tmp_path / "a.gguf").write_bytes(bad)
    with pytest.raises(UnsupportedModelError, match="architecture 'mamba' is not supported"):
        config_from_gguf(GGUFFile(tmp_path / "a.gguf"))
