"""The console's redrive-policy pages over HTTP (SQLite and MariaDB stores): an app's policy as declared, a bad
change refused naming the field, an operator's change recorded with who and why and taking effect in the running
app (its dead letter redriven and resolved), then the declaration put back."""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from pydantic import SecretStr

import logstore
from indexer import App, NonRetriableError
from indexer.runtime.redrive import PolicyStore
from indexer.testing import FakeClock
from logstore.retry import RetryPolicy
from tests.console.support import serving
from tests.harness.app_thread import app_in_thread

TOKEN = "console-redrive-token-3a9f-0123"
DECLARED: dict[str, Any] = {"delay": 60, "max_redrives": 2, "errors": ["SomethingElse"], "interval": 0.02}


class CardDeclined(NonRetriableError):
    """The card was refused (until ``fixed``)."""


@pytest.fixture(params=["sqlite", "mysql"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[logstore.Store]:
    url = f"sqlite:///{tmp_path / 'store'}" if request.param == "sqlite" else request.getfixturevalue("mysql_database")
    with logstore.open(url, shards=8) as opened:
        yield opened


def billing_app(store: logstore.Store, clock: FakeClock, fixed: list[bool]) -> App:
    app = App("billing", store=store, clock=clock, redrive=DECLARED,
              backoff=RetryPolicy(initial=0.001, maximum=0.002, deadline=None))

    @app.trigger("BASE", max_attempts=1)
    def bill(cell: logstore.Cell) -> None:
        if not fixed[0]:
            raise CardDeclined(f"card of {cell.body['rider']} declined")
    return app


def until(check: Callable[[], bool], what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def logged_in(url: str, name: str) -> tuple[requests.Session, str]:
    client = requests.Session()
    r = client.post(url + "/login", data={"name": name, "token": TOKEN, "next": "/redrive"})
    assert r.status_code == 200 and r.url == url + "/redrive"
    found = re.search(r'name="csrf" value="([^"]+)"', r.text)
    assert found
    return client, found.group(1)


def test_an_operator_changes_the_policy_in_the_console_and_the_running_app_follows_it(store: logstore.Store) -> None:
    clock, fixed = FakeClock(), [False]
    app = billing_app(store, clock, fixed)
    store.put_cells([(uuid.uuid4(), "BASE", 1, {"rider": "ann"})])
    with app_in_thread(app, "billing") as running, \
            serving({"billing": app.dlq}, token=SecretStr(TOKEN)) as console:
        until(lambda: len(app.dlq.list()) == 1, "the dead letter")
        client, csrf = logged_in(console.url, "ops")
        overview = client.get(console.url + "/redrive").text
        assert "<td>the app's declaration</td>" in overview and "errors SomethingElse" in overview
        page = client.get(console.url + "/redrive/billing")
        assert page.status_code == 200 and 'id="errors">SomethingElse' in page.text

        fixed[0] = True
        clock.advance(1000)
        time.sleep(0.3)
        assert app.dlq.list()[0].redrives == 0  # the declared policy does not name CardDeclined

        form = {"csrf": csrf, "enabled": "on", "delay": "60", "multiplier": "2", "max_redrives": "2",
                "errors": "CardDeclined", "retriable": "any", "interval": "0.02", "batch": "10",
                "note": "declined cards pass since the fix"}
        refused = client.post(console.url + "/redrive/billing", data={**form, "max_redrives": "0"},
                              allow_redirects=False)
        assert refused.status_code == 400 and "max_redrives" in refused.text
        assert 'value="CardDeclined"' in refused.text  # the form keeps what was typed
        record = PolicyStore(app.dlq.deadletters).get()
        assert record is not None and record.origin == "declared"

        changed = client.post(console.url + "/redrive/billing", data=form, allow_redirects=False)
        assert changed.status_code == 303 and changed.headers["Location"] == "/redrive/billing"
        shown = client.get(console.url + "/redrive/billing").text
        assert 'id="errors">CardDeclined' in shown and "changed by console:ops" in shown
        assert "declined cards pass since the fix" in shown

        until(lambda: app.dlq.list()[0].status == "resolved", "the redrive under the console's policy")
        entry = app.dlq.list()[0]
        assert entry.redrives == 1 and entry.history[-1].actor == "policy"
        assert 'id="redrives">1 ' in client.get(console.url + f"/entries/billing/{entry.id}").text

        reset = client.post(console.url + "/redrive/billing/reset", data={"csrf": csrf}, allow_redirects=False)
        assert reset.status_code == 303
        assert not running.failed
    history = PolicyStore(app.dlq.deadletters).history()
    assert [(r.actor, r.origin) for r in history] == [("app", "declared"), ("console:ops", "operator"),
                                                      ("console:ops", "declared")]
    assert history[1].note == "declined cards pass since the fix" and history[1].policy is not None
    assert history[1].policy.errors == ("CardDeclined",) and history[1].policy.multiplier == 2
    assert history[2].policy == history[0].policy


def test_a_policy_change_needs_a_session_and_the_forms_csrf_token(store: logstore.Store) -> None:
    app = billing_app(store, FakeClock(), [False])
    app.drain(timeout=30)  # seeds the declaration
    with serving({"billing": app.dlq}, token=SecretStr(TOKEN)) as console:
        anonymous = requests.post(console.url + "/redrive/billing", data={"delay": "1", "enabled": "on"},
                                  allow_redirects=False)
        assert anonymous.status_code == 403
        client, _csrf = logged_in(console.url, "mallory")
        forged = client.post(console.url + "/redrive/billing", data={"csrf": "forged", "delay": "1"},
                             allow_redirects=False)
        assert forged.status_code == 403
        assert client.get(console.url + "/redrive/nope").status_code == 404
    record = PolicyStore(app.dlq.deadletters).get()
    assert record is not None and record.origin == "declared" and record.policy is not None
    assert record.policy.delay == 60
