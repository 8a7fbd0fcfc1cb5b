"""Secondary index queries through a worker node (issue 54, point 5): `GET /v1/indexes` and `POST
/v1/indexes/{name}/query` answer what the library's `Index.query` answers, on SQLite and MariaDB clusters of two
storage nodes with the seed index backfilled and activated; bad input is a 400 naming the condition, an unknown
index or version a 404, an index without an active version a 409; the token and the answer's byte budget hold.
A store opened by the node's URL queries through it: `Index.query` answers what it answers on the cluster file,
typed alike, and raises the same errors."""

from __future__ import annotations

import datetime as dt
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import logstore
from indexer import App
from indexer.errors import EntryFieldError, IndexNotFoundError, IndexStateError, InvalidQueryError
from indexer.indexes.applier import Index
from indexer.indexes.backfill import backfill
from indexer.indexes.catalog import IndexCatalog
from logstore.errors import ConfigurationError, IndexUnknownError, InvalidConditionError
from logstore.persistence import TruncatedPage
from tests.harness.index_support import T0, seed, trip
from tests.harness.worker_support import NodeThread, call

NAME = "driver_partner_index"
TOKEN = "index-queries-token-0123"
AUTH = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}


class Trips:
    def __init__(self, store: logstore.Store) -> None:
        self.driver, self.city, self.other_city = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
        self.rows = [c.row_key for c in store.put_cells(
            [(uuid.uuid4(), "BASE", 1, trip(self.driver, self.city, i, fare=i)) for i in range(8)])]
        store.put_cells([(uuid.uuid4(), "BASE", 1, trip(uuid.uuid4(), self.other_city if i % 2 else self.city, i))
                         for i in range(40)])


@pytest.fixture
def served(store: logstore.Store, yaml_file: Path) -> Iterator[tuple[logstore.Store, NodeThread, Trips]]:
    trips = Trips(store)
    with App("trips", store=store, commit_interval=0.05) as app:
        app.index(yaml_file)
        app.drain(timeout=60)
    node = NodeThread(store, token=TOKEN).start()
    try:
        yield store, node, trips
    finally:
        node.stop()


def query(node: NodeThread, body: dict[str, Any], name: str = NAME, headers: dict[str, str] | None = None) -> tuple[
        int, Any]:
    status, doc, _ = call(node.url, "POST", f"/v1/indexes/{name}/query", json.dumps(body).encode(),
                          AUTH if headers is None else headers)
    return status, doc


def at(minute: int) -> str:
    return (T0 + dt.timedelta(minutes=minute)).isoformat()


def test_queries_over_http_answer_what_the_library_answers(served: tuple[logstore.Store, NodeThread, Trips]) -> None:
    store, node, trips = served
    where = {"driver_partner_uuid": str(trips.driver)}
    status, doc = query(node, {"where": where})
    assert status == 409 and doc["error"]["type"] == "IndexInactiveError"  # kept by the app, not backfilled yet
    assert "no active version" in doc["error"]["message"]
    status, doc = query(node, {"where": where, "version": 1})  # a version named is read whatever its state
    assert status == 200 and doc["version"] == 1
    assert backfill(store, NAME, 1).shards == store.shard_count
    IndexCatalog(store).activate(NAME, 1)

    status, doc, _ = call(node.url, "GET", "/v1/indexes", headers=AUTH)
    assert status == 200
    [listed] = doc["indexes"]
    assert listed["name"] == NAME and listed["active"] == 1
    [version] = listed["versions"]
    assert version["state"] == "active" and version["column"] == "BASE"
    assert version["keys"] == ["driver_partner_uuid", "city_uuid", "trip_created_at"]
    assert {"name": "fare", "type": "float", "key": False} in version["fields"]

    index = Index(store, NAME)
    cases: list[tuple[dict[str, Any], dict[str, Any]]] = [
        ({"where": {**where, "city_uuid": str(trips.city), "trip_created_at": [at(2), at(5)]}, "order": "desc"},
         {"driver_partner_uuid": trips.driver, "city_uuid": trips.city, "trip_created_at": (T0 + dt.timedelta(
             minutes=2), T0 + dt.timedelta(minutes=5)), "order": "desc"}),
        ({"where": {**where, "trip_created_at": [at(3), None]}, "limit": 2},
         {"driver_partner_uuid": trips.driver, "trip_created_at": (T0 + dt.timedelta(minutes=3), None), "limit": 2}),
        ({"where": {"city_uuid": str(trips.city)}, "scatter": True, "limit": 30},
         {"city_uuid": trips.city, "scatter": True, "limit": 30}),
        ({"where": {"city_uuid": str(trips.city), "trip_created_at": [None, 1_700_000_000 + 10**9]},
          "scatter": True, "order": "desc"},
         {"city_uuid": trips.city, "trip_created_at": (None, 1_700_000_000 + 10**9), "scatter": True,
          "order": "desc"}),
    ]
    for body, library in cases:
        status, doc = query(node, body)
        assert status == 200, doc
        assert doc["index"] == NAME and doc["version"] == 1 and "truncated" not in doc
        assert doc["entries"] == [e.to_json() for e in index.query(**library)], body
        assert doc["entries"], body
    status, doc = query(node, {"where": {**where, "city_uuid": str(trips.city), "trip_created_at": [at(2), at(5)]},
                               "order": "desc"})
    assert [e["row_key"] for e in doc["entries"]] == [str(trips.rows[i]) for i in (4, 3, 2)]
    assert doc["entries"][0]["fare"] == 4.0 and doc["entries"][0]["trip_created_at"] == at(4)


