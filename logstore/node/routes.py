"""The worker node's routes, one table for the server and its OpenAPI document: each route's method, path,
handler, who may call it, the :mod:`~logstore.node.models` its path, query and body are validated with,
and the shape of its answer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Access = Literal["open", "token", "admin"]


def ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    handler: str  # the WorkerNode method answering it
    summary: str
    ok: dict[str, Any]  # the JSON Schema of a 200 answer
    errors: tuple[int, ...] = ()  # statuses besides 400, 401 and 503
    path_model: str | None = None  # attribute names of models.Models
    query_model: str | None = None
    body_model: str | None = None
    access: Access = "token"
    media: str = "application/json"


def methods_of(route: Route) -> tuple[str, ...]:
    """The methods a route answers: its own, and HEAD beside GET (RFC 9110 9.3.2: GET's status and headers,
    no body)."""
    return (route.method, "HEAD") if route.method == "GET" else (route.method,)


_CELLS = {"type": "object", "required": ["cells"], "additionalProperties": False,
          "properties": {"cells": {"type": "array", "items": ref("Cell")}}}
_TRUNCATED = {"type": "boolean", "description": "true when the page was cut short by the answer's byte budget "
                                                "(the store's max_read_bytes): read on after its last cell"}
_PAGE = {"type": "object", "required": ["cells"], "additionalProperties": False,
         "properties": {"cells": {"type": "array", "items": ref("Cell")}, "truncated": _TRUNCATED}}
_OFFSETS = {"type": "object", "required": ["offsets"], "properties": {"offsets": {
    "type": "object", "additionalProperties": {
        "type": "object", "required": ["shard", "location", "owner", "doc"],
        "properties": {"shard": {"type": "integer"}, "location": {"type": ["integer", "null"]},
                       "owner": {"type": "string"}, "doc": {"type": "object"}}}}}}
_PROBE = {"type": "object"}
_HOLDERS = {"type": "object", "additionalProperties": {
    "type": "object", "required": ["waiting", "failed"], "additionalProperties": False,
    "properties": {"waiting": {"type": "integer"}, "failed": {"type": "integer"}}}}
_NODES = {"type": "array", "items": {"type": "string"}}
_ENTRY = {"type": "object", "required": ["row_key", "ref_key", "shard"],
          "description": "an index entry: its row, the ref_key of the cell it reflects, its shard, and its fields",
          "properties": {"row_key": {"type": "string", "format": "uuid"}, "ref_key": {"type": "integer"},
                         "shard": {"type": "integer"}}}
_INDEX = {"type": "object", "required": ["name", "active", "versions"], "additionalProperties": False, "properties": {
    "name": {"type": "string"}, "active": {"type": ["integer", "null"]}, "versions": {"type": "array", "items": {
        "type": "object", "required": ["version", "state", "column", "shard_field", "keys", "fields"],
        "additionalProperties": False, "properties": {
            "version": {"type": "integer"}, "state": {"enum": ["building", "ready", "active", "retired"]},
            "column": {"type": "string"}, "shard_field": {"type": "string"},
            "keys": {"type": "array", "items": {"type": "string"}},
            "fields": {"type": "array", "items": {
                "type": "object", "required": ["name", "type", "key"], "additionalProperties": False,
                "properties": {"name": {"type": "string"}, "type": {"type": "string"},
                               "key": {"type": "boolean"}}}}}}}}}

ROUTES: list[Route] = [
    Route("GET", "/healthz", "healthz", "the process answers", _PROBE, access="open"),
    Route("GET", "/readyz", "readyz", "every storage node answers (503 naming the ones that do not)", {
        "type": "object", "required": ["ready", "nodes"],
        "properties": {"ready": {"type": "boolean"},
                       "nodes": {"type": "object", "additionalProperties": {"type": "string"}}}}, access="open"),
    Route("GET", "/metrics", "prometheus", "Prometheus metrics (text exposition format)", {"type": "string"},
          media="text/plain"),
    Route("GET", "/openapi.json", "openapi", "this document", {"type": "object"}),
    Route("GET", "/v1/info", "info", "shard count and storage nodes", {
        "type": "object", "required": ["shards", "nodes", "max_body_bytes"],
        "properties": {"shards": {"type": "integer"}, "nodes": {"type": "array", "items": {"type": "string"}},
                       "max_body_bytes": {"type": "integer"}}}),
    Route("POST", "/v1/cells", "put_cells", "write cells (atomic per storage node; idempotent)", _CELLS,
          (409, 413), body_model="PutCells"),
    Route("POST", "/v1/system/cells", "put_system_cells",
          "write cells of any column, cellstream's own `_` ones (dead letters, offsets, the index catalog) too; "
          "needs the admin token", _CELLS, (403, 409, 413), body_model="PutSystemCells", access="admin"),
    Route("POST", "/v1/cells/read", "read_cells",
          "many cells at once, in the order asked (null: none there): a coordinate with a ref_key is that version, "
          "one without it the latest (as of `as_of` when given). An answer holds to the byte budget of a log page: "
          "one cut short says `\"truncated\": true` and holds the first coordinates' cells; ask again for the rest", {
              "type": "object", "required": ["cells"], "additionalProperties": False,
              "properties": {"cells": {"type": "array", "items": {"oneOf": [ref("Cell"), {"type": "null"}]}},
                             "truncated": _TRUNCATED}},
          (413,), body_model="ReadCells"),
    Route("GET", "/v1/rows/{row_key}", "get_row", "the latest cell of every column of the row (as of `as_of`)", {
        "type": "object", "required": ["cells"],
        "properties": {"cells": {"type": "object", "additionalProperties": ref("Cell")}}}, path_model="Row",
          query_model="AsOfQuery"),
    Route("GET", "/v1/rows/{row_key}/{column}", "get_latest", "the cell of the highest ref_key (as of `as_of`)",
          ref("Cell"), (404,), path_model="RowColumn", query_model="AsOfQuery"),
    # Not under /v1/rows/{row_key}/{column}/: a literal segment there would shadow the PUT of a {ref_key}.
    Route("GET", "/v1/versions/{row_key}/{column}", "get_versions",
          "a page of the cell's versions, the highest ref_key first; `next`: the `before` of the next page (null: "
          "none follows)", {
              "type": "object", "required": ["cells", "next"], "additionalProperties": False,
              "properties": {"cells": {"type": "array", "items": ref("Cell")},
                             "next": {"type": ["integer", "null"]}, "truncated": _TRUNCATED}},
          path_model="RowColumn", query_model="VersionsQuery"),
    Route("GET", "/v1/rows/{row_key}/{column}/{ref_key}", "get_cell", "one cell", ref("Cell"), (404,),
          path_model="CellAt"),
    Route("PUT", "/v1/rows/{row_key}/{column}/{ref_key}", "put_cell",
          "write one cell; the request body is the cell's body", ref("Cell"), (409, 413),
          path_model="CellWrite", body_model="CellBody"),
    Route("GET", "/v1/shards", "shards", "cells per shard and the node holding it", {
        "type": "object", "required": ["shards"], "properties": {"shards": {"type": "array", "items": {
            "type": "object", "required": ["shard", "node", "cells"],
            "properties": {"shard": {"type": "integer"}, "node": {"type": "string"},
                           "cells": {"type": "integer"}}}}}}),
    Route("GET", "/v1/counts", "counts",
          "cells per shard of the shards that may have moved since a mark this process of the node gave, and "
          "the mark for the next call: what a tailer looks at. Every shard's (`complete`) without a mark, for a "
          "mark this process did not give (the node restarted, or not a mark), and now and then anyway", {
              "type": "object", "required": ["shards", "cells", "mark", "complete"],
              "properties": {"shards": {"type": "array", "items": {"type": "integer"}},
                             "cells": {"type": "array", "items": {"type": "integer"},
                                       "description": "the cell count of each of `shards`, in order"},
                             "mark": {"type": "string"}, "complete": {"type": "boolean"}}},
          query_model="CountsQuery"),
    Route("GET", "/v1/shards/{shard}", "shard", "the shard's node and head location", {
        "type": "object", "required": ["shard", "node", "head"],
        "properties": {"shard": {"type": "integer"}, "node": {"type": "string"}, "head": {"type": "integer"}}},
          path_model="Shard"),
    Route("GET", "/v1/shards/{shard}/log", "log",
          "a page of the shard's log: cells after a location, in added_id order", {
              "type": "object", "required": ["cells", "next"],
              "properties": {"cells": {"type": "array", "items": ref("Cell")}, "next": {"type": "integer"},
                             "truncated": _TRUNCATED}},
          path_model="Shard", query_model="LogQuery"),
    Route("GET", "/v1/shards/{shard}/count", "count", "cells after a location", {
        "type": "object", "required": ["count"], "properties": {"count": {"type": "integer"}}},
          path_model="Shard", query_model="CountQuery"),
    Route("GET", "/v1/shards/{shard}/location", "location",
          "a location from which paging yields every cell created at or after a time", {
              "type": "object", "required": ["location"], "properties": {"location": {"type": "integer"}}},
          path_model="Shard", query_model="LocationQuery"),
    Route("GET", "/v1/indexes", "list_indexes",
          "the secondary indexes in the index catalog: their versions (not dropped), states and fields, the active one",
          {"type": "object", "required": ["indexes"], "additionalProperties": False,
           "properties": {"indexes": {"type": "array", "items": _INDEX}}}),
    Route("POST", "/v1/indexes/{name}/query", "query_index",
          "entries of an index (its active version, or `version`) whose query keys match `where`, ordered by the keys "
          "after the shard field, then row_key; without an equality on the shard field `scatter` must be true. "
          "An answer holds to the byte budget of a log page: one cut short says `\"truncated\": true` and holds "
          "the first entries; narrow the query (a range from the last entry's keys) for the rest", {
              "type": "object", "required": ["index", "version", "entries"], "additionalProperties": False,
              "properties": {"index": {"type": "string"}, "version": {"type": "integer"},
                             "entries": {"type": "array", "items": _ENTRY}, "truncated": {
                                 "type": "boolean", "description": "true when the entries were cut short by the "
                                 "answer's byte budget (the store's max_read_bytes)"}}},
          (404, 409, 413), path_model="IndexPath", body_model="IndexQuery"),
    Route("POST", "/v1/logs", "logs", "pages of many shards' logs at once (a shard that cannot be read: its error)", {
        "type": "object", "required": ["pages"], "properties": {"pages": {
            "type": "object", "additionalProperties": {"oneOf": [_PAGE, ref("Error")]}}}},
          (413,), body_model="LogsQuery"),
    Route("GET", "/v1/pending", "pending",
          "writes buffered while a primary was down, by the storage node they belong to (their home) and the one "
          "holding them meanwhile; `unreachable`: storage nodes that may hold some and did not answer", {
              "type": "object", "required": ["held", "unreachable"], "additionalProperties": False,
              "properties": {"held": {"type": "object", "additionalProperties": _HOLDERS}, "unreachable": _NODES}}),
    Route("POST", "/v1/pending/replay", "replay_pending",
          "one pass writing buffered cells home now (the node runs one every second anyway)", {
              "type": "object", "required": ["replayed", "failed", "waiting", "unreachable"],
              "additionalProperties": False,
              "properties": {"replayed": {"type": "integer"}, "failed": {"type": "integer"},
                             "waiting": {"type": "integer"}, "unreachable": _NODES}}),
    Route("GET", "/v1/offsets", "consumers", "the names of the consumers with offsets, sorted", {
        "type": "object", "required": ["consumers"], "additionalProperties": False,
        "properties": {"consumers": {"type": "array", "items": {"type": "string"}}}}),
    Route("GET", "/v1/offsets/{consumer}", "read_offsets", "a consumer's committed positions", _OFFSETS,
          path_model="Consumer"),
    Route("POST", "/v1/offsets/{consumer}/claim", "claim_offsets",
          "take over a consumer's positions (the previous holder's commits are refused from then on); needs the "
          "admin token", _OFFSETS, (403, 413), path_model="Consumer", body_model="ClaimOffsets", access="admin"),
    Route("POST", "/v1/offsets/{consumer}/commit", "commit_offsets",
          "store positions while holding them; answers the shards no longer held; needs the admin token", {
              "type": "object", "required": ["fenced"],
              "properties": {"fenced": {"type": "array", "items": {"type": "integer"}}}},
          (403, 413), path_model="Consumer", body_model="CommitOffsets", access="admin"),
]
