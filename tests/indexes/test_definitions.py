"""Index definitions (issue 5, first part): the YAML file, errors that name the line and the field,
and the typed entry a cell's body gives."""

from __future__ import annotations

import datetime as dt
import doctest
import uuid
from pathlib import Path

import pytest

import indexer.indexes.definitions
from indexer import NonRetriableError
from indexer.errors import EntryFieldError
from indexer.indexes.definitions import load_indexes
from logstore.errors import ConfigFileError
from tests.harness.index_support import SEED_YAML

SEED = SEED_YAML.lstrip("\n") + "      - {name: status, type: str}\n      - {name: extras, type: json}\n"


def test_the_seed_index_loads_with_its_query_keys(tmp_path: Path) -> None:
    path = tmp_path / "indexes.yaml"
    path.write_text(SEED)
    [index] = load_indexes(path)
    assert (index.name, index.column, index.version, index.shard_field) == (
        "driver_partner_index", "BASE", 1, "driver_partner_uuid")
    assert index.keys == ("driver_partner_uuid", "city_uuid", "trip_created_at")
    assert [f.type for f in index.fields] == ["uuid", "uuid", "datetime", "float", "str", "json"]


def test_the_module_example_runs() -> None:
    assert doctest.testmod(indexer.indexes.definitions).failed == 0


@pytest.mark.parametrize(
    ("change", "line", "field", "words"),
    [
        (("type: float", "type: decimal"), 10, "indexes[driver_partner_index].fields[fare].type", "'uuid'"),
        (("shard_field: driver_partner_uuid", "shard_field: driver"), 5, "indexes[driver_partner_index].shard_field",
         "not one of the fields"),
        (("{name: fare, type: float}", "{name: city_uuid, type: float}"), 6,
         "indexes[driver_partner_index].fields", "city_uuid declared more than once"),
        (("{name: extras, type: json}", "{name: extras, type: json, key: true}"), 6,
         "indexes[driver_partner_index].fields", "cannot be a query key"),
        (("    version: 1\n", ""), 2, "indexes[driver_partner_index].version", "Field required"),
        (("version: 1", "version: 0"), 4, "indexes[driver_partner_index].version", "greater than or equal to 1"),
        (("column: BASE", "column: _dlq"), 3, "indexes[driver_partner_index].column", "reserved"),
        (("{name: status, type: str}", "{name: row_key, type: str}"), 11,
         "indexes[driver_partner_index].fields[row_key].name", "reserved"),
        (("{name: status, type: str}", "{name: status, type: str, unique: true}"), 11,
         "indexes[driver_partner_index].fields[status].unique", "Extra inputs"),
        (("{name: fare, type: float}", "{name: fare, type: float"), None, "", "not valid YAML"),
    ],
)
def test_a_bad_definition_names_its_line_and_field(change: tuple[str, str], line: int | None, field: str,
                                                   words: str) -> None:
    with pytest.raises(ConfigFileError) as error:
        load_indexes(SEED.replace(*change))
    assert words in str(error.value)
    assert error.value.field == field
    if line is not None:
        assert error.value.line == line
        assert str(error.value).startswith(f"<indexes>:{line}: {field}: ")


def test_a_shard_field_of_a_type_without_a_stable_hash_is_refused() -> None:
    text = SEED.replace("shard_field: driver_partner_uuid", "shard_field: fare")
    with pytest.raises(ConfigFileError, match="has type float; it must be uuid, str or int") as error:
        load_indexes(text)
    assert error.value.line == 5


def test_two_indexes_with_one_name_and_a_file_that_is_not_a_mapping_are_refused(tmp_path: Path) -> None:
    twice = SEED + SEED.split("\n", 1)[1]
    with pytest.raises(ConfigFileError, match="driver_partner_index version 1 defined more than once"):
        load_indexes(twice)
    v2 = SEED.split("\n", 1)[1].replace("version: 1", "version: 2").replace("column: BASE", "column: OTHER")
    with pytest.raises(ConfigFileError, match="versions of driver_partner_index read different columns"):
        load_indexes(SEED + v2)
    assert [i.version for i in load_indexes(SEED + v2.replace("column: OTHER", "column: BASE"))] == [1, 2]
    with pytest.raises(ConfigFileError, match="must be a mapping"):
        load_indexes("- just\n- a list\n")
    with pytest.raises(ConfigFileError, match="cannot read it"):
        load_indexes(tmp_path / "missing.yaml")


def test_a_body_gives_typed_values_and_a_bad_one_is_a_non_retriable_error_naming_the_field() -> None:
    [index] = load_indexes(SEED)
    driver, city = uuid.uuid4(), uuid.uuid4()
    body = {"driver_partner_uuid": str(driver), "city_uuid": str(city), "trip_created_at": "2026-11-21T10:00:00+01:00",
            "fare": 12, "status": "completed", "extras": {"tip": [1, 2]}, "not_indexed": True}
    entry = index.entry(body)
    assert entry == {"driver_partner_uuid": driver, "city_uuid": city,
                     "trip_created_at": dt.datetime(2026, 11, 21, 9, 0, tzinfo=dt.UTC), "fare": 12.0,
                     "status": "completed", "extras": {"tip": [1, 2]}}
    assert index.entry({**body, "trip_created_at": 0})["trip_created_at"] == dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
    assert index.entry({**body, "status": None})["status"] is None  # not a key: null is kept

    bad = [
        ({k: v for k, v in body.items() if k != "fare"}, "fare", "missing"),
        ({**body, "city_uuid": "not-a-uuid"}, "city_uuid", "expected a UUID string"),
        ({**body, "city_uuid": None}, "city_uuid", "query key must have a value"),
        ({**body, "fare": True}, "fare", "expected a finite number"),
        ({**body, "fare": float("nan")}, "fare", "expected a finite number"),
        ({**body, "status": 3}, "status", "expected a string"),
        ({**body, "trip_created_at": "2026-11-21T10:00:00"}, "trip_created_at", "has none"),
        ({**body, "trip_created_at": "yesterday"}, "trip_created_at", "ISO-8601"),
    ]
    for cell_body, field, words in bad:
        with pytest.raises(EntryFieldError) as error:
            index.entry(cell_body)
        assert error.value.field == field and words in str(error.value)
        assert isinstance(error.value, NonRetriableError) and not error.value.retriable
        assert str(error.value).startswith(f"index driver_partner_index: field {field}: ")


def test_int_and_bool_fields_are_strict() -> None:
    [index] = load_indexes(
        "indexes:\n  - {name: by_count, column: STATS, version: 2, shard_field: n,\n"
        "     fields: [{name: n, type: int}, {name: ok, type: bool}]}\n")
    assert index.keys == ("n",)
    assert index.entry({"n": 5, "ok": False}) == {"n": 5, "ok": False}
    for body, field in [({"n": 5.0, "ok": True}, "n"), ({"n": True, "ok": True}, "n"), ({"n": 2**63, "ok": True}, "n"),
                        ({"n": 1, "ok": 1}, "ok")]:
        with pytest.raises(EntryFieldError) as error:
            index.entry(body)
        assert error.value.field == field
