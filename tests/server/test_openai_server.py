"""The running server driven by the official `openai` client (strict response validation) and raw HTTP.

Runs in: the pytest process; the server is a subprocess (tests/server/conftest.py) on SmolLM2.
"""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from tests.processes.children import worker_children
from tests.server.conftest import N_PREDICT, RunningServer, start_server

pytestmark = pytest.mark.real_model

MODEL = "SmolLM2-135M-Instruct.Q4_1"
# "Answer in one word" keeps the greedy reply on Paris on every path: without it the first token is a
# near-tie ("L" 24.77 vs "The" 24.68 on the native decoder), which llama.cpp also resolves to "L'Étoile, ...".
CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


def client(server: RunningServer, key: str = "unused", strict: bool = True) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0, timeout=120, _strict_response_validation=strict)


def completion_stream(server: RunningServer, **kwargs: object) -> list[openai.types.Completion]:
    """Streamed legacy completions. Their intermediate chunks carry "finish_reason": null, as OpenAI's
    own API (and llama.cpp) send them, but the SDK types the field as non-null, so strict validation
    would reject every such stream: these chunks are read non-strictly and checked here instead."""
    chunks = list(client(server, strict=False).completions.create(stream=True, **kwargs))  # type: ignore[call-overload]
    for ch in chunks[:-1]:
        assert ch.object == "text_completion" and ch.model == MODEL and ch.id == chunks[0].id
        for c in ch.choices:
            assert isinstance(c.text, str) and c.finish_reason in (None, "stop", "length") and isinstance(c.index, int)
    return chunks


def metric(server: RunningServer, name: str, default: float | None = None) -> float:
    text = httpx.get(server.url + "/metrics").text
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    if default is not None:  # a labelled counter appears once its label was first counted
        return default
    raise AssertionError(f"{name} not in /metrics")


def test_models_and_health(smollm2_server: RunningServer) -> None:
    c = client(smollm2_server)
    ids = [m.id for m in c.models.list()]
    assert ids == [MODEL]
    assert c.models.retrieve(MODEL).id == MODEL
    assert httpx.get(smollm2_server.url + "/health").json() == {"status": "ok"}


def test_chat_non_streaming(smollm2_server: RunningServer) -> None:
    r = client(smollm2_server).chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=24)  # type: ignore[arg-type]
    choice = r.choices[0]
    assert "Paris" in (choice.message.content or "")
    assert choice.finish_reason == "stop" and choice.message.role == "assistant"
    assert r.usage is not None and r.usage.prompt_tokens > 10 and 0 < r.usage.completion_tokens < 24
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_streaming_equals_non_streaming(smollm2_server: RunningServer) -> None:
    c = client(smollm2_server)
    full = c.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=24)  # type: ignore[arg-type]
    parts, finish, usage = [], None, None
    stream = c.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=24, stream=True,  # type: ignore[arg-type]
                                       stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            parts.append(ch.delta.content or "")
            finish = ch.finish_reason or finish
    assert "".join(parts) == full.choices[0].message.content
    assert finish == "stop"
    assert usage is not None and full.usage is not None and usage.completion_tokens == full.usage.completion_tokens


def test_completion_max_tokens_and_stop(smollm2_server: RunningServer) -> None:
    c = client(smollm2_server)
    r = c.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 8 and r.usage.prompt_tokens == 5
    text = r.choices[0].text
    assert text.startswith(" Paris")
    s = c.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0, stop=["."])
    assert s.choices[0].finish_reason == "stop"
    assert s.choices[0].text == text.split(".")[0]
    # a stop string split across tokens (" States" | " has"), streamed: nothing of it leaks out
    chunks = completion_stream(smollm2_server, model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0, stop=["es ha"])
    streamed = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason] == ["stop"]
    assert streamed == text.split("es ha")[0] and "es ha" not in streamed


