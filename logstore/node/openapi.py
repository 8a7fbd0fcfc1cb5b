"""The worker node's OpenAPI 3.1 document, served at ``/openapi.json``: built from the route table
(:mod:`logstore.node.routes`) and the request models the server validates with (:mod:`logstore.node.models`),
for the node's shard count. The tests run schemathesis on it, both ways: what it allows is accepted, what
it forbids is refused."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, TypeAdapter

from logstore.node.models import JSON_VALUE, SCHEMAS, models
from logstore.node.routes import ROUTES, Route, ref

_REF = "#/components/schemas/{model}"
_CELL = {
    "type": "object", "additionalProperties": False,
    "required": ["row_key", "column", "ref_key", "added_id", "shard", "created_at", "body"],
    "properties": {
        "row_key": {"type": "string", "format": "uuid"}, "column": {"type": "string"},
        "ref_key": {"type": "integer"}, "added_id": {"type": "integer"}, "shard": {"type": "integer"},
        "created_at": {"type": "string", "format": "date-time"}, "body": {"type": "object"},
    },
}
_ERROR = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["type", "message", "retriable"],
        "properties": {"type": {"type": "string"}, "message": {"type": "string"}, "retriable": {"type": "boolean"},
                       "field": {"type": "string"}, "problem": {"type": "string"},
                       "coordinates": {"type": "object"},
                       "cells_before": {"type": "array", "items": ref("Cell")}},
    }},
}
_MEANINGS = {400: "bad input: the error names the field", 401: "missing or wrong Bearer token",
             403: "the token does not allow this (the admin token does), or a request from a web page or for a "
                  "Host the node does not answer", 404: "not found",
             409: "a different cell exists at these coordinates (an index query: the index has no active version)",
             413: "request body too large",
             415: "the request body is not labelled application/json",
             429: "too many wrong tokens from this client or from all: retry after Retry-After seconds",
             503: "a storage node is unavailable, or the node is at its connection limit (retriable)"}


def _content(schema: dict[str, Any], media: str = "application/json") -> dict[str, Any]:
    return {"content": {media: {"schema": schema}}}


def _responses(route: Route) -> dict[str, Any]:
    out: dict[str, Any] = {"200": {"description": "done", **_content(route.ok, route.media)}}
    if route.path == "/readyz":
        out["503"] = {"description": "a storage node does not answer", **_content(route.ok)}
        return out
    statuses = (400, 403, *route.errors, 503) if route.access == "open" else (400, 401, 403, 429, *route.errors, 503)
    if route.body_model is not None:  # a body is read only when labelled JSON
        statuses = (*statuses, 415)
    for status in sorted(set(statuses)):
        out[str(status)] = {"description": _MEANINGS[status], **_content(ref("Error"))}
    return out


def _schema_of(model: Any, schemas: dict[str, Any]) -> dict[str, Any]:
    """The model's JSON Schema, its definitions moved to the document's components."""
    if isinstance(model, type) and issubclass(model, BaseModel):
        found = model.model_json_schema(ref_template=_REF)
        schemas.update(found.pop("$defs", {}))
        schemas[model.__name__] = found
        return ref(model.__name__)
    return TypeAdapter(model).json_schema(ref_template=_REF)


def _parameters(model: type[BaseModel], where: str) -> list[dict[str, Any]]:
    schema = model.model_json_schema(ref_template=_REF)
    required = set(schema.get("required", []))
    out = []
    for name, prop in schema["properties"].items():
        prop = {k: v for k, v in prop.items() if k != "title"}
        description = prop.pop("description", None)
        if "anyOf" in prop:  # X | None: an absent parameter is the None
            prop = next(p for p in prop["anyOf"] if p.get("type") != "null")
        param = {"name": name, "in": where, "required": where == "path" or name in required, "schema": prop}
        if description:
            param["description"] = description
        out.append(param)
    return out


def _refs(doc: Any) -> Any:
    """``doc`` with each JSON_VALUE marker replaced by its "$ref"."""
    if isinstance(doc, dict):
        return ref(str(doc["x-cellstream-schema"])) if doc == JSON_VALUE else {k: _refs(v) for k, v in doc.items()}
    if isinstance(doc, list):
        return [_refs(v) for v in doc]
    return doc


def document(shard_count: int) -> dict[str, Any]:
    built = models(shard_count)
    schemas: dict[str, Any] = {"Cell": _CELL, "Error": _ERROR, **SCHEMAS}
    paths: dict[str, Any] = {}
    for route in ROUTES:
        operation: dict[str, Any] = {"summary": route.summary, "responses": _responses(route)}
        if route.access == "open":
            operation["security"] = []
        parameters = []
        if route.path_model:
            parameters += _parameters(getattr(built, route.path_model), "path")
        if route.query_model:
            parameters += _parameters(getattr(built, route.query_model), "query")
        if parameters:
            operation["parameters"] = parameters
        if route.body_model:
            operation["requestBody"] = {"required": True,
                                        **_content(_schema_of(getattr(built, route.body_model), schemas))}
        paths.setdefault(route.path, {})[route.method.lower()] = operation
    doc: dict[str, Any] = _refs({
        "openapi": "3.1.0",
        "info": {"title": "cellstream worker node", "version": "1",
                 "description": f"The logstore API over {shard_count} shards: cells, rows, shard logs, consumer "
                                "offsets and secondary index queries. Every error is the Error document. Every GET "
                                "operation answers HEAD too (its status and headers, no body); a method an operation "
                                "does not list is a 405 with Allow, one the node does not know a 501."},
        "paths": paths,
        "components": {"schemas": schemas,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}],
    })
    return doc
