"""`powerinfer loadtest`: N streaming clients against a running server; latency, throughput, errors, RSS.

Runs in: its own process (a client of the server; it only reads the server's RSS through psutil).

    powerinfer loadtest --url http://127.0.0.1:8080 --clients 1,4,8 --requests 16 --max-tokens 64
    powerinfer loadtest --url http://127.0.0.1:8080 --clients 8 --duration 600 --pid SERVER_PID --plot soak.png

Each client sends streaming chat requests back to back (temperature 0, a rotating set of
prompts) and times the first token and the rest. With ``--duration`` it runs that long (a soak)
and samples the server's RSS (its workers included) every few seconds; ``--plot`` draws RSS and
tokens/s over time. Any non-200 answer, error event or broken stream counts as an error.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

import httpx
import psutil

from powerinfer.errors import PowerInferError
from powerinfer.flags import USAGE_ERROR, Parser, exit_status, report_paths

PROMPTS = ("Write a sentence about the sea.", "What is the capital of France?", "Name three fruits.", "Tell me about trains.",
           "Describe winter in one sentence.", "Why is the sky blue?", "Give me a name for a cat.", "What is 12 times 7?")


@dataclass
class Sample:
    ok: bool
    ttft: float = 0.0
    tokens: int = 0
    seconds: float = 0.0
    error: str = ""


@dataclass
class Run:
    samples: list[Sample] = field(default_factory=list)
    rss: list[tuple[float, float]] = field(default_factory=list)  # (seconds since start, MiB)
    tokens_at: list[tuple[float, int]] = field(default_factory=list)  # (seconds since start, tokens so far)
    lock: threading.Lock = field(default_factory=threading.Lock)
    wall: float = 0.0

    def add(self, s: Sample) -> None:
        with self.lock:
            self.samples.append(s)


def one_request(client: httpx.Client, url: str, model: str | None, prompt: str, max_tokens: int) -> Sample:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    t0 = time.perf_counter()
    ttft, tokens = 0.0, 0
    try:
        with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                return Sample(False, error=f"HTTP {r.status_code}: {r.text[:200]}")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if "error" in ev:
                    return Sample(False, error=str(ev["error"].get("message")))
                if ev.get("usage"):
                    tokens = int(ev["usage"]["completion_tokens"])
                elif not ttft and any(c.get("delta", {}).get("content") for c in ev.get("choices", [])):
                    ttft = time.perf_counter() - t0
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
        return Sample(False, error=f"{type(e).__name__}: {e}")
    return Sample(True, ttft, tokens, time.perf_counter() - t0)


def run_clients(url: str, model: str | None, clients: int, requests: int, duration: float, max_tokens: int, pid: int | None,
                key: str | None) -> Run:
    run = Run()
    start = time.perf_counter()
    stop = threading.Event()
    counter = iter(range(10**12))
    count_lock = threading.Lock()

    def client_loop(i: int) -> None:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        with httpx.Client(timeout=300, headers=headers) as c:
            while not stop.is_set():
                with count_lock:
                    n = next(counter)
                if not duration and n >= requests:
                    return
                run.add(one_request(c, url, model, PROMPTS[n % len(PROMPTS)], max_tokens))

    def sampler() -> None:
        procs: list[psutil.Process] = []
        while not stop.wait(2.0 if duration else 0.5):
            t = time.perf_counter() - start
            with run.lock:
                run.tokens_at.append((t, sum(s.tokens for s in run.samples)))
            if pid is None:
                continue
            try:
                root = psutil.Process(pid)
                procs = [root, *root.children(recursive=True)]
                run.rss.append((t, sum(p.memory_info().rss for p in procs if p.is_running()) / 2**20))
            except psutil.Error:
                continue

    threads = [threading.Thread(target=client_loop, args=(i,), daemon=True) for i in range(clients)]
    mon = threading.Thread(target=sampler, daemon=True)
    mon.start()
    for t in threads:
        t.start()
    if duration:
        stop.wait(duration)
        stop.set()
    for t in threads:
        t.join()
    run.wall = time.perf_counter() - start
    stop.set()
    mon.join()
    return run


def summarize(clients: int, run: Run) -> dict[str, float]:
    ok = [s for s in run.samples if s.ok]
    tokens = sum(s.tokens for s in ok)
    # decode speed of a stream: the tokens after the first over the time after it (the first arrives at ttft)
    per_stream = [(s.tokens - 1) / (s.seconds - s.ttft) for s in ok if s.seconds > s.ttft > 0 and s.tokens > 1]
    ttfts = sorted(s.ttft for s in ok)
    return {
        "clients": clients, "requests": len(run.samples), "errors": len(run.samples) - len(ok), "tokens": tokens,
        "wall_s": run.wall, "aggregate_tok_s": tokens / run.wall if run.wall else 0.0,
        "ttft_median_s": statistics.median([s.ttft for s in ok]) if ok else 0.0,
        "ttft_p90_s": ttfts[math.ceil(0.9 * len(ttfts)) - 1] if ttfts else 0.0,  # nearest rank: never below the median
        "stream_tok_s_median": statistics.median(per_stream) if per_stream else 0.0,
        "rss_start_mib": run.rss[0][1] if run.rss else 0.0, "rss_end_mib": run.rss[-1][1] if run.rss else 0.0,
    }


def plot(runs: list[tuple[int, Run]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for clients, run in runs:
        if run.rss:
            a.plot([t for t, _ in run.rss], [m for _, m in run.rss], label=f"{clients} clients")
        pts = run.tokens_at
        rates = [(t1, (n1 - n0) / (t1 - t0)) for (t0, n0), (t1, n1) in zip(pts, pts[1:]) if t1 > t0]
        b.plot([t for t, _ in rates], [r for _, r in rates], label=f"{clients} clients")
    a.set_ylabel("server RSS incl. workers (MiB)")
    b.set_ylabel("tokens/s")
    b.set_xlabel("seconds")
    a.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: Sequence[str] | None = None) -> int:
    p = Parser(prog="powerinfer loadtest", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8080", help="server base URL (without /v1)")
    p.add_argument("--model", default=None, help="model name to send (default: none, the server's own)")
    p.add_argument("--api-key", default=None, help="bearer token, when the server was started with --api-key")
    p.add_argument("--clients", default="1,4,8", help="comma-separated client counts, run one after another")
    p.add_argument("--requests", type=int, default=16, help="requests per run (ignored with --duration)")
    p.add_argument("--duration", type=float, default=0.0, help="seconds per run (a soak); 0 = --requests")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens each request asks for (default 64)")
    p.add_argument("--pid", type=int, default=None, help="server pid, to sample its RSS (workers included)")
    p.add_argument("--plot", default=None, help="PNG of RSS and tokens/s over time")
    p.add_argument("--json", action="store_true", help="print one JSON object per run")
    args = p.parse_args(argv)
    try:
        report_paths(None, args.plot)
    except PowerInferError as e:
        print(f"error: {e}", file=sys.stderr)
        return exit_status(e)
    try:
        counts = [int(c) for c in args.clients.split(",")]
        if any(c < 1 for c in counts) or args.max_tokens < 1 or args.requests < 1 or args.duration < 0:
            raise ValueError
    except ValueError:
        print("error: --clients must be positive integers; --requests and --max-tokens >= 1; --duration >= 0", file=sys.stderr)
        return USAGE_ERROR
    try:
        httpx.get(args.url + "/health", timeout=5).raise_for_status()
    except httpx.HTTPError as e:
        print(f"error: the server at {args.url} is not ready: {e}", file=sys.stderr)
        return 1
    runs = []
    for n in counts:
        run = run_clients(args.url, args.model, n, args.requests, args.duration, args.max_tokens, args.pid, args.api_key)
        runs.append((n, run))
        s = summarize(n, run)
        if args.json:
            print(json.dumps(s))
        else:
            print(f"{n:>3} clients: {s['requests']:>5} requests, {s['errors']} errors, {s['aggregate_tok_s']:7.1f} tok/s aggregate, "
                  f"per stream {s['stream_tok_s_median']:5.1f} tok/s, TTFT median {s['ttft_median_s'] * 1000:6.0f} ms "
                  f"(p90 {s['ttft_p90_s'] * 1000:.0f})" + (f", RSS {s['rss_start_mib']:.0f} -> {s['rss_end_mib']:.0f} MiB" if run.rss else ""),
                  flush=True)
        for e in sorted({x.error for x in run.samples if not x.ok})[:5]:
            print(f"    error: {e}")
    if args.plot:
        plot(runs, args.plot)
        print(f"plot: {args.plot}")
    return 1 if any(not s.ok for _, r in runs for s in r.samples) else 0


if __name__ == "__main__":
    sys.exit(main())
