"""`powerinfer-server` (also `powerinfer serve`, `python launch.py serve`): the OpenAI-compatible daemon.

Runs in: the server process (it becomes the coordinator; CPU workers are its children).

    powerinfer-server -m smollm2 --port 8080 --parallel 4
    curl http://127.0.0.1:8080/v1/chat/completions -H 'Content-Type: application/json' \
         -d '{"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}]}'

The socket is bound before the model loads (so a busy port is a one-line error at once and
``/health`` answers 503 while loading); a model that cannot load stops the server: one ``error:``
line and exit 1, so a supervisor (systemd's Restart=on-failure) sees it. SIGTERM or Ctrl+C: stop accepting, answer the queued
requests 503 shutting_down, let running ones finish for ``--shutdown-timeout`` seconds, end the
rest with the same error just before it (server/graceful.py), stop the workers, exit 0.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Sequence

from powerinfer.flags import (
    CLIError,
    Parser,
    add_gpu_args,
    add_lookup_arg,
    add_model_args,
    check_gpu_flags,
    configure_logging,
    exit_status,
    load_llm,
    positive_int,
    read_template,
)
from powerinfer.chat import ChatTemplate
from powerinfer.errors import PowerInferError

log = logging.getLogger("powerinfer.server")

# Requests without max_tokens (Open WebUI's title/tags/follow-up tasks send none) stop here. 1024
# tokens is several screens of chat, more than a small model's useful answers; -n -1 lifts it.
DEFAULT_N_PREDICT = 1024
# The server's context without -c (capped by the model's trained context): Open WebUI 0.12 sends its
# 36 built-in tool definitions with every chat message, ~6.6k tokens with SmolLM2's tokenizer, which
# 4096 (the library's default) refused outright. The CPU KV caches' pages are committed 4 KiB at a
# time as positions are written (memory.lazy_array), so a long default costs memory only when used.
SERVER_DEFAULT_CTX = 16384


def build_parser(prog: str = "powerinfer-server") -> argparse.ArgumentParser:
    p = Parser(prog=prog, description="OpenAI-compatible HTTP server: /v1/chat/completions, /v1/completions, /v1/models, "
                                         "/health, /metrics.")
    add_model_args(p, default_ctx=SERVER_DEFAULT_CTX, many=True)
    p.add_argument("--models-dir", default=None, metavar="DIR",
                   help="serve every .gguf file in DIR too (each named by its file name), loaded at its first request")
    p.add_argument("--models-memory", type=float, default=None, metavar="GIB",
                   help="with several models: GiB the loaded ones may take together, each counted as its file and a full KV "
                        "cache (default: 80%% of the memory available at start); the least recently used idle model is "
                        "unloaded to make room")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8080, help="TCP port (default 8080; 0 = any free port)")
    p.add_argument("--api-key", default=os.environ.get("POWERINFER_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: $POWERINFER_API_KEY, else none)")
    p.add_argument("-np", "--parallel", type=positive_int, default=4, help="sequences decoded together, each with its own KV cache (default 4)")
    p.add_argument("--queue", type=int, default=64, help="sequences that may wait for a slot before 429 (default 64)")
    p.add_argument("--alias", default=None, help="model name in /v1/models and requests (default: the model file's name)")
    p.add_argument("--cors-origins", default="",
                   help="browser origins allowed to call the API, comma-separated; default: pages on this machine only "
                        "(localhost, 127.0.0.1, [::1], any port), so that other websites cannot drive the model through a browser. "
                        "--cors-origins '*' allows any origin, as llama-server does by default")
    p.add_argument("--chat-template-file", default=None, metavar="FILE",
                   help="a Jinja chat template to use instead of the model file's (as llama-server's)")
    p.add_argument("--reasoning-format", choices=("deepseek", "none"), default="deepseek",
                   help="deepseek (default): a reasoning model's <think>...</think> goes to message.reasoning_content "
                        "(streamed: delta.reasoning_content); none: left in content. A request's reasoning_format overrides it")
    add_lookup_arg(p)
    p.add_argument("--pooling", choices=("mean", "last"), default="mean",
                   help="embeddings (/v1/embeddings, /embedding): the mean of the final hidden states over the input's tokens "
                        "(default) or the last token's; either scaled to unit length")
    p.add_argument("--slot-save-path", default=None, metavar="DIR",
                   help="the folder where POST /slots/ID?action=save|restore keeps a slot's KV cache (created if missing); "
                        "default: off. File names are plain names inside it")
    p.add_argument("--max-body", type=positive_int, default=8 << 20, help="largest request body in bytes (default 8 MiB)")
    p.add_argument("-n", "--n-predict", type=int, default=DEFAULT_N_PREDICT,
                   help=f"tokens a request may generate when it sets no max_tokens; -1 = until end of text or context "
                        f"(default {DEFAULT_N_PREDICT}: a client's background task without a limit must not hold a slot for minutes)")
    p.add_argument("--shutdown-timeout", type=float, default=10.0, help="seconds in-flight requests get on SIGTERM (default 10)")
    add_gpu_args(p)
    p.add_argument("--predictor", default=None, help="a .predictor file: sparse FFN")
    p.add_argument("--no-sparse", action="store_true", help="ignore the predictor's sparsity (dense, exact)")
    return p


def model_id(args: argparse.Namespace) -> str:
    if args.alias:
        return str(args.alias)
    return _file_id(args.model)


def _file_id(model: str) -> str:
    name = Path(model).name
    return name[: -len(".gguf")] if name.endswith(".gguf") else name


def plan_models(args: argparse.Namespace) -> tuple[tuple[str, str, int], ...]:
    """Several models (repeated -m, --models-dir): (name, path, estimated bytes) each; () for one
    (args.model is then that one). A file that cannot be read is listed, and fails its requests."""
    from powerinfer.cpu_workers.topology import default_workers, read_topology, split_threads
    from powerinfer.fetch import resolve_model
    from powerinfer.server.host import estimate_bytes

    given = list(args.model or [])
    if args.models_dir is not None:
        if not os.path.isdir(args.models_dir):
            raise CLIError(f"--models-dir {args.models_dir}: not a folder")
        given += sorted(os.path.join(args.models_dir, n) for n in os.listdir(args.models_dir) if n.endswith(".gguf"))
    if not given:
        raise CLIError("give a model: -m FILE (repeat it for several) or --models-dir DIR")
    if len(given) == 1 and args.models_dir is None:
        args.model = given[0]
        return ()
    if args.alias:
        raise CLIError("--alias names the one model of -m; with several, each is named by its file")
    topo = read_topology()
    workers = 0 if args.executor == "inprocess" else split_threads(topo, args.threads or default_workers(topo), args.worker_threads)[0]
    out: list[tuple[str, str, int]] = []
    for m in given:
        name = _file_id(m)
        if any(name == o[0] for o in out):
            raise CLIError(f"two models would both be named {name!r}: rename one of the files")
        try:
            path = str(resolve_model(m, progress=False))
            est = estimate_bytes(path, args.ctx_size, args.parallel, workers)
        except (PowerInferError, OSError) as e:
            log.warning("model %s cannot be read (%s): its requests will fail", m, e)
            path, est = m, 0
        out.append((name, path, est))
    return tuple(out)


def bind(host: str, port: int) -> socket.socket:
    if not 0 <= port <= 65535:
        raise CLIError(f"--port must be in 0..65535, got {port}")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise PowerInferError(f"port {port} on {host} is already in use (another server?); choose another with --port") from None
        raise PowerInferError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    except (socket.gaierror, UnicodeError) as e:
        sock.close()
        raise PowerInferError(f"cannot listen on {host}:{port}: {e}") from None
    sock.listen(256)
    sock.set_inheritable(True)
    return sock


def serve(argv: Sequence[str], prog: str = "powerinfer-server") -> int:
    import uvicorn

    from powerinfer.server.app import ServerConfig, create_app
    from powerinfer.server.graceful import GracefulServer

    args = build_parser(prog).parse_args(argv)
    configure_logging(args.log_level, args.verbose)
    if args.queue < 0:
        raise CLIError(f"--queue must be >= 0, got {args.queue}")
    if args.ctx_size is not None and args.ctx_size < 0:
        raise CLIError(f"--ctx-size must be >= 0, got {args.ctx_size}")
    if args.n_predict == 0 or args.n_predict < -1:
        raise CLIError(f"--n-predict must be positive or -1, got {args.n_predict}")
    if not args.shutdown_timeout >= 0:
        raise CLIError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    if args.api_key is not None and not args.api_key.strip():
        raise CLIError("--api-key must not be empty")
    check_gpu_flags(args)
    if args.chat_template_file:  # a template that cannot be read or compiled ends the daemon now, not after the model loads
        ChatTemplate(read_template(args.chat_template_file))
    if args.slot_save_path is not None:
        try:
            os.makedirs(args.slot_save_path, exist_ok=True)
        except OSError as e:
            raise CLIError(f"--slot-save-path {args.slot_save_path}: {e.strerror or e}") from None
        if not os.access(args.slot_save_path, os.W_OK | os.X_OK):
            raise CLIError(f"--slot-save-path {args.slot_save_path}: not a writable folder")
    if args.host not in ("127.0.0.1", "localhost", "::1") and args.api_key is None:
        log.warning("listening on %s without --api-key: anyone who can reach this port can use the model", args.host)
    models = plan_models(args)
    budget = 0
    if models:
        import psutil

        budget = int(args.models_memory * 2**30) if args.models_memory is not None else int(0.8 * psutil.virtual_memory().available)
        if budget <= 0:
            raise CLIError(f"--models-memory must be positive, got {args.models_memory}")
    sock = bind(args.host, args.port)
    cfg = ServerConfig(model_id=models[0][0] if models else model_id(args), models=models, models_memory=budget, parallel=args.parallel, queue=args.queue, api_key=args.api_key, max_body_bytes=args.max_body,
                       n_predict=args.n_predict, cors_origins=tuple(o.strip() for o in args.cors_origins.split(",") if o.strip()),
                       reasoning_format=args.reasoning_format, pooling=args.pooling,
                       slot_save_path=os.path.abspath(args.slot_save_path) if args.slot_save_path else None)
    args.n_slots = args.parallel
    app = create_app(cfg, lambda path: load_llm(argparse.Namespace(**{**vars(args), "model": path or args.model}), progress=False))
    host, port = sock.getsockname()[:2]
    # not "serving" yet: the model loads while the port already answers, and a model that cannot load ends the daemon
    if models:
        print(f"powerinfer-server: serving {len(models)} models ({', '.join(m[0] for m in models)}), each loaded at its first request "
              f"within {budget / 2**30:.1f} GiB; listening on http://{host}:{port}/v1", file=sys.stderr, flush=True)
    else:
        print(f"powerinfer-server: loading {cfg.model_id}; listening on http://{host}:{port}/v1 (/health answers 503 until it is ready)",
              file=sys.stderr, flush=True)
    server = GracefulServer(uvicorn.Config(app, log_level=args.log_level.lower() if not args.verbose else "debug",
                                           timeout_graceful_shutdown=args.shutdown_timeout, access_log=args.verbose,
                                           # longer than clients' pooled-connection idle time, so a reused
                                           # connection is not closed under a request (a reset POST is not retried)
                                           timeout_keep_alive=75, lifespan="on"), app.state.server_state)
    # uvicorn handles SIGTERM (graceful shutdown), then restores the previous handler and raises
    # the signal again; with this no-op handler in place that last step is harmless and the
    # daemon exits 0 after a clean stop instead of dying of its own SIGTERM.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    if app.state.server_state.load_error is not None:  # the server stopped because the model could not load
        raise PowerInferError(f"cannot load the model: {app.state.server_state.load_error}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return serve(list(sys.argv[1:] if argv is None else argv))
    except PowerInferError as e:
        print(f"error: {e}", file=sys.stderr)
        return exit_status(e)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