def test_logprobs_n_and_seed(smollm2_server: RunningServer) -> None:
    c = client(smollm2_server)
    r = c.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=4, logprobs=True, top_logprobs=3)  # type: ignore[arg-type]
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 4
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
    assert content[0].token == content[0].top_logprobs[0].token  # greedy picks the most likely
    many = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=1.0, seed=7, n=3, logprobs=2)
    assert sorted(ch.index for ch in many.choices) == [0, 1, 2]
    assert many.usage is not None and many.usage.completion_tokens == 18
    again = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=1.0, seed=7, n=3)
    assert [ch.text for ch in again.choices] == [ch.text for ch in many.choices]  # seeded: reproducible
    assert len({ch.text for ch in many.choices}) > 1  # ... yet the choices differ


def test_echo_with_logprobs_scores_the_prompt(smollm2_server: RunningServer) -> None:
    """lm-eval-harness's loglikelihood request: echo, logprobs, max_tokens 0 (prompt as token ids
    or text): one logprob per prompt token, the first null; a token the model generated has the
    same logprob when it is scored as part of a prompt. (The SDK types token_logprobs as floats,
    though OpenAI's own API sends that null too: these answers are read non-strictly.)"""
    c = client(smollm2_server, strict=False)
    gen = c.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=1, temperature=0, logprobs=1)
    assert gen.choices[0].logprobs is not None and gen.choices[0].text == " Paris"
    prompt = "The capital of France is Paris"
    r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=2, temperature=0)
    lp = r.choices[0].logprobs
    assert lp is not None and r.choices[0].text == prompt and r.usage is not None and r.usage.completion_tokens == 0
    assert lp.tokens is not None and lp.token_logprobs is not None and lp.top_logprobs is not None and lp.text_offset is not None
    assert len(lp.tokens) == r.usage.prompt_tokens and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert "".join(lp.tokens).endswith(prompt) and lp.text_offset[-1] == prompt.index(" Paris") and lp.tokens[-1] == " Paris"
    # within the head's rounding: the 8-bit head's logits are exact only for the candidates it
    # refines (decode: those within 1.0 of the best; a scored prompt: each row's best 32)
    assert abs(lp.token_logprobs[-1] - gen.choices[0].logprobs.token_logprobs[0]) < 1e-2  # type: ignore[index,operator]
    assert all(v is not None and v <= 0 and len(t) == 2 for v, t in zip(lp.token_logprobs[1:], lp.top_logprobs[1:]))
    # the same prompt as token ids, generating two tokens after it; streamed, the same numbers
    ids = httpx.post(smollm2_server.url + "/tokenize", json={"content": prompt}).json()["tokens"]
    req = dict(model=MODEL, prompt=ids, max_tokens=2, echo=True, logprobs=1, temperature=0)
    whole = c.completions.create(**req)  # type: ignore[call-overload]
    wl = whole.choices[0].logprobs
    assert wl is not None and wl.token_logprobs is not None and len(wl.token_logprobs) == len(ids) + 2
    assert wl.token_logprobs[0] is None and abs(wl.token_logprobs[len(ids) - 1] - lp.token_logprobs[-1]) < 1e-4  # type: ignore[operator]
    chunks = [ch for part in completion_stream(smollm2_server, **req) for ch in part.choices]
    streamed = [v for ch in chunks if ch.logprobs for v in ch.logprobs.token_logprobs or ()]
    offsets = [o for ch in chunks if ch.logprobs for o in ch.logprobs.text_offset or ()]
    assert streamed == wl.token_logprobs and offsets == wl.text_offset
    assert "".join(ch.text for ch in chunks) == whole.choices[0].text
    # special tokens written in a prompt are those tokens (as llama-server reads them), and the
    # echo gives the prompt as written
    chatml = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    ids = httpx.post(smollm2_server.url + "/tokenize", json={"content": chatml}).json()["tokens"]
    r = c.completions.create(model=MODEL, prompt=chatml, max_tokens=1, echo=True, logprobs=0, temperature=0)
    lp = r.choices[0].logprobs
    assert r.usage is not None and r.usage.prompt_tokens == len(ids) < 12 and r.choices[0].text.startswith(chatml)
    assert lp is not None and lp.tokens is not None and lp.tokens[:2] == ["<|im_start|>", "user"] and lp.text_offset is not None
    assert [chatml[o:].startswith(t) for t, o in zip(lp.tokens[:len(ids)], lp.text_offset)] == [True] * len(ids)
    # max_tokens 0 without echo has nothing to do
    with pytest.raises(openai.BadRequestError, match="echo"):
        c.completions.create(model=MODEL, prompt=prompt, max_tokens=0)


