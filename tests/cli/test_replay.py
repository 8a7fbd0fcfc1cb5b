"""``cellstream replay`` (cellstream/cli/replay.py) on real stores: a connector's sink replayed into a lake of its own
(flushed before its positions are committed, each cell once), a lake that holds positions refused; an app
replayed with --detach and run by `cellstream jobs resume --run`, its --rate in the job's throttle; bad positions
one line and exit 2."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import duckdb
import pytest

import logstore
from cellstream.cli.main import main
from logstore.jobs import JobStore

SHARDS = 8
CONNECTOR = """
name: lake
columns: [BASE]
checkpoint_interval: 0.05
sink:
  type: parquet
  root: {root}
"""
APP = """
from indexer import App

app = App("billing", store={url!r})
seen = []


@app.trigger("BASE")
def bill(cell):
    seen.append(cell)
"""


@pytest.fixture(params=["sqlite", "mysql"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'store'}" if request.param == "sqlite" else str(
        request.getfixturevalue("mysql_database"))


def lake_rows(root: Path) -> list[tuple[int, int]]:
    with duckdb.connect() as con:
        return [(int(s), int(a)) for s, a in con.execute(
            f"SELECT shard, added_id FROM read_parquet('{root}/BASE/date=*/*.parquet', hive_partitioning=true) "
            "ORDER BY shard, added_id").fetchall()]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_a_connector_replayed_into_a_lake_of_its_own_and_a_loaded_lake_refused(
        url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with logstore.open(url, shards=SHARDS) as store:
        cells = store.put_cells([(uuid.uuid4(), "BASE", 1, {"n": i, "fare": 2.5}) for i in range(300)])
    config = tmp_path / "reload.yaml"
    config.write_text(CONNECTOR.format(root="reloaded"))
    code, out, err = run(capsys, "replay", str(config), "--store", url, "--from", "beginning", "--json")
    assert code == 0, err
    planned, final = (json.loads(line) for line in out.splitlines())
    assert final["id"] == planned["id"] and final["state"] == "done" and final["done"] == 300
    assert lake_rows(tmp_path / "reloaded") == sorted((c.shard, c.added_id) for c in cells)  # each once
    code, out, err = run(capsys, "jobs", "show", planned["id"], "--store", url)
    assert code == 0 and f"positions in consumer replay.{planned['id']}" in out
    code, out, err = run(capsys, "replay", str(config), "--store", url, "--from", "beginning")
    assert code == 4 and "holds positions already" in err and len(err.splitlines()) == 1


def test_an_app_replay_detached_then_run_by_jobs_resume_with_its_rate(
        url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with logstore.open(url, shards=SHARDS) as store:
        store.put_cells([(uuid.uuid4(), "BASE", 1, {"n": i}) for i in range(50)])
    module = tmp_path / "billing_app.py"
    module.write_text(APP.format(url=url))
    code, out, err = run(capsys, "replay", f"{module}:app", "--from", "beginning", "--shards", "0-3", "--rate",
                         "5000", "--detach", "--json")
    assert code == 0, err
    job_id = json.loads(out)["id"]
    with logstore.open(url) as store:
        record = JobStore(store).get(job_id)
        assert record.state == "planned" and record.throttle.rate == 5000
        assert record.total == sum(1 for c in store.get_cells_for_shards(dict.fromkeys(range(4), 0)).values()
                                   for _ in (c if isinstance(c, list) else []))
    code, out, err = run(capsys, "jobs", "resume", job_id, "--run", "--store", url)
    assert code == 0 and f"job {job_id} done: {record.total} cells" in out, err
    assert f"{record.total} cells of the range passed: {record.total} handled, 0 dead-lettered" in out


def test_bad_positions_are_one_line_and_exit_2(url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    logstore.open(url, shards=SHARDS).close()
    module = tmp_path / "billing_app.py"
    module.write_text(APP.format(url=url))
    for argv in (["--from", "yesterday"], ["--from", "beginning", "--shards", "0-99"],
                 ["--from", "beginning", "--until", "2026-01-01T00:00:00"], ["--from", "beginning", "--rate", "0"],
                 ["--from", "beginning", "--rate", "nan"]):
        code, _out, err = run(capsys, "replay", f"{module}:app", *argv)
        assert code == 2 and len(err.splitlines()) == 1 and err.startswith("cellstream: error:"), (argv, err)
