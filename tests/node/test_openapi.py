"""schemathesis against the worker node's OpenAPI document, both ways: a request the document allows is
accepted (no "schema-valid request rejected"), one it forbids is refused with a 4xx, none gets a server
error, and every answer matches the document (status, content type, headers, body schema)."""

from __future__ import annotations

import copy
import json
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import checks
from schemathesis.checks import CheckFunction
from schemathesis.core.result import Ok

import logstore
from indexer import App
from indexer.indexes.backfill import backfill
from indexer.indexes.catalog import IndexCatalog
from logstore.node import openapi
from logstore.node.guard import AuthLimits
from tests.harness.index_support import SEED_YAML, T0, trip
from tests.harness.worker_support import worker_node

TOKEN = "schemathesis-token"
ADMIN = "schemathesis-admin-token"  # takes every route, /v1/system/cells too
SHARDS = 16
INDEX = "driver_partner_index"
DRIVERS, CITY = [uuid.UUID(int=n) for n in (1, 2, 3)], uuid.UUID(int=7)  # the seed index's trips
checks.load_all_checks()  # the OpenAPI checks register themselves on import
# Every check schemathesis has (14 in 4.32; a new version's new ones too): its functions here, and a class-based
# one runs by itself (schemathesis adds the registry's classes to every validation).
CHECKS: list[CheckFunction] = [c for c in checks.CHECKS.get_all() if not checks.is_check_class(c)]


@pytest.fixture(scope="module")
def node_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    directory: Path = tmp_path_factory.mktemp("worker-openapi")
    # schemathesis tries wrong tokens by the hundred from one address: no throttle, so each gets its 401
    unlimited = AuthLimits(client_burst=1e9, overall_burst=1e9)
    seed_index(f"sqlite:///{directory}", directory / "indexes.yaml")
    with worker_node(f"sqlite:///{directory}", SHARDS, token=TOKEN, admin_token=ADMIN,
                     auth_limits=unlimited) as node:
        yield node.url


def seed_index(url: str, yaml_file: Path) -> None:
    """The seed index, active, over trips of a few drivers: the index routes answer with entries."""
    yaml_file.write_text(SEED_YAML)
    with logstore.open(url, shards=SHARDS) as store:
        store.put_cells([(uuid.uuid4(), "BASE", 1, trip(DRIVERS[i % 3], CITY, i)) for i in range(30)])
        with App("trips", store=store, commit_interval=0.05) as app:
            app.index(yaml_file)
            app.drain(timeout=60)
        backfill(store, INDEX, 1)
        IndexCatalog(store).activate(INDEX, 1)


# The document the node serves, loaded without a node running (schemathesis' lazy fixture loading does not
# work with pytest 9); test_the_node_serves_this_document checks the node serves exactly it.
schema = schemathesis.openapi.from_dict(openapi.document(SHARDS))


