"""The OpenAI error body every HTTP failure answers with (Anthropic's on its Messages routes), shared
by the server and the router.

It sits at the bottom of the package (imports nothing of it), so the standalone router can answer
bad input exactly as the server does without importing the server.
"""

from __future__ import annotations

import hmac

API_KEY_ENV = "SHARDSERVE_API_KEY"
ANTHROPIC_PATHS = "/v1/messages"  # routes whose errors take Anthropic's shape (a path prefix)
_KINDS = {400: "invalid_request_error", 401: "invalid_request_error", 404: "not_found_error",
          413: "invalid_request_error", 500: "internal_error", 502: "bad_gateway", 503: "service_unavailable",
          504: "gateway_timeout"}


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    """`{"error": {"message", "type", "param", "code"}}`; `code` defaults to the status as text."""
    kind = _KINDS.get(status, "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code or str(status)}}


def bearer_ok(authorization: str | None, key: str) -> bool:
    """Whether an Authorization header carries `Bearer key`, compared in constant time."""
    return hmac.compare_digest((authorization or "").encode(), f"Bearer {key}".encode())


def key_ok(headers, key: str) -> bool:
    """Whether a request carries the key: `Authorization: Bearer key`, or `x-api-key: key` as
    Anthropic's clients send it."""
    return bearer_ok(headers.get("authorization"), key) or hmac.compare_digest(
        (headers.get("x-api-key") or "").encode(), key.encode())


def unauthorized_body(anthropic: bool = False) -> dict:
    message = "invalid or missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'"
    if anthropic:
        return {"type": "error", "error": {"type": "authentication_error", "message": message}}
    return error_body(message, 401, code="invalid_api_key")
