"""An app whose handler fails until it is fixed, with its dead letters; a console served from a thread."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import logstore
from cellstream.cli.apps import open_dlq_app
from cellstream.console import Console, ConsoleConfig
from indexer import App
from indexer.runtime.dlq_triage import DeadLetterQueue
from logstore.jobs import JobStore

APP = '''
from pathlib import Path

from indexer import App, NonRetriableError
from logstore.retry import RetryPolicy

FIXED = Path({fixed!r})
app = App({name!r}, store={url!r}, backoff=RetryPolicy(initial=0.001, maximum=0.002, deadline=None))


class CardDeclined(NonRetriableError):
    """The card was refused."""


@app.trigger("BASE", max_attempts=2)
def bill_rider(cell):
    if cell.body.get("bad") and not FIXED.exists():
        raise CardDeclined(f"card of {{cell.body['rider']}} declined")


@app.trigger("STATUS", max_attempts=2)
def notify(cell):
    if cell.body.get("bad"):
        raise ValueError(f"no address for {{cell.body['rider']}}")
'''


@dataclass
class TriageApp:
    spec: str
    url: str
    fixed: Path  # the handler succeeds once this file exists: "the fix is deployed"
    app: App

    def fix(self) -> None:
        self.fixed.write_text("deployed\n")

    @property
    def queue(self) -> DeadLetterQueue:
        return self.app.dlq


def write_trips(url: str, bills: int = 12, notes: int = 3, shards: int | None = None) -> None:
    """Every third BASE cell has a blocked card (``bad``); every STATUS cell is ``bad``."""
    with logstore.open(url, shards=shards) as store:
        store.put_cells([(uuid.uuid4(), "BASE", 1, {"rider": f"rider-{i}", "fare": 10 + i, "bad": i % 3 == 0})
                         for i in range(bills)])
        if notes:
            store.put_cells([(uuid.uuid4(), "STATUS", 1, {"rider": f"rider-{i}", "bad": True})
                             for i in range(notes)])


def triage_app(tmp_path: Path, *, name: str = "billing", bills: int = 12, notes: int = 3,
               shards: int | None = None) -> TriageApp:
    """An app module with dead letters: every third BASE cell is declined (``bill_rider``, fixable), every
    STATUS cell fails in ``notify`` (not fixable). Apps made in one ``tmp_path`` share its store (and
    each handles every cell written there)."""
    url = f"sqlite:///{tmp_path / 'store'}"
    write_trips(url, bills, notes, shards)
    module = tmp_path / f"{name}_app.py"
    module.write_text(APP.format(name=name, url=url, fixed=str(tmp_path / f"{name}.fixed")))
    spec = f"{module}:app"
    app = open_dlq_app(spec, None)
    app.drain(timeout=60)
    return TriageApp(spec, url, tmp_path / f"{name}.fixed", app)


@contextmanager
def serving(queues: Mapping[str, DeadLetterQueue], job_store: JobStore | None = None,
            **options: object) -> Iterator[Console]:
    """A console on a free loopback port, its event loop in a thread of its own (so that a blocking test
    client or browser can talk to it) named ``console``."""
    console = Console(queues, ConsoleConfig(port=0, **options), store_label="sqlite:///test",  # type: ignore[arg-type]
                      job_store=job_store)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="console", daemon=True)
    thread.start()
    try:
        asyncio.run_coroutine_threadsafe(console.start(), loop).result(60)
        yield console
    finally:
        asyncio.run_coroutine_threadsafe(console.stop(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
