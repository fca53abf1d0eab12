"""What the server's handlers share: its models (each a ModelHost), the default one, and with
several models the memory budget they share and the rule that keeps to it.

Runs in: the server process (the handlers on the event loop; loads and unloads in worker threads).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from typing import AsyncIterator, Callable

from starlette.concurrency import run_in_threadpool

from powerinfer.api import LLM
from powerinfer.server.api_errors import APIError
from powerinfer.server.host import ModelHost
from powerinfer.server.metrics import ServerMetrics
from powerinfer.server.scheduler import Scheduler
from powerinfer.server.settings import ServerConfig

log = logging.getLogger(__name__)


class ServerState:
    """What the handlers share: the models (each a ModelHost: loaded, loading, unloaded or failed),
    the default one, and with several models the memory budget they share.

    One model (``-m``): it loads at start, ``/health`` answers 503 until it is ready, and a model
    that cannot load ends the daemon. Several (repeated ``-m``, ``--models-dir``): each loads at its
    first request, within ``--models-memory`` (the least recently used idle models are unloaded to
    make room), and one that cannot load fails its own requests while the others serve.
    """

    def __init__(self, config: ServerConfig, load: Callable[[str], LLM]) -> None:
        self.config = config
        self.metrics = ServerMetrics(config.parallel)
        self.created = int(time.time())
        self.multi = bool(config.models)
        self.hosts: dict[str, ModelHost] = {}
        for mid, path, est in config.models or ((config.model_id, "", 0),):
            self.hosts[mid] = ModelHost(mid, path, functools.partial(load, path), self.metrics, config.queue, est)
        self.default = next(iter(self.hosts.values()))
        self.lock = threading.Lock()  # one load-or-evict decision at a time
        self.lease_lock = threading.Lock()  # the hosts' lease counts
        self.closing = False
        self.on_load_failure: Callable[[], None] = lambda: None  # one model that cannot load: the daemon stops (main.py exits 1)

    @property
    def load_error(self) -> str | None:
        return None if self.multi else self.default.load_error

    def start(self) -> None:
        if not self.multi:
            self.default.on_load_failure = lambda: self.on_load_failure()
            self.default.start()

    def host(self, name: str | None) -> ModelHost:
        """The model a request names (None: the default), or a 404 that lists them."""
        if name is None:
            return self.default
        h = self.hosts.get(name)
        if h is None:
            served = ", ".join(repr(m) for m in self.hosts)
            raise APIError(404, f"model {name!r} not found; this server serves {served}", param="model", code="model_not_found")
        return h

    def ready(self, name: str | None = None) -> tuple[LLM, Scheduler]:
        return self.host(name).ready()

    @contextlib.asynccontextmanager
    async def use(self, name: str | None = None) -> AsyncIterator[ModelHost]:
        """The named model, ready to serve, held for the block (it is not unloaded meanwhile: a
        request's jobs reach its scheduler inside). With several models it is loaded first if it
        is not (the request waits for the load), within the memory budget."""
        host = self.host(name)
        if self.multi:  # may wait for a load, or for an unload to make room: off the event loop
            await run_in_threadpool(self._lease, host)
        else:  # one model is never unloaded: no thread hop on every request
            with self.lease_lock:
                host.leases += 1
        try:
            host.ready()
            yield host
        finally:
            with self.lease_lock:
                host.leases -= 1

    def _lease(self, host: ModelHost) -> None:
        """Several models: hold host, loading it first (and unloading others to make room) if it is not loaded."""
        with self.lock:
            if host.state in ("unloaded", "failed"):
                if self.closing:
                    raise APIError(503, "the server is shutting down", type="server_error", code="shutting_down")
                self._make_room(host)
                host.start()
            with self.lease_lock:
                host.leases += 1
        host.ready_event.wait()

    def _make_room(self, host: ModelHost) -> None:
        """Unload idle models, least recently used first, until host fits the budget."""
        budget = self.config.models_memory
        gib = 2.0**30
        if budget and host.est_bytes > budget:
            raise APIError(503, f"the model {host.model_id!r} needs about {host.est_bytes / gib:.1f} GiB (weights and a full KV "
                                f"cache); --models-memory allows {budget / gib:.1f} GiB (or lower -c / --parallel)",
                           type="server_error", code="insufficient_memory")
        others = [h for h in self.hosts.values() if h is not host and h.state in ("loaded", "loading")]
        used = sum(h.est_bytes for h in others)
        for h in sorted(others, key=lambda h: h.last_used):
            if not budget or used + host.est_bytes <= budget:
                break
            if h.state == "loading" or h.busy or h.leases:
                continue
            log.info("unloading %s to make room for %s", h.model_id, host.model_id)
            h.close()
            used -= h.est_bytes
        if budget and used + host.est_bytes > budget:
            busy = ", ".join(repr(h.model_id) for h in others if h.state in ("loaded", "loading"))
            raise APIError(503, f"no room for {host.model_id!r} in --models-memory now: {busy} are busy; try again shortly",
                           type="server_error", code="insufficient_memory", headers={"Retry-After": "5"})

    def drain(self) -> None:
        """Shutdown begins: no new requests, the queued ones answered 503 shutting_down now."""
        self.closing = True
        for h in self.hosts.values():
            h.drain()

    def abort(self) -> None:
        """The shutdown deadline is near: end the running requests with 503 shutting_down (an
        error event when streamed) while their handlers can still answer (without blocking)."""
        for h in self.hosts.values():
            h.abort()

    def close(self, timeout: float = 10.0) -> None:
        """Abort what is left, stop the workers (each model's thread closes the model it loaded)."""
        self.closing = True
        for h in self.hosts.values():
            h.close(timeout)
