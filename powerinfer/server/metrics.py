"""Prometheus metrics of the server (``GET /metrics``).

Runs in: the server process; updated by the scheduler thread, read by the HTTP side.

Each server owns its registry (not prometheus_client's global one), so several servers can live
in one process, as the tests do.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    def __init__(self, n_slots: int) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("powerinfer_requests_running", "Sequences holding a KV-cache slot", registry=r)
        self.waiting = Gauge("powerinfer_requests_waiting", "Sequences queued for a slot", registry=r)
        self.slots = Gauge("powerinfer_slots", "KV-cache slots (--parallel)", registry=r)
        self.healthy = Gauge("powerinfer_healthy", "1 when the model is loaded and every worker answers", registry=r)
        self.prompt_tokens = Counter("powerinfer_prompt_tokens", "Prompt tokens computed (cached prefixes not counted)", registry=r)
        self.generation_tokens = Counter("powerinfer_generation_tokens", "Tokens sampled", registry=r)
        self.prompt_tokens_cache = Counter("powerinfer_prompt_tokens_cache", "Prompt tokens reused from a slot's KV cache", registry=r)
        self.requests = Counter("powerinfer_sequences", "Finished sequences by outcome", ["outcome"], registry=r)
        self.http = Counter("powerinfer_http_requests", "HTTP requests by status code", ["code"], registry=r)
        self.ttft = Histogram("powerinfer_time_to_first_token_seconds", "Queue + prefill time to the first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("powerinfer_time_per_output_token_seconds", "Mean time between output tokens of a sequence",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram("powerinfer_decode_batch_size", "Sequences per batched decode step",
                                    buckets=tuple(float(2**i) for i in range(8)), registry=r)
        self.slots.set(n_slots)

    def render(self) -> bytes:
        return generate_latest(self.registry)
