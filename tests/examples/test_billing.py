"""The billing example (cellstream/demo/examples/billing.py), tested the way its users would test their
own apps: with indexer.testing's ``app_harness`` fixture, which the installed package registers with
pytest (no conftest brings it in), over a temporary embedded store and a fake clock."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from pathlib import Path

import pytest

from cellstream.demo.examples import billing
from indexer.testing import AppHarness, FakeClock
from logstore import Store

Harnesses = Callable[..., AppHarness]


def billed_by(provider: billing.CardProvider) -> Callable[[Store], billing.App]:
    return lambda store: billing.build(store, provider)


def test_a_trip_is_charged_once_and_marked_completed(app_harness: Harnesses) -> None:
    provider = billing.CardProvider(flaky_every=0)
    harness = app_harness(billed_by(provider))
    trip = harness.write("BASE", {"rider": "rider-1", "fare": 12.5})

    counts = harness.drain()

    assert (counts.processed, counts.retried, counts.dead_lettered) == (1, 0, 0)
    assert provider.charges == {str(trip.row_key): ("rider-1", 12.5)}
    status = harness.cell(trip.row_key, "STATUS")
    assert status is not None and status.ref_key == 1
    assert status.body == {"is_completed": True, "charged": 12.5}
    assert [(c.row_key, c.column) for c in harness.written()] == [(trip.row_key, "STATUS")]
    assert harness.dead_letters() == [] and harness.retries == []


def test_a_trip_delivered_again_is_not_charged_again(app_harness: Harnesses) -> None:
    provider = billing.CardProvider(flaky_every=0)
    harness = app_harness(billed_by(provider))
    trip = harness.write("BASE", {"rider": "rider-1", "fare": 12.5})
    harness.drain()
    # A correction of the trip (its next BASE version) reaches the handler too; the trip is completed.
    harness.write("BASE", {"rider": "rider-1", "fare": 99.0}, row_key=trip.row_key)

    assert harness.drain().processed == 1
    assert provider.calls == 1
    assert provider.charges == {str(trip.row_key): ("rider-1", 12.5)}
    assert len(harness.written("STATUS")) == 1


def test_a_provider_timeout_is_retried_on_the_fake_clock(app_harness: Harnesses) -> None:
    provider = billing.CardProvider(flaky_every=2)  # the second call times out, the third goes through
    harness = app_harness(billed_by(provider))
    first = harness.write("BASE", {"rider": "rider-1", "fare": 10.0})
    harness.drain()
    second = harness.write("BASE", {"rider": "rider-2", "fare": 20.0})

    counts = harness.drain()

    assert (counts.processed, counts.retried, counts.dead_lettered) == (1, 1, 0)
    [retry] = harness.retries
    assert (retry.handler, retry.attempt, type(retry.error)) == ("bill_rider", 1, billing.ProviderTimeout)
    assert [cell.row_key for cell in retry.cells] == [second.row_key]
    # The pause went to the fake clock (the policy's first delay: 0.1 s less up to half of it), not to sleep.
    assert harness.clock.slept == [retry.delay] and 0.05 <= retry.delay <= 0.1
    assert set(provider.charges) == {str(first.row_key), str(second.row_key)}


def test_a_provider_that_keeps_timing_out_dead_letters_after_five_attempts(app_harness: Harnesses) -> None:
    start = dt.datetime(2031, 3, 1, 8, 0, tzinfo=dt.UTC)
    clock = FakeClock(start)
    harness = app_harness(billed_by(billing.CardProvider(flaky_every=1)), clock=clock)
    trip = harness.write("BASE", {"rider": "rider-1", "fare": 10.0})

    counts = harness.drain()

    assert (counts.processed, counts.retried, counts.dead_lettered) == (0, 4, 1)
    assert [r.attempt for r in harness.retries] == [1, 2, 3, 4]
    # Exponential backoff with jitter: each pause in [base / 2, base], the base doubling from 0.1 s.
    assert len(clock.slept) == 4
    for pause, base in zip(clock.slept, (0.1, 0.2, 0.4, 0.8), strict=True):
        assert base / 2 <= pause <= base
    [entry] = harness.dead_letters()
    assert (entry.handler, entry.attempts, entry.status) == ("bill_rider", 5, "open")
    assert entry.error_type == "cellstream.demo.examples.billing.ProviderTimeout"
    assert entry.cell["row_key"] == str(trip.row_key) and entry.body == {"rider": "rider-1", "fare": 10.0}
    # Dated by the fake clock: the first failure at its start, the last after the four pauses.
    assert entry.first_failure == start
    # (each pause moves the clock by itself, rounded to the microsecond as a timedelta is)
    assert entry.last_failure == start + sum((dt.timedelta(seconds=p) for p in clock.slept), dt.timedelta())
    assert harness.cell(trip.row_key, "STATUS") is None


def test_a_declined_card_is_dead_lettered_at_once_and_replayed_once_fixed(app_harness: Harnesses) -> None:
    provider = billing.CardProvider(blocked={"rider-blocked"}, flaky_every=0)
    harness = app_harness(billed_by(provider))
    trip = harness.write("BASE", {"rider": "rider-blocked", "fare": 30.0})

    counts = harness.drain()

    assert (counts.processed, counts.retried, counts.dead_lettered) == (0, 0, 1)
    assert harness.retries == [] and harness.clock.slept == []  # non-retriable: no second attempt
    [entry] = harness.dead_letters(error="cellstream.demo.examples.billing.CardDeclined")
    assert (entry.attempts, entry.message) == (1, "card of rider-blocked declined")
    assert harness.written() == []

    provider.blocked.clear()  # the rider fixed the card
    [result] = harness.dlq.replay(entry.id)

    assert (result.before, result.after) == ("open", "resolved")
    assert harness.dead_letters(status="open") == []
    assert provider.charges == {str(trip.row_key): ("rider-blocked", 30.0)}
    status = harness.cell(trip.row_key, "STATUS")
    assert status is not None and status.body["is_completed"] is True


def test_a_trip_without_a_rider_is_dead_lettered_with_its_reason(app_harness: Harnesses) -> None:
    harness = app_harness(billed_by(billing.CardProvider(flaky_every=0)))
    harness.write("BASE", {"fare": 30.0})

    assert harness.drain().dead_lettered == 1
    [entry] = harness.dead_letters()
    assert entry.error_type == "indexer.errors.NonRetriableError" and "has no rider" in entry.message


def test_the_module_app_runs_over_the_harness_store_not_its_own(
        app_harness: Harnesses, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """billing.app is built at import time over CELLSTREAM_STORE (default ./billing-data); under the harness
    its handler writes through its context to the temporary store, and the app is given back unchanged."""
    monkeypatch.chdir(tmp_path)
    target, clock = billing.app.store_target, billing.app.clock
    monkeypatch.setattr(billing.provider, "flaky_every", 0)
    monkeypatch.setattr(billing.provider, "charges", {})
    harness = app_harness(billing.app)
    trip = harness.write("BASE", {"rider": "rider-1", "fare": 7.0})

    assert harness.drain().processed == 1

    status = harness.cell(trip.row_key, "STATUS")
    assert status is not None and status.body == {"is_completed": True, "charged": 7.0}
    harness.close()
    assert (billing.app.store_target, billing.app.clock) == (target, clock)
    assert not any(tmp_path.iterdir()), "the app's own store was opened"