def test_logprob_bytes_reassemble_split_characters(smollm2_server: RunningServer) -> None:
    """SmolLM2 writes 🤗 as three tokens (F0 9F | A4 | 97): each token's own bytes, not U+FFFD's."""
    r = client(smollm2_server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Write: 🤗 🤗 🤗"}], temperature=0, max_tokens=6, logprobs=True,
        top_logprobs=2)  # type: ignore[arg-type]
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and "🤗" in (r.choices[0].message.content or "")
    assert any(t.token == "\ufffd" for t in content)  # a token that holds part of a character ...
    assert bytes(b for t in content for b in (t.bytes or [])).decode("utf-8") == r.choices[0].message.content  # ... and its bytes
    for t in content:
        assert t.top_logprobs[0].bytes == t.bytes  # greedy: the chosen token is the most likely one


def test_requests_without_max_tokens_stop_at_n_predict(smollm2_server: RunningServer) -> None:
    r = client(smollm2_server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count from 1 to 1000, separated by commas."}], temperature=0)  # type: ignore[arg-type]
    assert r.usage is not None and r.usage.completion_tokens == N_PREDICT
    assert r.choices[0].finish_reason == "length"
    longer = client(smollm2_server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count from 1 to 1000, separated by commas."}], temperature=0,
        max_tokens=N_PREDICT + 8)  # type: ignore[arg-type]
    assert longer.usage is not None and longer.usage.completion_tokens == N_PREDICT + 8  # an explicit max_tokens is honoured


def test_full_context_ends_with_length(smollm2_server: RunningServer) -> None:
    """A reply that reaches the end of the slot's 512 tokens is cut cleanly, not failed."""
    prompt = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, " * 15  # 466 tokens
    r = client(smollm2_server).completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=200)
    assert r.usage is not None and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens + r.usage.completion_tokens == 512


def test_non_streaming_client_that_hangs_up_frees_its_slot(smollm2_server: RunningServer) -> None:
    """Tokens keep coming, so no quiet moment reveals the disconnect: it must be noticed at once."""
    cancelled = metric(smollm2_server, 'powerinfer_sequences_total{outcome="cancelled"}', 0.0)
    ok = metric(smollm2_server, 'powerinfer_sequences_total{outcome="ok"}', 0.0)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(smollm2_server.base_url + "/completions", json={"prompt": "Count: 1, 2, 3,", "max_tokens": 400, "temperature": 0},
                   timeout=httpx.Timeout(5, read=0.3))  # 400 tokens take ~1 s on the native pool
    deadline = time.monotonic() + 3  # the cancelled count below proves it did not simply finish
    while metric(smollm2_server, "powerinfer_requests_running") != 0:
        assert time.monotonic() < deadline, "the abandoned request kept its slot"
        time.sleep(0.05)
    assert metric(smollm2_server, 'powerinfer_sequences_total{outcome="cancelled"}', 0.0) == cancelled + 1
    assert metric(smollm2_server, 'powerinfer_sequences_total{outcome="ok"}', 0.0) == ok
    t0 = time.monotonic()
    client(smollm2_server).completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0)
    assert time.monotonic() - t0 < 3  # the next request is not stuck behind it


