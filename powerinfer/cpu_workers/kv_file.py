"""A slot's KV cache in a file (llama-server's slot save and restore): its layout, and the reads and
writes of one holder's key-value heads.

Runs in: the coordinator (the header; the in-process executors' caches) and each CPU worker of the
native pool (its own kv heads, written at their place in the same file).

Layout (little-endian)::

    magic "PIKVSLOT", u32 version, u32 header length H
    header: H bytes of JSON: the model's identity and KV geometry, the cache layout ("native" or
            "torch": the torch shards keep keys with rotary rows permuted), the n cached tokens
    padding to 64 bytes, then per layer l in order:
        K [n_kv, n, D] float32, then V [n_kv, n, Dv] float32

A holder of kv heads [kv0, kv1) of a layer reads and writes [kv0:kv1] of both blocks, so however
the heads are split between processes (the pool's ranks, torch shards), they fill one file that
any split of the same model and layout restores.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import asdict, dataclass
from typing import Any, Iterable

import numpy as np

from powerinfer.errors import InvalidArgumentError

MAGIC = b"PIKVSLOT"
VERSION = 1
MAX_HEADER = 64 << 20  # the token list of a 1M-token context fits with room to spare


@dataclass(frozen=True)
class KvGeometry:
    n_layers: int
    n_kv: int
    head_dim: int  # D, keys
    v_head_dim: int  # Dv, values

    def layer_bytes(self, n: int) -> int:
        return self.n_kv * n * (self.head_dim + self.v_head_dim) * 4


def data_offset(header_len: int) -> int:
    return (len(MAGIC) + 8 + header_len + 63) & ~63


def write_header(path: str, model: dict[str, Any], geo: KvGeometry, layout: str, tokens: list[int]) -> int:
    """Create path (replacing it) sized for the whole cache; returns the data's offset."""
    head = json.dumps({"model": model, "geometry": asdict(geo), "layout": layout, "tokens": tokens}, separators=(",", ":")).encode()
    off = data_offset(len(head))
    with open(path, "wb") as fh:
        fh.write(MAGIC + struct.pack("<II", VERSION, len(head)) + head)
        fh.truncate(off + geo.n_layers * geo.layer_bytes(len(tokens)))
    return off


def read_header(path: str) -> tuple[dict[str, Any], int]:
    """(the header, the data's offset); InvalidArgumentError for a file that is not a slot file or is cut short."""
    try:
        with open(path, "rb") as fh:
            first = fh.read(len(MAGIC) + 8)
            if len(first) < len(MAGIC) + 8 or first[: len(MAGIC)] != MAGIC:
                raise InvalidArgumentError(f"{os.path.basename(path)} is not a saved slot")
            version, n = struct.unpack("<II", first[len(MAGIC):])
            if version != VERSION:
                raise InvalidArgumentError(f"{os.path.basename(path)} is a version {version} slot file; this build reads version {VERSION}")
            if n > MAX_HEADER:
                raise InvalidArgumentError(f"{os.path.basename(path)}: its header claims {n} bytes")
            head = json.loads(fh.read(n))
            size = os.fstat(fh.fileno()).st_size
    except (OSError, ValueError) as e:
        raise InvalidArgumentError(f"cannot read {os.path.basename(path)}: {e}") from None
    try:
        geo = KvGeometry(**head["geometry"])
        tokens = head["tokens"]
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens) or not isinstance(head.get("model"), dict):
            raise TypeError("bad fields")
    except (KeyError, TypeError) as e:
        raise InvalidArgumentError(f"{os.path.basename(path)}: a malformed slot header ({e})") from None
    off = data_offset(n)
    if size < off + geo.n_layers * geo.layer_bytes(len(tokens)):
        raise InvalidArgumentError(f"{os.path.basename(path)} is cut short: {size} bytes")
    return head, off


def write_heads(fd: int, off: int, geo: KvGeometry, n: int, layer: int, kv0: int, k: np.ndarray, v: np.ndarray) -> None:
    """Write kv heads [kv0, kv0 + len(k)) of layer: k [h, n, D] and v [h, n, Dv] float32."""
    base = off + layer * geo.layer_bytes(n)
    os.pwrite(fd, np.ascontiguousarray(k, dtype=np.float32).tobytes(), base + kv0 * n * geo.head_dim * 4)
    os.pwrite(fd, np.ascontiguousarray(v, dtype=np.float32).tobytes(), base + geo.n_kv * n * geo.head_dim * 4 + kv0 * n * geo.v_head_dim * 4)


def read_heads(fd: int, off: int, geo: KvGeometry, n: int, layer: int, kv0: int, h: int) -> tuple[np.ndarray, np.ndarray]:
    """kv heads [kv0, kv0 + h) of layer: (k [h, n, D], v [h, n, Dv]) float32."""
    base = off + layer * geo.layer_bytes(n)
    kb, vb = h * n * geo.head_dim * 4, h * n * geo.v_head_dim * 4
    k = os.pread(fd, kb, base + kv0 * n * geo.head_dim * 4)
    v = os.pread(fd, vb, base + geo.n_kv * n * geo.head_dim * 4 + kv0 * n * geo.v_head_dim * 4)
    if len(k) != kb or len(v) != vb:
        raise InvalidArgumentError("the slot file is cut short")
    return (np.frombuffer(k, dtype=np.float32).reshape(h, n, geo.head_dim), np.frombuffer(v, dtype=np.float32).reshape(h, n, geo.v_head_dim))


Holder = tuple[int, int, Any, Any]  # (layer, first kv head, k cache [slots, h, n_ctx, D], v cache [slots, h, n_ctx, Dv]): numpy or torch


def save_caches(path: str, off: int, geo: KvGeometry, slot: int, n: int, holders: Iterable[Holder]) -> None:
    """These caches' heads of slot's first n positions -> their places in the file."""
    fd = os.open(path, os.O_WRONLY)
    try:
        for layer, kv0, k, v in holders:
            write_heads(fd, off, geo, n, layer, kv0, np.asarray(k[slot, :, :n]), np.asarray(v[slot, :, :n]))
    finally:
        os.close(fd)


def load_caches(path: str, off: int, geo: KvGeometry, slot: int, n: int, holders: Iterable[Holder]) -> None:
    """The file -> these caches' heads of slot's first n positions."""
    fd = os.open(path, os.O_RDONLY)
    try:
        for layer, kv0, k, v in holders:
            kk, vv = read_heads(fd, off, geo, n, layer, kv0, int(k.shape[1]))
            if isinstance(k, np.ndarray):
                k[slot, :, :n], v[slot, :, :n] = kk, vv
            else:  # torch
                import torch

                k[slot, :, :n] = torch.from_numpy(kk.copy())
                v[slot, :, :n] = torch.from_numpy(vv.copy())
    finally:
        os.close(fd)
