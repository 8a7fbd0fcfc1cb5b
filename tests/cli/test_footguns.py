"""What an operator at 3 a.m. must not be caught by: a read that creates a store, a --store that is silently
ignored, options that only work in one place, a discard of one entry at a time, a dead letter shown as one
escaped string, an error printed twice or prefixed twice."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

import logstore
from cellstream.cli.main import main
from tests.cli.test_apps import APP, run
from tests.harness.shared_servers import mysql_admin


@pytest.mark.parametrize("argv", [
    ["get", str(uuid.uuid4()), "BASE"], ["row", str(uuid.uuid4())], ["log", "0"], ["shards"], ["pending"],
    ["index", "status"], ["tail", "status", "t", "--offsets", "offsets.json"],
])
def test_a_read_of_a_missing_sqlite_store_says_so_and_creates_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    missing = tmp_path / "nowhere"
    code, out, err = run(capsys, *argv, "--store", f"sqlite:///{missing}")
    assert (code, out) == (4, "")
    assert err == f"cellstream: error: no store at sqlite:///{missing} (create one with `cellstream init`)\n"
    assert not missing.exists()


def test_only_init_and_put_create_a_store(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["init", "--shards", "8"], ["put", str(uuid.uuid4()), "BASE", "1", "{}"]):
        target = tmp_path / argv[0]
        code, _, err = run(capsys, *argv, "--store", f"sqlite:///{target}")
        assert code == 0, err
        assert (target / "logstore.db").exists()


def test_a_read_of_a_missing_mysql_database_says_so_and_creates_nothing(
        mysql_database: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "get", str(uuid.uuid4()), "BASE", "--store", mysql_database)
    name = mysql_database.rsplit("/", 1)[1]
    assert code == 4 and err.startswith("cellstream: error: no store at mysql://cellstream:***@") and name in err
    admin = mysql_admin()
    try:
        with admin.cursor() as cur:
            assert cur.execute("SHOW DATABASES LIKE %s", (name,)) == 0
    finally:
        admin.close()


def test_a_wrong_mysql_password_is_one_line_once(mysql_database: str, capsys: pytest.CaptureFixture[str]) -> None:
    wrong = mysql_database.replace("cellstream:cellstream@", "cellstream:wrong-pw@")
    code, out, err = run(capsys, "init", "--store", wrong)
    assert (code, out) == (4, "") and err.count("\n") == 1 and err.count("Access denied") == 1
    assert err.startswith("cellstream: error: ") and "wrong-pw" not in err


@pytest.fixture
def triage(sqlite_url: str, tmp_path: Path) -> str:
    """An app with three open dead letters (two from one card) in an existing store; its MODULE:APP."""
    with logstore.open(sqlite_url, shards=8) as store:
        store.put_cells([(uuid.uuid4(), "BASE", 1, {"bad": i < 3, "card": "visa" if i < 2 else "amex"})
                         for i in range(5)])
    module = tmp_path / f"triage{uuid.uuid4().hex[:6]}.py"
    module.write_text(APP.format(url=sqlite_url, fixed=False))
    spec = f"{module}:app"
    assert main(["run", spec, "--drain"]) == 0
    return spec


def test_run_and_dlq_refuse_a_store_that_is_not_the_apps_and_take_the_same_one_spelled_otherwise(
        triage: str, sqlite_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    other = f"sqlite:///{tmp_path / 'other'}"
    for argv in (["run", triage, "--drain"], ["dlq", "--app", triage, "list"]):
        code, out, err = run(capsys, *argv, "--store", other)
        assert (code, out) == (4, "") and err.count("\n") == 1
        assert f"--store {other} is not the store of {triage}, which uses {sqlite_url}" in err
    assert not (tmp_path / "other").exists()
    same = f"sqlite:///{Path(sqlite_url.removeprefix('sqlite:///')) / '..' / Path(sqlite_url).name}"
    code, out, err = run(capsys, "dlq", "--app", triage, "list", "--store", same, "--json")
    assert code == 0, err
    assert len(out.splitlines()) == 3


def test_global_options_go_before_or_after_the_command_and_app_before_or_after_the_action(
        triage: str, sqlite_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    before = run(capsys, "--json", "dlq", "--app", triage, "list")
    after = run(capsys, "dlq", "list", "--app", triage, "--json")
    assert before == after and before[0] == 0 and len(before[1].splitlines()) == 3
    assert all(json.loads(line)["status"] == "open" for line in before[1].splitlines())
    row = str(uuid.uuid4())
    assert run(capsys, "--store", sqlite_url, "put", row, "BASE", "1", '{"a": 1}')[0] == 0
    first = run(capsys, "--json", "--store", sqlite_url, "get", row, "BASE")
    second = run(capsys, "get", row, "BASE", "--store", sqlite_url, "--json")
    assert first == second and json.loads(first[1])["body"] == {"a": 1}
    with pytest.raises(SystemExit):
        main(["dlq", "list", "--help"])
    assert "--app MODULE:APP|CONNECTOR.yaml" in capsys.readouterr().out


def test_discard_match_with_a_dry_run_first(triage: str, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    code, out, _ = run(capsys, "dlq", "--app", triage, "discard", "--match", "handler=charge", "--reason", "x",
                       "--dry-run", "--json")
    assert code == 0 and len(out.splitlines()) == 3
    assert run(capsys, "dlq", "--app", triage, "list", "--status", "open", "--json")[1].count("\n") == 3
    code, out, _ = run(capsys, "dlq", "--app", triage, "discard", "--match", "handler=charge,error=Value",
                       "--reason", "test cards")
    assert code == 0 and out.count("discarded (test cards)") == 3
    code, out, _ = run(capsys, "dlq", "--app", triage, "list", "--status", "discarded", "--json")
    assert [json.loads(line)["status"] for line in out.splitlines()] == ["discarded"] * 3
    code, out, _ = run(capsys, "dlq", "--app", triage, "discard", "--match", "handler=charge", "--reason", "x")
    assert code == 0 and out == "no open dead letters match\n"
    code, _, err = run(capsys, "dlq", "--app", triage, "discard", "--reason", "x")
    assert code == 2 and "an entry ID or --match FILTER" in err


def test_dlq_show_is_readable_text_and_json_on_request(triage: str, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    entry = json.loads(run(capsys, "dlq", "--app", triage, "list", "--json")[1].splitlines()[0])
    code, out, _ = run(capsys, "dlq", "--app", triage, "show", entry["id"])
    assert code == 0 and out.startswith(f"dead letter {entry['id']} (open)\n")
    text = out.split("traceback:\n", 1)[1]
    assert "\n  Traceback (most recent call last):\n" in "\n" + text and "ValueError: card declined" in text
    assert '\\n' not in out and '"traceback"' not in out
    assert "  error        ValueError: card declined" in out
    shown = json.loads(run(capsys, "dlq", "--app", triage, "show", entry["id"], "--json")[1])
    assert shown["id"] == entry["id"] and shown["traceback"].startswith("Traceback")


def test_usage_errors_name_the_command_once(sqlite_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "log", "zero", "--store", sqlite_url)
    assert code == 2 and err == "cellstream: error: log: argument shard: invalid int value: 'zero'\n"
    code, _, err = run(capsys, "--nope")
    assert code == 2 and err.count("cellstream") == 1
