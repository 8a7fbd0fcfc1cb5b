"""The CLI end to end through main(argv): output, JSON, exit codes, one-line errors."""

from __future__ import annotations

import importlib.metadata
import importlib.resources
import io
import json
import uuid
from pathlib import Path

import pytest

import logstore
from cellstream.cli.main import main
from logstore.retry import RetryPolicy


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_put_get_row_log_shards_in_json(sqlite_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    key = str(uuid.uuid4())
    assert run(capsys, "init", "--store", sqlite_url, "--shards", "8", "--json")[:2] == (
        0, json.dumps({"shards": 8, "nodes": ["node0"]}) + "\n")
    code, out, _ = run(capsys, "put", "--store", sqlite_url, "--json", key, "BASE", "1", '{"city": "Aarhus"}')
    put = json.loads(out)
    assert code == 0 and put["body"] == {"city": "Aarhus"} and put["row_key"] == key and put["added_id"] >= 1
    run(capsys, "put", "--store", sqlite_url, key, "BASE", "2", '{"city": "Lisbon"}')
    code, out, _ = run(capsys, "get", "--store", sqlite_url, "--json", key, "BASE")
    assert code == 0 and json.loads(out)["body"] == {"city": "Lisbon"}
    code, out, _ = run(capsys, "get", "--store", sqlite_url, "--json", key, "BASE", "--ref", "1")
    assert json.loads(out) == put
    code, out, _ = run(capsys, "row", "--store", sqlite_url, "--json", key)
    assert code == 0 and list(json.loads(out)) == ["BASE"]
    shard = put["shard"]
    code, out, _ = run(capsys, "log", str(shard), "--store", sqlite_url, "--json")
    lines = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and [c["ref_key"] for c in lines] == [1, 2]
    code, out, _ = run(capsys, "log", str(shard), "--store", sqlite_url, "--json", "--from", str(put["added_id"]))
    assert [json.loads(line)["ref_key"] for line in out.splitlines()] == [2]
    code, out, _ = run(capsys, "log", str(shard), "--store", sqlite_url, "--json", "--limit", "1")
    assert len(out.splitlines()) == 1
    code, out, _ = run(capsys, "log", str(shard), "--store", sqlite_url, "--json", "--since", "2000-01-01T00:00:00Z")
    assert len(out.splitlines()) == 2
    code, out, _ = run(capsys, "shards", "--store", sqlite_url, "--json")
    assert json.loads(out) == {"shards": 8, "cells": 2, "nodes": [{"node": "node0", "shards": 8, "cells": 2}]}
    code, out, _ = run(capsys, "shards", "--store", sqlite_url, "--json", "--per-shard")
    assert json.loads(out)["per_shard"] == [{"shard": shard, "node": "node0", "cells": 2}]
    code, out, _ = run(capsys, "shards", "--store", sqlite_url, "--json", "--all")
    assert len(json.loads(out)["per_shard"]) == 8


def test_human_output_and_env_store(sqlite_url: str, capsys: pytest.CaptureFixture[str],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CELLSTREAM_STORE", sqlite_url)
    key = str(uuid.uuid4())
    monkeypatch.setattr("sys.stdin", io.StringIO('{"note": "from stdin"}'))
    code, out, _ = run(capsys, "put", key, "NOTES", "3", "-")
    assert code == 0 and f"{key} NOTES@3 " in out and '{"note":"from stdin"}' in out
    code, out, err = run(capsys, "log", str(logstore.open(sqlite_url).shard_of(key)))
    assert "NOTES@3" in out and "1 cells; next location" in err


def test_batch_put_from_json_lines(sqlite_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    keys = [str(uuid.uuid4()) for _ in range(5)]
    batch = tmp_path / "cells.jsonl"
    batch.write_text("\n".join(json.dumps({"row_key": k, "column": "BASE", "ref_key": 1, "body": {"i": i}})
                               for i, k in enumerate(keys)) + "\n\n")
    code, out, _ = run(capsys, "put", "--store", sqlite_url, "--json", "--batch", str(batch))
    assert code == 0 and [json.loads(line)["row_key"] for line in out.splitlines()] == keys
    batch.write_text(json.dumps({"row_key": keys[0], "column": "BASE"}) + "\n")
    code, out, err = run(capsys, "put", "--store", sqlite_url, "--batch", str(batch))
    assert code == 2 and "line 1: expected an object" in err


@pytest.mark.parametrize(
    ("argv", "code", "message"),
    [
        (["put", "not-a-uuid", "BASE", "1", "{}"], 2, "invalid cell row_key: 'not-a-uuid' is not a UUID"),
        (["put", str(uuid.UUID(int=1)), "BASE", "x", "{}"], 2, "REF_KEY 'x' is not an integer"),
        (["put", str(uuid.UUID(int=1)), "BASE", "1", "{oops"], 2, "BODY is not valid JSON"),
        (["put", str(uuid.UUID(int=1)), "BASE", "1", '{"x": NaN}'], 2, "NaN is not a JSON number"),
        (["put", str(uuid.UUID(int=1)), "BASE", "1", "[1]"], 2, "invalid cell body: expected a dict"),
        (["put", str(uuid.UUID(int=1)), "_dlq", "1", "{}"], 2, "reserved"),
        (["put", str(uuid.UUID(int=1)), "BASE"], 2, "put needs ROW_KEY COLUMN REF_KEY BODY"),
        (["get", str(uuid.UUID(int=9)), "BASE"], 1, ""),
        (["row", str(uuid.UUID(int=9))], 1, ""),
        (["log", "99"], 2, "shard must be an integer in [0, 8)"),
        (["log", "1", "--limit", "0"], 2, "--limit must be at least 1"),
        (["log", "1", "--since", "yesterday"], 2, "is not an ISO-8601 time"),
        (["log", "one"], 2, "invalid int value"),
        (["frobnicate"], 2, "invalid choice"),
        (["put", str(uuid.UUID(int=1)), "BASE", "1", '{"x": ' + "9" * 5000 + "}"], 2, "BODY is not valid JSON"),
        (["put", str(uuid.UUID(int=1)), "BASE", "1", "[" * 100_000 + "]" * 100_000], 2, "nested too deeply"),
        (["log", "1", "--follow", "--poll", "-1"], 2, "--poll must be a positive number"),
        (["log", "1", "--follow", "--poll", "nan"], 2, "--poll must be a positive number"),
        (["log", "1", "--from", str(2**70)], 2, "location must be an integer in [0, 2^63)"),
        (["init", "--shards", "16"], 4, "created with 8 shards, opened with 16"),
    ],
)
def test_bad_input_is_one_line_and_a_documented_exit_code(
    sqlite_url: str, capsys: pytest.CaptureFixture[str], argv: list[str], code: int, message: str
) -> None:
    logstore.open(sqlite_url, shards=8).close()
    got, out, err = run(capsys, *argv, *([] if argv[0] == "frobnicate" else ["--store", sqlite_url]))
    assert got == code
    if message:
        assert message in err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    else:
        assert "no cell" in out


def test_conflict_and_missing_store_exit_codes(sqlite_url: str, capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    key = str(uuid.uuid4())
    assert run(capsys, "put", "--store", sqlite_url, key, "BASE", "1", '{"a": 1}')[0] == 0
    code, _, err = run(capsys, "put", "--store", sqlite_url, key, "BASE", "1", '{"a": 2}')
    assert code == 3 and "already exists with a different body" in err
    monkeypatch.delenv("CELLSTREAM_STORE", raising=False)
    code, _, err = run(capsys, "shards")
    assert code == 2 and err.strip() == "cellstream: error: no store given: pass --store URL or set CELLSTREAM_STORE"
    real_open = logstore.open  # nothing listens on port 1: give up after 1 s of retries, not the default 15 s
    monkeypatch.setattr(logstore, "open", lambda target, shards=None, **options: real_open(
        target, shards, retry=RetryPolicy(initial=0.05, maximum=0.2, deadline=1.0), **options))
    code, _, err = run(capsys, "shards", "--store", "mysql://u:Secret-pw-42@127.0.0.1:1/db")
    assert code == 5 and "Secret-pw-42" not in err


def test_batch_that_is_not_utf8_is_one_line(sqlite_url: str, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    batch = tmp_path / "bad.jsonl"
    batch.write_bytes(b'{"row_key": "\xff\xfe"}\n')
    code, _, err = run(capsys, "put", "--store", sqlite_url, "--batch", str(batch))
    assert code == 2 and "not UTF-8" in err and len(err.strip().splitlines()) == 1


def test_demo_ignores_the_store_in_the_environment(sqlite_url: str, capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    logstore.open(sqlite_url, shards=8).close()
    monkeypatch.setenv("CELLSTREAM_STORE", sqlite_url)
    assert run(capsys, "demo")[0] == 0
    with logstore.open(sqlite_url) as store:
        assert sum(s.cells for s in store.shard_stats()) == 0


def test_log_follow_prints_new_cells(sqlite_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    from cellstream.cli import cells, common
    from cellstream.cli.main import build_parser

    store = logstore.open(sqlite_url, shards=1)
    first = store.put_cell(uuid.uuid4(), "BASE", 1, {"n": 1})
    polls = 0

    def sleep(_: float) -> None:
        nonlocal polls
        polls += 1
        if polls == 1:
            store.put_cell(uuid.uuid4(), "BASE", 1, {"n": 2})
        else:
            raise KeyboardInterrupt

    args = build_parser().parse_args(["log", "0", "--follow", "--json", "--store", sqlite_url])
    with pytest.raises(KeyboardInterrupt):
        cells.cmd_log(store, args, common.Output(True, __import__("sys").stdout), sleep=sleep)
    out = capsys.readouterr().out
    assert [json.loads(line)["body"]["n"] for line in out.splitlines()] == [1, 2]
    assert json.loads(out.splitlines()[0])["added_id"] == first.added_id
    store.close()


def test_demo_runs_on_the_embedded_default(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "demo")
    assert code == 0
    assert "get_cell_latest(STATUS) -> ref_key 2" in out
    assert "different body: CellConflictError" in out
    assert "page 2: next location" in out and "caught up at location" in out
    assert "(run 2): loaded 1 cells" in out and "field 'fare' was float, got string" in out
    assert out.rstrip().endswith("demo finished")


def test_demo_on_mysql(mysql_database: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "demo", "--store", mysql_database)
    assert code == 0 and "a new cell arrives" in out


def test_version_is_the_installed_distributions(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"cellstream {importlib.metadata.version('cellstream')}"


@pytest.mark.parametrize("package", ["logstore", "tailer", "indexer", "connectors", "cellstream"])
def test_every_package_declares_its_type_hints(package: str) -> None:
    assert importlib.resources.files(package).joinpath("py.typed").is_file()
