"""Several models in one daemon (repeated -m, --models-dir): each loads at its first request, the
least recently used idle one is unloaded to stay within --models-memory, a file that cannot load
fails its own requests while the others serve, an unknown name is a 404 that lists them.

Runs in: the pytest process; the server (and its workers) in processes of their own.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Iterator

import httpx
import psutil
import pytest

from powerinfer.server.host import estimate_bytes
from tests.server.conftest import RunningServer, start_server

pytestmark = pytest.mark.real_model

CTX, SLOTS = 512, 2
MESSAGES = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def models_dir(smollm2_path: Path, gemma3_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("models")
    for p in (smollm2_path, gemma3_path):
        (d / p.name).symlink_to(p)
    (d / "broken.gguf").write_bytes(b"GGUF" + b"\0" * 60)  # a header and nothing behind it
    return d


@pytest.fixture(scope="module")
def budget(smollm2_path: Path, gemma3_path: Path) -> int:
    """Room for either model as estimated before loading (each is measured once loaded, and takes less), not both."""
    return max(estimate_bytes(str(p), CTX, SLOTS, 2) for p in (smollm2_path, gemma3_path)) + (1 << 20)  # GiB on the command line: a margin for rounding


@pytest.fixture(scope="module")
def server(models_dir: Path, budget: int, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    s = start_server(None, tmp_path_factory.mktemp("multi"), "--models-dir", str(models_dir), "-c", str(CTX), "--parallel", str(SLOTS),
                     "-t", "2", "--models-memory", f"{budget / 2**30:.6f}")
    yield s
    s.stop()


def _tree_pss(pid: int) -> int:  # the server's and its workers', bytes
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    total = 0
    for p in procs:
        try:
            total += p.memory_full_info().pss
        except psutil.NoSuchProcess:
            pass
    return total


def _chat(server: RunningServer, model: str) -> httpx.Response:
    return httpx.post(server.base_url + "/chat/completions", json={"model": model, "messages": MESSAGES, "max_tokens": 8, "temperature": 0},
                      timeout=300)


def _states(server: RunningServer) -> dict[str, str]:
    return {d["id"]: d["status"]["value"] for d in httpx.get(server.base_url + "/models", timeout=30).json()["data"]}


def test_models_switch_per_request_within_the_budget(server: RunningServer, smollm2_path: Path, gemma3_path: Path, budget: int) -> None:
    small, gemma = smollm2_path.stem, gemma3_path.stem
    assert httpx.get(server.url + "/health", timeout=30).json() == {"status": "ok"}
    assert set(_states(server).values()) == {"unloaded"}
    base = _tree_pss(server.proc.pid)
    answers: dict[str, list[str]] = {small: [], gemma: []}
    for i, model in enumerate((small, gemma, small, gemma)):
        r = _chat(server, model)
        assert r.status_code == 200 and r.json()["model"] == model, r.text
        answers[model].append(r.json()["choices"][0]["message"]["content"])
        states = _states(server)
        assert states[model] == "loaded"
        if i == 1:  # the first switch: the model loaded first counts as measured, the other as estimated: no room for both
            assert states[small] == "unloaded"
        assert _tree_pss(server.proc.pid) - base <= budget
    assert answers[small][0] == answers[small][1] and answers[gemma][0] == answers[gemma][1]  # reloaded, the same answers


def test_a_bad_file_fails_alone(server: RunningServer, smollm2_path: Path) -> None:
    r = _chat(server, "broken")
    assert r.status_code == 503 and r.json()["error"]["code"] == "model_load_failed", r.text
    assert _states(server)["broken"] == "failed"
    assert _chat(server, smollm2_path.stem).status_code == 200


def test_unknown_model_lists_the_served_ones(server: RunningServer, smollm2_path: Path) -> None:
    r = _chat(server, "no-such-model")
    assert r.status_code == 404 and smollm2_path.stem in r.json()["error"]["message"] and "broken" in r.json()["error"]["message"]


@pytest.mark.parametrize("argv, msg", [
    ([], "give a model"),
    (["--models-dir", "/nonexistent/folder"], "not a folder"),
    (["-m", "a.gguf", "-m", "b.gguf", "--alias", "x"], "--alias names the one model"),
    (["-m", "x/a.gguf", "-m", "y/a.gguf"], "both be named 'a'"),
])
def test_bad_model_flags(argv: list[str], msg: str, capsys: pytest.CaptureFixture[str]) -> None:
    from powerinfer.server.main import main

    assert main([*argv, "--port", "0"]) == 2
    assert msg in capsys.readouterr().err


def test_room_is_made_by_unloading_idle_models_least_recently_used_first() -> None:
    """ServerState's budget arithmetic on stand-in hosts: idle ones go oldest first, busy or held
    ones stay, and what cannot fit is refused with both sizes named."""
    from powerinfer.server.app import ServerState
    from powerinfer.server.requests import APIError
    from powerinfer.server.settings import ServerConfig

    gib = 2**30
    cfg = ServerConfig(model_id="a", models=(("a", "a.gguf", 3 * gib), ("b", "b.gguf", 3 * gib), ("c", "c.gguf", 3 * gib),
                                             ("huge", "h.gguf", 20 * gib)), models_memory=7 * gib)
    state = ServerState(cfg, lambda path: None)  # type: ignore[arg-type,return-value]
    closed: list[str] = []
    for i, name in enumerate(("a", "b")):
        h = state.hosts[name]
        h.scheduler = SimpleNamespace(active=[], waiting=[], calls=[])  # type: ignore[assignment]  # "loaded", idle
        h.last_used = float(i)
        h.close = (lambda n: lambda timeout=10.0: (closed.append(n), setattr(state.hosts[n], "scheduler", None)))(name)  # type: ignore[method-assign]
    state.hosts["a"].leases = 1  # held by a request: not unloaded although oldest
    state._make_room(state.hosts["c"])  # noqa: SLF001 - the rule itself
    assert closed == ["b"]
    with pytest.raises(APIError) as e:
        state._make_room(state.hosts["huge"])  # noqa: SLF001
    assert e.value.status == 503 and "20.0 GiB" in str(e.value) and "7.0 GiB" in str(e.value)
    state.hosts["b"].scheduler = SimpleNamespace(active=[], waiting=[], calls=[])  # type: ignore[assignment]
    state.hosts["b"].leases = 1
    with pytest.raises(APIError, match="busy"):  # a and b held: no room for c now, try again
        state._make_room(state.hosts["c"])  # noqa: SLF001
