"""schemathesis against the worker node's OpenAPI document, both ways: a request the document allows is
accepted (no "schema-valid request rejected"), one it forbids is refused with a 4xx, none gets a server
error, and every answer matches the document (status, content type, headers, body schema)."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import checks

from logstore.node import openapi
from logstore.node.guard import AuthLimits
from tests.harness.worker_support import worker_node

TOKEN = "schemathesis-token"
ADMIN = "schemathesis-admin-token"  # takes every route, /v1/system/cells too
SHARDS = 16
CHECKS = [checks.not_a_server_error, checks.status_code_conformance, checks.content_type_conformance,
          checks.response_schema_conformance, checks.response_headers_conformance, checks.negative_data_rejection,
          checks.positive_data_acceptance, checks.ignored_auth, checks.unsupported_method]


@pytest.fixture(scope="module")
def node_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    directory: Path = tmp_path_factory.mktemp("worker-openapi")
    # schemathesis tries wrong tokens by the hundred from one address: no throttle, so each gets its 401
    unlimited = AuthLimits(client_burst=1e9, overall_burst=1e9)
    with worker_node(f"sqlite:///{directory}", SHARDS, token=TOKEN, admin_token=ADMIN,
                     auth_limits=unlimited) as node:
        yield node.url


# The document the node serves, loaded without a node running (schemathesis' lazy fixture loading does not
# work with pytest 9); test_the_node_serves_this_document checks the node serves exactly it.
schema = schemathesis.openapi.from_dict(openapi.document(SHARDS))


def test_the_node_serves_this_document(node_url: str) -> None:
    request = urllib.request.Request(f"{node_url}/openapi.json", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        assert json.loads(response.read()) == openapi.document(SHARDS)


@schema.parametrize()
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_the_api_keeps_its_document(case: schemathesis.Case, node_url: str) -> None:
    # The real token replaces a generated one; a case of a route that needs one and leaves it out (negative
    # data) is sent without it, so the node must refuse it: adding it undid the mutation the check then judged.
    public = case.operation.definition.raw.get("security") == []
    sent = public or "Authorization" in (case.headers or {})
    headers = {"Authorization": f"Bearer {ADMIN}"} if sent else None
    case.call_and_validate(base_url=node_url, headers=headers, checks=CHECKS)
