"""Request fuzzing against a running SmolLM2 server: every hostile request answers 4xx in OpenAI's error
shape (or 200 when a mutation happens to be valid), and the server keeps serving.

Runs in: the pytest process; the server is a subprocess. The long mode is
``python -m powerinfer.devtools.fuzz.requests --url URL --cases N``.
"""

from __future__ import annotations

import collections
from pathlib import Path

import httpx
import pytest

from powerinfer.devtools.fuzz.requests import GENERATORS, make_case, run
from tests.server.conftest import start_server

pytestmark = pytest.mark.real_model


def test_cases_are_reproducible_and_cover_every_class() -> None:
    assert make_case(3, 17) == make_case(3, 17)
    kinds = collections.Counter(make_case(0, i).kind for i in range(600))
    assert set(kinds) == {name for name, _, _ in GENERATORS}


def test_hostile_requests_get_4xx_and_the_server_survives(smollm2_path: Path, tmp_path: Path) -> None:
    server = start_server(smollm2_path, tmp_path, "-c", "128", "--parallel", "4", "-t", "2", "--executor", "inprocess")
    try:
        outcomes = run(server.url, 300, seed=12345)
        problems = [(o.case.kind, o.case.path, o.problem) for o in outcomes if o.problem]
        assert not problems
        assert sum(400 <= o.status < 500 for o in outcomes) > 200  # most cases are invalid, and were refused
        assert httpx.get(server.url + "/health").json() == {"status": "ok"}
        r = httpx.post(server.base_url + "/completions", json={"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0})
        assert r.json()["choices"][0]["text"].startswith(" Paris")
    finally:
        assert server.stop() == 0
