"""Fixtures for server tests: a running `powerinfer-server` subprocess on a free port.

Runs in: the pytest process; the server under test runs in its own process (with its workers).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx
import pytest


N_PREDICT = 48  # the shared server's -n: requests without max_tokens stop here


@dataclass
class RunningServer:
    proc: subprocess.Popen[str]
    url: str  # http://127.0.0.1:PORT
    log: Path

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def stop(self, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return int(self.proc.returncode)


def start_server(model: Path | None, tmp: Path, *args: str, ready: bool = True, timeout: float = 120.0) -> RunningServer:
    """Start the server on port 0 and return once it listens (and, with ready, once /health is 200).
    model None: args name the models (--models-dir, several -m)."""
    log = tmp / f"server-{time.monotonic_ns()}.log"
    fh = open(log, "w")
    given = ["-m", str(model)] if model is not None else []
    proc = subprocess.Popen([sys.executable, "-m", "powerinfer.server.main", *given, "--port", "0", *args],
                            stdout=fh, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    fh.close()
    deadline = time.monotonic() + timeout
    url = None
    while time.monotonic() < deadline:
        m = re.search(r"on (http://[\d.]+:\d+)/v1", log.read_text())
        if m:
            url = m.group(1)
            break
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {log.read_text()}")
        time.sleep(0.05)
    if url is None:
        proc.kill()
        raise RuntimeError(f"server did not start: {log.read_text()}")
    server = RunningServer(proc, url, log)
    while ready and time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {log.read_text()}")
        time.sleep(0.1)
    if ready:
        server.stop()
        raise RuntimeError(f"server not healthy in {timeout}s: {log.read_text()}")
    return server


def serving(model: Path, tmp_path_factory: pytest.TempPathFactory, name: str, *args: str) -> Iterator[RunningServer]:
    """A module fixture's body: a server on the model with these flags, stopped after the module."""
    server = start_server(model, tmp_path_factory.mktemp(name), *args)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def smollm2_server(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """SmolLM2 with 8 slots of 512 tokens, 2 CPU workers, --parallel 8, a small queue, -n 48."""
    server = start_server(smollm2_path, tmp_path_factory.mktemp("server"), "-c", "512", "--parallel", "8", "--queue", "32",
                          "-t", "2", "--max-body", str(1 << 20), "-n", str(N_PREDICT))
    yield server
    server.stop()
