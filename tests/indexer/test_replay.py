"""Replays (indexer/runtime/replay.py) on real stores (SQLite, MariaDB): exactly the range planned (the heads at
planning, --from a time, --until a location, --shards), in per-shard order; the live app running alongside with
its offsets untouched and its processing going on; the app's retries and dead letters, marked as the replay's;
latest only; a stall failing the job and a resume after the fix; and a replay SIGKILLed mid-run, in a real
process, resumed by `cellstream jobs resume --run` from its committed positions, losing nothing."""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import logstore
from indexer import App, NonRetriableError
from indexer.runtime.replay import Replay, positions_consumer, replay_params
from logstore.jobs import JobRecord, JobRunner, KindRegistry, RunnerConfig
from logstore.retry import RetryPolicy
from tests.harness import REPO
from tests.harness.app_thread import app_in_thread

SHARDS = 8
FAST = RunnerConfig(lease_seconds=5.0, poll_seconds=0.05, progress_seconds=0.1, backoff_seconds=0.05)
QUICK = RetryPolicy(initial=0.001, maximum=0.002, deadline=None)


@pytest.fixture(params=["sqlite", "mysql"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'store'}" if request.param == "sqlite" else str(
        request.getfixturevalue("mysql_database"))


@pytest.fixture
def store(url: str) -> Iterator[logstore.Store]:
    with logstore.open(url, shards=SHARDS) as opened:
        yield opened


def write(store: logstore.Store, n: int, column: str = "BASE", **extra: Any) -> list[logstore.Cell]:
    return store.put_cells([(uuid.uuid4(), column, 1, {"n": i, **extra}) for i in range(n)])


def ids(cells: list[logstore.Cell]) -> list[tuple[int, int]]:
    return sorted((c.shard, c.added_id) for c in cells)


def in_shard_order(cells: list[logstore.Cell]) -> bool:
    by_shard: dict[int, list[int]] = defaultdict(list)
    for cell in cells:
        by_shard[cell.shard].append(cell.added_id)
    return all(found == sorted(found) for found in by_shard.values())


def plan(store: logstore.Store, app: App, **range_: Any) -> tuple[JobRunner, JobRecord]:
    """A replay job of ``app`` over ``range_`` (``start``, ``until``, ``shards``, ``latest_only``), planned."""
    runner = JobRunner(store, KindRegistry([Replay(store, lambda _params: (app, lambda: None))]), FAST)
    return runner, runner.submit("replay", replay_params(app, {"app": "test"}, **{"start": "beginning", **range_}))


def test_a_replay_delivers_the_range_planned_once_in_shard_order(store: logstore.Store) -> None:
    cells = write(store, 300)
    write(store, 20, "OTHER")  # not the app's column
    seen: list[logstore.Cell] = []
    app = App("billing", store=store)
    app.trigger("BASE")(seen.append)
    runner, job = plan(store, app)
    assert job.total == 300
    write(store, 40)  # after the plan: past each shard's end
    record = runner.run(job.id)
    assert record.state == "done" and record.done == record.total == 300
    assert ids(seen) == ids(cells)
    assert in_shard_order(seen)
    assert store.read_offsets("app.billing") == {}  # the app's consumer was never claimed
    positions = store.read_offsets(positions_consumer(job.id))
    assert all((positions[c.shard].location or 0) >= c.added_id for c in cells)
    app.close()


