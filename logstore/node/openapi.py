"""The worker node's OpenAPI 3.1 document, served at ``/openapi.json``: request bodies from the pydantic
models of :mod:`logstore.node.wire`, every response a documented JSON shape (the tests run schemathesis on it)."""

from __future__ import annotations

from typing import Any

from logstore.node.wire import COLUMN_PATTERN, CONSUMER_PATTERN, MAX_LOCATION, REQUESTS, UUID_PATTERN

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
                       "cells_before": {"type": "array", "items": {"$ref": "#/components/schemas/Cell"}}},
    }},
}
_OFFSETS = {
    "type": "object", "required": ["offsets"],
    "properties": {"offsets": {"type": "object", "additionalProperties": {
        "type": "object", "required": ["shard", "location", "owner", "doc"],
        "properties": {"shard": {"type": "integer"}, "location": {"type": ["integer", "null"]},
                       "owner": {"type": "string"}, "doc": {"type": "object"}}}}},
}


def _schema(schema: dict[str, Any]) -> dict[str, Any]:
    return {"content": {"application/json": {"schema": schema}}}


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def _responses(ok: dict[str, Any], *errors: int) -> dict[str, Any]:
    meanings = {400: "bad input: the error names the field", 401: "missing or wrong Bearer token",
                404: "not found", 409: "a different cell exists at these coordinates",
                413: "request body too large", 503: "a storage node is unavailable (retriable)"}
    out: dict[str, Any] = {"200": {"description": "done", **_schema(ok)}}
    for status in (400, 401, *errors, 503):
        out[str(status)] = {"description": meanings[status], **_schema(_ref("Error"))}
    return out


def _path_param(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "in": "path", "required": True, "schema": schema}


def _query(name: str, schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "schema": schema, "description": description}


def _body(schema: dict[str, Any]) -> dict[str, Any]:
    return {"required": True, **_schema(schema)}


