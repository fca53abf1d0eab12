#!/usr/bin/env python3
"""OpenAI-API conformance checks for a running server, derived from llama.cpp's server unit tests.

Role: tool; runs in its own process against a running server (stdlib + httpx + openai only).

    powerinfer-server -m smollm2 --port 8099 -c 1024 --parallel 4 -t 2 &
    python scripts/conformance.py --url http://127.0.0.1:8099 [-k NAME_PART]

Each check names the test in ggml-org/llama.cpp tools/server/tests/unit/ it derives from. Checked: behaviour any
OpenAI-compatible server owes, plus the llama.cpp extensions a compatible server advertises (/tokenize, /detokenize,
/props, /metrics, grammar, timings); checks of llama.cpp-only conventions say "llama.cpp" in their source. Not
checked: answer quality, llama.cpp's exact texts for its own test models, llama.cpp-only features (slots, LoRA,
embeddings, infill, ...). Prints PASS/FAIL per check and "N of M checks passed"; always exits 0.
"""
import argparse
import json
import re
import threading
import traceback

import httpx
import openai

U, MODEL, N_CTX, N_SLOTS = "", "", 1024, 4  # set in main()
CTX_GIVEN = True  # N_CTX came from --n-ctx (else from /props, which is already per slot on llama.cpp)
BOOK = [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}]
CODE = [{"role": "system", "content": "You are a coding assistant."}, {"role": "user", "content": "Write an example"}]
PROMPT = "I believe the meaning of life is"
CHECKS = []

def check(name, source, fn=None):
    """Registers fn (or the decorated function) as a check: returns on pass, raises AssertionError on fail."""
    def deco(f):
        CHECKS.append((name, source, f))
        return f
    return deco(fn) if fn else deco

def fail(msg): raise AssertionError(msg)

def need(cond, msg):
    if not cond:
        fail(msg)

def req(method, path, body=None, headers=None): return httpx.request(method, U + path, json=body, headers=headers, timeout=120)

def ok(path, body):
    r = req("POST", path, body)
    need(r.status_code == 200, f"HTTP {r.status_code}: {r.text[:200]}")
    return r.json()

