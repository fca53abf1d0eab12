"""Request fuzzing against a running server: hostile bodies and headers, every answer must be a 4xx in
OpenAI's error shape (or a 200 for a body that happens to be valid), and the server must keep serving.

Runs in: the fuzzing process (a client of the server under test).

    python -m powerinfer.devtools.fuzz.requests --url http://127.0.0.1:8080 --cases 5000 --seed 1

Case ``i`` of seed ``S`` is a pure function of (S, i). Classes: wrong types for each field,
missing fields, NaN/Infinity/negative/huge numbers, deep nesting, multi-megabyte strings, invalid
UTF-8, thousands of stop strings, ``n``/``max_tokens`` extremes, random JSON values, random byte
mutations of valid bodies, wrong methods and content types, unknown routes.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import httpx

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
COMP = {"prompt": "hi", "max_tokens": 2, "temperature": 0}
FIELDS = ("messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "frequency_penalty",
          "presence_penalty", "repeat_penalty", "stop", "seed", "n", "stream", "stream_options", "logprobs", "top_logprobs", "model", "echo")
HOSTILE_VALUES: tuple[Any, ...] = (None, True, False, 0, -1, 1, 2**31, -(2**63), 2**64, 10**40, 1.5, -0.0, 1e308, -1e308, 5e-324, "",
                                   "x", "0", "NaN", "\x00", "\ud7ff", [], [1], [[[]]], {}, {"a": 1}, ["x"] * 50)
RAW_NUMBERS = (b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-1e999", b"1" * 5000, b"0.0000000000000000000000000001e-400")


@dataclass(frozen=True)
class Case:
    kind: str
    method: str
    path: str
    body: bytes | None
    headers: tuple[tuple[str, str], ...] = (("content-type", "application/json"),)


def _dump(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode("utf-8", errors="surrogatepass")


def _random_json(rng: random.Random, depth: int = 0) -> Any:
    r = rng.random()
    if depth > 3 or r < 0.4:
        return rng.choice(HOSTILE_VALUES)
    if r < 0.7:
        return [_random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(FIELDS + ("role", "content", "type", "text")): _random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))}


def _chat_or_comp(rng: random.Random) -> tuple[str, dict[str, Any]]:
    return ("/v1/chat/completions", dict(CHAT)) if rng.random() < 0.5 else ("/v1/completions", dict(COMP))


def _wrong_type(rng: random.Random) -> Case:
    path, body = _chat_or_comp(rng)
    body[rng.choice(FIELDS)] = rng.choice(HOSTILE_VALUES)
    return Case("wrong_type", "POST", path, _dump(body))


def _missing(rng: random.Random) -> Case:
    path, body = _chat_or_comp(rng)
    for k in rng.sample(sorted(body), rng.randint(1, len(body))):
        del body[k]
    return Case("missing_field", "POST", path, _dump(body))


def _bad_number(rng: random.Random) -> Case:
    path, body = _chat_or_comp(rng)
    key = rng.choice(("max_tokens", "temperature", "top_p", "top_k", "n", "seed", "min_p", "frequency_penalty", "top_logprobs"))
    raw = _dump(body)[:-1] + b', "' + key.encode() + b'": ' + rng.choice(RAW_NUMBERS) + b"}"
    return Case("bad_number", "POST", path, raw)


def _deep(rng: random.Random) -> Case:
    n = rng.choice((65, 1000, 100000))
    opener, closer = (b"[", b"]") if rng.random() < 0.5 else (b'{"a":', b"}")
    inner = opener * n + b"1" + closer * n
    return Case("deep_nesting", "POST", rng.choice(("/v1/chat/completions", "/v1/completions")), b'{"prompt": ' + inner + b"}")


def _huge_string(rng: random.Random) -> Case:
    path, body = _chat_or_comp(rng)
    big = "a " * rng.choice((300_000, 2_000_000, 5_000_000))
    if "messages" in body:
        body["messages"] = [{"role": "user", "content": big}]
    else:
        body["prompt"] = big
    return Case("huge_string", "POST", path, _dump(body))


def _bad_utf8(rng: random.Random) -> Case:
    path, body = _chat_or_comp(rng)
    raw = bytearray(_dump(body))
    at = raw.index(b"hi")
    raw[at : at + 2] = rng.choice((b"\xff\xfe", b"\xc3\x28", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x80"))
    return Case("invalid_utf8", "POST", path, bytes(raw))


def _many_stops(rng: random.Random) -> Case:
    path, body = _chat_or_comp(rng)
    body["stop"] = [f"s{i}" for i in range(rng.choice((17, 1000, 20000)))] if rng.random() < 0.7 else ["x" * 100_000]
    return Case("many_stops", "POST", path, _dump(body))


def _extremes(rng: random.Random) -> Case:
    path, body = _chat_or_comp(rng)
    body[rng.choice(("n", "max_tokens", "max_completion_tokens", "top_logprobs", "logprobs"))] = rng.choice(
        (0, -1, -2, 17, 10**6, 2**63, 10**100))
    return Case("extremes", "POST", path, _dump(body))


def _random_body(rng: random.Random) -> Case:
    return Case("random_json", "POST", rng.choice(("/v1/chat/completions", "/v1/completions")), _dump(_random_json(rng)))


def _mutated(rng: random.Random) -> Case:
    path, body = _chat_or_comp(rng)
    raw = bytearray(_dump(body))
    for _ in range(rng.randint(1, 4)):
        at = rng.randrange(len(raw))
        op = rng.random()
        if op < 0.4:
            raw[at] = rng.randrange(256)
        elif op < 0.7:
            del raw[at : at + rng.randint(1, 8)]
        else:
            raw[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
    return Case("mutated", "POST", path, bytes(raw))


def _http_level(rng: random.Random) -> Case:
    choice = rng.randrange(5)
    if choice == 0:
        return Case("http", "GET", "/v1/chat/completions", None)
    if choice == 1:
        return Case("http", "POST", "/v1/chat/completions", b"messages=hi", (("content-type", "application/x-www-form-urlencoded"),))
    if choice == 2:
        return Case("http", "POST", rng.choice(("/v1/embeddings", "/v2/chat", "/../../etc/passwd", "/v1/models/x/y")), _dump(CHAT))
    if choice == 3:
        return Case("http", "POST", "/v1/completions", b"")
    return Case("http", "DELETE", "/v1/models", None)


GENERATORS: tuple[tuple[str, Callable[[random.Random], Case], float], ...] = (
    ("wrong_type", _wrong_type, 4), ("missing_field", _missing, 1), ("bad_number", _bad_number, 2), ("deep_nesting", _deep, 0.5),
    ("huge_string", _huge_string, 0.2), ("invalid_utf8", _bad_utf8, 1), ("many_stops", _many_stops, 1), ("extremes", _extremes, 2),
    ("random_json", _random_body, 3), ("mutated", _mutated, 3), ("http", _http_level, 1),
)


def make_case(seed: int, i: int) -> Case:
    rng = random.Random(seed * 1_000_003 + i)
    _, gen, _ = rng.choices(GENERATORS, weights=[w for _, _, w in GENERATORS])[0]
    return gen(rng)


@dataclass(frozen=True)
class Outcome:
    case: Case
    status: int
    problem: str  # "" when the answer is acceptable


def check(client: httpx.Client, url: str, case: Case) -> Outcome:
    try:
        r = client.request(case.method, url + case.path, content=case.body, headers=dict(case.headers))
    except httpx.HTTPError as e:
        return Outcome(case, 0, f"transport error: {type(e).__name__}: {e}")
    if r.status_code == 200:
        return Outcome(case, 200, "")  # a valid body (mutations can produce one)
    if not 400 <= r.status_code < 500 or r.status_code == 429:
        # 429 is fine under load, but the fuzzer runs at a fixed concurrency below --queue
        return Outcome(case, r.status_code, f"status {r.status_code}: {r.text[:200]}")
    try:
        err = r.json()["error"]
        if set(err) != {"message", "type", "param", "code"} or not isinstance(err["message"], str):
            raise KeyError("shape")
    except (ValueError, KeyError, TypeError):
        return Outcome(case, r.status_code, f"not OpenAI's error shape: {r.text[:200]}")
    return Outcome(case, r.status_code, "")


def run(url: str, cases: int, seed: int, concurrency: int = 4) -> list[Outcome]:
    # valid cases may generate up to the server's context with n = 16 behind a queue of others:
    # only a request that takes this long counts as a hang
    with httpx.Client(timeout=600) as client, ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda i: check(client, url, make_case(seed, i)), range(cases)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m powerinfer.devtools.fuzz.requests", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="server base URL (without /v1)")
    p.add_argument("--cases", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--concurrency", type=int, default=4)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    outcomes = run(args.url, args.cases, args.seed, args.concurrency)
    by_kind: dict[str, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    for o in outcomes:
        by_kind[o.case.kind][o.status] += 1
    bad = [o for o in outcomes if o.problem]
    healthy = httpx.get(args.url + "/health", timeout=10).status_code == 200
    print(f"{len(outcomes)} cases in {time.perf_counter() - t0:.0f}s (seed {args.seed}); non-4xx or malformed answers: {len(bad)}; "
          f"server healthy afterwards: {healthy}")
    for kind, counts in sorted(by_kind.items()):
        print(f"  {kind:<14} " + ", ".join(f"{code}: {n}" for code, n in sorted(counts.items())))
    for o in bad[:10]:
        print(f"  PROBLEM [{o.case.kind}] {o.case.method} {o.case.path}: {o.problem}")
    return 0 if not bad and healthy else 1


if __name__ == "__main__":
    sys.exit(main())
