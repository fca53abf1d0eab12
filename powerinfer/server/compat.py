"""llama.cpp-server compatibility beside the OpenAI routes: CORS, /tokenize, /detokenize, /props,
and the ``timings`` object and cached prompt tokens of a finished request.

Runs in: the server process (HTTP side, on the event loop; tokenizing runs in a worker thread).

CORS. A browser page may read this server's answers only if the server says its origin may: by
default only pages served from this machine (``http(s)://localhost``, ``127.0.0.1``, ``[::1]``,
any port), because a server on a workstation should not let any website a user visits drive the
model (spend its compute, read its answers) through the user's browser. ``--cors-origins`` names
the allowed origins instead (comma-separated; list the local ones too to keep them), ``*`` allows
every origin. Preflight ``OPTIONS`` requests are answered by the middleware before
authentication, as browsers send them without credentials; any other request whose ``Origin`` is
not allowed gets a 403 before it reaches the model (a "simple" cross-site POST needs no preflight).
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.middleware.cors import CORSMiddleware

from powerinfer.server.requests import bad
from powerinfer.coordinator.sequence import Sequence

if TYPE_CHECKING:
    from powerinfer.server.settings import ServerConfig
    from powerinfer.server.state import ServerState

LOCAL_ORIGINS = r"^https?://(localhost|127\.0\.0\.1|\[::1\])(:\d+)?$"
MAX_TOKENIZE_CHARS = 1 << 22


def origin_allowed(origin: str, origins: tuple[str, ...]) -> bool:
    """Whether a browser page from origin may call the API under this policy."""
    if "*" in origins:
        return True
    return origin in origins if origins else re.match(LOCAL_ORIGINS, origin) is not None


def add_cors(app: FastAPI, origins: tuple[str, ...]) -> None:
    """CORS with preflight: local pages by default, the given origins, or every one with "*"; other
    origins' requests refused with a 403 (see the module docstring)."""
    every = "*" in origins
    app.add_middleware(CORSMiddleware, allow_origins=["*"] if every else list(origins),
                       allow_origin_regex=None if every or origins else LOCAL_ORIGINS, allow_methods=["GET", "POST", "OPTIONS"],
                       allow_headers=["*"], max_age=600)

    @app.middleware("http")
    async def refuse_foreign_origins(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        origin = request.headers.get("origin")
        if origin is not None and request.method != "OPTIONS" and not origin_allowed(origin, origins):
            body = {"error": {"message": f"requests from pages at {origin} are not allowed (--cors-origins)",
                              "type": "invalid_request_error", "param": None, "code": "origin_not_allowed"}}
            return JSONResponse(body, status_code=403)
        return await call_next(request)


def timings(prompt_n: int, t_submit: float, t_first: float, predicted_n: int, t_end: float, cache_n: int = 0) -> dict[str, float]:
    """llama.cpp's ``timings``: cache_n prompt tokens reused, prompt_n evaluated from submission to
    the first token, predicted_n tokens from then to the end (monotonic seconds in)."""
    prompt_ms = max(0.0, (t_first - t_submit) * 1e3) if t_first else max(0.0, (t_end - t_submit) * 1e3)
    predicted_ms = max(0.0, (t_end - t_first) * 1e3) if t_first else 0.0
    return {
        "cache_n": cache_n,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
        "prompt_per_second": 1e3 * prompt_n / prompt_ms if prompt_ms > 0 else 0.0,
        "predicted_n": predicted_n,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / predicted_n if predicted_n else 0.0,
        "predicted_per_second": 1e3 * predicted_n / predicted_ms if predicted_ms > 0 else 0.0,
    }


def cached_tokens(jobs: list[Sequence], n: int = 1) -> int:
    """Prompt tokens found in the slots' caches (``usage.prompt_tokens_details``), counted once per
    prompt as ``prompt_tokens`` is: by the first of its n choices."""
    return sum(j.cached for j in jobs if j.index % n == 0)


def job_timings(jobs: list[Sequence], predicted_n: int) -> dict[str, float]:
    """llama.cpp's ``timings`` of a request: its prompts (less the cached tokens) up to the first
    token of any choice, its choices' predicted_n tokens (as counted from their chunks) from then
    to the last one."""
    prompt_n = sum(len(j.prompt) - j.cached for j in jobs)
    firsts = [j.t_first for j in jobs if j.t_first]
    t_end = max([j.t_end for j in jobs if j.t_end] or [time.monotonic()])
    cache_n = sum(j.cached for j in jobs)
    return timings(prompt_n, min(j.t_submit for j in jobs), min(firsts) if firsts else 0.0, predicted_n, t_end, cache_n)


def _flag(body: dict[str, Any], key: str, default: bool) -> bool:
    v = body.get(key, default)
    if not isinstance(v, bool):
        raise bad(f"'{key}' must be a boolean", key, "invalid_type")
    return v


def _model(body: dict[str, Any], request: Request) -> str | None:
    """The model a llama.cpp-style request names (its body's "model", or ?model=), None: the default."""
    m = body.get("model", request.query_params.get("model"))
    if m is not None and not isinstance(m, str):
        raise bad("'model' must be a string", "model", "invalid_type")
    return m


def add_routes(app: FastAPI, state: "ServerState", config: "ServerConfig", check_key: Callable[[Request], None],
               read_body: Callable[[Request], Awaitable[dict[str, Any]]]) -> None:
    """/tokenize, /detokenize and /props (llama.cpp's shapes), and the chat page at /."""

    page = (Path(__file__).with_name("static") / "chat.html").read_bytes()

    @app.get("/")
    async def chat_page() -> HTMLResponse:
        # the page itself is public (like llama-server's); the API calls it makes carry the key
        return HTMLResponse(page, headers={"Cache-Control": "no-cache", "Content-Security-Policy": "default-src 'self' 'unsafe-inline'"})

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        check_key(request)
        body = await read_body(request)
        content = body.get("content")
        if not isinstance(content, str):
            raise bad("'content' must be a string", "content", "invalid_type" if content is not None else "missing_required_parameter")
        if len(content) > MAX_TOKENIZE_CHARS:
            raise bad(f"'content' has {len(content)} characters; at most {MAX_TOKENIZE_CHARS}", "content")
        add_special, with_pieces = _flag(body, "add_special", False), _flag(body, "with_pieces", False)
        async with state.use(_model(body, request)) as host:
            llm, _ = host.ready()
            ids = await run_in_threadpool(lambda: llm.tokenize(content, add_bos=add_special, special=True))
        if not with_pieces:
            return {"tokens": ids}
        out: list[dict[str, Any]] = []
        for i in ids:
            raw = llm.tokenizer.token_bytes(i)
            try:
                out.append({"id": i, "piece": raw.decode("utf-8")})
            except UnicodeDecodeError:  # part of a character: llama.cpp gives the bytes
                out.append({"id": i, "piece": list(raw)})
        return {"tokens": out}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        check_key(request)
        body = await read_body(request)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise bad("'tokens' must be a list of token ids", "tokens", "invalid_type")
        async with state.use(_model(body, request)) as host:
            llm, _ = host.ready()
            vocab = llm.config.vocab_size
            if any(not 0 <= t < vocab for t in tokens):
                raise bad(f"token ids must be in [0, {vocab})", "tokens")
            return {"content": await run_in_threadpool(llm.detokenize, tokens)}

    @app.get("/props")
    async def props(request: Request) -> dict[str, Any]:
        check_key(request)
        async with state.use(request.query_params.get("model")) as host:
            llm, _ = host.ready()
        template = llm.chat_template.source if llm.chat_template is not None else ""
        return {
            "default_generation_settings": {
                "n_ctx": llm.n_ctx,
                "params": {"n_predict": config.n_predict, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
                           "repeat_penalty": 1.0, "repeat_last_n": 64, "seed": -1},
            },
            "total_slots": config.parallel,
            "model_alias": host.model_id,
            "model_path": str(llm.path),
            "chat_template": template,
            "modalities": {"vision": False, "audio": False},
            "build_info": f"powerinfer-py {_version()}",
            "sparse": llm.sparse,
            "created": int(time.time()),
        }


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("powerinfer")
    except PackageNotFoundError:
        return "unknown"