def test_from_a_time_until_a_location_over_some_shards(store: logstore.Store) -> None:
    before = write(store, 200)
    time.sleep(0.05)
    since = dt.datetime.now(dt.UTC)
    time.sleep(0.05)
    after = write(store, 400)
    shards = {0, 1, 2, 3}
    mine = sorted((c for c in after if c.shard in shards), key=lambda c: (c.shard, c.added_id))
    last = [c for c in mine if c.shard == 2]
    until = last[len(last) // 2]  # shard 2 ends at this cell, included; the others at their heads
    expected = [c for c in mine if c.shard != 2 or c.added_id <= until.added_id]
    seen: list[logstore.Cell] = []
    app = App("billing", store=store)
    app.trigger("BASE")(seen.append)
    runner, job = plan(store, app, start=since.isoformat(), until=f"2:{until.added_id}", shards="0-3")
    assert job.total == len(expected)
    assert runner.run(job.id).state == "done"
    assert ids(seen) == ids(expected) and not set(ids(before)) & set(ids(seen))
    app.close()


@pytest.mark.parametrize(("start", "until", "says"), [
    ("2026-11-27T21:00:00Z", "2026-11-27T20:00:00Z", "is before --from"),
    ("2:40", "2:30", "--until 2:30 is before --from 2:40"),
    ("beginning", "beginning", "would hold nothing"),
])
def test_a_range_that_ends_before_it_starts_is_refused(store: logstore.Store, start: str, until: str,
                                                       says: str) -> None:
    app = App("inverted", store=store)

    @app.trigger("BASE")
    def handle(cell: logstore.Cell) -> None:
        pass

    with pytest.raises(logstore.InvalidArgumentError, match=says):
        replay_params(app, {"app": "test"}, start=start, until=until)


def test_the_live_app_keeps_running_with_its_offsets_untouched(store: logstore.Store) -> None:
    cells = write(store, 400)
    live_seen: list[logstore.Cell] = []
    live = App("billing", store=store, commit_interval=0.05)
    live.trigger("BASE")(live_seen.append)
    replayed: list[logstore.Cell] = []
    replaying = App("billing", store=store, commit_interval=0.05)
    replaying.trigger("BASE")(replayed.append)
    heads = {s: max(c.added_id for c in cells if c.shard == s) for s in {c.shard for c in cells}}
    with app_in_thread(live, "live") as running:
        deadline = time.monotonic() + 30
        while ({s: r.location for s, r in store.read_offsets("app.billing").items()} != heads
               and time.monotonic() < deadline):
            time.sleep(0.02)  # until the live app handled and committed everything
        offsets = store.read_offsets("app.billing")
        assert ids(live_seen) == ids(cells) and {s: r.location for s, r in offsets.items()} == heads
        runner, job = plan(store, replaying)
        assert runner.run(job.id).state == "done"
        assert ids(replayed) == ids(cells) and in_shard_order(replayed)
        assert store.read_offsets("app.billing") == offsets  # locations and owners alike
        more = write(store, 50)
        while len(live_seen) < len(cells) + len(more) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert ids(live_seen) == ids(cells + more) and not running.failed
        assert len(replayed) == len(cells)  # the replay ended at its range's end
    live.close()
    replaying.close()


class Declined(NonRetriableError):
    """The card was refused."""


def test_failing_cells_follow_the_apps_retries_and_dead_letters_marked_as_the_replays(
        store: logstore.Store) -> None:
    cells = write(store, 60) + write(store, 3, bad=True)
    attempts: dict[tuple[int, int], int] = defaultdict(int)
    app = App("billing", store=store, backoff=QUICK)

    @app.trigger("BASE", max_attempts=3)
    def bill(cell: logstore.Cell) -> None:
        attempts[cell.shard, cell.added_id] += 1
        if cell.body.get("bad"):
            raise Declined(f"card {cell.body['n']} declined")
        if cell.body["n"] % 10 == 0 and attempts[cell.shard, cell.added_id] == 1:
            raise TimeoutError("flaky")  # retried: the second attempt goes through

    runner, job = plan(store, app)
    record = runner.run(job.id)
    assert record.state == "done"
    assert Replay(store, lambda _params: (app, lambda: None)).details(record)[1:] == [
        "63 cells of the range passed: 60 handled, 3 dead-lettered"]  # what `replay` prints at the end
    assert all(attempts[c.shard, c.added_id] >= 1 for c in cells)
    entries = app.dlq.list()
    assert sorted((e.cell["shard"], e.cell["added_id"]) for e in entries) == ids([c for c in cells
                                                                                  if c.body.get("bad")])
    for entry in entries:
        assert entry.source["mode"] == "replay" and entry.source["job"] == job.id
        assert entry.attempts == 1 and entry.error_type.endswith("Declined")
    assert sum(1 for c in cells if attempts[c.shard, c.added_id] == 2) == 6  # n = 0, 10, ... 50 retried once
    app.close()


def test_latest_only_delivers_the_newest_version_of_each_row_and_column_in_range(store: logstore.Store) -> None:
    rows = [uuid.uuid4() for _ in range(40)]
    store.put_cells([(row, "BASE", 1, {"v": 1}) for row in rows])
    store.put_cells([(row, "BASE", 2, {"v": 2}) for row in rows[:30]])
    store.put_cells([(row, "BASE", 3, {"v": 3}) for row in rows[:10]])
    seen: list[logstore.Cell] = []
    app = App("warehouse", store=store)
    app.trigger("BASE")(seen.append)
    runner, job = plan(store, app, latest_only=True)
    store.put_cells([(row, "BASE", 4, {"v": 4}) for row in rows[:5]])  # after the end: the live stream's
    record = runner.run(job.id)
    assert record.state == "done" and record.done == 40 + 30 + 10
    assert Replay(store, lambda _params: (app, lambda: None)).details(record)[1:] == [
        "80 cells of the range passed: 35 handled, 0 dead-lettered, 45 older versions passed over"]
    got = sorted((str(c.row_key), c.ref_key) for c in seen)
    assert got == sorted([(str(r), 3) for r in rows[5:10]] + [(str(r), 2) for r in rows[10:30]]
                         + [(str(r), 1) for r in rows[30:]])
    app.close()


def test_a_stall_fails_the_job_and_a_resume_after_the_fix_goes_on(store: logstore.Store) -> None:
    write(store, 100)
    bad = write(store, 5, bad=True)
    later = write(store, 100)
    fixed: list[bool] = []
    seen: list[logstore.Cell] = []
    app = App("billing", store=store, backoff=QUICK, stall_threshold=2)

    @app.trigger("BASE", max_attempts=1)
    def bill(cell: logstore.Cell) -> None:
        if cell.body.get("bad") and not fixed:
            raise Declined("declined")
        seen.append(cell)

    runner, job = plan(store, app)
    record = runner.run(job.id)
    assert record.state == "failed" and "HandlerStalledError" in (record.error or "")
    fixed.append(True)
    for entry in app.dlq.list():
        app.dlq.discard(entry.id, "fixed", actor="test")
    runner.jobs.resume(job.id)
    assert runner.run(job.id).state == "done"
    handled = {(c.shard, c.added_id) for c in seen}
    entries = app.dlq.list()
    assert len(entries) == 2 and all(e.status == "discarded" for e in entries)
    assert set(ids(later)) <= handled
    assert set(ids(bad)) <= handled | {(e.cell["shard"], e.cell["added_id"]) for e in entries}
    app.close()


def test_a_pause_keeps_what_the_handlers_finished_and_a_resume_goes_on_from_there(store: logstore.Store) -> None:
    cells = write(store, 1500)
    seen: list[logstore.Cell] = []
    app = App("billing", store=store, page_size=40, commit_interval=60.0)  # no commit but the pause's
    job_ids: list[str] = []

    @app.trigger("BASE")
    def bill(cell: logstore.Cell) -> None:
        seen.append(cell)
        if len(seen) == 300:
            runner.jobs.pause(job_ids[0])  # seen by the runner within a poll, while more cells are under way
        time.sleep(0.001)

    runner, job = plan(store, app)
    job_ids.append(job.id)
    assert runner.run(job.id).state == "paused"
    assert 300 <= len(seen) < len(cells)
    runner.jobs.resume(job.id)
    assert runner.run(job.id).state == "done"
    assert sorted(ids(seen)) == ids(cells)  # each cell once: what was under way at the pause counted
    app.close()


APP = """
import os
import time
from pathlib import Path

from indexer import App

app = App("slow", store={store!r}, commit_interval=0.1, page_size=40)


@app.trigger("BASE")
def record(cell):
    with open({log!r}, "a") as fh:
        fh.write(f"{{os.getpid()}} {{cell.shard}} {{cell.added_id}}\\n")
    time.sleep(0.003)
"""


def test_a_replay_sigkilled_mid_run_resumes_from_its_positions_and_loses_nothing(
        url: str, store: logstore.Store, tmp_path: Path) -> None:
    cells = write(store, 1200)
    log = tmp_path / "handled.log"
    module = tmp_path / "slow_app.py"
    module.write_text(APP.format(store=url, log=str(log)))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "cellstream", "replay", f"{module}:app", "--from", "beginning",
                             "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=tmp_path)
    try:
        assert proc.stdout is not None
        planned = json.loads(proc.stdout.readline())
        deadline = time.monotonic() + 60
        while not log.exists() or len(log.read_text().splitlines()) < 500:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    job_id = planned["id"]
    committed = store.read_offsets(positions_consumer(job_id))
    assert any(record.location for record in committed.values())  # the killed run committed some positions
    done = subprocess.run([sys.executable, "-m", "cellstream", "jobs", "resume", job_id, "--run", "--store", url],
                          capture_output=True, env=env, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr.decode()
    lines = [line.split() for line in log.read_text().splitlines()]
    first = [(int(s), int(a)) for pid, s, a in lines if int(pid) == proc.pid]
    second = [(int(s), int(a)) for pid, s, a in lines if int(pid) != proc.pid]
    assert set(first) | set(second) == set(ids(cells))  # every cell at least once
    for run in (first, second):
        by_shard: dict[int, list[int]] = defaultdict(list)
        for shard, added in run:
            by_shard[shard].append(added)
        assert all(found == sorted(found) for found in by_shard.values())
    assert len(second) < len(cells)  # from the committed positions, not from the start
    assert len(set(first) & set(second)) < len(first)


def test_a_rate_paces_the_replay_rather_than_holding_a_page_back(store: logstore.Store) -> None:
    """The throttle's wait comes before each read: under --rate 20 a read holds about a second of it, so 60 cells
    come over some seconds, where a page of them was read (and handed over) at once after a long silence."""
    from logstore.jobs import ThrottleSettings

    write(store, 60)
    handled: list[float] = []
    app = App("paced", store=store)

    @app.trigger("BASE")
    def note(cell: logstore.Cell) -> None:
        handled.append(time.monotonic())

    runner = JobRunner(store, KindRegistry([Replay(store, lambda _params: (app, lambda: None))]), FAST)
    job = runner.submit("replay", replay_params(app, {"app": "test"}, start="beginning"),
                        throttle=ThrottleSettings(rate=20))
    assert runner.run(job.id).state == "done"
    # 60 cells at 20/s: the reads' sizes follow the shards' pages, so the span is not a fixed 2 s (1.3-1.9 s
    # seen); read in one go it is about nothing.
    assert len(handled) == 60 and handled[-1] - handled[0] >= 1.0, handled[-1] - handled[0]
    app.close()
