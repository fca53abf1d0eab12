"""llama-server's /slots on SmolLM2: a slot's KV cache saved, erased and restored (into another
slot) gives the very generation of the original; bad file names, missing and foreign files, busy
slots and unknown actions are refused.

Runs in: the pytest process; the server runs in its own process (its native ranks write and read
their kv heads of the file).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from powerinfer.server.requests import APIError
from powerinfer.server.slots_api import check_filename
from tests.server.conftest import RunningServer, serving

pytestmark = pytest.mark.real_model

BAD_NAMES = ["../a.bin", "..", ".", "a/b", "/etc/passwd", "a\\b", "..\\a", " a", "a ", ".hidden", "a\x00b", "a\nb", "x" * 256, "", "c:evil"]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_bad_file_names_are_refused(name: str) -> None:
    with pytest.raises(APIError) as e:
        check_filename(name)
    assert e.value.status == 400


def test_plain_names_pass() -> None:
    for name in ("a.bin", "slot-1_2026.kv", "été.bin", "x" * 255):
        assert check_filename(name) == name


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("slots") / "saved"  # the server creates it


@pytest.fixture(scope="module")
def server(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory, folder: Path) -> Iterator[RunningServer]:
    yield from serving(smollm2_path, tmp_path_factory, "slots", "-c", "512", "--parallel", "2", "-t", "2", "--slot-save-path", str(folder))


def _complete(server: RunningServer, prompt: str, n: int = 16) -> dict:
    return httpx.post(server.base_url + "/completions", json={"prompt": prompt, "max_tokens": n, "temperature": 0}, timeout=120).json()


def _action(server: RunningServer, slot: int, action: str, **body: object) -> httpx.Response:
    return httpx.post(f"{server.url}/slots/{slot}?action={action}", json=body, timeout=120)


PROMPT = "The history of the printing press begins in the fifteenth century, when"


def test_save_erase_restore_round_trip(server: RunningServer, folder: Path) -> None:
    first = _complete(server, PROMPT)
    slots = httpx.get(server.url + "/slots", timeout=30).json()
    used = max(slots, key=lambda s: s["n_cached"])["id"]
    n_cached = slots[used]["n_cached"]
    saved = _action(server, used, "save", filename="press.bin").json()
    assert saved["n_saved"] == n_cached and saved["n_written"] == (folder / "press.bin").stat().st_size
    for s in range(2):
        _action(server, s, "erase")
    assert all(s["n_cached"] == 0 for s in httpx.get(server.url + "/slots", timeout=30).json())
    other = 1 - used
    restored = _action(server, other, "restore", filename="press.bin").json()
    assert restored["n_restored"] == n_cached and restored["id_slot"] == other
    again = _complete(server, PROMPT)
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    # the restored cache served it: all of the prompt but its last token came from the file
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == again["usage"]["prompt_tokens"] - 1


def test_refusals(server: RunningServer, folder: Path) -> None:
    assert _action(server, 0, "save", filename="../escape.bin").status_code == 400
    assert not (folder.parent / "escape.bin").exists()
    assert _action(server, 0, "frobnicate", filename="a.bin").status_code == 400
    assert _action(server, 7, "save", filename="a.bin").status_code == 400
    r = _action(server, 0, "restore", filename="missing.bin")
    assert r.status_code == 404 and "missing.bin" in r.json()["error"]["message"]
    (folder / "junk.bin").write_bytes(b"not a slot file at all")
    assert _action(server, 0, "restore", filename="junk.bin").status_code == 400
    # a slot file of another model (its header says so) is refused, and the slot is left as it was
    _complete(server, "Hello there", 4)
    assert _action(server, 0, "save", filename="mine.bin").status_code == 200 or _action(server, 1, "save", filename="mine.bin").status_code == 200
    raw = (folder / "mine.bin").read_bytes()
    n = int.from_bytes(raw[12:16], "little")
    head = json.loads(raw[16 : 16 + n])
    head["model"]["name"] = "someone-else"
    new = json.dumps(head, separators=(",", ":")).encode().ljust(n)  # same length: the data stay in place
    (folder / "foreign.bin").write_bytes(raw[:16] + new + raw[16 + n :])
    r = _action(server, 0, "restore", filename="foreign.bin")
    assert r.status_code == 400 and "another model" in r.json()["error"]["message"], r.text
    (folder / "short.bin").write_bytes(raw[: len(raw) // 2])
    assert _action(server, 0, "restore", filename="short.bin").status_code == 400


def test_a_busy_slot_is_not_touched(server: RunningServer) -> None:
    body = {"prompt": "Count from one to one hundred: one, two,", "max_tokens": 400, "temperature": 0, "stream": True}
    started = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", server.base_url + "/completions", json=body, timeout=120) as r:
            for _ in r.iter_lines():
                started.set()

    t = threading.Thread(target=stream)
    t.start()
    try:
        assert started.wait(60)
        busy = [s["id"] for s in httpx.get(server.url + "/slots", timeout=30).json() if s["is_processing"]]
        assert busy
        r = _action(server, busy[0], "save", filename="busy.bin")
        assert r.status_code == 409, r.text
    finally:
        t.join(120)
