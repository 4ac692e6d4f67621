"""The OpenAPI document (/openapi.json) with each route's request body.

The routes read their bodies themselves (`parse_body`: a size limit first, then one 400 naming
the field), so FastAPI cannot see the models; this puts each model's JSON schema back into the
document for clients, code generators and the schemathesis fuzz test (tests/e2e/test_api_fuzz.py).
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

REF = "#/components/schemas/{model}"


def document_bodies(app: FastAPI, bodies: dict[str, type[BaseModel]], models: list[str]) -> None:
    """Make `app.openapi()` describe `bodies` (POST path -> its request model); a body's
    `model` field names one of `models`, the names this server answers to (others are a 404)."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for path, model in bodies.items():
                schema = model.model_json_schema(ref_template=REF, by_alias=True)
                if "model" in schema.get("properties", {}):
                    named = {"type": "string", "enum": list(models)}
                    optional = "model" not in schema.get("required", ())
                    schema["properties"]["model"] = {"anyOf": [named, {"type": "null"}]} if optional else named
                schemas.update(schema.pop("$defs", {}))
                schemas[model.__name__] = schema
                doc["paths"][path]["post"]["requestBody"] = {
                    "required": True,
                    "content": {"application/json": {"schema": {"$ref": REF.format(model=model.__name__)}}},
                }
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
