"""llama.cpp-server compatibility: CORS, /tokenize, /detokenize, /props, logit_bias, several
prompts in one completion request, cached prompt tokens and timings, on SmolLM2.

Runs in: the pytest process, against a `powerinfer-server` subprocess (tests/server/conftest.py);
the CORS policy itself also on a bare app (starlette's test client).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest
from fastapi import FastAPI
from starlette.testclient import TestClient

from powerinfer.server.compat import add_cors
from tests.server.conftest import RunningServer, serving

MODEL = "SmolLM2-135M-Instruct.Q4_1"
CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


@pytest.fixture(scope="module")
def server(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    yield from serving(smollm2_path, tmp_path_factory, "compat", "-c", "512", "--parallel", "4", "-t", "2", "-n", "32")


def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120, _strict_response_validation=True)


def _preflight(c: TestClient | httpx.Client, origin: str) -> httpx.Response:
    return c.options("/v1/chat/completions", headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                                                      "Access-Control-Request-Headers": "authorization,content-type"})


def test_cors_preflight_local_origins_only_by_default(server: RunningServer) -> None:
    with httpx.Client(base_url=server.url) as c:
        ok = _preflight(c, "http://localhost:3000")
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://localhost:3000"
        assert "POST" in ok.headers["access-control-allow-methods"]
        assert _preflight(c, "http://127.0.0.1:8081").status_code == 200
        evil = _preflight(c, "https://evil.example")
        assert evil.status_code == 400 and "access-control-allow-origin" not in evil.headers
        # a foreign page's request is refused before it reaches the model: a "simple" text/plain
        # POST needs no preflight, and the browser would only hide the answer
        r = c.post("/v1/completions", headers={"Origin": "https://evil.example", "Content-Type": "text/plain"},
                   content=json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 1}))
        assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
        assert c.get("/v1/models", headers={"Origin": "https://evil.example"}).status_code == 403
        assert c.get("/v1/models").status_code == 200  # no Origin (curl, SDKs): not a browser page
        assert c.get("/v1/models", headers={"Origin": "http://[::1]:5173"}).headers["access-control-allow-origin"] == "http://[::1]:5173"


@pytest.mark.parametrize("origins, allowed, refused", [
    (("https://chat.example",), "https://chat.example", "http://localhost:3000"),
    (("*",), "https://anything.example", None),
])
def test_cors_origins_option(origins: tuple[str, ...], allowed: str, refused: str | None) -> None:
    app = FastAPI()

    @app.post("/v1/chat/completions")
    def chat() -> dict[str, str]:
        return {}

    add_cors(app, origins)
    with TestClient(app) as c:
        assert _preflight(c, allowed).status_code == 200
        if refused:
            assert _preflight(c, refused).status_code == 400


def test_tokenize_detokenize_props(server: RunningServer) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        toks = c.post("/tokenize", json={"content": "Hello world"}).json()["tokens"]
        assert toks == [19556, 905]
        # SmolLM2's file does not add a BOS token; special tokens are parsed either way
        assert c.post("/tokenize", json={"content": "Hello world", "add_special": True}).json()["tokens"] == toks
        assert c.post("/tokenize", json={"content": "<|im_start|>"}).json()["tokens"] == [1]
        pieces = c.post("/tokenize", json={"content": "Hello world", "with_pieces": True}).json()["tokens"]
        assert [p["id"] for p in pieces] == toks and "".join(p["piece"] for p in pieces) == "Hello world"
        assert c.post("/detokenize", json={"tokens": toks}).json() == {"content": "Hello world"}
        emoji = c.post("/tokenize", json={"content": "🤗", "with_pieces": True}).json()["tokens"]
        assert bytes(b for p in emoji for b in (p["piece"] if isinstance(p["piece"], list) else p["piece"].encode())) == "🤗".encode()
        for path, body, param in (("/tokenize", {}, "content"), ("/tokenize", {"content": 5}, "content"),
                                  ("/tokenize", {"content": "x", "with_pieces": "yes"}, "with_pieces"),
                                  ("/detokenize", {"tokens": [1, "a"]}, "tokens"), ("/detokenize", {"tokens": [10**9]}, "tokens")):
            r = c.post(path, json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, body)
        props = c.get("/props").json()
        assert props["default_generation_settings"]["n_ctx"] == 512 and props["total_slots"] == 4
        assert props["default_generation_settings"]["params"]["n_predict"] == 32
        assert "im_start" in props["chat_template"] and props["model_alias"] == MODEL


def test_logit_bias_bans_and_forces(server: RunningServer) -> None:
    c = client(server)
    plain = c.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3, temperature=0)
    first = httpx.post(server.url + "/tokenize", json={"content": " Paris"}).json()["tokens"][0]
    assert plain.choices[0].text.startswith(" Paris")
    banned = c.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3, temperature=0, logit_bias={str(first): -100})
    assert not banned.choices[0].text.startswith(" Paris")
    forced = c.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3, temperature=0.9, seed=3,
                                  logit_bias={"28": 100})  # token 28 is ","
    assert forced.choices[0].text == ",,,"
    with pytest.raises(openai.BadRequestError, match="vocabulary"):
        c.completions.create(model=MODEL, prompt="x", max_tokens=1, logit_bias={"999999": 1})


def test_several_prompts_in_one_completion_request(server: RunningServer) -> None:
    c = client(server)
    prompts = ["The capital of France is", "One, two, three,"]
    both = c.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0, n=2)
    assert [ch.index for ch in sorted(both.choices, key=lambda ch: ch.index)] == [0, 1, 2, 3]
    solo = [c.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0).choices[0].text for p in prompts]
    texts = {ch.index: ch.text for ch in both.choices}
    assert [texts[0], texts[1], texts[2], texts[3]] == [solo[0], solo[0], solo[1], solo[1]]  # choice i answers prompt i // n
    assert both.usage is not None and both.usage.prompt_tokens == 5 + len(httpx.post(server.url + "/tokenize",
                                                                                       json={"content": prompts[1]}).json()["tokens"])


def test_cached_tokens_and_timings(server: RunningServer) -> None:
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 8, "temperature": 0}
    first = httpx.post(server.base_url + "/chat/completions", json=body, timeout=120).json()
    again = httpx.post(server.base_url + "/chat/completions", json=body, timeout=120).json()
    n_prompt = first["usage"]["prompt_tokens"]
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == n_prompt - 1  # the same prompt again: all of it is in its slot's cache but the last token (llama-server's rule)
    t = again["timings"]
    assert t["prompt_n"] == n_prompt - again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert t["predicted_n"] == again["usage"]["completion_tokens"] and t["predicted_ms"] > 0 and t["predicted_per_second"] > 0
    # streamed: the usage chunk carries both
    with httpx.stream("POST", server.base_url + "/chat/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}},
                      timeout=120) as r:
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: {")]
    last = json.loads(lines[-1][6:])
    assert last["usage"]["prompt_tokens_details"]["cached_tokens"] == cached, last
    assert last["timings"]["predicted_n"] == last["usage"]["completion_tokens"] > 0, last


def test_responses_api(server: RunningServer) -> None:
    """A basic /v1/responses with the official client, strict: text in, text out, streamed events."""
    c = client(server)
    r = c.responses.create(model=MODEL, input="What is the capital of France? Answer in one word.", temperature=0, max_output_tokens=16)
    assert r.status == "completed" and "Paris" in r.output_text
    assert r.usage is not None and r.usage.output_tokens > 0 and r.usage.input_tokens > 10
    msgs = c.responses.create(model=MODEL, instructions="Answer in one word.", max_output_tokens=16, temperature=0,
                              input=[{"role": "user", "content": [{"type": "input_text", "text": "Capital of France?"}]}])
    assert msgs.output_text.strip()
    cut = c.responses.create(model=MODEL, input="Tell me a long story.", max_output_tokens=4, temperature=0)
    assert cut.status == "incomplete" and cut.incomplete_details is not None and cut.incomplete_details.reason == "max_output_tokens"
    events = list(c.responses.create(model=MODEL, input="What is the capital of France? Answer in one word.", temperature=0,
                                     max_output_tokens=16, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert kinds[-1] == "response.completed" and "response.output_text.done" in kinds
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")  # type: ignore[union-attr]
    assert deltas == r.output_text and [e.sequence_number for e in events] == list(range(len(events)))
    for body, param in (({"input": 5}, "input"), ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
                        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools")):
        resp = httpx.post(server.base_url + "/responses", json={"model": MODEL, **body}, timeout=60)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