def document() -> dict[str, Any]:
    row_key = _path_param("row_key", {"type": "string", "pattern": UUID_PATTERN})
    column = _path_param("column", {"type": "string", "pattern": COLUMN_PATTERN})
    ref_key = _path_param("ref_key", {"type": "integer", "minimum": 0, "maximum": MAX_LOCATION})
    shard = _path_param("shard", {"type": "integer", "minimum": 0, "maximum": 65535})
    consumer = _path_param("consumer", {"type": "string", "pattern": CONSUMER_PATTERN})
    after = _query("after", {"type": "integer", "minimum": 0, "maximum": MAX_LOCATION},
                   "location to read after (default 0)")
    name = COLUMN_PATTERN.strip("^$")
    columns = _query("columns", {"type": "string", "pattern": f"^{name}(,{name})*$"}, "comma-separated column names")
    cells = {"type": "object", "required": ["cells"], "properties": {"cells": {"type": "array", "items": _ref("Cell")}}}
    paths: dict[str, Any] = {
        "/healthz": {"get": {"summary": "the process answers", "security": [],
                             "responses": {"200": {"description": "alive", **_schema({"type": "object"})}}}},
        "/readyz": {"get": {"summary": "every storage node answers", "security": [], "responses": {
            "200": {"description": "ready", **_schema({"type": "object"})},
            "503": {"description": "a storage node does not answer", **_schema({"type": "object"})}}}},
        "/v1/info": {"get": {"summary": "shard count and storage nodes", "responses": _responses({
            "type": "object", "required": ["shards", "nodes"],
            "properties": {"shards": {"type": "integer"}, "nodes": {"type": "array", "items": {"type": "string"}},
                           "max_body_bytes": {"type": "integer"}}})}},
        "/v1/cells": {"post": {"summary": "write cells (atomic per storage node; idempotent)",
                               "requestBody": _body(_ref("PutCells")), "responses": _responses(cells, 409, 413)}},
        "/v1/system/cells": {"post": {"summary": "write cells, cellstream's own _-prefixed columns allowed",
                                      "requestBody": _body(_ref("PutCells")),
                                      "responses": _responses(cells, 409, 413)}},
        "/v1/rows/{row_key}": {"get": {"summary": "the latest cell of every column of the row",
                                       "parameters": [row_key], "responses": _responses({
                                           "type": "object", "required": ["cells"], "properties": {
                                               "cells": {"type": "object", "additionalProperties": _ref("Cell")}}})}},
        "/v1/rows/{row_key}/{column}": {"get": {"summary": "the cell of the highest ref_key",
                                                "parameters": [row_key, column],
                                                "responses": _responses(_ref("Cell"), 404)}},
        "/v1/rows/{row_key}/{column}/{ref_key}": {
            "get": {"summary": "one cell", "parameters": [row_key, column, ref_key],
                    "responses": _responses(_ref("Cell"), 404)},
            "put": {"summary": "write one cell; the request body is the cell's body",
                    "parameters": [row_key, column, ref_key], "requestBody": _body({"type": "object"}),
                    "responses": _responses(_ref("Cell"), 409, 413)}},
        "/v1/shards": {"get": {"summary": "cells per shard and the node holding it", "responses": _responses({
            "type": "object", "required": ["shards"], "properties": {"shards": {"type": "array", "items": {
                "type": "object", "properties": {"shard": {"type": "integer"}, "node": {"type": "string"},
                                                 "cells": {"type": "integer"}}}}}})}},
        "/v1/shards/{shard}": {"get": {"summary": "the shard's node and head location", "parameters": [shard],
                                       "responses": _responses({"type": "object", "required": ["shard", "head"],
                                                                "properties": {"shard": {"type": "integer"},
                                                                               "node": {"type": "string"},
                                                                               "head": {"type": "integer"}}})}},
        "/v1/shards/{shard}/log": {"get": {
            "summary": "a page of the shard's log: cells after a location, in added_id order",
            "parameters": [shard, after, _query("limit", {"type": "integer", "minimum": 1, "maximum": 100_000},
                                                 "cells at most (default 1000)"), columns],
            "responses": _responses({"type": "object", "required": ["cells", "next"], "properties": {
                "cells": {"type": "array", "items": _ref("Cell")}, "next": {"type": "integer"}}})}},
        "/v1/shards/{shard}/count": {"get": {
            "summary": "cells after a location", "parameters": [shard, after, columns],
            "responses": _responses({"type": "object", "required": ["count"],
                                     "properties": {"count": {"type": "integer"}}})}},
        "/v1/shards/{shard}/location": {"get": {
            "summary": "a location from which paging yields every cell created at or after a time",
            "parameters": [shard, {"name": "at", "in": "query", "required": True,
                                   "schema": {"type": "string", "format": "date-time"}}],
            "responses": _responses({"type": "object", "required": ["location"],
                                     "properties": {"location": {"type": "integer"}}})}},
        "/v1/logs": {"post": {
            "summary": "pages of many shards' logs at once", "requestBody": _body(_ref("LogsQuery")),
            "responses": _responses({"type": "object", "required": ["pages"], "properties": {"pages": {
                "type": "object", "additionalProperties": {"oneOf": [cells, _ref("Error")]}}}}, 413)}},
        "/v1/offsets/{consumer}": {"get": {"summary": "a consumer's committed positions", "parameters": [consumer],
                                           "responses": _responses(_OFFSETS)}},
        "/v1/offsets/{consumer}/claim": {"post": {
            "summary": "take over a consumer's positions (the previous holder's commits are refused from then on)",
            "parameters": [consumer], "requestBody": _body(_ref("ClaimOffsets")),
            "responses": _responses(_OFFSETS, 413)}},
        "/v1/offsets/{consumer}/commit": {"post": {
            "summary": "store positions while holding them; answers the shards no longer held",
            "parameters": [consumer], "requestBody": _body(_ref("CommitOffsets")),
            "responses": _responses({"type": "object", "required": ["fenced"], "properties": {
                "fenced": {"type": "array", "items": {"type": "integer"}}}}, 413)}},
    }
    schemas: dict[str, Any] = {"Cell": _CELL, "Error": _ERROR}
    for model in REQUESTS:
        found = model.model_json_schema(ref_template=_REF)
        schemas.update(found.pop("$defs", {}))
        schemas[model.__name__] = found
    return {
        "openapi": "3.1.0",
        "info": {"title": "cellstream worker node", "version": "1",
                 "description": "The logstore API: cells, rows, shard logs and consumer offsets."},
        "paths": paths,
        "components": {"schemas": schemas,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}],
    }
