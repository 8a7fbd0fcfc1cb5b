"""``cellstream run`` and ``cellstream dlq`` against an app module written for the test (embedded store)."""

from __future__ import annotations

import getpass
import json
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

import logstore
from cellstream.cli.main import main
from tests.harness.app_thread import app_in_thread

APP = '''
from indexer import App
from logstore.retry import RetryPolicy

FIXED = {fixed!r}
app = App("cli", store={url!r}, backoff=RetryPolicy(initial=0.001, maximum=0.002, deadline=None))

@app.trigger("BASE", max_attempts=2)
def charge(cell):
    if cell.body.get("bad") and not FIXED:
        raise ValueError("card declined")
'''


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_run_drain_then_triage_from_the_command_line(sqlite_url: str, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    with logstore.open(sqlite_url, shards=8) as store:
        store.put_cells([(uuid.uuid4(), "BASE", 1, {"bad": i < 2}) for i in range(6)])
    module = tmp_path / "cliapp.py"
    module.write_text(APP.format(url=sqlite_url, fixed=False))
    spec = f"{module}:app"

    code, out, _ = run(capsys, "run", spec, "--drain", "--json")
    assert code == 0 and json.loads(out) == {"processed": 4, "retried": 2, "dead_lettered": 2}

    code, out, _ = run(capsys, "dlq", "--app", spec, "list", "--json", "--status", "open")
    entries = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and len(entries) == 2 and {e["error_type"] for e in entries} == {"ValueError"}
    first, second = (e["id"] for e in entries)

    code, out, _ = run(capsys, "dlq", "--app", spec, "stats", "--json")
    [group] = [json.loads(line) for line in out.splitlines()]
    assert (group["handler"], group["count"], group["open"]) == ("charge", 2, 2)

    code, out, _ = run(capsys, "dlq", "--app", spec, "show", first, "--json")
    shown = json.loads(out)
    assert code == 0 and shown["body"] == {"bad": True} and "card declined" in shown["traceback"]

    code, out, _ = run(capsys, "dlq", "--app", spec, "discard", second, "--reason", "test card")
    assert code == 0 and "discarded" in out
    code, out, _ = run(capsys, "dlq", "--app", spec, "show", second)
    # Who did it: the operating-system user, in the history (the console records its logged-in name).
    assert f"discarded by cli:{getpass.getuser()}: test card" in out

    code, out, _ = run(capsys, "dlq", "--app", spec, "list", "--json", "--text", "CARD DECL")
    assert code == 0 and len(out.splitlines()) == 2
    code, out, _ = run(capsys, "dlq", "--app", spec, "list", "--text", "expired")
    assert code == 0 and "no dead letters match" in out

    code, out, _ = run(capsys, "dlq", "--app", spec, "replay", first, "--json")  # not fixed yet: it fails again
    [again] = [json.loads(line) for line in out.splitlines()]
    assert code == 6 and again["after"] == "open" and "card declined" in again["error"]

    module.write_text(APP.format(url=sqlite_url, fixed=True))  # the fix is deployed
    code, out, _ = run(capsys, "dlq", "--app", spec, "replay", "--match", "handler=charge", "--dry-run")
    assert code == 0 and out.count("would replay") == 1
    code, out, _ = run(capsys, "dlq", "--app", spec, "replay", "--match", "handler=charge", "--json")
    assert [json.loads(line)["after"] for line in out.splitlines()] == ["resolved"]
    code, out, _ = run(capsys, "dlq", "--app", spec, "list", "--status", "open")
    assert code == 0 and "no dead letters match" in out


def test_a_running_apps_open_dead_letters_follow_triage_done_from_the_command_line(
        sqlite_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """While an app runs, ``cellstream dlq discard`` and ``replay`` (another process, here main()) close its
    entries: its ``cellstream_app_dlq_open`` falls within its recount interval, and so does the count its stall
    threshold compares, so new failures are dead-lettered instead of stopping the app."""
    from cellstream.cli.apps import load_app

    with logstore.open(sqlite_url, shards=8) as store:
        store.put_cells([(uuid.uuid4(), "BASE", 1, {"bad": i < 3}) for i in range(6)])
    module = tmp_path / "liveapp.py"
    module.write_text(APP.format(url=sqlite_url, fixed=False))
    spec = f"{module}:app"
    app = load_app(spec)
    app.config = app.config.model_copy(update={"stall_threshold": 3, "dlq_recount_interval": 0.2})

    def open_gauge() -> float | None:
        return app.metrics.registry.get_sample_value("cellstream_app_dlq_open", {"app": "cli", "handler": "charge"})

    def wait_for_gauge(value: float) -> None:
        deadline = time.monotonic() + 15
        while open_gauge() != value:
            assert not live.failed, live.failed
            assert time.monotonic() < deadline, f"cellstream_app_dlq_open is {open_gauge()}, not {value}"
            time.sleep(0.05)

    try:
        with app_in_thread(app, "live-app") as live:
            wait_for_gauge(3)
            code, out, _ = run(capsys, "dlq", "--app", spec, "list", "--json", "--status", "open")
            ids = [json.loads(line)["id"] for line in out.splitlines()]
            assert code == 0 and len(ids) == 3
            code, _, _ = run(capsys, "dlq", "--app", spec, "discard", ids[0], "--reason", "test card")
            assert code == 0
            wait_for_gauge(2)
            module.write_text(APP.format(url=sqlite_url, fixed=True))  # the fix, for the replay (the app runs the old)
            code, out, _ = run(capsys, "dlq", "--app", spec, "replay", "--match", "handler=charge", "--json")
            assert code == 0 and [json.loads(line)["after"] for line in out.splitlines()] == ["resolved"] * 2
            wait_for_gauge(0)
            assert app.processor.open == {"charge": 0}
            # Three more failures fit under the threshold again: with the count left at 3 the first would stall it.
            with logstore.open(sqlite_url) as store:
                store.put_cells([(uuid.uuid4(), "BASE", 1, {"bad": True}) for _ in range(3)])
            wait_for_gauge(3)
            assert live.thread.is_alive() and not live.failed
            assert app.metrics.registry.get_sample_value("cellstream_app_handler_stalled",
                                                         {"app": "cli", "handler": "charge"}) == 0
    finally:
        app.close()
    assert not live.thread.is_alive() and not live.failed, live.failed


def test_run_per_shard_metrics_overrides_the_app_option(sqlite_url: str, tmp_path: Path) -> None:
    from cellstream.cli.apps import load_app

    module = tmp_path / "flagapp.py"
    module.write_text(APP.format(url=sqlite_url, fixed=True))
    assert not load_app(f"{module}:app").config.per_shard_metrics
    assert load_app(f"{module}:app", per_shard_metrics=True).config.per_shard_metrics


def test_bad_input_is_one_line_and_a_documented_exit_code(sqlite_url: str, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    module = tmp_path / "cliapp2.py"
    module.write_text(APP.format(url=sqlite_url, fixed=False))
    spec = f"{module}:app"
    logstore.open(sqlite_url, shards=8).close()
    code, _, err = run(capsys, "dlq", "--app", spec, "show", str(uuid.uuid4()))
    assert code == 1 and err.count("\n") == 1 and "no dead letter" in err
    code, _, err = run(capsys, "dlq", "--app", spec, "replay", "--match", "color=red")
    assert code == 2 and "color" in err
    code, _, err = run(capsys, "dlq", "--app", spec, "replay")
    assert code == 2 and "--match" in err
    code, _, err = run(capsys, "dlq", "--app", "no_such_module_xyz:app", "list")
    assert code == 4 and "cannot import" in err
    code, _, err = run(capsys, "dlq", "--app", f"{module}:missing", "list")
    assert code == 4 and "not an indexer.App" in err
    code, _, err = run(capsys, "run", spec, "--workers", "2")
    assert code == 4 and "--workers > 1" in err


@pytest.mark.parametrize("drain", [True, False])
def test_run_tunes_its_process_for_streaming(sqlite_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             drain: bool) -> None:
    """An app process is a streaming process as a tailer's is (direct mode runs the tailer's worker loop):
    ``cellstream run`` sets the collector's thresholds, freezes what loading the app allocated and shortens
    the switch interval before the app serves. At 4096 shards a direct-mode drain had one or two full
    collections of 20-30 ms each with Python's defaults."""
    import gc
    import sys

    import indexer
    from cellstream.cli.common import STREAMING_GC_THRESHOLDS, STREAMING_SWITCH_INTERVAL

    seen: list[tuple[tuple[int, int, int], int, float]] = []

    def serve(app: indexer.App, *args: Any, **kwargs: Any) -> indexer.Counts:
        seen.append((gc.get_threshold(), gc.get_freeze_count(), sys.getswitchinterval()))
        return indexer.Counts(0, 0, 0)

    logstore.open(sqlite_url, shards=8).close()
    module = tmp_path / "tunedapp.py"
    module.write_text(APP.format(url=sqlite_url, fixed=True))
    gc.set_threshold(700, 10, 10)  # Python's defaults (tests/conftest.py restores the suite's after each test)
    sys.setswitchinterval(0.005)
    monkeypatch.setattr(indexer.App, "drain" if drain else "run", serve)
    assert main(["run", f"{module}:app", *(["--drain"] if drain else [])]) == 0
    [(thresholds, frozen, interval)] = seen
    assert thresholds == STREAMING_GC_THRESHOLDS != (700, 10, 10)
    assert frozen > 10_000  # the imported modules' objects at least
    assert interval == STREAMING_SWITCH_INTERVAL != 0.005
