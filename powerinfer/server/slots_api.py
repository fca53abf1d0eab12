"""llama-server's ``/slots``: the slots' state, and a slot's KV cache saved to, restored from or
erased in a file of the ``--slot-save-path`` folder.

Runs in: the server process (HTTP side); the cache itself moves in the scheduler thread between
steps (coordinator/slots.py), never while the slot serves a request.

File names are plain names inside the folder: no separators, no "..", no leading dot or space, no
control characters, at most 255 bytes (llama-server's rule); anything else is a 400, so a client
cannot read or write outside the folder.
"""

from __future__ import annotations

import os
import time
import unicodedata
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from powerinfer.coordinator.slots import restore_slot, save_slot
from powerinfer.errors import InvalidArgumentError
from powerinfer.server.requests import APIError, bad
from powerinfer.server.scheduler import Scheduler

MAX_NAME_BYTES = 255


def check_filename(name: Any) -> str:
    """name when it is a safe plain file name, else a 400."""
    if not isinstance(name, str) or not name:
        raise bad("'filename' must be a non-empty string", "filename", "invalid_type" if name is not None else "missing_required_parameter")
    ok = (len(name.encode("utf-8", "surrogatepass")) <= MAX_NAME_BYTES and name not in (".", "..") and ".." not in name
          and not any(c in name for c in "/\\:") and name == name.strip() and not name.startswith(".")
          and not any(unicodedata.category(c).startswith("C") for c in name))
    if not ok:
        raise bad(f"invalid filename {name[:80]!r}: a plain file name inside the slot folder is expected", "filename")
    return name


def _slot_busy(sched: Scheduler, slot: int) -> bool:
    return any(j.slot == slot for j in sched.active)


def add_slot_routes(app: FastAPI, use: Any, folder: str | None, check_key: Any, read_body: Any) -> None:
    """async with use(model name or None) as host: the ModelHost (server/host.py), ready and held."""

    @app.get("/slots")
    async def slots(request: Request) -> JSONResponse:
        check_key(request)
        async with use(request.query_params.get("model")) as host:
            llm, sched = host.ready()
        eng = llm.engine
        busy = {j.slot for j in list(sched.active)}
        return JSONResponse([{"id": i, "n_ctx": eng.n_ctx, "is_processing": i in busy, "n_cached": len(eng.slot_tokens[i])}
                             for i in range(eng.n_slots)])

    @app.post("/slots/{id_slot}")
    async def slot_action(id_slot: int, request: Request) -> JSONResponse:
        check_key(request)
        action = request.query_params.get("action")
        if action not in ("save", "restore", "erase"):
            raise bad("'action' must be save, restore or erase", "action")
        if action != "erase" and folder is None:
            raise APIError(501, "slot save and restore are off: start the server with --slot-save-path DIR", type="not_supported_error",
                           code="not_supported")
        async with use(request.query_params.get("model")) as host:
            llm, sched = host.ready()
            if not 0 <= id_slot < llm.engine.n_slots:
                raise bad(f"slot {id_slot} out of range (0..{llm.engine.n_slots - 1})", "id_slot")
            body = await read_body(request) if action != "erase" else {}
            name = check_filename(body.get("filename")) if action != "erase" else ""
            path = os.path.join(folder or "", name)
            if action == "restore" and not os.path.isfile(path):
                raise APIError(404, f"no saved slot named {name!r}", param="filename", code="not_found")
            eng = llm.engine

            def run() -> dict[str, Any]:  # in the scheduler thread, between steps
                if _slot_busy(sched, id_slot):
                    raise APIError(409, f"slot {id_slot} is serving a request; try again when it is idle", code="slot_busy")
                t0 = time.perf_counter()
                if action == "erase":
                    n = len(eng.slot_tokens[id_slot])
                    eng.rewind(0, id_slot)
                    return {"id_slot": id_slot, "n_erased": n}
                if action == "save":
                    n, nbytes = save_slot(eng, id_slot, path)
                    return {"id_slot": id_slot, "filename": name, "n_saved": n, "n_written": nbytes,
                            "timings": {"save_ms": (time.perf_counter() - t0) * 1e3}}
                n, nbytes = restore_slot(eng, id_slot, path)
                return {"id_slot": id_slot, "filename": name, "n_restored": n, "n_read": nbytes,
                        "timings": {"restore_ms": (time.perf_counter() - t0) * 1e3}}

            try:
                return JSONResponse(await run_in_threadpool(sched.between_steps, run))
            except InvalidArgumentError as e:
                raise bad(str(e), "filename") from None
            except OSError as e:
                raise APIError(500, f"the slot file could not be written or read: {e.strerror or e}", type="server_error",
                               code="io_error") from None
