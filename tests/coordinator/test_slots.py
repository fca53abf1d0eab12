"""Slot save and restore on synthetic models (coordinator/slots.py, cpu_workers/kv_file.py): the
restored cache is the saved one (a continuation equals the original's, and a cache scribbled over
in the file changes it), on the native decoder and the torch shards, split or not.

Runs in: the pytest process (in-process executors).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from powerinfer.api import LLM
from powerinfer.coordinator.slots import restore_slot, save_slot
from powerinfer.cpu_workers.kv_file import read_header
from powerinfer.errors import InvalidArgumentError

PROMPT = [256, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]


@pytest.mark.parametrize("kw", [{"executor": "inprocess"}, {"executor": "inprocess", "native": False},
                                {"executor": "inprocess", "native": False, "n_shards": 2}], ids=["native", "torch", "torch-2-shards"])
def test_round_trip(make_model: Callable[..., Path], tmp_path: Path, kw: dict) -> None:
    llm = LLM(make_model(arch="gemma3", qtype=QT.Q4_0, n_layers=2), n_ctx=64, n_slots=2, **kw)
    try:
        eng = llm.engine
        list(llm.generate(PROMPT, 6, temperature=0))
        cached = list(eng.slot_tokens[0])
        more = cached + [33, 34]
        want = eng.eval(more[len(cached):], slot=0)  # the logits of the continuation on the live cache
        eng.rewind(len(cached), 0)
        path = str(tmp_path / "s.bin")
        n, size = save_slot(eng, 0, path)
        assert n == len(cached) and size == os.path.getsize(path)
        head, off = read_header(path)
        assert head["tokens"] == cached
        eng.rewind_all()
        eng.eval([256, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], slot=1)  # slot 1 holds other positions' KV
        restore_slot(eng, 1, path)
        assert eng.slot_tokens[1] == cached
        assert np.array_equal(eng.eval(more[len(cached):], slot=1), want)
        # scribble over the file's cache: the restored cache is what the file says, so the logits move
        with open(path, "r+b") as fh:
            fh.seek(off)
            fh.write(np.full((size - off) // 4, 3.0, np.float32).tobytes())
        restore_slot(eng, 1, path)
        assert not np.array_equal(eng.eval(more[len(cached):], slot=1), want)
    finally:
        llm.close()


def test_refusals(make_model: Callable[..., Path], tmp_path: Path) -> None:
    a = LLM(make_model(arch="llama", qtype=QT.Q4_0, n_layers=2), n_ctx=64, executor="inprocess")
    b = LLM(make_model(arch="llama", qtype=QT.Q4_0, n_layers=3), n_ctx=64, executor="inprocess")
    torch_ex = LLM(make_model(arch="llama", qtype=QT.Q4_0, n_layers=2), n_ctx=64, executor="inprocess", native=False)
    try:
        with pytest.raises(InvalidArgumentError, match="holds no tokens"):
            save_slot(a.engine, 0, str(tmp_path / "empty.bin"))
        assert not (tmp_path / "empty.bin").exists()
        list(a.generate(PROMPT, 2, temperature=0))
        path = str(tmp_path / "a.bin")
        save_slot(a.engine, 0, path)
        with pytest.raises(InvalidArgumentError, match="another model"):
            restore_slot(b.engine, 0, path)
        with pytest.raises(InvalidArgumentError, match="torch KV cache|native KV cache"):
            restore_slot(torch_ex.engine, 0, path)
        with pytest.raises(InvalidArgumentError, match="out of range"):
            save_slot(a.engine, 3, path)
        assert not [p for p in os.listdir(tmp_path) if p.endswith(".part")]  # nothing half-written left behind
    finally:
        for m in (a, b, torch_ex):
            m.close()
