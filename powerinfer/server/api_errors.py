"""The server's errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` with an
HTTP status (and headers such as Retry-After).

Runs in: the server process (HTTP side); every module that refuses a request raises these.
"""

from __future__ import annotations

from typing import Any, Mapping

__all__ = ["APIError", "bad"]


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)
