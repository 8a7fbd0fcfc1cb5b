"""Scheduled redrive (indexer/runtime/redrive.py) on real stores (SQLite, MariaDB), with a clock the test moves:
a dead letter redriven after its delay and resolved; one that keeps failing stops after max_redrives, open, with its
history; errors the policy does not name never redriven; a restarted app goes on counting; the policy in force is
the store's (an operator's change wins over the declaration)."""

from __future__ import annotations

import datetime as dt
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import logstore
from indexer import App, NonRetriableError
from indexer.errors import InvalidPolicyError
from indexer.runtime.dlq_store import DeadLetter
from indexer.runtime.policy import Outcome, describe
from indexer.runtime.redrive import PolicyStore, RedrivePolicy
from indexer.testing import FakeClock
from logstore.retry import RetryPolicy
from tests.harness.app_thread import app_in_thread

SHARDS = 8
DELAY = 60.0
POLICY: dict[str, Any] = {"delay": DELAY, "max_redrives": 2, "errors": ["CardDeclined"], "interval": 0.02}


class CardDeclined(NonRetriableError):
    """The card was refused (until the fix: ``fixed``)."""


@pytest.fixture(params=["sqlite", "mysql"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[logstore.Store]:
    url = f"sqlite:///{tmp_path / 'store'}" if request.param == "sqlite" else request.getfixturevalue("mysql_database")
    with logstore.open(url, shards=SHARDS) as opened:
        yield opened


class Billing:
    """An app whose ``bill`` handler declines ``bad`` cells until ``fixed``; ``notify`` always fails (ValueError)."""

    def __init__(self, store: logstore.Store, clock: FakeClock, policy: dict[str, Any] | None = POLICY) -> None:
        self.fixed = False
        self.app = App("billing", store=store, clock=clock, redrive=policy, dlq_recount_interval=0.05,
                       backoff=RetryPolicy(initial=0.001, maximum=0.002, deadline=None))

        @self.app.trigger("BASE", max_attempts=1)
        def bill(cell: logstore.Cell) -> None:
            if cell.body.get("bad") and not self.fixed:
                raise CardDeclined(f"card of {cell.body['rider']} declined")

        @self.app.trigger("STATUS", max_attempts=1)
        def notify(cell: logstore.Cell) -> None:
            raise ValueError(f"no address for {cell.body['rider']}")


def entries(app: App, handler: str) -> list[DeadLetter]:
    return [e for e in app.dlq.list() if e.handler == handler]


def until(check: Callable[[], bool], what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def one(app: App, handler: str) -> DeadLetter:
    found = entries(app, handler)
    assert len(found) == 1, found
    return found[0]


def settled(app: App, handler: str, redrives: int, status: str) -> Callable[[], bool]:
    def check() -> bool:
        found = entries(app, handler)
        return len(found) == 1 and found[0].redrives == redrives and found[0].status == status
    return check


def metric(app: App, name: str, **labels: str) -> float:
    value = app.metrics.registry.get_sample_value(name, {"app": "billing", **labels})
    return value or 0.0


def test_a_dead_letter_is_redriven_after_its_delay_and_resolved(store: logstore.Store) -> None:
    clock = FakeClock()
    billing = Billing(store, clock)
    store.put_cells([(uuid.uuid4(), "BASE", 1, {"rider": "ann", "bad": True})])
    with app_in_thread(billing.app, "billing") as running:
        until(lambda: len(entries(billing.app, "bill")) == 1, "the dead letter")
        time.sleep(0.3)  # many checks of the policy, none due before the delay
        assert one(billing.app, "bill").redrives == 0 and one(billing.app, "bill").status == "open"
        assert metric(billing.app, "cellstream_app_dlq_redrive_waiting", handler="bill") == 1
        billing.fixed = True
        clock.advance(DELAY + 1)
        until(settled(billing.app, "bill", 1, "resolved"), "the redrive")
    assert not running.failed
    entry = one(billing.app, "bill")
    assert [(e.status, e.actor, e.note) for e in entry.history[-2:]] == [
        ("replayed", "policy", "redrive 1 of 2 by the redrive policy"), ("resolved", "policy", "redrive succeeded")]
    assert entry.history[-1].at >= entry.first_failure + dt.timedelta(seconds=DELAY)
    assert metric(billing.app, "cellstream_app_dlq_redrives_total", handler="bill", outcome="resolved") == 1
    assert metric(billing.app, "cellstream_app_dlq_redrive_waiting", handler="bill") == 0


def test_an_entry_that_keeps_failing_stops_after_max_redrives_and_stays_open(store: logstore.Store) -> None:
    clock = FakeClock()
    billing = Billing(store, clock, {**POLICY, "multiplier": 2.0})
    store.put_cells([(uuid.uuid4(), "BASE", 1, {"rider": "bob", "bad": True})])
    with app_in_thread(billing.app, "billing") as running:
        until(lambda: len(entries(billing.app, "bill")) == 1, "the dead letter")
        clock.advance(DELAY + 1)
        until(settled(billing.app, "bill", 1, "open"), "the first redrive")
        clock.advance(DELAY + 1)  # the second waits twice as long (multiplier 2): not due yet
        time.sleep(0.3)
        assert one(billing.app, "bill").redrives == 1
        clock.advance(DELAY)
        until(settled(billing.app, "bill", 2, "open"), "the second redrive")
        clock.advance(100 * DELAY)
        time.sleep(0.3)  # many checks: no third redrive
        until(lambda: metric(billing.app, "cellstream_app_dlq_redrive_exhausted", handler="bill") == 1,
              "the exhausted gauge")
    assert not running.failed
    entry = one(billing.app, "bill")
    assert entry.status == "open" and entry.redrives == 2
    assert [(e.status, e.actor, e.note) for e in entry.history if e.actor == "policy"] == [
        ("replayed", "policy", "redrive 1 of 2 by the redrive policy"), ("open", "policy", "redrive failed"),
        ("replayed", "policy", "redrive 2 of 2 by the redrive policy"), ("open", "policy", "redrive failed")]
    assert all("CardDeclined" in (e.error or "") for e in entry.history if e.status == "open")
    assert metric(billing.app, "cellstream_app_dlq_redrives_total", handler="bill", outcome="failed") == 2
    assert metric(billing.app, "cellstream_app_dlq_redrive_waiting", handler="bill") == 0


def test_errors_the_policy_does_not_name_are_never_redriven(store: logstore.Store) -> None:
    clock = FakeClock()
    billing = Billing(store, clock)
    billing.fixed = True  # the declined card is fixed; notify's ValueError is not in the policy
    store.put_cells([(uuid.uuid4(), "STATUS", 1, {"rider": "cy"})])
    store.put_cells([(uuid.uuid4(), "BASE", 1, {"rider": "cy", "bad": True})])
    billing.fixed = False
    with app_in_thread(billing.app, "billing") as running:
        until(lambda: len(entries(billing.app, "bill")) == 1 and len(entries(billing.app, "notify")) == 1,
              "both dead letters")
        billing.fixed = True
        clock.advance(100 * DELAY)
        until(settled(billing.app, "bill", 1, "resolved"), "the redrive of the declined card")
        time.sleep(0.3)
    assert not running.failed
    untouched = one(billing.app, "notify")
    assert untouched.status == "open" and untouched.redrives == 0
    assert all(e.actor != "policy" for e in untouched.history)
    assert metric(billing.app, "cellstream_app_dlq_redrive_waiting", handler="notify") == 0


def test_a_restarted_app_goes_on_counting_the_redrives_of_an_entry(store: logstore.Store) -> None:
    clock = FakeClock()
    first = Billing(store, clock)
    store.put_cells([(uuid.uuid4(), "BASE", 1, {"rider": "dee", "bad": True})])
    with app_in_thread(first.app, "billing-1"):
        until(lambda: len(entries(first.app, "bill")) == 1, "the dead letter")
        clock.advance(DELAY + 1)
        until(settled(first.app, "bill", 1, "open"), "the first redrive")
    first.app.close()
    second = Billing(store, clock)  # a new process of the app: nothing of the first's memory
    with app_in_thread(second.app, "billing-2") as running:
        clock.advance(DELAY + 1)
        until(settled(second.app, "bill", 2, "open"), "the second redrive")
        clock.advance(100 * DELAY)
        time.sleep(0.3)
    assert not running.failed
    entry = one(second.app, "bill")
    assert entry.redrives == 2 and sum(1 for e in entry.history if e.actor == "policy") == 4


def test_the_policy_in_force_is_the_stores_and_an_operators_change_wins(store: logstore.Store) -> None:
    clock = FakeClock()
    billing = Billing(store, clock, {**POLICY, "errors": ["SomethingElse"]})
    store.put_cells([(uuid.uuid4(), "BASE", 1, {"rider": "eve", "bad": True})])
    with app_in_thread(billing.app, "billing") as running:
        until(lambda: len(entries(billing.app, "bill")) == 1, "the dead letter")
        billing.fixed = True
        clock.advance(100 * DELAY)
        time.sleep(0.3)
        assert one(billing.app, "bill").redrives == 0  # the declared policy names another error
        policies = PolicyStore(billing.app.dlq.deadletters)
        seeded = policies.get()
        assert seeded is not None and seeded.origin == "declared" and seeded.actor == "app"
        policies.set(RedrivePolicy.parse(POLICY), "cli:ops", "declined cards pass now")
        until(settled(billing.app, "bill", 1, "resolved"), "the redrive under the operator's policy")
    assert not running.failed
    # A restart with another declaration keeps the operator's policy in force, the declaration beside it.
    declared = {**POLICY, "errors": ["YetAnother"]}
    again = Billing(store, clock, declared)
    again.app.drain(timeout=30)
    policies = PolicyStore(again.app.dlq.deadletters)
    record = policies.get()
    assert record is not None and record.origin == "operator"
    assert record.policy == RedrivePolicy.parse(POLICY) and record.declared == RedrivePolicy.parse(declared)
    assert [r.actor for r in policies.history()] == ["app", "cli:ops", "app"]
    reset = policies.reset("cli:ops")
    assert reset is not None and reset.origin == "declared" and reset.policy == RedrivePolicy.parse(declared)


def test_a_bad_policy_is_a_typed_error_naming_the_field(store: logstore.Store) -> None:
    with pytest.raises(InvalidPolicyError, match="max_redrives"):
        App("billing", store=store, redrive={"delay": 5, "max_redrives": 0})
    with pytest.raises(InvalidPolicyError, match="pattern"):
        RedrivePolicy.parse({"delay": 5, "pattern": "("})
    with pytest.raises(InvalidPolicyError, match="colour"):
        RedrivePolicy.parse({"delay": 5, "colour": "red"})
    with pytest.raises(InvalidPolicyError, match="field=value"):
        RedrivePolicy(delay=5).updated(["delay"])
    assert RedrivePolicy(delay=5).updated(["errors=A, B", "retriable=true"]).errors == ("A", "B")


def test_an_app_in_kafka_mode_redrives_its_dead_letters_too(tmp_path: Path, topic_prefix: str) -> None:
    from tests.harness.kafka_support import publish
    from tests.harness.shared_servers import KAFKA

    clock, fixed = FakeClock(), [False]
    with logstore.open(f"sqlite:///{tmp_path / 'kafka-store'}", shards=SHARDS) as store:
        store.put_cells([(uuid.uuid4(), "BASE", 1, {"rider": "fay"})])
        publish(store, topic_prefix)
        app = App(f"{topic_prefix}-billing", store=store, brokers=KAFKA, topic_prefix=topic_prefix, clock=clock,
                  redrive=POLICY, backoff=RetryPolicy(initial=0.001, maximum=0.002, deadline=None))

        @app.trigger("BASE", max_attempts=1)
        def bill(cell: logstore.Cell) -> None:
            if not fixed[0]:
                raise CardDeclined(f"card of {cell.body['rider']} declined")

        with app_in_thread(app, "billing-kafka") as running:
            until(lambda: len(app.dlq.list()) == 1, "the dead letter", timeout=60)
            assert app.dlq.list()[0].source["topic"] == f"{topic_prefix}.BASE"
            fixed[0] = True
            clock.advance(DELAY + 1)
            until(lambda: app.dlq.list()[0].status == "resolved", "the redrive")
        assert not running.failed
        [entry] = app.dlq.list()
        assert entry.redrives == 1 and entry.history[-1].actor == "policy"
        app.close()


def test_which_errors_by_retriable_and_by_a_pattern_of_the_message(store: logstore.Store) -> None:
    clock = FakeClock()
    billing = Billing(store, clock, None)
    store.put_cells([(uuid.uuid4(), "BASE", 1, {"rider": "gus", "bad": True}),
                     (uuid.uuid4(), "STATUS", 1, {"rider": "gus"})])
    billing.app.drain(timeout=30)
    declined, no_address = one(billing.app, "bill"), one(billing.app, "notify")
    assert (declined.retriable, no_address.retriable) == (False, True)  # NonRetriableError; a plain ValueError

    def picked(**fields: Any) -> set[str]:
        policy = RedrivePolicy(delay=1, **fields)
        return {e.handler for e in (declined, no_address) if policy.matches(e)}
    assert picked() == {"bill", "notify"}
    assert picked(retriable=True) == {"notify"} and picked(retriable=False) == {"bill"}
    assert picked(pattern=r"^no address") == {"notify"} and picked(pattern="declined$") == {"bill"}
    assert picked(errors=["ValueError"]) == {"notify"}
    assert picked(errors=["test_redrive.CardDeclined"]) == {"bill"} and picked(errors=["Declined"]) == set()
    assert picked(handlers=["bill"], errors=["ValueError"]) == set()


def test_a_cell_dead_lettered_again_keeps_the_redrive_count_of_its_entry(store: logstore.Store) -> None:
    clock = FakeClock()
    billing = Billing(store, clock, None)
    store.put_cells([(uuid.uuid4(), "BASE", 1, {"rider": "hal", "bad": True})])
    billing.app.drain(timeout=30)
    deadletters = billing.app.dlq.deadletters
    entry = deadletters.change(one(billing.app, "bill"), "replayed", note="redrive 1 of 3", actor="policy",
                               redrive=True)
    assert entry.redrives == 1
    # The same cell fails again (delivered again after a crash before the offset commit): the same entry.
    outcome = Outcome(False, 1, describe(CardDeclined("card of hal declined")), clock.now(), clock.now())
    again = deadletters.record("bill", "BASE", entry.source, entry.cell, entry.body, outcome)
    assert again.id == entry.id and again.status == "open" and again.redrives == 1
