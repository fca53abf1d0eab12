"""The HTTP server's shutdown: uvicorn's graceful stop, with the requests it would cut off answered.

Runs in: the server process (the event loop's thread).

On SIGTERM uvicorn stops accepting, waits up to ``--shutdown-timeout`` for the running requests,
cancels the handlers still running, and only then runs the app's shutdown. A cancelled handler
answers nothing (a bare 500 or a stream that just stops, and a traceback in the log), and the
requests still queued waited out the whole timeout. Here the queue is answered 503 shutting_down
when the shutdown begins, and a moment before the deadline the running requests are ended the
same way (an error event when streamed), while their handlers can still send it.
"""

from __future__ import annotations

import asyncio
import socket

import uvicorn

from powerinfer.server.state import ServerState

MAX_MARGIN_S = 1.0  # how long before the deadline the running requests are ended (at most half the timeout)


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        state.on_load_failure = self._load_failed

    def _load_failed(self) -> None:
        """The model could not load: stop serving (uvicorn's loop sees should_exit within 0.1 s)."""
        self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.state.drain()
        timeout = self.config.timeout_graceful_shutdown or 0.0
        handle = asyncio.get_running_loop().call_later(max(0.0, timeout - min(MAX_MARGIN_S, timeout / 2)), self.state.abort)
        try:
            await super().shutdown(sockets)
        finally:
            handle.cancel()
