"""Errors the API answers with, and parsing a body into a model without ever answering 422."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from shardserve.http_common import BodyError, json_object
from shardserve.server.protocol import RefusedField, error_body


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.status, self.param), self.status, headers=self.headers)


async def parse_body(request: Request, model: type[BaseModel], max_bytes: int) -> BaseModel:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > max_bytes:
        raise APIError(413, f"request body of {declared} bytes exceeds the limit of {max_bytes}")
    raw = await request.body()
    if len(raw) > max_bytes:
        raise APIError(413, f"request body of {len(raw)} bytes exceeds the limit of {max_bytes}")
    try:
        data = json_object(raw)
    except BodyError as e:
        raise APIError(400, str(e), param=e.param) from None
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