def test_the_node_serves_this_document(node_url: str) -> None:
    request = urllib.request.Request(f"{node_url}/openapi.json", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        assert json.loads(response.read()) == openapi.document(SHARDS)


@schema.parametrize()
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_the_api_keeps_its_document(case: schemathesis.Case[Any], node_url: str) -> None:
    # The real token replaces a generated one; a case of a route that needs one and leaves it out (negative
    # data) is sent without it, so the node must refuse it: adding it undid the mutation the check then judged.
    public = case.operation.definition.raw.get("security") == []
    sent = public or "Authorization" in (case.headers or {})
    headers = {"Authorization": f"Bearer {ADMIN}"} if sent else None
    case.call_and_validate(base_url=node_url, headers=headers, checks=CHECKS)


# The read API of issue 54 (a cell's versions, reads as of a time, batched reads): its operations again, with
# more examples, so that the `as_of` times, `before` bounds and batches of coordinates are tried widely.
READ_API = schema.include(path_regex=r"^/v1/(cells/read|versions/|rows/\{row_key\}(/\{column\})?$)")


def test_the_read_api_is_in_the_document() -> None:
    operations = {(op.ok().method.upper(), op.ok().path) for op in READ_API.get_all_operations()
                  if isinstance(op, Ok)}
    assert operations == {("POST", "/v1/cells/read"), ("GET", "/v1/versions/{row_key}/{column}"),
                          ("GET", "/v1/rows/{row_key}/{column}"), ("GET", "/v1/rows/{row_key}")}


@READ_API.parametrize()
@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_the_read_api_keeps_its_document(case: schemathesis.Case[Any], node_url: str) -> None:
    # As test_the_api_keeps_its_document: the admin token where the case sends one.
    public = case.operation.definition.raw.get("security") == []
    sent = public or "Authorization" in (case.headers or {})
    case.call_and_validate(base_url=node_url, headers={"Authorization": f"Bearer {ADMIN}"} if sent else None,
                           checks=CHECKS)


def index_document() -> dict[str, Any]:
    """The document of a node whose one index is the seed index: the query route's `name` is that index and its
    `where` the index's own keys and types (the served document cannot know a node's indexes, which change while
    it runs: there `where` is any key, and a key the index lacks is a 400 naming it)."""
    doc = copy.deepcopy(openapi.document(SHARDS))
    operation = doc["paths"]["/v1/indexes/{name}/query"]["post"]
    [name] = [p for p in operation["parameters"] if p["name"] == "name"]
    name["schema"] = {"enum": [INDEX]}
    uuid_value = {"type": "string", "format": "uuid"}
    driver = {"anyOf": [{"enum": [str(d) for d in DRIVERS]}, uuid_value]}  # the seeded ones too: answers with entries
    # RFC 3339 as Python's ISO-8601 parsing takes it (an upper-case T and Z, no leap second), in years a UTC time
    # can hold whatever the offset; or epoch seconds within years 1 to 9999.
    time_value = {"anyOf": [
        {"type": "string", "format": "date-time",
         "pattern": r"^[1-8][0-9]{3}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-5][0-9](\.[0-9]+)?"
                    r"(Z|[+-][0-9]{2}:[0-9]{2})$"},
        {"type": "number", "minimum": -62135596800, "maximum": 253402300799}]}

    def value_or_range(value: dict[str, Any]) -> dict[str, Any]:
        return {"anyOf": [value, {"type": "array", "minItems": 2, "maxItems": 2,
                                  "items": {"anyOf": [value, {"type": "null"}]}}]}
    query = copy.deepcopy(doc["components"]["schemas"]["IndexQuery"])
    query["properties"]["where"] = {
        "type": "object", "additionalProperties": False, "required": ["driver_partner_uuid"],
        "properties": {"driver_partner_uuid": driver, "city_uuid": value_or_range({"anyOf": [
                           {"enum": [str(CITY)]}, uuid_value]}),
                       "trip_created_at": value_or_range(time_value)}}
    query["required"] = ["where"]
    doc["components"]["schemas"]["SeedIndexQuery"] = query
    operation["requestBody"]["content"]["application/json"] = {
        "schema": {"$ref": "#/components/schemas/SeedIndexQuery"}, "examples": {  # queries that find entries
            "driver": {"value": {"where": {"driver_partner_uuid": str(DRIVERS[0])}}},
            "range": {"value": {"where": {"driver_partner_uuid": str(DRIVERS[1]), "city_uuid": str(CITY),
                                          "trip_created_at": [T0.isoformat(), None]}, "order": "desc", "limit": 3}},
            "scatter": {"value": {"where": {"driver_partner_uuid": str(DRIVERS[2]),
                                            "trip_created_at": [None, 1_800_000_000]}, "scatter": True}}}}
    return doc


INDEX_QUERIES = schemathesis.openapi.from_dict(index_document()).include(path="/v1/indexes/{name}/query")


@INDEX_QUERIES.parametrize()
@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_index_queries_keep_the_document_of_their_index(case: schemathesis.Case[Any], node_url: str) -> None:
    # Every check on queries of a real index: a query its keys and types allow is answered (200, or 404 for a
    # version it lacks), none gets a 500. But an index takes a value as its field's type takes it in a cell's
    # body (Python's UUID and ISO-8601 parsing: "{...}" and "urn:uuid:" UUIDs, "2026-11-21T08:00+01:00"), more
    # than JSON Schema's uuid and date-time formats say: a value outside this document may be a query the index
    # answers, so negative_data_rejection does not judge these cases (the served document has no such formats).
    sent = "Authorization" in (case.headers or {})
    negative = case.meta is not None and case.meta.generation.mode.is_negative
    case.call_and_validate(base_url=node_url, headers={"Authorization": f"Bearer {ADMIN}"} if sent else None,
                           checks=CHECKS, excluded_checks=[checks.negative_data_rejection] if negative else None)