@pytest.mark.parametrize(("body", "field", "words"), [
    ({"where": {"nope": 1, "driver_partner_uuid": str(uuid.uuid4())}}, "where.nope", "not a query key (keys: "
                                                                                    "driver_partner_uuid, city_uuid"),
    ({"where": {"driver_partner_uuid": "not-a-uuid"}}, "where.driver_partner_uuid", "expected a UUID string"),
    ({"where": {"driver_partner_uuid": str(uuid.uuid4()), "trip_created_at": ["2026-11-21T08:00:00", None]}},
     "where.trip_created_at", "with a zone"),
    ({"where": {"driver_partner_uuid": str(uuid.uuid4()), "fare": 1.0}}, "where.fare", "not a query key"),
    ({"where": {"driver_partner_uuid": str(uuid.uuid4()), "trip_created_at": "0001-01-01T00:30:00+01:00"}},
     "where.trip_created_at", "within years 1 to 9999"),  # before year 1 in UTC: was an OverflowError, a 500
    ({"where": {"driver_partner_uuid": [1, 2, 3]}}, "where.driver_partner_uuid", "[start, end]"),
    ({"where": {"driver_partner_uuid": {"a": 1}}}, "where.driver_partner_uuid", "[start, end]"),
    ({"where": {"city_uuid": str(uuid.uuid4())}}, "scatter", "reads every shard"),
    ({"where": {}}, "scatter", "reads every shard"),
    ({"where": {"driver_partner_uuid": str(uuid.uuid4())}, "limit": 0}, "limit", "greater than or equal to 1"),
    ({"where": {"driver_partner_uuid": str(uuid.uuid4())}, "order": "up"}, "order", "'asc' or 'desc'"),
    ({"where": {"driver_partner_uuid": str(uuid.uuid4())}, "scatter": "yes"}, "scatter", "boolean"),
    ({"where": {"driver_partner_uuid": str(uuid.uuid4())}, "limits": 5}, "limits", "Extra inputs"),
])
def test_a_bad_query_is_a_400_naming_the_condition(served: tuple[logstore.Store, NodeThread, Trips],
                                                   body: dict[str, Any], field: str, words: str) -> None:
    status, doc = query(served[1], {**body, "version": 1})
    assert status == 400, doc
    assert doc["error"]["field"] == field and words in doc["error"]["problem"], doc


def test_a_time_no_utc_time_can_hold_is_a_bad_field_not_a_crash() -> None:
    # The same rule reads a cell's body: such a cell is dead-lettered with the reason (an EntryFieldError), where
    # an OverflowError escaped before.
    body = trip(uuid.uuid4(), uuid.uuid4(), 0)
    for when in ("0001-01-01T00:30:00+01:00", "9999-12-31T23:30:00-01:00"):
        with pytest.raises(EntryFieldError, match="within years 1 to 9999"):
            seed(1).entry({**body, "trip_created_at": when})


def test_unknown_indexes_and_versions_are_404_and_the_token_is_required(
        served: tuple[logstore.Store, NodeThread, Trips]) -> None:
    _, node, trips = served
    where = {"driver_partner_uuid": str(trips.driver)}
    status, doc = query(node, {"where": where}, name="no_such_index")
    assert status == 404 and "no index named 'no_such_index'" in doc["error"]["message"]
    status, doc = query(node, {"where": where, "version": 7})
    assert status == 404 and "no version 7 (versions: 1)" in doc["error"]["message"]
    status, doc = query(node, {"where": where}, name="Bad-Name")
    assert status == 400 and doc["error"]["field"] == "name"
    assert query(node, {"where": where, "version": 1}, headers={"Content-Type": "application/json"})[0] == 401
    assert call(node.url, "GET", "/v1/indexes")[0] == 401
    status, doc = query(node, {"where": where, "version": 1}, headers={**AUTH, "Content-Type": "text/plain"})
    assert status == 415


