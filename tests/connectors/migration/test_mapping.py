"""A migration's declaration and how a source row becomes cells (no server: the mapping alone)."""

from __future__ import annotations

import datetime as dt
import decimal
import uuid

import pytest

from connectors.errors import ConversionError
from connectors.migration.mapping import TOMBSTONE, RowMapper, json_value, uuid5_row_key
from connectors.migration.source import SourceRow
from connectors.migration.spec import load_migration
from logstore.errors import ConfigFileError

NAMESPACE = "6ba7b811-9dad-11d1-80b4-00c04fd430c8"
SPEC = f"""
name: trips
source: {{url: "postgresql://app:s3cret@127.0.0.1:5433/app", table: trips}}
row_key: {{uuid5: {NAMESPACE}}}
columns:
  BASE: [rider, fare]
  ROUTE: [pickup]
"""


def test_a_uuid5_row_key_is_the_same_for_the_same_key_and_differs_otherwise() -> None:
    mapper = RowMapper(load_migration(SPEC))
    ns = uuid.UUID(NAMESPACE)
    assert mapper.row_key((42,), None) == uuid5_row_key(ns, "trips", (42,)) == uuid.uuid5(ns, "trips:[42]")
    assert mapper.row_key((42,), None) != mapper.row_key((43,), None)
    assert uuid5_row_key(ns, "legs", (4, "2")) != uuid5_row_key(ns, "legs", (42,))  # no join ambiguity
    assert uuid5_row_key(ns, "other", (42,)) != mapper.row_key((42,), None)


def test_a_row_becomes_a_cell_per_column_versioned_by_its_position() -> None:
    mapper = RowMapper(load_migration(SPEC))
    row = SourceRow((7,), {"id": 7, "rider": "ann", "fare": decimal.Decimal("12.50"),
                           "pickup": dt.datetime(2026, 1, 2, 3, 4, 5, 6), "ignored": b"x"})
    cells = mapper.cells(row, 1234)
    assert [(c.column, c.ref_key, c.body) for c in cells] == [
        ("BASE", 1234, {"rider": "ann", "fare": "12.50"}),
        ("ROUTE", 1234, {"pickup": "2026-01-02T03:04:05.000006+00:00"})]
    assert {c.row_key for c in cells} == {mapper.row_key((7,), None)}
    dead = {**TOMBSTONE, "_key": [7]}  # the key, for a sink or the flow back to name the deleted row
    assert [(c.column, c.body) for c in mapper.tombstones((7,), None, 1300)] == [("BASE", dead), ("ROUTE", dead)]


def test_a_version_column_and_a_uuid_column() -> None:
    key = uuid.uuid4()
    spec = load_migration(SPEC.replace(f"{{uuid5: {NAMESPACE}}}", "{column: trip_uuid}")
                          + "ref_key: {column: updated_at}\n")
    mapper = RowMapper(spec)
    when = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    cells = mapper.cells(SourceRow((1,), {"trip_uuid": str(key), "updated_at": when, "rider": "b", "fare": 1,
                                          "pickup": None}), 99)
    assert {c.row_key for c in cells} == {key}
    assert {c.ref_key for c in cells} == {int(when.timestamp()) * 1_000_000}
    assert mapper.cells(SourceRow((1,), {"trip_uuid": key.bytes, "updated_at": 5}), 99)[0].ref_key == 5
    with pytest.raises(ConversionError, match="not a UUID"):
        mapper.cells(SourceRow((2,), {"trip_uuid": "nope", "updated_at": 5}), 99)
    with pytest.raises(ConversionError, match="updated_at"):
        mapper.cells(SourceRow((2,), {"trip_uuid": str(key), "updated_at": None}), 99)


@pytest.mark.parametrize(("value", "want"), [
    (float("nan"), ConversionError), (b"\x00\xff", "AP8="), (dt.date(2026, 1, 2), "2026-01-02"),
    ({"a": [decimal.Decimal("1.5"), None]}, {"a": ["1.5", None]}), (uuid.UUID(int=1), str(uuid.UUID(int=1))),
    (True, True), (3, 3), (2.5, 2.5)])
def test_json_value(value: object, want: object) -> None:
    if want is ConversionError:
        with pytest.raises(ConversionError):
            json_value(value)
    else:
        assert json_value(value) == want


@pytest.mark.parametrize(("change", "problem"), [
    (("row_key: {uuid5: " + NAMESPACE + "}", "row_key: {}"), "either a column"),
    (("row_key: {uuid5: " + NAMESPACE + "}", "row_key: {uuid5: nope}"), "must be a UUID"),
    (("postgresql://", "sqlite://"), "postgresql:// or mysql://"),
    (("BASE: [rider, fare]", "BASE: []"), "names no source column"),
    (("BASE:", "_BASE:"), "reserved"),
    (("table: trips", "table: 'trips; drop'"), "table"),
    (("table: trips", "table: trips, replicas: ['mysql://u:p@h:3306/db']"), "replicas are for a MySQL source"),
])
def test_a_wrong_declaration_is_named(change: tuple[str, str], problem: str) -> None:
    with pytest.raises(ConfigFileError, match=problem):
        load_migration(SPEC.replace(*change))


def test_the_password_is_never_shown() -> None:
    spec = load_migration(SPEC)
    assert "s3cret" not in repr(spec) and "s3cret" not in str(spec.source)
    assert spec.source.kind == "postgres" and spec.source_columns == ["rider", "fare", "pickup"]
