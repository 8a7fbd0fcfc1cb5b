"""The job machinery (logstore.jobs) on each backend: records as system cells changed by compare-and-set, the
owner lease and its takeover after a SIGKILL, pause, resume, cancel, retries, the throttle changed while a
job runs, and ``cellstream jobs``. One contract, run on SQLite and on MariaDB; the kind is a real one that
copies cells (tests/logstore/copy_job.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import logstore
from cellstream.cli import jobs as jobs_cli
from cellstream.cli.main import main
from logstore import JobStateError
from logstore.jobs import JobRecord, JobRunner, JobStore, KindRegistry, RunnerConfig, ThrottleSettings
from logstore.jobs.throttle import Throttle
from tests.logstore.copy_job import CopyKind, key_in_shard

SHARDS = 8
ROOT = Path(__file__).resolve().parents[2]
FAST = RunnerConfig(lease_seconds=2.0, poll_seconds=0.05, progress_seconds=0.2, backoff_seconds=0.05)


def fill(store: logstore.Store, shard: int, n: int) -> None:
    store.put_cells([(key_in_shard(f"row/{shard}/{i}", shard, SHARDS), "src", 1, {"i": i}) for i in range(n)])


def copies(store: logstore.Store, shard: int) -> dict[uuid.UUID, int]:
    """How many ``dst`` cells each row of the shard has (1: copied once)."""
    out: dict[uuid.UUID, int] = {}
    location = 0
    while True:
        page, location = store.get_cells_for_shard(shard, location, 1000, columns=["dst"])
        for cell in page:
            out[cell.row_key] = out.get(cell.row_key, 0) + 1
        if not page:
            return out


def wait_for(what: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


class InThread:
    """``runner.run(job_id)`` in a thread; ``result()`` joins it."""

    def __init__(self, runner: JobRunner, job_id: str) -> None:
        self.record: JobRecord | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(runner, job_id), daemon=True)
        self.thread.start()

    def _run(self, runner: JobRunner, job_id: str) -> None:
        try:
            self.record = runner.run(job_id)
        except BaseException as exc:
            self.error = exc

    def result(self, timeout: float = 20.0) -> JobRecord:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the job did not stop in time"
        if self.error is not None:
            raise self.error
        assert self.record is not None
        return self.record


class JobsContract:
    """What jobs hold to on every backend; a subclass gives ``url``."""

    @pytest.fixture
    def url(self) -> str:
        raise NotImplementedError

    @pytest.fixture
    def store(self, url: str) -> Iterator[logstore.Store]:
        with logstore.open(url, shards=SHARDS) as opened:
            yield opened

    @pytest.fixture
    def kind(self, store: logstore.Store) -> CopyKind:
        return CopyKind(store)

    def runner(self, store: logstore.Store, kind: CopyKind, config: RunnerConfig = FAST) -> JobRunner:
        return JobRunner(store, KindRegistry([kind]), config)

    # -- a job from start to end -------------------------------------------------------------------
    def test_a_job_runs_its_steps_in_order_and_ends_done(self, store: logstore.Store, kind: CopyKind) -> None:
        fill(store, 1, 30)
        fill(store, 5, 30)
        runner = self.runner(store, kind, RunnerConfig(progress_seconds=60))
        job = runner.submit("copy", {"shards": [1, 5], "chunk": 3})
        assert job.state == "planned" and job.id.startswith("copy-") and len(job.id) == len("copy-7f3a2c")
        final = runner.run(job.id)
        assert final.state == "done" and final.owner is None and final.finished_at is not None
        assert [(s.name, s.state, s.done, s.total) for s in final.steps] == [
            ("shard 1", "done", 30, 30), ("shard 5", "done", 30, 30)]
        assert set(copies(store, 1).values()) == {1} and len(copies(store, 1)) == 30
        assert set(copies(store, 5).values()) == {1} and len(copies(store, 5)) == 30
        # 20 chunks, but progress is written with the heartbeats: create, claim, start and end of each step, end.
        assert final.revision <= 8
        assert JobStore(store).get(job.id) == final
        with pytest.raises(JobStateError, match="is done"):
            runner.run(job.id)

    def test_listing_reads_on_after_a_cut_page(self, url: str, store: logstore.Store, kind: CopyKind) -> None:
        runner = self.runner(store, kind)
        made = {runner.submit("copy", {"shards": [1], "pad": "x" * 3000}).id for _ in range(6)}
        with logstore.open(url, max_read_bytes=4000) as small:
            assert {j.id for j in JobStore(small).jobs()} == made
        listing = JobStore(store)
        assert {j.id for j in listing.jobs()} == made
        JobStore(store).pause(sorted(made)[0])
        assert {j.state for j in listing.jobs()} == {"planned", "paused"}  # read on from where it ended

    # -- leases ----------------------------------------------------------------------------------------
    def test_a_runner_killed_mid_step_is_taken_over_from_the_steps_cursor(
            self, url: str, store: logstore.Store, kind: CopyKind) -> None:
        fill(store, 2, 60)
        fill(store, 6, 60)
        jobs = JobStore(store)
        job = self.runner(store, kind).submit("copy", {"shards": [2, 6], "chunk": 4},
                                              throttle=ThrottleSettings(rate=40, burst_seconds=0.2))
        process = subprocess.Popen([sys.executable, "-m", "tests.logstore.copy_job", url, job.id, "1.5"], cwd=ROOT)
        takeover = JobRunner(store, KindRegistry([kind]), FAST, owner="me")
        try:
            wait_for(lambda: jobs.get(job.id).steps[0].done >= 12)
            with pytest.raises(JobStateError, match="is run by"):
                takeover.claim(job.id)  # its owner runs: its lease holds
        finally:
            process.kill()
            process.wait()
        owner = jobs.get(job.id).owner
        assert owner is not None and owner != "me"
        done_before = sum(c.get("seq", 0) for c in self.cursors(store, job.id))
        assert 0 < done_before < 120
        jobs.set_throttle(job.id, rate=None)
        # Its lease still holds, but its owner was a process of this host that is gone: taken over at once.
        assert not jobs.get(job.id).lease_lapsed()
        final = takeover.run(job.id)
        assert final.state == "done" and [s.done for s in final.steps] == [60, 60]
        for shard in (2, 6):
            assert set(copies(store, shard).values()) == {1} and len(copies(store, shard)) == 60  # none twice
        assert kind.copied == 120 - done_before  # went on from the cursor, did not start over

    @staticmethod
    def cursors(store: logstore.Store, job_id: str) -> list[dict[str, Any]]:
        out = []
        for shard, name in ((2, "shard 2"), (6, "shard 6")):
            found = store.get_cell_latest(key_in_shard(f"{job_id}/{name}", shard, SHARDS), "copycursor")
            out.append(dict(found.body) if found is not None else {})
        return out

    def test_two_runners_racing_for_a_job_one_wins(self, store: logstore.Store, kind: CopyKind) -> None:
        fill(store, 3, 40)
        for _ in range(4):
            job = self.runner(store, kind).submit("copy", {"shards": [3]})
            runners = [JobRunner(store, KindRegistry([kind]), FAST, owner=f"r{n}") for n in range(2)]
            barrier = threading.Barrier(2)
            won: list[str] = []
            lost: list[BaseException] = []

            def claim(runner: JobRunner, job_id: str = job.id, barrier: threading.Barrier = barrier,
                      won: list[str] = won, lost: list[BaseException] = lost) -> None:
                barrier.wait()
                try:
                    won.append(runner.claim(job_id).owner or "")
                except JobStateError as exc:
                    lost.append(exc)
            threads = [threading.Thread(target=claim, args=(r,)) for r in runners]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert len(won) == 1 and len(lost) == 1 and JobStore(store).get(job.id).owner == won[0]

    def test_the_lease_is_renewed_while_a_step_runs(self, store: logstore.Store, kind: CopyKind) -> None:
        fill(store, 3, 40)
        config = FAST.model_copy(update={"lease_seconds": 0.6, "progress_seconds": 60.0})  # renewed by heartbeats
        job = self.runner(store, kind).submit("copy", {"shards": [3], "chunk": 2},
                                              throttle=ThrottleSettings(rate=16))
        running = InThread(JobRunner(store, KindRegistry([kind]), config, owner="a"), job.id)
        other = JobRunner(store, KindRegistry([kind]), config, owner="b")
        wait_for(lambda: JobStore(store).get(job.id).owner == "a")
        refused = 0
        while running.thread.is_alive():
            try:
                other.claim(job.id)
            except JobStateError:
                refused += 1
            else:
                pytest.fail("a second runner took a job whose owner is alive")
            time.sleep(0.1)
        assert running.result().state == "done" and refused >= 10

    # -- pause, resume, cancel -----------------------------------------------------------------------
    def test_pause_stops_between_chunks_and_resume_goes_on_from_the_runners_cursor(
            self, store: logstore.Store, kind: CopyKind) -> None:
        fill(store, 4, 40)
        fill(store, 7, 40)
        jobs = JobStore(store)
        runner = self.runner(store, kind)
        job = runner.submit("copy", {"shards": [4, 7], "chunk": 4, "own_cursor": False},
                            throttle=ThrottleSettings(rate=40, burst_seconds=0.2))
        running = InThread(runner, job.id)
        wait_for(lambda: jobs.get(job.id).done >= 8)
        assert jobs.pause(job.id).state == "paused"
        paused = running.result()
        assert paused.state == "paused" and paused.owner is None and paused.lease_expires is None
        assert 0 < paused.done < 80 and paused.done == kind.copied  # its progress is what it did
        with pytest.raises(JobStateError, match="resume"):
            runner.claim(job.id)
        assert jobs.resume(job.id).state == "planned"
        jobs.set_throttle(job.id, rate=None)
        final = runner.run(job.id)
        assert final.state == "done" and final.done == 80 and kind.copied == 80
        for shard in (4, 7):
            assert set(copies(store, shard).values()) == {1} and len(copies(store, shard)) == 40

    def test_cancel_stops_a_running_job_for_good(self, store: logstore.Store, kind: CopyKind) -> None:
        fill(store, 4, 40)
        jobs = JobStore(store)
        runner = self.runner(store, kind)
        job = runner.submit("copy", {"shards": [4], "chunk": 4},
                            throttle=ThrottleSettings(rate=40, burst_seconds=0.2))
        running = InThread(runner, job.id)
        wait_for(lambda: jobs.get(job.id).done >= 8)
        assert jobs.cancel(job.id).state == "cancelling"
        final = running.result()
        assert final.state == "cancelled" and final.owner is None and 0 < final.done < 40
        for change in (jobs.resume, jobs.pause, runner.run):
            with pytest.raises(JobStateError, match="cancelled"):
                change(job.id)
        waiting = runner.submit("copy", {"shards": [4]})
        assert jobs.cancel(waiting.id).state == "cancelled"  # no runner holds it: cancelled at once

    # -- throttle, retries -------------------------------------------------------------------------
    def test_a_throttle_changed_while_the_job_runs_takes_effect(self, store: logstore.Store, kind: CopyKind) -> None:
        fill(store, 0, 200)
        jobs = JobStore(store)
        runner = self.runner(store, kind)
        job = runner.submit("copy", {"shards": [0], "chunk": 5}, throttle=ThrottleSettings(rate=20))
        started = time.monotonic()
        running = InThread(runner, job.id)
        time.sleep(1.0)
        assert kind.copied <= 20 + 2 * 20 + 5  # the bucket's second, then 20 a second
        jobs.set_throttle(job.id, rate=None)
        changed = time.monotonic()
        final = running.result(timeout=6)  # at 20 a second it would take 10 seconds
        assert final.state == "done" and final.done == 200 and time.monotonic() - changed < 4
        assert final.throttle.rate is None and time.monotonic() - started < 8

    def test_a_failing_step_is_retried_then_the_job_fails_with_its_error(
            self, store: logstore.Store, kind: CopyKind) -> None:
        fill(store, 1, 10)
        runner = self.runner(store, kind)
        job = runner.submit("copy", {"shards": [1], "fail": {"times": 3, "retriable": True}})
        failed = runner.run(job.id)
        assert failed.state == "failed" and kind.runs == 3 and failed.owner is None
        assert failed.steps[0].state == "failed" and failed.steps[0].attempts == 3
        assert failed.error == failed.steps[0].error == "StorageUnavailableError: copy run 3 failed"
        resumed = JobStore(store).resume(job.id)
        assert resumed.state == "planned" and resumed.steps[0].attempts == 0
        assert runner.run(job.id).state == "done" and kind.runs == 4  # the 4th run succeeds

    def test_a_step_that_fails_retriably_a_few_times_succeeds_and_another_error_fails_at_once(
            self, store: logstore.Store, kind: CopyKind) -> None:
        fill(store, 1, 10)
        runner = self.runner(store, kind)
        job = runner.submit("copy", {"shards": [1], "fail": {"times": 2, "retriable": True}})
        final = runner.run(job.id)
        assert final.state == "done" and kind.runs == 3 and final.steps[0].attempts == 2
        other = CopyKind(store)
        job = self.runner(store, other).submit("copy", {"shards": [1], "fail": {"times": 5, "retriable": False}})
        failed = self.runner(store, other).run(job.id)
        assert failed.state == "failed" and other.runs == 1 and failed.error == "StorageError: copy run 1 failed"

    def test_the_records_metrics_show_failed_jobs_and_jobs_without_a_runner(
            self, store: logstore.Store, kind: CopyKind) -> None:
        fill(store, 1, 10)
        runner = self.runner(store, kind)
        runner.metrics.watch(runner.jobs)
        waiting = runner.submit("copy", {"shards": [1]})
        failing = runner.submit("copy", {"shards": [1], "fail": {"times": 1, "retriable": False}})
        assert runner.run(failing.id).state == "failed"
        value = runner.metrics.registry.get_sample_value
        assert value("cellstream_job_failed", {"job_id": failing.id, "kind": "copy"}) == 1
        assert value("cellstream_job_failed", {"job_id": waiting.id, "kind": "copy"}) is None
        assert (value("cellstream_job_lease_lapsed_seconds", {"job_id": waiting.id, "kind": "copy"}) or -1) >= 0
        assert value("cellstream_job_lease_lapsed_seconds", {"job_id": failing.id, "kind": "copy"}) is None
        assert value("cellstream_jobs", {"kind": "copy", "state": "planned"}) == 1
        assert value("cellstream_jobs", {"kind": "copy", "state": "failed"}) == 1
        assert value("cellstream_job_steps_total", {"kind": "copy", "result": "failed"}) == 1
        JobStore(store).cancel(failing.id)
        runner.run(waiting.id)
        assert value("cellstream_job_failed", {"job_id": failing.id, "kind": "copy"}) is None
        assert value("cellstream_job_lease_lapsed_seconds", {"job_id": waiting.id, "kind": "copy"}) is None
        assert value("cellstream_job_units_total", {"kind": "copy"}) == 10
        assert value("cellstream_jobs", {"kind": "copy", "state": "done"}) == 1

    # -- the command ---------------------------------------------------------------------------------
    def test_the_jobs_commands(self, url: str, store: logstore.Store, kind: CopyKind,
                               capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
        fill(store, 1, 12)
        runner = self.runner(store, kind)
        job = runner.submit("copy", {"shards": [1], "chunk": 5})

        def command(*args: str) -> tuple[int, Any]:
            code = main(["--store", url, "jobs", *args, "--json"])
            text = capsys.readouterr().out
            return code, json.loads(text) if text.strip() else None

        code, listed = command("list")
        assert code == 0 and [(j["id"], j["state"], j["steps"]) for j in listed] == [(job.id, "planned", 1)]
        code, shown = command("show", job.id)
        assert code == 0 and shown["id"] == job.id and shown["steps"][0]["name"] == "shard 1"
        code, changed = command("throttle", job.id, "--rate", "500", "--pause", "0.01")
        assert code == 0 and JobStore(store).get(job.id).throttle == ThrottleSettings(rate=500, pause_seconds=0.01)
        code, changed = command("pause", job.id)
        assert code == 0 and changed["state"] == "paused"
        assert command("resume", job.id, "--run")[0] == 4  # the kind is unknown to the command: nothing ran
        monkeypatch.setitem(jobs_cli.KIND_FACTORIES, "copy", lambda s: CopyKind(s))
        code, final = command("resume", job.id, "--run")
        assert code == 0 and final["state"] == "done" and final["done"] == 12
        assert command("list")[1] == [] and [j["id"] for j in command("list", "--all")[1]] == [job.id]
        assert command("cancel", job.id)[0] == 9  # done: nothing to cancel
        assert command("show", "copy-000000")[0] == 1
        assert main(["--store", url, "jobs", "throttle", job.id]) == 2
        capsys.readouterr()
        failing = runner.submit("copy", {"shards": [1], "fail": {"times": 9, "retriable": False}})
        code, final = command("resume", failing.id, "--run")
        assert code == 6 and final["state"] == "failed" and "copy run 1 failed" in final["error"]
        code, changed = command("cancel", failing.id)
        assert code == 0 and changed["state"] == "cancelled"
        assert main(["--store", url, "jobs", "list", "--all"]) == 0
        human = capsys.readouterr().out
        assert human.split() == [job.id, "copy", "done", "12/12", "cells", "steps", "1/1",
                                 failing.id, "copy", "cancelled", "0/?", "cells", "steps", "0/1"]



class TestSQLiteJobs(JobsContract):
    @pytest.fixture
    def url(self, sqlite_url: str) -> str:
        return sqlite_url


class TestMySQLJobs(JobsContract):
    @pytest.fixture
    def url(self, mysql_database: str) -> str:
        return mysql_database


def test_a_nice_ratio_pauses_in_proportion_to_the_chunk_just_done() -> None:
    throttle = Throttle(ThrottleSettings(nice_ratio=2.0))
    throttle.wait(1)  # the first chunk's start is unknown: no pause
    assert throttle.waited < 0.05
    time.sleep(0.2)  # a chunk of 0.2 s
    throttle.wait(1)
    assert throttle.waited >= 0.4
    other = threading.Thread(target=throttle.wait, args=(1,))  # another thread's first chunk: no pause
    before = throttle.waited
    other.start()
    other.join()
    assert throttle.waited - before < 0.2
