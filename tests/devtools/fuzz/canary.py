"""A deliberately misbehaving loader, to prove the fuzz harness notices every kind of failure.

Runs in: the fuzz worker process started by tests/devtools/fuzz/test_file_fuzz.py (imported by name there).
What it does is chosen by the case file's content: crash the interpreter, hang, allocate more
than the worker's address-space limit, raise a non-PowerInferError, raise a two-line message.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from powerinfer.errors import ModelFileError
from powerinfer.devtools.fuzz.load import Stages, load_case

HUGE = 8 << 30  # more than the 1 GiB headroom the test gives the worker, far less than 2**63


def _act(content: bytes) -> None:
    if content == b"crash":
        os.abort()
    if content == b"hang":
        time.sleep(600)
    if content == b"alloc":
        bytearray(HUGE)  # sized by a "count" nobody checked: MemoryError under RLIMIT_AS
    if content == b"typeerror":
        raise TypeError("len() of an int")
    if content == b"badmsg":
        raise ModelFileError("first line\nsecond line")
    if content == b"clean":
        raise ModelFileError("a clean one-line refusal")


def load(job: Mapping[str, Any]) -> dict[str, Any]:
    path = Path(job["path"])
    if path.stat().st_size > 16:  # warm-up with a real base file: the normal pipeline
        return load_case(job)
    stages = Stages()
    stages.run("open", lambda: _act(path.read_bytes()))
    return {"stages": stages.results, "elapsed": 0.0}
