"""Fault injection on a running server: workers killed or stopped during prefill, decode and streaming,
the server itself killed. Each has a defined outcome:

* the requests in flight get a clear error (503 ``worker_failed``, or an SSE error event once a
  stream has begun): a restarted worker pool holds no KV cache, so they cannot continue;
* the runtime restarts the pool and every later request is served normally;
* no process is left behind (a SIGSTOPped worker is SIGKILLed during the restart; workers die with
  a SIGKILLed server).

Runs in: the pytest process; the server is a subprocess with 2 CPU worker processes.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx
import psutil
import pytest

from tests.processes.children import worker_children
from tests.server.conftest import RunningServer, start_server

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def server(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    s = start_server(smollm2_path, tmp_path_factory.mktemp("faults"), "-c", "512", "--parallel", "2", "-t", "2",
                     "--worker-threads", "1")
    yield s
    s.stop()


def workers(server: RunningServer) -> list[psutil.Process]:
    return worker_children(server.proc.pid)


def stream_events(server: RunningServer, after: int, fault: signal.Signals | None, max_tokens: int = 300) -> tuple[list[dict], psutil.Process | None]:
    """Stream a completion; after `after` events send `fault` to a worker; return all events."""
    events: list[dict] = []
    victim = None
    with httpx.stream("POST", server.base_url + "/completions", timeout=60,
                      json={"prompt": "Count: 1, 2, 3,", "max_tokens": max_tokens, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events.append(json.loads(line[6:]))
            if len(events) == after and fault is not None:
                victim = workers(server)[1]
                os.kill(victim.pid, fault)
    return events, victim


def wait_healthy(server: RunningServer, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while httpx.get(server.url + "/health").status_code != 200:
        assert time.monotonic() < deadline, "the server did not recover"
        time.sleep(0.1)


def served_normally(server: RunningServer) -> None:
    wait_healthy(server)
    r = httpx.post(server.base_url + "/completions", json={"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith(" Paris")


@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSTOP], ids=["SIGKILL", "SIGSTOP"])
def test_worker_fault_while_streaming(server: RunningServer, fault: signal.Signals) -> None:
    t0 = time.monotonic()
    events, victim = stream_events(server, after=5, fault=fault)
    assert "error" in events[-1], events[-1]
    err = events[-1]["error"]
    assert err["code"] == "worker_failed" and ("SIGKILL" in err["message"] or "stopped answering" in err["message"])
    assert time.monotonic() - t0 < 30  # a stopped worker is declared dead after its heartbeat timeout (3 s)
    served_normally(server)
    assert victim is not None and (not victim.is_running() or victim.status() == psutil.STATUS_ZOMBIE)  # killed and reaped
    assert len(workers(server)) == 2


def test_worker_killed_during_prefill(server: RunningServer) -> None:
    long_prompt = "The history of the city " * 80  # ~400 tokens: prefill takes a while on 2 workers
    result: dict[str, httpx.Response] = {}

    def ask() -> None:
        result["r"] = httpx.post(server.base_url + "/completions", json={"prompt": long_prompt, "max_tokens": 8}, timeout=60)

    t = threading.Thread(target=ask)
    t.start()
    time.sleep(0.3)
    os.kill(workers(server)[0].pid, signal.SIGKILL)
    t.join()
    r = result["r"]
    assert r.status_code == 503 and r.headers["retry-after"] == "2"
    assert r.json()["error"]["code"] == "worker_failed"
    served_normally(server)


def test_other_requests_recover_after_a_fault(server: RunningServer) -> None:
    """Two clients in flight fail together; a request queued behind them is served once the pool is back."""
    served_normally(server)
    outcomes: list[str] = []

    def client(after: int, fault: signal.Signals | None) -> None:
        # long enough (480 tokens) that the other stream is still running when the worker dies
        events, _ = stream_events(server, after=after, fault=fault, max_tokens=480)
        outcomes.append("error" if "error" in events[-1] else "ok")

    threads = [threading.Thread(target=client, args=(0, None)), threading.Thread(target=client, args=(20, signal.SIGKILL))]
    for t in threads:
        t.start()
        time.sleep(0.2)
    for t in threads:
        t.join()
    assert outcomes.count("error") >= 1
    served_normally(server)


def test_killed_server_leaves_no_workers(smollm2_path: Path, tmp_path: Path) -> None:
    s = start_server(smollm2_path, tmp_path, "-c", "128", "-t", "2")
    kids = psutil.Process(s.proc.pid).children(recursive=True)
    assert kids
    s.proc.kill()
    s.proc.wait()
    _, alive = psutil.wait_procs(kids, timeout=10)
    assert not alive, [p.pid for p in alive]


def metric_value(server: RunningServer, name: str) -> float:
    for line in httpx.get(server.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_sigterm_answers_queued_and_unfinished_requests(smollm2_path: Path, tmp_path: Path) -> None:
    """SIGTERM with 2 requests running (one streamed) and 1 queued, --shutdown-timeout 3: the
    queued one hears 503 shutting_down at once, the running ones just before the deadline (an
    error event when streamed), nothing is cut off bare, no traceback, exit 0, no worker left."""
    s = start_server(smollm2_path, tmp_path, "-c", "4096", "--parallel", "2", "--queue", "4", "-t", "2", "--shutdown-timeout", "3")
    kids = psutil.Process(s.proc.pid).children(recursive=True)
    body = {"prompt": "Count: 1, 2, 3,", "max_tokens": 4000, "temperature": 0}
    results: dict[str, tuple[float, int, str]] = {}

    def post(name: str, stream: bool) -> None:
        with httpx.stream("POST", s.base_url + "/completions", json={**body, "stream": stream}, timeout=60) as r:
            text = "".join(r.iter_text())
            results[name] = (time.monotonic(), r.status_code, text)

    threads = [threading.Thread(target=post, args=(n, n == "streamed")) for n in ("streamed", "whole")]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while metric_value(s, "powerinfer_requests_running") < 2:  # both running before the third queues
        assert time.monotonic() < deadline
        time.sleep(0.05)
    queued = threading.Thread(target=post, args=("queued", False))
    queued.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)
    for t in [*threads, queued]:
        t.join(30)
    assert s.proc.wait(30) == 0 and time.monotonic() - t0 < 6
    end, status, text = results["queued"]
    assert status == 503 and json.loads(text)["error"]["code"] == "shutting_down" and end - t0 < 1.5
    end, status, text = results["whole"]
    assert status == 503 and json.loads(text)["error"]["code"] == "shutting_down" and 1.0 < end - t0 < 3.5
    end, status, text = results["streamed"]
    assert status == 200 and '"code":"shutting_down"' in text.replace(" ", ""), text[-300:]
    log = s.log.read_text()
    assert "Traceback" not in log and "Exception in ASGI" not in log, log[-2000:]
    _, alive = psutil.wait_procs(kids, timeout=10)
    assert not alive


def test_a_request_just_after_an_idle_worker_died_is_served(server: RunningServer) -> None:
    """A worker killed while the pool is idle: the next request was in no step when it died, so
    it waits for the restart instead of failing (the idle check runs only every 0.5 s)."""
    served_normally(server)
    for _ in range(3):
        os.kill(workers(server)[0].pid, signal.SIGKILL)
        time.sleep(0.05)
        r = httpx.post(server.base_url + "/completions", json={"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0},
                       timeout=60)
        assert r.status_code == 200, r.text
        wait_healthy(server)
