"""What a new operator hit trying the commands (issue 48): worker processes that logged bare lines, a drain that
ignored --workers, progress bars drawn into pipes with totals unlike the results, a broken pipe reported as an
error, per-shard lines before the totals, options shown where they do not apply, and errors that did not say
what to do."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

import logstore
from cellstream.cli.main import main
from tests.cli.test_apps import APP, run
from tests.harness.index_support import SEED_YAML, trip
from tests.harness.worker_support import worker_node

TOKEN = "papercut-token-must-not-be-printed"


def cli(*argv: str) -> list[str]:
    return [sys.executable, "-m", "cellstream", *argv]


def clean_env(**extra: str) -> dict[str, str]:
    drop = {"CELLSTREAM_STORE", "CELLSTREAM_LOG_FORMAT", "CELLSTREAM_TOKEN", "CELLSTREAM_ZOOKEEPER"}
    return {**{k: v for k, v in os.environ.items() if k not in drop}, **extra}


class Stderr:
    """A process's stderr lines, read by a thread (a process that logs nothing more cannot block the test)."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        assert process.stderr is not None
        self.process, self.lines = process, list[str]()
        self._got: queue.Queue[str | None] = queue.Queue()
        stream = process.stderr

        def read() -> None:
            for line in iter(stream.readline, ""):
                self._got.put(line.rstrip("\n"))
            self._got.put(None)
        self._reader = threading.Thread(target=read, daemon=True)
        self._reader.start()

    def until(self, done: Any, what: str) -> None:
        """Read until ``done(lines)``; fail after 60 s or when the process exits first."""
        deadline = time.monotonic() + 60
        while not done(self.lines):
            assert time.monotonic() < deadline and self.process.poll() is None, f"no {what}: {self.lines}"
            with contextlib.suppress(queue.Empty):
                line = self._got.get(timeout=0.5)
                if line is not None:
                    self.lines.append(line)

    def rest(self) -> list[str]:
        """Every line, once the process has exited (within 60 s)."""
        self.process.wait(60)
        while (line := self._got.get(timeout=60)) is not None:
            self.lines.append(line)
        return self.lines


