"""What an operator sees of a running cellstream: log lines with their time and level (text or JSON), a start-up
line naming the version and the settings with secrets masked, and the build-info metric in every registry."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_client import generate_latest

import logstore
from cellstream import __version__
from cellstream.cli import logsetup
from indexer.runtime.metrics import AppMetrics
from tailer.metrics import TailerMetrics

TOKEN = "observability-token-must-not-be-logged"


def serve_until_started(store: str, *args: str) -> list[str]:
    """``cellstream serve`` until its start-up line is logged; the stderr lines up to it."""
    process = subprocess.Popen([sys.executable, "-m", "cellstream", "serve", "--store", store, "--bind",
                                "127.0.0.1:0", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**{k: v for k, v in os.environ.items() if k != "CELLSTREAM_LOG_FORMAT"},
                                    "CELLSTREAM_TOKEN": TOKEN})
    lines: list[str] = []
    try:
        assert process.stderr is not None
        deadline = time.monotonic() + 60
        while not any("starting" in line for line in lines):
            assert time.monotonic() < deadline and process.poll() is None, lines
            lines.append(process.stderr.readline().rstrip("\n"))
    finally:
        process.terminate()
        process.communicate(timeout=30)
    return lines


def test_log_lines_as_json_with_time_and_level_and_a_start_up_line(sqlite_url: str) -> None:
    with logstore.open(sqlite_url, shards=8):
        pass
    lines = serve_until_started(sqlite_url, "--log-format", "json")
    docs = [json.loads(line) for line in lines if line]
    assert docs and all(set(d) >= {"time", "level", "logger", "message"} for d in docs)
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+00:00", d["time"]) for d in docs)
    start = next(d for d in docs if "starting" in d["message"])
    assert start["level"] == "INFO" and start["logger"] == "cellstream"
    assert start["message"].startswith(f"cellstream {__version__} serve starting: ")
    settings = json.loads(start["message"].split("starting: ", 1)[1])
    assert settings["store"] == sqlite_url and settings["token_required"] is True
    assert settings["url"].startswith("http://127.0.0.1:")
    assert TOKEN not in "\n".join(lines)


def test_log_lines_as_text_begin_with_time_and_level(sqlite_url: str) -> None:
    with logstore.open(sqlite_url, shards=8):
        pass
    lines = serve_until_started(sqlite_url)
    start = next(line for line in lines if "starting" in line)
    assert re.match(rf"\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d,\d{{3}} INFO cellstream: cellstream {re.escape(__version__)} "
                    r"serve starting: \{", start), start


def test_the_start_up_line_masks_the_store_password(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "cellstream")
    args = argparse.Namespace(store="mysql://app:hunter2@db.example:3306/cells", name="t", run=print)
    logsetup.starting("tail", args, kafka_security={"sasl.password": "**********"})
    line = caplog.records[-1].getMessage()
    assert "hunter2" not in line and "db.example" in line and "run" not in json.loads(line.split(": ", 1)[1])


def test_every_registry_carries_the_build_info() -> None:
    for registry, component in ((TailerMetrics("t").registry, "tailer"), (AppMetrics("a").registry, "app")):
        text = generate_latest(registry).decode()
        assert re.search(rf'cellstream_build_info\{{component="{component}",python="[0-9.]+",'
                         rf'version="{re.escape(__version__)}"\}} 1.0', text), text


def test_json_formatter_keeps_the_traceback() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed %s", ("here",), sys.exc_info())
    doc = json.loads(logsetup.JsonFormatter().format(record))
    assert doc["message"] == "failed here" and doc["level"] == "ERROR" and "ValueError: boom" in doc["exception"]


def test_readme_metric_names_are_the_exposed_ones() -> None:
    readme = (Path(__file__).parents[2] / "README.md").read_text() + "".join(
        p.read_text() for p in (Path(__file__).parents[2] / "docs").glob("*.md"))
    exposed = generate_latest(TailerMetrics("t").registry).decode() + generate_latest(AppMetrics("a").registry).decode()
    names = set(re.findall(r"^# TYPE (\S+) (\S+)", exposed, re.M))
    counters = {name.removesuffix("_total") for name, kind in names if kind == "counter"}
    for name in counters:  # a counter is exposed as <name>_total: the docs must not name it without
        assert not re.search(rf"`{name}`", readme), f"the docs name {name} without its _total"