def test_errors_in_openai_shape(smollm2_server: RunningServer) -> None:
    c = client(smollm2_server)
    with pytest.raises(openai.BadRequestError) as bad:
        c.chat.completions.create(model=MODEL, messages=CHAT, temperature=5)  # type: ignore[arg-type]
    assert bad.value.status_code == 400 and bad.value.param == "temperature"  # type: ignore[attr-defined]
    with pytest.raises(openai.BadRequestError) as long:
        c.completions.create(model=MODEL, prompt="hello " * 600, max_tokens=4)
    assert long.value.code == "context_length_exceeded" and "--ctx-size" in long.value.message
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="gpt-4o", messages=CHAT)  # type: ignore[arg-type]
    with pytest.raises(openai.NotFoundError):
        c.get("/nothing-here", cast_to=object)
    raw = httpx.post(smollm2_server.base_url + "/chat/completions", content=b'{"messages": [', headers={"content-type": "application/json"})
    assert raw.status_code == 400 and raw.json()["error"]["code"] == "invalid_json"
    big = httpx.post(smollm2_server.base_url + "/completions", content=b'{"prompt": "' + b"a" * (2 << 20) + b'"}')
    assert big.status_code == 413 and set(big.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(smollm2_server.url + "/health").status_code == 200  # still serving


def _stream_text(server: RunningServer, prompt: str, max_tokens: int) -> str:
    chunks = completion_stream(server, model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0)
    return "".join(ch.text for chunk in chunks for ch in chunk.choices)


PROMPTS = [f"Write a sentence about {t}." for t in ("cats", "the sea", "Paris", "rain", "a robot", "tea", "winter", "music", "bread", "trains")]


def test_concurrent_streams_equal_solo_and_batch(smollm2_server: RunningServer) -> None:
    """8 concurrent streaming clients, 40 requests, temperature 0: each text equals the request alone."""
    n_tokens = 24
    t0 = time.perf_counter()
    solo = {p: _stream_text(smollm2_server, p, n_tokens) for p in PROMPTS}
    solo_s = time.perf_counter() - t0
    requests = [PROMPTS[i % len(PROMPTS)] for i in range(40)]
    batch0 = metric(smollm2_server, "powerinfer_decode_batch_size_sum")
    steps0 = metric(smollm2_server, "powerinfer_decode_batch_size_count")
    t0 = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(lambda p: _stream_text(smollm2_server, p, n_tokens), requests))
    conc_s = time.perf_counter() - t0
    assert texts == [solo[p] for p in requests]
    mean_batch = (metric(smollm2_server, "powerinfer_decode_batch_size_sum") - batch0) / (
        metric(smollm2_server, "powerinfer_decode_batch_size_count") - steps0)
    assert mean_batch > 3  # the decode steps really were shared
    print(f"\n1 client: {len(PROMPTS) * n_tokens / solo_s:.1f} tok/s; 8 clients: {len(requests) * n_tokens / conc_s:.1f} tok/s "
          f"aggregate, mean decode batch {mean_batch:.1f}")


def test_cancelled_stream_frees_its_slot(smollm2_server: RunningServer) -> None:
    with httpx.stream("POST", smollm2_server.base_url + "/completions",
                      json={"prompt": "Count: 1, 2, 3,", "max_tokens": 400, "temperature": 0, "stream": True}) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
        assert metric(smollm2_server, "powerinfer_requests_running") == 1
    deadline = time.monotonic() + 5
    while metric(smollm2_server, "powerinfer_requests_running") != 0:
        assert time.monotonic() < deadline, "the cancelled stream kept its slot"
        time.sleep(0.05)
    assert metric(smollm2_server, 'powerinfer_sequences_total{outcome="cancelled"}') >= 1


