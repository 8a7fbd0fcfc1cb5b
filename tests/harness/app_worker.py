"""A stream-processing app process for the fault tests: ``python tests/harness/app_worker.py CONFIG_JSON``.

Its handler appends ``worker shard added_id row_key`` to the log file for each cell
of column BASE (one line, flushed, before returning), and on a cell whose body has
``"hang": true`` the first process to get there (with ``hang`` set in the config)
writes the marker file and blocks forever: the test SIGKILLs it there, mid-handler.
Later deliveries of that cell find the marker and go through. With ``brokers`` in
the config the app runs in Kafka mode on the topics ``<topic_prefix>.<column>``. With
``index`` (a YAML file) it also keeps those indexes, and writes what each index
applier did to the ``results`` file at the end of a drain.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from indexer import App
from indexer.indexes.applier import IndexApplier
from logstore import Cell


def main() -> None:
    config = json.loads(sys.argv[1])
    log = Path(config["log"])
    lock = threading.Lock()
    options = {"brokers": config["brokers"], "topic_prefix": config["topic_prefix"]} if config.get("brokers") else {
        "zookeeper": config.get("zookeeper")}
    app = App(config["name"], store=config["store"], session_timeout=config.get("session_timeout", 10.0),
              commit_interval=0.2, **options)

    @app.trigger("BASE", max_attempts=3)
    def record(cell: Cell) -> None:
        marker = Path(config["marker"])
        if cell.body.get("hang") and config.get("hang") and not marker.exists():
            marker.write_text(f"{os.getpid()} {cell.shard} {cell.added_id}")
            while True:  # until SIGKILL
                time.sleep(1)
        with lock, open(log, "a") as fh:
            fh.write(f"{os.getpid()} {cell.shard} {cell.added_id} {cell.row_key}\n")
            fh.flush()

    if config.get("index"):
        app.index(Path(config["index"]))
    if config.get("drain"):
        app.drain(timeout=120)
    else:
        app.run()
    if config.get("results"):  # what each index applier did, for the test to read
        Path(config["results"]).write_text(json.dumps(
            {t.name: t.applier.result._asdict() for t in app.triggers if isinstance(t.applier, IndexApplier)}))


def kill_mid_handler_then_drain(config: dict[str, Any], timeout: float = 90) -> tuple[int, list[list[str]]]:
    """Run a worker with ``hang`` set, SIGKILL it in the handler of the hanging cell, then drain with a
    second worker; return the killed process's pid and the log's lines (pid, shard, added_id, row_key)."""
    marker = Path(config["marker"])
    proc = subprocess.Popen([sys.executable, __file__, json.dumps({**config, "hang": True})])
    try:
        deadline = time.monotonic() + timeout
        while not marker.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the worker never reached the cell"
            time.sleep(0.05)
        time.sleep(1.0)  # let it commit what it finished
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    subprocess.run([sys.executable, __file__, json.dumps({**config, "drain": True})], check=True,
                   timeout=timeout * 2)
    return proc.pid, [line.split() for line in Path(config["log"]).read_text().splitlines()]


if __name__ == "__main__":
    main()