def stop(process: subprocess.Popen[str]) -> None:
    """SIGTERM (the parent of workers forwards it: none is left behind), then SIGKILL after 30 s."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# -- cellstream run --------------------------------------------------------------------------
def test_run_workers_log_json_lines_with_time_level_logger_and_worker_and_say_they_stopped(
        sqlite_url: str, zk_chroot: str, tmp_path: Path) -> None:
    with logstore.open(sqlite_url, shards=8) as store:
        store.put_cells([(uuid.uuid4(), "BASE", 1, {"n": i}) for i in range(20)])
    module = tmp_path / "zkapp.py"
    module.write_text(APP.format(url=sqlite_url, fixed=True).replace(
        'app = App("cli", store=', f'app = App("cli", zookeeper={zk_chroot!r}, store='))
    process = subprocess.Popen(cli("run", f"{module}:app", "--workers", "2", "--log-format", "json"),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env())
    stderr = Stderr(process)
    try:
        stderr.until(lambda got: sum("worker process" in line and "running" in line for line in got) == 2,
                     "start-up line of both workers")
        process.send_signal(signal.SIGTERM)
        lines = stderr.rest()
    finally:
        stop(process)
    docs = [json.loads(line) for line in lines if line]  # every line a JSON object: none bare
    assert process.returncode == 0
    assert all(set(d) >= {"time", "level", "logger", "message"} for d in docs)
    by_worker = {d.get("worker") for d in docs if d["level"] == "INFO"}
    assert by_worker >= {None, "worker-0", "worker-1"}  # the parent's INFO lines and each worker's
    stopped = [(d.get("worker"), d["message"]) for d in docs if "stopped" in d["message"]
               and d["logger"] == "cellstream.cli.apps"]
    assert {w for w, _ in stopped} == {"worker-0", "worker-1", None}, stopped
    assert any(m == "app cli stopped: 2 workers, 0 failed" for w, m in stopped if w is None)


def test_a_worker_told_to_stop_while_it_started_stops_once_it_serves(sqlite_url: str, tmp_path: Path) -> None:
    """A SIGTERM that reaches a worker process of ``run --workers N`` before its event loop handles the signal
    is noted and kept: the worker stops as soon as it serves, cleanly, instead of running on or dying half
    made."""
    from cellstream.cli.apps import _until_terminated, load_app

    logstore.open(sqlite_url, shards=8).close()
    module = tmp_path / "earlyapp.py"
    module.write_text(APP.format(url=sqlite_url, fixed=True))
    app = load_app(f"{module}:app")
    terminated = threading.Event()
    terminated.set()
    try:
        asyncio.run(asyncio.wait_for(_until_terminated(app, terminated), 30))  # TimeoutError: it ran on
    finally:
        app.close()


def test_run_logs_a_stopped_line_on_sigterm(sqlite_url: str, tmp_path: Path) -> None:
    logstore.open(sqlite_url, shards=8).close()
    module = tmp_path / "oneapp.py"
    module.write_text(APP.format(url=sqlite_url, fixed=True))
    process = subprocess.Popen(cli("run", f"{module}:app"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=clean_env())
    stderr = Stderr(process)
    try:
        stderr.until(lambda got: any("claimed" in line for line in got), "claim")
        process.send_signal(signal.SIGTERM)
        lines = stderr.rest()
    finally:
        stop(process)
    assert process.returncode == 0
    assert any(re.fullmatch(r"\S+ \S+ INFO cellstream\.cli\.apps: app cli stopped", line) for line in lines), lines


def test_run_drain_refuses_workers_in_one_line(sqlite_url: str, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    logstore.open(sqlite_url, shards=8).close()
    module = tmp_path / "drainapp.py"
    module.write_text(APP.format(url=sqlite_url, fixed=True))
    code, out, err = run(capsys, "run", f"{module}:app", "--drain", "--workers", "2")
    assert (code, out) == (2, "")
    assert err == ("cellstream: error: --drain runs in one process: drop --workers (N processes share the shards "
                   "only while they run, without --drain)\n")


def test_run_help_names_only_options_run_has(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert not re.search(r"--zookeeper(?!-auth-file)", text), text
    assert "the app's zookeeper= (direct mode) or brokers= (Kafka mode)" in text


# -- index backfill and verify: bars on a terminal only, with the totals they report ----------------------
class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def indexed(sqlite_url: str, tmp_path: Path) -> str:
    """A store whose index driver_partner_index v1 is kept by an app: 40 BASE cells among 60 of other columns."""
    from indexer import App

    yaml_file = tmp_path / "v1.yaml"
    yaml_file.write_text(SEED_YAML)
    with logstore.open(sqlite_url, shards=8) as store:
        driver, city = uuid.uuid4(), uuid.uuid4()
        store.put_cells([(uuid.uuid4(), "BASE" if i % 5 < 2 else "OTHER", 1, trip(driver, city, i))
                         for i in range(100)])
        with App("trips", store=store, commit_interval=0.05) as app:
            app.index(yaml_file)
            app.drain(timeout=60)
    return sqlite_url


def last_bar(text: str) -> tuple[str, int, int]:
    """The last state a tqdm bar drew: its description, done and total."""
    found = re.findall(r"(?:^|\r)([^\r|]*?):?\s*\d+%\|[^|]*\| (\d+)/(\d+) \[", text)
    assert found, repr(text[-500:])
    desc, done, total = found[-1]
    return desc.strip().rstrip(":"), int(done), int(total)


def test_backfill_and_verify_draw_no_bar_into_a_pipe(indexed: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "index", "backfill", "driver_partner_index", "--version", "1", "--store", indexed)
    assert code == 0 and err == "" and "\r" not in out
    # The app applied the cells first (live): the backfill's are superseded.
    assert re.fullmatch(r"index driver_partner_index version 1: 8 of 8 shards done, 40 BASE cells read, 0 applied, "
                        r"40 superseded, 0 dead-lettered in \d+\.\ds\n", out), out
    code, out, err = run(capsys, "index", "verify", "driver_partner_index", "--version", "1", "--store", indexed)
    assert (code, err) == (0, "")
    assert out == ("index driver_partner_index version 1: the entries and logs of 8 shards read, 40 rows checked "
                   "(0 pending), no mismatches\n")


def test_backfill_and_verify_bars_on_a_terminal_count_what_they_report(
        indexed: str, monkeypatch: pytest.MonkeyPatch) -> None:
    terminal, stdout = Terminal(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", terminal)
    monkeypatch.setattr(sys, "stdout", stdout)
    assert main(["index", "backfill", "driver_partner_index", "--version", "1", "--store", indexed]) == 0
    assert last_bar(terminal.getvalue()) == ("BASE cells", 40, 40)  # not the 100 cells of every column
    assert " 40 BASE cells read" in stdout.getvalue()
    terminal.seek(0)
    terminal.truncate()
    assert main(["index", "verify", "driver_partner_index", "--version", "1", "--store", indexed, "--json"]) == 0
    assert terminal.getvalue() == ""  # --json: no bar
    assert main(["index", "verify", "driver_partner_index", "--version", "1", "--store", indexed]) == 0
    assert last_bar(terminal.getvalue()) == ("log", 8, 8)  # each phase counts the 8 shards, not 16 "shards"
    assert "entries" in terminal.getvalue() and "/16 " not in terminal.getvalue()
    assert "the entries and logs of 8 shards read" in stdout.getvalue()


# -- output: pipes, totals, help ----------------------------------------------------------------------
def test_a_closed_pipe_on_stdout_ends_the_command_quietly_with_141(sqlite_url: str) -> None:
    with logstore.open(sqlite_url, shards=8) as store:
        store.put_cells([(uuid.uuid4(), "BASE", 1, {"n": i}) for i in range(5)])
    read, write = os.pipe()
    os.close(read)  # `| head` that has gone: every write gets EPIPE
    try:
        done = subprocess.run(cli("shards", "--all", "--store", sqlite_url), stdout=write, stderr=subprocess.PIPE,
                              text=True, env=clean_env(), timeout=60)
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (141, "")


def test_shards_prints_the_totals_first_and_shards_on_request(sqlite_url: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    with logstore.open(sqlite_url, shards=8) as store:
        cells = store.put_cells([(uuid.uuid4(), "BASE", 1, {"n": i}) for i in range(5)])
    code, out, _ = run(capsys, "shards", "--store", sqlite_url)
    assert code == 0
    assert out.splitlines() == ["8 shards, 5 cells on 1 storage node", "node  shards      cells",
                                "node0      8          5"]
    code, out, _ = run(capsys, "shards", "--store", sqlite_url, "--per-shard")
    lines = out.splitlines()
    assert lines[:5] == ["8 shards, 5 cells on 1 storage node", "node  shards      cells", "node0      8          5",
                         "", " shard node       cells"]
    assert [int(line.split()[0]) for line in lines[5:]] == sorted({c.shard for c in cells})


def test_tail_status_gives_totals_and_only_the_shards_worth_a_look(sqlite_url: str, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    with logstore.open(sqlite_url, shards=8) as store:
        cells = store.put_cells([(uuid.uuid4(), "BASE", 1, {"n": i}) for i in range(20)])
        heads = {s: store.head(s) for s in range(8)}
    behind = cells[0].shard
    offsets = tmp_path / "offsets.json"
    offsets.write_text(json.dumps({"shards": {str(s): {"location": 0 if s == behind else head, "deadlettered": 0,
                                                       "last_error": None} for s, head in heads.items()}}))
    lag = sum(1 for c in cells if c.shard == behind)
    code, out, _ = run(capsys, "tail", "status", "t", "--offsets", str(offsets), "--store", sqlite_url, "--json")
    report = json.loads(out)
    assert code == 0 and report["totals"]["shards"] == 8 and report["totals"]["lag_cells"] == lag
    assert report["totals"]["lagging_shards"] == 1 and [r["shard"] for r in report["shards"]] == [behind]
    assert list(report).index("totals") < list(report).index("shards")
    code, out, _ = run(capsys, "tail", "status", "t", "--offsets", str(offsets), "--store", sqlite_url, "--all",
                       "--json")
    assert len(json.loads(out)["shards"]) == 8
    code, out, _ = run(capsys, "tail", "--offsets", str(offsets), "status", "t", "--store", sqlite_url)
    assert out.splitlines()[1].startswith(f"  8 shards: 1 lagging, {lag} cells behind (up to ")


def test_tail_status_help_shows_only_its_own_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["tail", "status", "--help"])
    text = capsys.readouterr().out
    assert "--offsets" in text and "--zookeeper" in text and "--all" in text
    for worker_only in ("--brokers", "--partitions", "--columns", "--metrics-port", "--out", "--name"):
        assert worker_only not in text, worker_only


# -- dead letters ---------------------------------------------------------------------------------
@pytest.fixture
def triage(sqlite_url: str, tmp_path: Path) -> str:
    """An app with two open dead letters; its MODULE:APP."""
    with logstore.open(sqlite_url, shards=8) as store:
        store.put_cells([(uuid.uuid4(), "BASE", 1, {"bad": i < 2}) for i in range(4)])
    module = tmp_path / "cutapp.py"
    module.write_text(APP.format(url=sqlite_url, fixed=False))
    spec = f"{module}:app"
    assert main(["run", spec, "--drain"]) == 0
    return spec


def test_dlq_discard_dry_run_needs_no_reason_and_a_discard_says_it_needs_one(
        triage: str, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    code, out, err = run(capsys, "dlq", "--app", triage, "discard", "--match", "handler=charge", "--dry-run")
    assert (code, err) == (0, "") and out.count("would be discarded") == 2
    entry = json.loads(run(capsys, "dlq", "--app", triage, "list", "--json")[1].splitlines()[0])
    code, out, err = run(capsys, "dlq", "--app", triage, "discard", entry["id"], "--dry-run")
    assert (code, err) == (0, "") and out == f"{entry['id']} would be discarded (open now)\n"
    code, out, err = run(capsys, "dlq", "--app", triage, "discard", entry["id"])
    assert (code, out) == (2, "")
    assert err == "cellstream: error: dlq discard needs --reason TEXT (kept in each entry's history), or --dry-run\n"


@pytest.mark.parametrize("action", ["show", "discard", "replay"])
def test_a_malformed_dead_letter_id_is_bad_input(triage: str, capsys: pytest.CaptureFixture[str],
                                                 action: str) -> None:
    capsys.readouterr()
    reason = ["--reason", "x"] if action == "discard" else []
    code, out, err = run(capsys, "dlq", "--app", triage, action, "not-an-id", *reason)
    assert (code, out) == (2, "")
    assert err == (f"cellstream: error: dlq {action}: 'not-an-id' is not a dead letter's ID (a UUID, as `dlq list` "
                   "prints)\n")
    code, _, err = run(capsys, "dlq", "--app", triage, action, str(uuid.uuid4()), *reason)
    assert code == 1 and "has no dead letter" in err  # well-formed but missing: not found


def test_dlq_stats_has_a_header(triage: str, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    code, out, _ = run(capsys, "dlq", "--app", triage, "stats")
    header, row = out.splitlines()
    assert code == 0 and header.split() == ["COUNT", "OPEN", "HANDLER", "ERROR", "FINGERPRINT", "FIRST", "LAST",
                                            "EXAMPLE"]
    assert row.split()[:4] == ["2", "2", "charge", "ValueError"] and row.endswith("'card declined'")
    assert header.index("HANDLER") == row.index("charge")  # the columns line up


# -- errors that say what to do -----------------------------------------------------------------
def test_index_query_names_the_scatter_flag(indexed: str, capsys: pytest.CaptureFixture[str]) -> None:
    from indexer.indexes.backfill import backfill
    from indexer.indexes.catalog import IndexCatalog

    with logstore.open(indexed) as store:
        backfill(store, "driver_partner_index", 1)
        IndexCatalog(store).activate("driver_partner_index", 1)
    code, out, err = run(capsys, "index", "query", "driver_partner_index", f"city_uuid={uuid.uuid4()}",
                         "--store", indexed)
    assert (code, out) == (2, "")
    assert err == ("cellstream: error: index driver_partner_index: a query without driver_partner_uuid=VALUE reads "
                   "every shard; ask for it with --scatter\n")
    code, _, err = run(capsys, "index", "query", "driver_partner_index", f"city_uuid={uuid.uuid4()}", "--scatter",
                       "--store", indexed)
    assert (code, err) == (0, "-- 0 entries (version 1)\n")


def test_a_worker_nodes_refusal_says_where_the_token_comes_from(sqlite_url: str, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    with worker_node(sqlite_url, 8, token=TOKEN) as node:
        monkeypatch.delenv("CELLSTREAM_TOKEN", raising=False)
        code, out, err = run(capsys, "shards", "--store", node.url)
        assert (code, out) == (4, "")
        assert err.endswith("(no token was sent: set the CELLSTREAM_TOKEN environment variable, or give "
                            "logstore.open one)\n")
        monkeypatch.setenv("CELLSTREAM_TOKEN", TOKEN[::-1])
        code, out, err = run(capsys, "shards", "--store", node.url)
        assert code == 4 and err.endswith("(the token sent came from the CELLSTREAM_TOKEN environment variable)\n")
        assert TOKEN not in err and TOKEN[::-1] not in err
        monkeypatch.setenv("CELLSTREAM_TOKEN", TOKEN)
        assert run(capsys, "shards", "--store", node.url)[0] == 0


def test_an_app_file_elsewhere_with_a_relative_store_is_warned_about(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CELLSTREAM_STORE", raising=False)
    logstore.open("sqlite:///relstore", shards=8).close()
    (tmp_path / "apps").mkdir()
    (tmp_path / "apps" / "rel.py").write_text(APP.format(url="sqlite:///relstore", fixed=True))
    (tmp_path / "here.py").write_text(APP.format(url="sqlite:///relstore", fixed=True))
    assert main(["dlq", "--app", "apps/rel.py:app", "list"]) == 0
    [warning] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warning == (f"apps/rel.py:app names its store by a relative path, sqlite:///relstore: that is "
                       f"{tmp_path.resolve() / 'relstore'}, in the current directory, not beside apps/rel.py; give "
                       "the app an absolute path to be sure which store it uses")
    caplog.clear()
    assert main(["dlq", "--app", "here.py:app", "list"]) == 0  # beside the store: nothing to warn about
    assert main(["dlq", "--app", "apps/rel.py:app", "list", "--store", "sqlite:///relstore"]) == 0  # named: chosen
    assert [r for r in caplog.records if r.levelname == "WARNING"] == []
