"""Saving a KV slot to a file and restoring it (llama-server's ``/slots`` save and restore).

Runs in: the coordinator (the server's scheduler thread, between steps: nothing else touches the
model meanwhile).

The file holds the slot's cached tokens and their KV cache (layout: cpu_workers/kv_file.py); the
executor writes or reads the cache where it lives (in this process, or each native rank its own
kv heads). A restored slot is as if its tokens had just been computed: a prompt that starts with
them reuses them, and what it generates is what the saved slot would have generated.
"""

from __future__ import annotations

import os
from typing import Any

from powerinfer.coordinator.engine import Engine
from powerinfer.coordinator.executor import no_kv
from powerinfer.cpu_workers.kv_file import KvGeometry, read_header, write_header
from powerinfer.errors import InvalidArgumentError


def geometry(engine: Engine) -> KvGeometry:
    cfg = engine.cfg
    return KvGeometry(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, cfg.v_head_dim)


def identity(engine: Engine) -> dict[str, Any]:
    """What a slot file must match to be restored here: the same model file, as far as size and
    shape tell."""
    cfg = engine.cfg
    return {"name": cfg.name, "arch": cfg.arch, "file_bytes": os.path.getsize(engine.f.path), "d_model": cfg.d_model,
            "vocab": cfg.vocab_size}


def _layout(engine: Engine) -> str:
    """The executor's KV layout; the executor's own refusal where it cannot reach its cache."""
    layout = engine.executor.describe().kv_layout
    if layout is None:
        no_kv("this executor")
    return layout


def save_slot(engine: Engine, slot: int, path: str) -> tuple[int, int]:
    """slot's cached tokens and their KV cache -> path (written aside and renamed: an old file of
    that name is replaced only by a whole new one) -> (tokens, bytes written)."""
    layout = _layout(engine)
    tokens = list(engine.slot_tokens[slot]) if 0 <= slot < engine.n_slots else None
    if tokens is None:
        raise InvalidArgumentError(f"slot {slot} out of range (0..{engine.n_slots - 1})")
    if not tokens:
        raise InvalidArgumentError(f"slot {slot} holds no tokens to save")
    tmp = f"{path}.{os.getpid()}.part"
    try:
        off = write_header(tmp, identity(engine), geometry(engine), layout, tokens)
        engine.executor.save_kv(slot, len(tokens), tmp, off)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return len(tokens), os.path.getsize(path)


def restore_slot(engine: Engine, slot: int, path: str) -> tuple[int, int]:
    """path -> slot's cache (what the slot held before is forgotten) -> (tokens, bytes read)."""
    layout = _layout(engine)
    if not 0 <= slot < engine.n_slots:
        raise InvalidArgumentError(f"slot {slot} out of range (0..{engine.n_slots - 1})")
    head, off = read_header(path)
    name = os.path.basename(path)
    if head["model"] != identity(engine):
        raise InvalidArgumentError(f"{name} was saved from another model ({head['model'].get('name')!r}, "
                                   f"{head['model'].get('file_bytes')} bytes); this server runs {engine.cfg.name!r}")
    geo = geometry(engine)
    if head["layout"] != layout or head["geometry"] != geo.__dict__:
        raise InvalidArgumentError(f"{name} holds a {head['layout']} KV cache; this executor keeps a {layout} one")
    tokens: list[int] = head["tokens"]
    if not tokens or len(tokens) > engine.n_ctx:
        raise InvalidArgumentError(f"{name} holds {len(tokens)} tokens; a slot here holds 1..{engine.n_ctx}")
    if any(not 0 <= t < engine.cfg.vocab_size for t in tokens):
        raise InvalidArgumentError(f"{name} holds token ids outside the vocabulary")
    engine.rewind(0, slot)  # a restore that fails part way leaves an empty slot, never a half-restored one
    engine.executor.load_kv(slot, len(tokens), path, off)
    engine.slot_tokens[slot].extend(tokens)
    return len(tokens), geo.n_layers * geo.layer_bytes(len(tokens))
