"""The OpenAI error body every HTTP failure answers with, shared by the server and the router.

It sits at the bottom of the package (imports nothing of it), so the standalone router can answer
bad input exactly as the server does without importing the server.
"""

from __future__ import annotations

_KINDS = {400: "invalid_request_error", 404: "not_found_error", 413: "invalid_request_error",
          500: "internal_error", 502: "bad_gateway", 503: "service_unavailable", 504: "gateway_timeout"}


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    """`{"error": {"message", "type", "param", "code"}}`; `code` defaults to the status as text."""
    kind = _KINDS.get(status, "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code or str(status)}}