def test_api_key_queue_full_and_sigterm(smollm2_path: Path, tmp_path: Path) -> None:
    server = start_server(smollm2_path, tmp_path, "-c", "256", "--parallel", "1", "--queue", "0", "-t", "1", "--api-key", "sekrit")
    try:
        with pytest.raises(openai.AuthenticationError):
            client(server, "wrong").models.list()
        assert httpx.get(server.base_url + "/models").status_code == 401
        c = client(server, "sekrit")
        assert [m.id for m in c.models.list()] == [MODEL]
        # one long stream holds the only slot; the next request is refused with Retry-After
        started, release = threading.Event(), threading.Event()

        def hold() -> None:  # keeps its stream (and the slot) open until the refused request is done
            with httpx.stream("POST", server.base_url + "/completions", headers={"Authorization": "Bearer sekrit"},
                              json={"prompt": "1, 2, 3,", "max_tokens": 200, "temperature": 0, "stream": True}) as r:
                for i, _ in enumerate(r.iter_lines()):
                    if i == 4:
                        started.set()
                        release.wait(60)
                        break

        t = threading.Thread(target=hold)
        t.start()
        assert started.wait(60)
        busy = httpx.post(server.base_url + "/completions", headers={"Authorization": "Bearer sekrit"},
                          json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        release.set()
        t.join()
        assert busy.status_code == 429 and busy.headers["retry-after"] == "1"
        assert busy.json()["error"]["type"] == "rate_limit_error"
        children = psutil.Process(server.proc.pid).children(recursive=True)
        assert children, "the server should have worker processes"
    finally:
        assert server.stop() == 0
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, f"processes left behind: {[p.pid for p in alive]}"


def test_dead_worker_turns_health_503_until_restarted(smollm2_server: RunningServer) -> None:
    worker = worker_children(smollm2_server.proc.pid)[0]
    worker.kill()
    codes: list[int] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        codes.append(httpx.get(smollm2_server.url + "/health").status_code)
        if 503 in codes and codes[-1] == 200:
            break
        time.sleep(0.05)
    assert 503 in codes and codes[-1] == 200, codes
    r = client(smollm2_server).completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3, temperature=0)
    assert r.choices[0].text.startswith(" Paris")


def test_surrogates_head_allow_streamed_offsets_and_a_client_leaving_mid_body(smollm2_server: RunningServer) -> None:
    url = smollm2_server.url
    # a lone UTF-16 half is valid JSON; it becomes U+FFFD, as a UTF-8 decoder would make it, not a 500
    r = httpx.post(url + "/v1/chat/completions", content=b'{"messages":[{"role":"user","content":"\\ud800 hi"}],"max_tokens":2}',
                   headers={"content-type": "application/json"}, timeout=120)
    assert r.status_code == 200, r.text
    # uptime checkers send HEAD; a 405 names the allowed methods
    assert httpx.head(url + "/health").status_code == 200 and httpx.head(url + "/v1/models").status_code == 200
    r = httpx.delete(url + "/health")
    assert r.status_code == 405 and "GET" in r.headers.get("allow", "")
    # streamed completions' text_offset runs on across chunks, as in the whole answer
    req = dict(model=MODEL, prompt="1, 2, 3,", max_tokens=6, temperature=0, logprobs=1)
    whole = client(smollm2_server).completions.create(**req)  # type: ignore[call-overload]
    offsets = [o for ch in completion_stream(smollm2_server, **req) for c in ch.choices if c.logprobs for o in c.logprobs.text_offset or ()]
    assert whole.choices[0].logprobs is not None and offsets == whole.choices[0].logprobs.text_offset and offsets[-1] > 0
    # the tokens a stop string cut away have no logprobs: the tokens spell the text, streamed or not;
    # but they were generated: usage counts them, the one that completed the stop string too
    req = dict(model=MODEL, prompt="1, 2, 3,", max_tokens=12, temperature=0, logprobs=1, stop=[", 7"])
    whole = client(smollm2_server).completions.create(**req)  # type: ignore[call-overload]
    lps = whole.choices[0].logprobs
    assert whole.choices[0].finish_reason == "stop" and lps is not None and "".join(lps.tokens or ()) == whole.choices[0].text
    assert whole.usage is not None and whole.usage.completion_tokens == len(lps.tokens or ()) + len(", 7")  # 1 char a token here
    chunks = [c for ch in completion_stream(smollm2_server, **req) for c in ch.choices]
    streamed = [t for c in chunks if c.logprobs for t in c.logprobs.tokens or ()]
    assert "".join(streamed) == "".join(c.text for c in chunks) == whole.choices[0].text
    # a client that leaves while sending its body is logged quietly, not as an internal error
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
                  b'{"messages":')
    time.sleep(1.0)
    assert httpx.get(url + "/health").status_code == 200
    assert "internal error" not in smollm2_server.log.read_text() and "Exception in ASGI" not in smollm2_server.log.read_text()
