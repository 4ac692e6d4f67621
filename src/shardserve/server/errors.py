"""Errors the API answers with, and parsing a body into a model without ever answering 422."""

from __future__ import annotations

import json

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from shardserve.server.protocol import RefusedField, error_body


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.status, self.param), self.status, headers=self.headers)


# Deeper bodies are refused: what the parser accepts (~1,000 levels) some later step (a schema's
# compilation, a chat template, a message's encoding) could still fail on, as an internal error.
MAX_DEPTH = 128


def too_deep(data: object) -> bool:
    """Whether `data` nests lists or dicts more than MAX_DEPTH deep (walked without recursion)."""
    todo = [(data, 1)]
    while todo:
        item, depth = todo.pop()
        if depth > MAX_DEPTH:
            return True
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        todo.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return False


async def parse_body(request: Request, model: type[BaseModel], max_bytes: int) -> BaseModel:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > max_bytes:
        raise APIError(413, f"request body of {declared} bytes exceeds the limit of {max_bytes}")
    raw = await request.body()
    if len(raw) > max_bytes:
        raise APIError(413, f"request body of {len(raw)} bytes exceeds the limit of {max_bytes}")
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"malformed JSON body: {e}") from None
    except RecursionError:  # the parser recurses once per level of nesting
        raise APIError(400, f"the request body nests arrays or objects more than {MAX_DEPTH} deep") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    if too_deep(data):
        raise APIError(400, f"the request body nests arrays or objects more than {MAX_DEPTH} deep")
    try:
        return model.model_validate(data)
    except RefusedField as e:
        raise APIError(400, e.message, param=e.field) from None
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        if err["type"] == "extra_forbidden":  # every field is honoured or refused, never ignored
            raise APIError(400, f"unrecognized field {param!r}: this server does not support it", param=param) from None
        raise APIError(400, f"invalid field {param!r}: {err['msg']}", param=param) from None