def test_an_answer_holds_to_the_byte_budget(cluster: str, yaml_file: Path) -> None:
    with logstore.open(cluster) as store:
        trips = Trips(store)
        with App("trips", store=store, commit_interval=0.05) as app:
            app.index(yaml_file)
            app.drain(timeout=60)
    with logstore.open(cluster, max_read_bytes=700) as store:  # room for three entries of about 230 bytes
        node = NodeThread(store, token=TOKEN).start()
        try:
            status, doc = query(node, {"where": {"driver_partner_uuid": str(trips.driver)}, "version": 1})
            whole = Index(store, NAME, version=1).query(driver_partner_uuid=trips.driver)
            with logstore.open(node.url, token=TOKEN) as client:  # a client is told the answer was cut
                cut = Index(client, NAME, version=1).query(driver_partner_uuid=trips.driver)
        finally:
            node.stop()
    assert status == 200 and doc["truncated"] is True
    assert doc["entries"] == [e.to_json() for e in whole[:len(doc["entries"])]]
    assert 1 <= len(doc["entries"]) < len(whole) == 8
    assert sum(len(json.dumps(e, separators=(",", ":"))) for e in doc["entries"]) <= 700
    assert isinstance(cut, TruncatedPage) and list(cut) == whole[:len(doc["entries"])]


def test_a_client_of_the_node_queries_as_the_cluster_file_does(
        served: tuple[logstore.Store, NodeThread, Trips]) -> None:
    store, node, trips = served
    with logstore.open(node.url, token=TOKEN) as client:
        assert client.index_queries_remote and not store.index_queries_remote
        with pytest.raises(IndexStateError, match="no active version"):
            Index(client, NAME).query(driver_partner_uuid=trips.driver)
        assert backfill(store, NAME, 1).shards == store.shard_count
        IndexCatalog(store).activate(NAME, 1)
        asked: list[dict[str, Any]] = [
            {"driver_partner_uuid": trips.driver, "city_uuid": trips.city,
             "trip_created_at": (T0 + dt.timedelta(minutes=2), T0 + dt.timedelta(minutes=5)), "order": "desc"},
            {"driver_partner_uuid": str(trips.driver), "trip_created_at": [at(3), None], "limit": 2},
            {"city_uuid": trips.city, "scatter": True, "limit": 30},
        ]
        for query_args in asked:
            remote = Index(client, NAME).query(**query_args)
            assert remote == Index(store, NAME).query(**query_args) and remote, query_args
            assert not isinstance(remote, TruncatedPage)
        assert Index(client, NAME).definition == Index(store, NAME).definition
        assert client.index_info(NAME) == store.index_info(NAME)
        [first] = Index(client, NAME, version=1).query(driver_partner_uuid=trips.driver, limit=1)
        assert isinstance(first.row_key, uuid.UUID) and first.fields["driver_partner_uuid"] == trips.driver
        assert first.fields["trip_created_at"] == T0 and isinstance(first.fields["fare"], float)
        assert client.query_index(NAME, {"driver_partner_uuid": trips.driver}) == Index(store, NAME).query(
            driver_partner_uuid=trips.driver)

        with pytest.raises(InvalidQueryError, match="reads every shard"):
            Index(client, NAME).query(city_uuid=trips.city)
        with pytest.raises(InvalidQueryError, match="expected a UUID string"):
            Index(client, NAME).query(driver_partner_uuid="not-a-uuid")
        with pytest.raises(InvalidConditionError) as caught:
            client.query_index(NAME, {"driver_partner_uuid": trips.driver, "fare": 1.0})
        assert caught.value.field == "fare" and "not a query key" in caught.value.problem
        with pytest.raises(IndexNotFoundError, match="no version 7"):
            Index(client, NAME, version=7).query(driver_partner_uuid=trips.driver)
        with pytest.raises(IndexUnknownError, match="no index named 'nope'"):
            client.query_index("nope", {"driver_partner_uuid": trips.driver})
        with pytest.raises(ConfigurationError, match="query_index"):
            client.indexes  # noqa: B018 - the index tables stay the node's


def test_the_query_command_through_the_node(served: tuple[logstore.Store, NodeThread, Trips],
                                            monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    from cellstream.cli.main import main

    store, node, trips = served
    assert backfill(store, NAME, 1).shards == store.shard_count
    IndexCatalog(store).activate(NAME, 1)
    monkeypatch.setenv("CELLSTREAM_TOKEN", TOKEN)
    code = main(["index", "query", NAME, f"driver_partner_uuid={trips.driver}", f"city_uuid={trips.city}",
                 f"trip_created_at={at(2)}..{at(5)}", "--order", "desc", "--store", node.url, "--json"])
    found = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert code == 0 and [e["row_key"] for e in found] == [str(trips.rows[i]) for i in (4, 3, 2)]
    assert main(["index", "query", "nope", "a=1", "--store", node.url]) == 1
    assert main(["index", "query", NAME, "fare=1", "--store", node.url]) == 2
