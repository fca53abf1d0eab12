"""The OpenAI-compatible HTTP API (FastAPI): routes, auth, body limits, streaming, errors.

Runs in: the server process, on uvicorn's event loop. The model is loaded in a background
thread after the socket is bound (``/health`` answers 503 until then) and is only ever touched
by the scheduler thread; handlers hand it jobs and read their chunks from an asyncio queue.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
from dataclasses import replace
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from powerinfer.api import LLM
from powerinfer.server import embeddings, responses_api
from powerinfer.server.compat import add_cors, add_routes
from powerinfer.server.generate import prompt_ids, run_jobs, submit_jobs, thinking
from powerinfer.server.host import ModelHost
from powerinfer.server.state import ServerState
from powerinfer.server.requests import APIError, ChatRequest, CompletionRequest, parse_chat, parse_completion, parse_json
from powerinfer.server.settings import ServerConfig
from powerinfer.server.slots_api import add_slot_routes

__all__ = ["ServerConfig", "ServerState", "create_app"]

log = logging.getLogger(__name__)


class StatusCounter:
    """ASGI middleware counting responses by status code for /metrics."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        started = False

        async def counting(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.state.metrics.http.labels(str(message["status"])).inc()
            await send(message)

        try:
            await self.app(scope, receive, counting)
        except Exception:
            # Starlette's outermost error middleware answers an unhandled error with a 500 outside
            # this one (and re-raises it), so that answer is counted here
            if not started:
                self.state.metrics.http.labels("500").inc()
            raise


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def create_app(config: ServerConfig, load: Callable[[str], LLM]) -> FastAPI:
    """load(path): the model at path (config.models' paths; "" for the one model of -m)."""
    state = ServerState(config, load)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.start()
        yield
        await run_in_threadpool(state.close)

    app = FastAPI(title="powerinfer-server", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    add_cors(app, config.cors_origins)
    app.add_middleware(StatusCounter, state=state)  # outermost: counts the preflight answers too

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "http_error")
        msg = f"unknown route {request.method} {request.url.path}" if e.status_code in (404, 405) else str(e.detail)
        return error_response(APIError(e.status_code, msg, code=kind, headers=e.headers))  # 405: Allow

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        log.exception("internal error on %s", request.url.path)
        return error_response(APIError(500, "internal server error", type="server_error", code="internal_error"))

    def check_key(request: Request) -> None:
        if config.api_key is None:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        # compare_digest: the time taken does not reveal how much of the key matched
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), config.api_key.encode()):
            raise APIError(401, "invalid or missing API key (Authorization: Bearer KEY)", type="authentication_error",
                           code="invalid_api_key")

    async def read_body(request: Request) -> dict[str, Any]:
        limit = config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"request body of {declared} bytes exceeds the limit of {limit}", code="body_too_large")
        chunks, size = [], 0
        try:
            async for part in request.stream():
                size += len(part)
                if size > limit:
                    raise APIError(413, f"request body exceeds the limit of {limit} bytes", code="body_too_large")
                chunks.append(part)
        except ClientDisconnect:
            # the client left while sending its body: nobody reads an answer, and it is not a server error
            log.info("client left while sending the body of %s %s", request.method, request.url.path)
            raise APIError(400, "the client disconnected before its request body arrived", code="client_disconnected") from None
        return parse_json(b"".join(chunks))

    @app.api_route("/health", methods=["GET", "HEAD"])  # uptime checkers send HEAD
    async def health() -> JSONResponse:
        if state.multi:  # the daemon serves; each model's state is in /v1/models
            return JSONResponse({"status": "ok"} if not state.closing else {"status": "shutting down"}, status_code=200 if not state.closing else 503)
        try:
            _, sched = state.ready()
        except APIError as e:
            return JSONResponse({"status": "error" if state.load_error else "loading", **e.body()}, status_code=503, headers=e.headers)
        if not sched.healthy:
            e = APIError(503, "a worker died; restarting the runtime", type="server_error", code="restarting", headers={"Retry-After": "2"})
            return JSONResponse({"status": "restarting", **e.body()}, status_code=503, headers=e.headers)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_card(h: ModelHost) -> dict[str, Any]:
        card: dict[str, Any] = {"id": h.model_id, "object": "model", "created": state.created, "owned_by": "powerinfer"}
        if state.multi:  # llama-server's router lists each model's state too
            card["status"] = {"value": h.state, **({"error": h.load_error} if h.load_error else {})}
        return card

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models(request: Request) -> dict[str, Any]:
        check_key(request)
        return {"object": "list", "data": [model_card(h) for h in state.hosts.values()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str, request: Request) -> dict[str, Any]:
        check_key(request)
        return model_card(state.host(name))

    async def generate(request: Request, parse: Callable[[dict[str, Any]], ChatRequest | CompletionRequest]) -> Response:
        check_key(request)
        req = await run_in_threadpool(parse, await read_body(request))  # compiles grammars: off the event loop
        async with state.use(req.common.model) as host:
            llm, sched = host.ready()
            ids = await run_in_threadpool(prompt_ids, llm, req)
            return await run_jobs(request, llm, sched, req, ids, replace(config, model_id=host.model_id))

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await generate(request, parse_chat)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, parse_completion)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        check_key(request)
        body = await read_body(request)
        _, req = responses_api.parse(body)
        async with state.use(req.common.model) as host:
            llm, sched = host.ready()
            prompts = await run_in_threadpool(prompt_ids, llm, req)
            opens = thinking(llm, req, prompts, config)
            return await responses_api.respond(request, body, req, prompts[0], sched, host.model_id,
                                               lambda common, ps: submit_jobs(llm, sched, common, ps, config),
                                               None if opens is None else opens[0])

    async def embed(request: Request, oai: bool) -> Response:
        check_key(request)
        req = embeddings.parse(await read_body(request), oai)
        async with state.use(req.model) as host:
            llm, sched = host.ready()
            return await embeddings.respond(request, req, llm, sched, host.model_id, config.pooling)

    @app.post("/v1/embeddings")
    async def embeddings_oai(request: Request) -> Response:
        return await embed(request, True)

    @app.post("/embedding")
    async def embedding_llama(request: Request) -> Response:  # llama-server's own shape
        return await embed(request, False)

    add_routes(app, state, config, check_key, read_body)
    add_slot_routes(app, state.use, config.slot_save_path, check_key, read_body)
    for path, fn in (("/chat/completions", chat), ("/completions", completions), ("/responses", responses), ("/embeddings", embeddings_oai)):
        app.add_api_route(path, fn, methods=["POST"], include_in_schema=False)
    app.add_api_route("/models", models, methods=["GET", "HEAD"], include_in_schema=False)
    app.state.server_state = state  # the shutdown (server/graceful.py) drains its scheduler
    return app