# greedy unless a check asks otherwise: a sampled reply may end before max_tokens, and the checks
# that expect finish_reason "length" would then fail by chance (a clean-clone CI run saw it once)
def chat(**kw): return ok("/v1/chat/completions", {"messages": BOOK, "max_tokens": 8, "temperature": 0, **kw})
def cmpl(**kw): return ok("/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, **kw})

def bad(path, body, codes=(400,)):
    r = req("POST", path, body)
    need(r.status_code in codes, f"expected HTTP {codes}, got {r.status_code}: {r.text[:150]}")
    need("error" in r.json(), f"no 'error' in {r.text[:150]}")
    return r.json()

def sse(path, body):
    """POSTs body with stream=true: (status, events, saw [DONE], content-type, error body)."""
    events, done = [], False
    with httpx.stream("POST", U + path, json={**body, "stream": True}, timeout=120) as r:
        ct = r.headers.get("content-type", "")
        if r.status_code != 200:
            r.read()
            return r.status_code, [], False, ct, (r.json() if ct.startswith("application/json") else r.text)
        for line in r.iter_lines():
            data = line[5:].strip() if line.startswith("data:") else ""
            done = done or data == "[DONE]"
            if data and data != "[DONE]":
                events.append(json.loads(data))
    return 200, events, done, ct, None

def chat_stream(**kw):
    st, ev, done, ct, err = sse("/v1/chat/completions", {"messages": BOOK, "max_tokens": 8, "temperature": 0, **kw})
    need(st == 200, f"HTTP {st}: {err}")
    return ev, done, ct

def choices(ev): return [e["choices"][0] for e in ev if e.get("choices")]
def client(v1=True): return openai.OpenAI(api_key="dummy", base_url=U + ("/v1" if v1 else ""), max_retries=0)
def tokenize(text, **kw): return ok("/tokenize", {"content": text, **kw})["tokens"]
def get(path, **kw): return httpx.get(U + path, timeout=30, **kw)

# ---------------------------------------------------------------- test_basic.py / test_security.py
@check("health", "test_basic.py::test_server_start_simple")
def _():
    r = get("/health")
    need(r.status_code == 200 and "error" not in r.json(), f"HTTP {r.status_code}")
@check("models_list", "test_basic.py::test_server_models")
def _():
    b = get("/v1/models").json()
    need(b.get("object") == "list" and len(b["data"]) == 1, b)
    need(isinstance(b["data"][0]["id"], str) and b["data"][0].get("object") == "model", b["data"][0])
check("models_without_v1_prefix", "test_security.py::test_access_public_endpoint[/models]",
      lambda: need(get("/models").status_code == 200, "GET /models is not 200"))
@check("props_fields", "test_basic.py::test_server_props")
def _():
    b = get("/props").json()
    need(b["total_slots"] == N_SLOTS and ".gguf" in b["model_path"], b)
    need(isinstance(b["default_generation_settings"]["n_ctx"], int), b["default_generation_settings"])
@check("props_n_ctx_per_slot", "test_basic.py::test_server_props (llama.cpp: -c is split across slots)")
def _():
    n = get("/props").json()["default_generation_settings"]["n_ctx"]
    need(CTX_GIVEN, "pass --n-ctx (the server's -c): without it the split of -c across slots cannot be checked")
    need(n == N_CTX // N_SLOTS, f"default_generation_settings.n_ctx={n}, llama.cpp: n_ctx/slots={N_CTX // N_SLOTS}")
check("chat_route_without_v1_prefix", "test_security.py::test_openai_library_correct_api_key", lambda: need(len(
    client(v1=False).chat.completions.create(model=MODEL, messages=BOOK, max_tokens=4).choices) == 1, "not 1 choice"))
check("unknown_model_name_accepted", "test_chat_completion.py::test_chat_completion_with_openai_library (llama.cpp)",
      lambda: client().chat.completions.create(model="gpt-3.5-turbo-instruct", messages=BOOK, max_tokens=4))
@check("any_bearer_accepted_without_api_key", "test_security.py::test_correct_api_key")
def _():
    r = req("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}, {"Authorization": "Bearer sk-whatever"})
    need(r.status_code == 200 and "error" not in r.json(), f"HTTP {r.status_code}")

def preflight(header):
    r = httpx.options(U + "/v1/chat/completions", timeout=30, headers={"Origin": "http://localhost:8080",
                      "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "Authorization"})
    need(r.status_code == 200, f"preflight HTTP {r.status_code}")
    return r.headers.get(header, "")

SRC_CORS = "test_security.py::test_cors_options"
check("cors_preflight_allow_origin", SRC_CORS + "[Access-Control-Allow-Origin]", lambda: need(
    preflight("access-control-allow-origin") in ("http://localhost:8080", "*"), "origin not allowed"))
check("cors_preflight_allow_methods", SRC_CORS + "[Access-Control-Allow-Methods]", lambda: need(
    {"GET", "POST"} <= set(re.split(r"[,\s]+", preflight("access-control-allow-methods"))), "GET/POST missing"))
check("cors_preflight_allow_headers", SRC_CORS + "[Access-Control-Allow-Headers]", lambda: need(
    preflight("access-control-allow-headers").lower() in ("*", "authorization"), "Authorization not allowed"))
check("cors_header_on_actual_request", SRC_CORS, lambda: need(get("/v1/models", headers={"Origin": "http://127.0.0.1:3000"})
      .headers.get("access-control-allow-origin") in ("http://127.0.0.1:3000", "*"), "no Access-Control-Allow-Origin"))

# ---------------------------------------------------------------- test_chat_completion.py
SRC_CC = "test_chat_completion.py::test_chat_completion"
@check("chat_basic_shape", SRC_CC)
def _():
    b = chat()
    c = b["choices"][0]
    need("cmpl" in b["id"] and b.get("object") == "chat.completion" and isinstance(b.get("created"), int), b)
    need(isinstance(b.get("model"), str) and b.get("system_fingerprint"), b)
    need(c["index"] == 0 and c["message"]["role"] == "assistant" and isinstance(c["message"]["content"], str), c)
@check("chat_finish_length_and_usage", SRC_CC)
def _():
    b = chat()
    u = b["usage"]
    need(b["choices"][0]["finish_reason"] == "length", b["choices"][0]["finish_reason"])
    need(u["completion_tokens"] == 8 and 0 < u["prompt_tokens"] == u["total_tokens"] - 8, u)
check("chat_model_null", SRC_CC + "[model=None]", lambda: chat(model=None))
check("chat_content_parts", SRC_CC + "[content parts]", lambda: need(isinstance(chat(messages=[BOOK[0], {
    "role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "the best book"}]}])[
    "choices"][0]["message"]["content"], str), "content is not a string"))
@check("chat_openai_library", "test_chat_completion.py::test_chat_completion_with_openai_library")
def _():
    res = client().chat.completions.create(model=MODEL, messages=BOOK, max_tokens=8, seed=42, temperature=0.8)
    need(res.system_fingerprint and res.choices[0].finish_reason == "length" and res.choices[0].message.content, res)
check("chat_openai_library_stream", "test_chat_completion.py::test_logprobs_stream", lambda: need("".join(
    c.choices[0].delta.content or "" for c in client().chat.completions.create(
        model=MODEL, messages=BOOK, max_tokens=8, stream=True) if c.choices), "empty text"))
SRC_CS = "test_chat_completion.py::test_chat_completion_stream"
@check("chat_stream_first_delta_role", SRC_CS)
def _():
    ev, _, _ = chat_stream()
    d = ev[0]["choices"][0]["delta"]
    need(d.get("role") == "assistant" and not d.get("content"), f"first delta {d}")
    need(all(c["delta"].get("role") is None for c in choices(ev[1:])), "role repeated after the first chunk")
@check("chat_stream_ids_and_fields", SRC_CS)
def _():
    ev, _, _ = chat_stream()
    need(len({e["id"] for e in ev}) == 1, "id changes within the stream")
    need(all(e.get("object") == "chat.completion.chunk" and isinstance(e.get("model"), str) and e.get("system_fingerprint")
             for e in ev), ev[0])
@check("chat_stream_finish_chunk", SRC_CS)
def _():
    chs = choices(chat_stream()[0])
    need(all(c["finish_reason"] is None for c in chs[:-1]), "finish_reason before the last chunk")
    need(chs[-1]["finish_reason"] == "length" and not chs[-1]["delta"].get("content"), chs[-1])
    need("".join(c["delta"].get("content") or "" for c in chs), "empty streamed content")
@check("chat_stream_sse_framing", "utils.py::ServerProcess.make_stream_request (every stream test)")
def _():
    _, done, ct = chat_stream()
    need(ct.startswith("text/event-stream") and done, f"content-type {ct!r}, [DONE] seen: {done}")
@check("chat_stream_include_usage", SRC_CS + " (usage chunk)")
def _():
    ev, _, _ = chat_stream(stream_options={"include_usage": True})
    u = ev[-1].get("usage") or fail(f"no usage on the last chunk: {str(ev[-1])[:150]}")
    need(ev[-1]["choices"] == [] and u["completion_tokens"] == 8 and u["prompt_tokens"] > 0, ev[-1])
    need(all(e.get("usage") is None for e in ev[:-1]), "usage on a non-final chunk")
@check("chat_stream_timings", "test_chat_completion.py::test_chat_completion_with_timings_per_token")
def _():
    ev, _, _ = chat_stream(max_tokens=10, stream_options={"include_usage": True}, timings_per_token=True)
    t = [e for e in ev if not e["choices"]][-1].get("timings") or {}
    need("timings" not in ev[0], "first event has timings")
    need("prompt_per_second" in t and "predicted_per_second" in t and t.get("predicted_n", 99) <= 10, t)

def check_timings(b, n):
    t, u = b.get("timings") or fail("no timings"), b["usage"]
    cached = t.get("cache_n", (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
    # n tokens unless the model ended earlier (EOS): predicted_n counts what was generated
    need(t["predicted_n"] == u["completion_tokens"] <= n and t["prompt_n"] + cached == u["prompt_tokens"], f"timings {t}, usage {u}")

check("chat_timings", "test_completion.py::test_completion (timings)", lambda: check_timings(chat(), 8))
check("completions_timings", "test_completion.py::test_completion (timings)", lambda: check_timings(cmpl(), 8))

def rf(fmt, n):
    return chat(messages=CODE, max_tokens=n, response_format=fmt)["choices"][0]["message"]["content"].strip()

def items_ok(c):  # {"items": [...]} without "type" admits any JSON value (cut at max_tokens); arrays hold integers
    return re.match(r"\[\s*(-?\d|])", c) if c.startswith("[") else re.match(r'["{\d\-tfn]', c)

SRC_RF = "test_chat_completion.py::test_completion_with_response_format"
for _n, _fmt, _k, _test in [
        ("rf_json_object_schema_const", {"type": "json_object", "schema": {"const": "42"}}, 6, lambda c: c == '"42"'),
        ("rf_json_schema_const", {"type": "json_schema", "json_schema": {"schema": {"const": "foooooo"}}}, 10,
         lambda c: c == '"foooooo"'),
        ("rf_json_object_items", {"type": "json_object", "schema": {"items": [{"type": "integer"}]}}, 10, items_ok),
        ("rf_json_object_plain", {"type": "json_object"}, 10, lambda c: c.startswith("{"))]:
    check(_n, SRC_RF, lambda f=_fmt, k=_k, t=_test: (lambda c: need(t(c), f"content {c!r}"))(rf(f, k)))
for _n, _fmt in [("rf_invalid_type_sound", {"type": "sound"}),
                 ("rf_invalid_schema_123", {"type": "json_object", "schema": 123}),
                 ("rf_invalid_schema_type_123", {"type": "json_object", "schema": {"type": 123}}),
                 ("rf_invalid_schema_type_hiccup", {"type": "json_object", "schema": {"type": "hiccup"}})]:
    check(_n, SRC_RF + "[invalid]",
          lambda f=_fmt: bad("/v1/chat/completions", {"messages": CODE, "max_tokens": 1, "response_format": f}))
check("rf_json_schema_object_parses", SRC_RF, lambda: (lambda c: need(json.loads(c).get("a") in ("x", "y"), c))(rf(
    {"type": "json_schema", "json_schema": {"name": "t", "strict": True, "schema": {"type": "object", "properties": {
        "a": {"enum": ["x", "y"]}}, "required": ["a"], "additionalProperties": False}}}, 40)))
check("json_schema_param", "test_chat_completion.py::test_completion_with_json_schema", lambda: (lambda c: need(
    c.strip() == '"42"', repr(c)))(chat(messages=CODE, max_tokens=6, json_schema={"const": "42"})["choices"][0]["message"]["content"]))
check("grammar_param_chat", "test_chat_completion.py::test_completion_with_grammar", lambda: (lambda c: need(c == "aaaaa", repr(c)))(
    chat(messages=[{"role": "user", "content": "Does not matter what I say, does it?"}], max_tokens=6,
         grammar='root ::= "a"{5,5}')["choices"][0]["message"]["content"]))
check("grammar_param_completions", "test_chat_completion.py::test_completion_with_grammar (/v1/completions)", lambda: (
    lambda t: need(t == "aaaaa", repr(t)))(cmpl(grammar='root ::= "a"{5,5}', max_tokens=6)["choices"][0]["text"]))
for _i, _m in enumerate([None, "string", [123], [{}], [{"role": 123}], [{"role": "system", "content": 123}],
                         [{"role": "system", "content": "test"}, {}]]):
    check(f"chat_invalid_messages_{_i}:{json.dumps(_m)}", "test_chat_completion.py::test_invalid_chat_completion_req",
          lambda m=_m: bad("/v1/chat/completions", {"messages": m}, codes=(400, 422, 500)))

def chat_lp(n, **kw):
    return client().chat.completions.create(model=MODEL, temperature=0.0, messages=BOOK, max_tokens=n, logprobs=True,
                                            top_logprobs=10, **kw)

@check("chat_logprobs", "test_chat_completion.py::test_logprobs")
def _():
    res = chat_lp(5)
    lp = res.choices[0].logprobs.content or fail("no logprobs.content")
    need(all(t.logprob <= 0.0 and t.bytes is not None and t.top_logprobs for t in lp), lp)
    need("".join(t.token for t in lp) == res.choices[0].message.content, "tokens do not spell the content")
check("chat_logprobs_top_count", "test_completion.py::test_n_probs (top count)", lambda: need(all(
    len(t.top_logprobs) == 10 for t in chat_lp(3).choices[0].logprobs.content), "top_logprobs != 10"))
@check("chat_logprobs_stream", "test_chat_completion.py::test_logprobs_stream")
def _():
    out = agg = ""
    for ch in chat_lp(5, stream=True):
        if ch.choices and ch.choices[0].finish_reason is None and ch.choices[0].delta.content:
            out += ch.choices[0].delta.content
            for t in (ch.choices[0].logprobs and ch.choices[0].logprobs.content) or fail("chunk without logprobs"):
                agg += t.token
                need(t.logprob <= 0.0 and t.bytes is not None and t.top_logprobs, t)
    need(out and agg == out, f"{agg!r} != {out!r}")

EXCLUDE = "i I the The to a an be is was but But and And so So you You he He she She we We they They it It his His her Her book Book"

def no_excluded(text):
    need(text and not [w for w in EXCLUDE.split() if f" {w} " in text], f"banned words in {text!r}")

def bias():
    return {str(t): -100 for t in tokenize(f" {EXCLUDE} ")}

check("chat_logit_bias", "test_chat_completion.py::test_logit_bias", lambda: no_excluded(client().chat.completions.create(
    model=MODEL, temperature=0.0, messages=BOOK, max_tokens=64, logit_bias=bias()).choices[0].message.content))
check("completions_logit_bias", "test_completion.py::test_logit_bias[tokenize, openai_style]", lambda: no_excluded(
    cmpl(prompt="What is the best book", max_tokens=64, temperature=0.0, logit_bias=bias())["choices"][0]["text"]))
def long_chat():  # over the server's context whatever its -c (100 copies exceed 1024 tokens)
    return {"messages": BOOK * (100 * -(-N_CTX // 1024))}
SRC_CTX = "test_chat_completion.py::test_context_size_exceeded"
check("ctx_exceeded_400", SRC_CTX, lambda: (lambda e: need(e.get("code") == "context_length_exceeded" or e.get(
    "type") == "exceed_context_size_error", e))(bad("/v1/chat/completions", long_chat())["error"]))
@check("ctx_exceeded_llamacpp_fields", SRC_CTX + " (llama.cpp error fields)")
def _():
    e = bad("/v1/chat/completions", long_chat())["error"]
    need(e.get("type") == "exceed_context_size_error" and e.get("n_prompt_tokens", 0) > 0, e)
    need(e.get("n_ctx") == N_CTX // N_SLOTS, f"n_ctx={e.get('n_ctx')}, llama.cpp: n_ctx/slots={N_CTX // N_SLOTS}")
@check("ctx_exceeded_stream_is_http_400", SRC_CTX + "_stream")
def _():
    st, _, _, _, err = sse("/v1/chat/completions", long_chat())
    need(st == 400 and isinstance(err, dict) and "error" in err, f"HTTP {st}: {str(err)[:150]}")
@check("chat_n_2_choices", "test_chat_completion.py::test_chat_completions_multiple_choices")
def _():
    chs = chat(n=2)["choices"]
    need([c["index"] for c in chs] == [0, 1], chs)
    need(all(c["message"]["role"] == "assistant" and c["finish_reason"] == "length" for c in chs), chs)
@check("cached_tokens_reported", "test_metrics.py::test_prompt_cache_metrics")
def _():
    body = {"messages": [{"role": "user", "content": "Tell me a story about a cat and a dog. " * 4}], "max_tokens": 2}
    ok("/v1/chat/completions", body)
    d = ok("/v1/chat/completions", body)["usage"].get("prompt_tokens_details") or {}
    need(d.get("cached_tokens", 0) > 0, f"prompt_tokens_details={d}")
@check("timings_cache_n", "test_metrics.py::test_prompt_cache_metrics (llama.cpp timings.cache_n)")
def _():
    ok("/v1/completions", {"prompt": PROMPT + " to be happy.", "max_tokens": 4})
    t = ok("/v1/completions", {"prompt": PROMPT + " to be happy.", "max_tokens": 4}).get("timings", {})
    need(t.get("cache_n", 0) > 0, f"no cache_n > 0 in timings {sorted(t)}")
check("metrics_prometheus", "test_metrics.py::test_prompt_cache_metrics", lambda: (lambda r: need(
    r.status_code == 200 and "# TYPE" in r.text, f"HTTP {r.status_code}"))(get("/metrics")))
check("metrics_prompt_cache_counter", "test_metrics.py::test_prompt_cache_metrics (llama.cpp metric name)", lambda: need(
    re.search(r"prompt_tokens_cache_total\s+[1-9]", get("/metrics").text), "no *prompt_tokens_cache_total > 0"))

# ---------------------------------------------------------------- test_completion.py (on /v1/completions)
@check("completions_basic_shape", "test_completion.py::test_completion")
def _():
    b = cmpl()
    c = b["choices"][0]
    need(b.get("object") == "text_completion" and "cmpl" in b["id"] and b.get("system_fingerprint"), b)
    need(isinstance(c["text"], str) and c["index"] == 0 and c["finish_reason"] == "length", c)
    need(b["usage"]["completion_tokens"] == 8, b["usage"])
check("completions_openai_library", "test_completion.py::test_completion_with_openai_library", lambda: (lambda res: need(
    res.choices[0].finish_reason == "length" and res.choices[0].text is not None and res.system_fingerprint, res))(
    client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)))
check("completions_stream_openai_library", "test_completion.py::test_completion_stream_with_openai_library", lambda: need("".join(
    c.choices[0].text for c in client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, stream=True)
    if c.choices[0].finish_reason is None), "empty stream"))
@check("completions_stream_finish_length", "test_ctx_shift.py::test_ctx_shift_disabled_stream")
def _():
    st, ev, done, _, err = sse("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 32, "temperature": 0})
    chs = choices(ev)
    need(st == 200 and done and chs[-1]["finish_reason"] == "length", f"HTTP {st} {err}")
    need(all(c["finish_reason"] is None for c in chs[:-1]) and "".join(c["text"] for c in chs), chs)
@check("completions_stream_vs_nonstream", "test_completion.py::test_completion_stream_vs_non_stream")
def _():
    s = "".join(c["text"] for c in choices(sse("/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0})[1]))
    n = cmpl(temperature=0)["choices"][0]["text"]
    need(s == n, f"{s!r} != {n!r}")

def texts(runs, kw):
    return [cmpl(max_tokens=16, **kw(i))["choices"][0]["text"] for i in range(runs)]

check("seed_consistent_temp0", "test_completion.py::test_consistent_result_same_seed", lambda: (lambda o: need(
    len(set(o)) == 1, o))(texts(3, lambda i: {"seed": 42, "temperature": 0.0})))
check("seed_consistent_temp1", "test_completion.py::test_consistent_result_same_seed (sampling)", lambda: (lambda o: need(
    len(set(o)) == 1, o))(texts(3, lambda i: {"seed": 42, "temperature": 1.0})))
check("seed_different_results", "test_completion.py::test_different_result_different_seed", lambda: (lambda o: need(all(
    a != b for a, b in zip(o, o[1:])), o))(texts(4, lambda i: {"seed": i, "temperature": 1.0})))
SRC_TI = "test_completion.py::test_completion_with_tokens_input"
check("completions_token_prompt", SRC_TI + "[single]", lambda: need(isinstance(
    cmpl(prompt=tokenize(PROMPT, add_special=True), temperature=0)["choices"][0]["text"], str), "no text"))
for _n, _p in [("completions_batch_token_prompts", "tokens"), ("completions_batch_mixed_prompts", "mixed")]:
    @check(_n, f"{SRC_TI}[{_p}]")
    def _(p=_p):
        toks = tokenize(PROMPT, add_special=True)
        chs = sorted(cmpl(prompt=[toks, toks if p == "tokens" else PROMPT], temperature=0)["choices"], key=lambda c: c["index"])
        need([c["index"] for c in chs] == [0, 1] and chs[0]["text"] == chs[1]["text"], chs)

def parallel(n):
    res = [None] * n

    def run(i):
        try:
            res[i] = cmpl(prompt=f"Write a very long story number {i}.", max_tokens=16, seed=42, temperature=1.0)
        except Exception as e:  # noqa: BLE001 - reported below
            res[i] = e
    ts = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    need(all(not isinstance(r, Exception) and r["choices"][0]["text"] for r in res), res)

for _k in (2, 4, 6):
    check(f"completions_parallel_{_k}", "test_completion.py::test_completion_parallel_slots", lambda k=_k: parallel(k))
@check("completions_logprobs", "test_completion.py::test_n_probs")
def _():
    lp = cmpl(logprobs=5, temperature=0.0, max_tokens=5)["choices"][0].get("logprobs") or fail("no logprobs")
    need(len(lp["tokens"]) == 5 and len(lp["token_logprobs"]) == 5 and max(lp["token_logprobs"]) <= 0.0, lp)
    need(all(isinstance(d, dict) and len(d) == 5 for d in lp["top_logprobs"]), lp["top_logprobs"])
check("completions_ctx_exceeded", "test_completion.py::test_nocache_long_input_prompt",
      lambda: bad("/v1/completions", {"prompt": PROMPT * (200 * -(-N_CTX // 1024)), "max_tokens": 8}))

def stop_case(stream):
    base = cmpl(prompt="Once upon a time", temperature=0, max_tokens=32)["choices"][0]["text"]
    stop = base[8:12]
    need(len(stop.strip()) >= 2, f"greedy output too short to pick a stop string: {base!r}")
    body = {"prompt": "Once upon a time", "temperature": 0, "max_tokens": 32, "stop": [stop, "\u2603never"]}
    c = choices(sse("/v1/completions", body)[1]) if stream else ok("/v1/completions", body)["choices"]
    got, fin, want = "".join(x["text"] for x in c), c[-1]["finish_reason"], base[:base.index(stop)]
    need(got == want and fin == "stop", f"stop={stop!r}: got {got!r} ({fin}), want {want!r}")

SRC_STOP = "test_completion.py::test_completion_stream_with_openai_library_stops"
check("completions_stop_string", SRC_STOP, lambda: stop_case(False))
check("completions_stop_string_stream", SRC_STOP, lambda: stop_case(True))

# ---------------------------------------------------------------- test_tokenize.py
@check("tokenize_detokenize_roundtrip", "test_tokenize.py::test_tokenize_detokenize")
def _():
    toks = tokenize("What is the capital of France ?")
    need(len(toks) > 5 and ok("/detokenize", {"tokens": toks})["content"].strip() == "What is the capital of France ?", toks)
@check("tokenize_add_special", "test_tokenize.py::test_tokenize_with_bos")
def _():
    plain, special = tokenize("Hello world"), tokenize("Hello world", add_special=True)
    need(all(isinstance(t, int) for t in special) and special[len(special) - len(plain):] == plain, (plain, special))
check("tokenize_with_pieces", "test_tokenize.py::test_tokenize_with_pieces", lambda: need(all(
    isinstance(t, dict) and t["id"] > 0 and len(t["piece"]) > 0
    for t in tokenize("This is a test string with unicode 媽 and emoji 🤗", with_pieces=True)), "bad piece entry"))
check("tokenize_unicode_roundtrip", "test_tokenize.py::test_tokenize_with_pieces", lambda: need(ok("/detokenize", {
    "tokens": tokenize("unicode 媽 and emoji 🤗")})["content"].strip() == "unicode 媽 and emoji 🤗", "roundtrip differs"))

# ---------------------------------------------------------------- test_compat_oai_responses.py
def resp(fmt, n):
    return req("POST", "/v1/responses", {"input": "Write an example", "max_output_tokens": n, "text": {"format": fmt}})

def resp_text(r):
    need(r.status_code == 200, f"HTTP {r.status_code}: {r.text[:150]}")
    return next(o for o in r.json()["output"] if o["type"] == "message")["content"][0]["text"].strip()

SRC_RTF = "test_compat_oai_responses.py::test_responses_with_text_format"
check("responses_json_schema_const", SRC_RTF, lambda: (lambda t: need(t == '"foooooo"', repr(t)))(
    resp_text(resp({"type": "json_schema", "name": "test", "schema": {"const": "foooooo"}}, 10))))
check("responses_json_object", SRC_RTF, lambda: (lambda t: need(t.startswith("{"), repr(t)))(
    resp_text(resp({"type": "json_object"}, 10))))
check("responses_text_format", SRC_RTF, lambda: resp_text(resp({"type": "text"}, 10)))
check("responses_json_schema_missing_schema", SRC_RTF + "[invalid]", lambda: (lambda r: need(
    r.status_code == 400 and "error" in r.json(), f"HTTP {r.status_code}"))(resp({"type": "json_schema", "name": "t"}, 0)))
@check("responses_openai_library", "test_compat_oai_responses.py::test_responses_with_openai_library")
def _():
    res = client().responses.create(model=MODEL, input=BOOK, max_output_tokens=8, temperature=0.8)
    need(res.id.startswith("resp_") and res.output[0].id.startswith("msg_"), (res.id, res.output[0].id))
    need(res.output_text and res.usage and res.usage.output_tokens == 8, res.usage)
@check("responses_stream_openai_library", "test_compat_oai_responses.py::test_responses_stream_with_openai_library")
def _():
    text, rid, mid, types, final = "", "", "", [], None
    for r in client().responses.create(model=MODEL, input=BOOK, max_output_tokens=8, temperature=0.8, stream=True):
        types.append(r.type)
        if r.type in ("response.created", "response.in_progress"):
            need(rid in ("", r.response.id), f"{r.type} id {r.response.id} != {rid}")
            rid = r.response.id
        elif r.type == "response.output_item.added":
            mid = r.item.id
        elif r.type.startswith(("response.content_part.", "response.output_text.")):
            need(r.item_id == mid, f"{r.type} item_id {r.item_id} != {mid}")
        text += r.delta if r.type == "response.output_text.delta" else ""
        # the terminal event: llama.cpp sends response.completed; OpenAI sends response.incomplete at max_output_tokens
        final = r.response if r.type in ("response.completed", "response.incomplete") else final
    need(rid.startswith("resp_") and mid.startswith("msg_"), (rid, mid))
    need(final is not None and final.id == rid and final.output_text == text and text, f"events {types}")

# ---------------------------------------------------------------- test_tool_call.py
def tool(name, props):
    return {"type": "function", "function": {"name": name, "description": "", "parameters": {
        "type": "object", "properties": props, "required": list(props)}}}

TEST_TOOL = tool("test", {"success": {"type": "boolean", "const": True}})
PY_TOOL = tool("python", {"code": {"type": "string", "description": "The code to run."}})

def tool_req(stream=False, **kw):
    body = {"messages": CODE, "max_tokens": 256, "tools": [TEST_TOOL], "tool_choice": "required",
            "parallel_tool_calls": False, "temperature": 0.0, **kw}
    if not stream:
        return ok("/v1/chat/completions", body)["choices"][0]
    calls, fin = {}, None
    for c in choices(sse("/v1/chat/completions", body)[1]):
        fin = c["finish_reason"] or fin
        for tc in c["delta"].get("tool_calls") or []:
            cur = calls.setdefault(tc.get("index", 0), {"id": "", "type": None, "function": {"name": "", "arguments": ""}})
            cur["id"], cur["type"] = cur["id"] + (tc.get("id") or ""), tc.get("type") or cur["type"]
            for k in ("name", "arguments"):
                cur["function"][k] += (tc.get("function") or {}).get(k) or ""
    return {"message": {"tool_calls": list(calls.values()) or None}, "finish_reason": fin}

def one_call(choice, name="test", key="success"):
    calls = choice["message"].get("tool_calls")
    need(calls and len(calls) == 1, f"expected 1 tool call: {str(choice['message'])[:200]}")
    args = calls[0]["function"]["arguments"]
    need(calls[0]["function"]["name"] == name and isinstance(args, str) and key in json.loads(args), calls[0])
    return calls[0]

SRC_TC = "test_tool_call.py::do_test_completion_with_required_tool_tiny"
check("tool_required_call", SRC_TC, lambda: (lambda c: one_call(c) and need(
    c["message"].get("content") in (None, ""), f"content {c['message'].get('content')!r}"))(tool_req()))
check("tool_required_call_stream", SRC_TC + "[streamed]", lambda: one_call(tool_req(stream=True)))
@check("tool_required_parallel_default", SRC_TC + " (parallel_tool_calls=true, OpenAI's default)")
def _():
    c = tool_req(tools=[TEST_TOOL, PY_TOOL], parallel_tool_calls=True)
    need(c["message"].get("tool_calls"), f"no tool call: {str(c['message'])[:150]}")
    need(c["message"].get("content") in (None, ""), f"content {c['message'].get('content')!r}")
for _n, _st in [("tool_call_id_and_finish_reason", False), ("tool_call_id_and_finish_reason_stream", True)]:
    check(_n, SRC_TC + ("[streamed]" if _st else ""), lambda st=_st: (lambda c: (lambda tc: need(
        tc.get("id") and tc.get("type") == "function" and c["finish_reason"] == "tool_calls", (tc, c["finish_reason"])))(
        one_call(c)))(tool_req(stream=st)))
check("tool_choice_named_function", "test_tool_call.py::test_completion_with_required_tool_real_model[python]",
      lambda: one_call(tool_req(tools=[TEST_TOOL, PY_TOOL], tool_choice={"type": "function", "function": {"name": "python"}}),
                       "python", "code"))
for _n, _tools, _choice, _st in [("tool_choice_none", [PY_TOOL], "none", False),
                                 ("tool_choice_none_stream", [PY_TOOL], "none", True), ("no_tools_no_call", None, None, False)]:
    check(_n, "test_tool_call.py::test_completion_without_tool_call_fast", lambda t=_tools, c=_choice, s=_st: (
        lambda ch: need(ch["message"].get("tool_calls") in (None, []), f"tool_calls {ch['message'].get('tool_calls')}"))(
        tool_req(stream=s, tools=t, tool_choice=c, max_tokens=32,
                 messages=[CODE[0], {"role": "user", "content": "say hello world with python"}])))
@check("tool_result_roundtrip", "test_tool_call.py::do_test_calc_result")
def _():
    call = {"id": "call_6789", "type": "function", "function": {"name": "calculate", "arguments": '{"expression":"sin(pi/6)"}'}}
    msgs = [{"role": "system", "content": "You are a tools-calling assistant."}, {"role": "user", "content": "sin(30 deg)?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "name": "calculate", "content": "0.55644242476", "tool_call_id": "call_6789"}]
    m = ok("/v1/chat/completions", {"messages": msgs, "tools": [tool("calculate", {"expression": {"type": "string"}})],
                                    "max_tokens": 16, "tool_choice": "none"})["choices"][0]["message"]
    need(m["role"] == "assistant" and m["content"] is not None, m)

# ---------------------------------------------------------------- general error handling
check("error_object_shape", "test_security.py::test_incorrect_api_key (error body shape)", lambda: (lambda e: need(
    isinstance(e, dict) and isinstance(e.get("message"), str) and isinstance(e.get("type"), str), e))(
    bad("/v1/chat/completions", {"messages": "string"}, codes=(400, 422))["error"]))
check("malformed_json_body", "test_chat_completion.py::test_invalid_chat_completion_req", lambda: (lambda r: need(
    r.status_code == 400 and "error" in r.json(), f"HTTP {r.status_code}: {r.text[:120]}"))(httpx.post(
    U + "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}, timeout=30)))
check("unknown_route_404", "test_basic.py::test_no_webui (404 for unserved paths)",
      lambda: need(get("/v1/definitely-not-a-route").status_code == 404, "not 404"))

def main():
    global U, MODEL, N_CTX, N_SLOTS, CTX_GIVEN
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8099")
    ap.add_argument("--n-ctx", type=int, default=None,
                    help="the server's -c (llama.cpp's per-slot n_ctx checks; the too-long prompts are sized by it); default: from /props")
    ap.add_argument("--n-slots", type=int, default=4, help="the server's --parallel")
    ap.add_argument("-k", default="", help="run only the checks whose name contains this")
    a = ap.parse_args()
    U, N_CTX, N_SLOTS = a.url.rstrip("/"), a.n_ctx, a.n_slots
    if N_CTX is None:
        CTX_GIVEN = False
        try:
            # per slot on llama.cpp (-c / --parallel), the whole context here: times the slots is
            # at least the server's whole context either way, which is what sizes the too-long prompts
            N_CTX = int(get("/props").json()["default_generation_settings"]["n_ctx"]) * N_SLOTS
        except Exception:  # noqa: BLE001 - props_* report it
            N_CTX = 1024
    try:
        MODEL = get("/v1/models").json()["data"][0]["id"]
    except Exception:  # noqa: BLE001 - models_list reports it
        MODEL = "default"
    sel, passed = [c for c in CHECKS if a.k in c[0]], 0
    for name, source, fn in sel:
        try:
            fn()
            passed += 1
            print(f"PASS {name}", flush=True)
        except AssertionError as e:
            print(f"FAIL {name}: {str(e)[:300]}  [{source}]", flush=True)
        except Exception as e:  # noqa: BLE001 - a crash fails that check only
            line = traceback.extract_tb(e.__traceback__)[-1].lineno
            print(f"FAIL {name}: {type(e).__name__}: {str(e)[:250]} (line {line})  [{source}]", flush=True)
    print(f"{passed} of {len(sel)} checks passed")

if __name__ == "__main__":
    main()
