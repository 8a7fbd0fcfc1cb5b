"""The console's catalog: summaries followed incrementally from the DLQ shards, filtered, grouped, charted."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from cellstream.console.catalog import EntryCatalog, Query, Summary, timeline
from indexer import DLQFilter
from tests.console.support import triage_app, write_trips


def test_a_refresh_reads_only_what_changed_and_the_latest_version_wins(tmp_path: Path) -> None:
    billing = triage_app(tmp_path)
    catalog = EntryCatalog({"billing": billing.queue.deadletters})
    assert catalog.refresh() == 7 and len(catalog) == 7
    assert catalog.refresh() == 0
    every = Query(None, DLQFilter())
    before = catalog.query(every)

    entry = next(e for e in billing.queue.list(handler="notify"))
    billing.queue.discard(entry.id, "no address", actor="console:test")
    write_trips(billing.url, bills=1, notes=0)  # rider-0 again: declined, a new entry
    billing.app.drain(timeout=60)
    assert catalog.refresh() == 2 and len(catalog) == 8
    summary = catalog.get("billing", entry.id)
    assert summary is not None and summary.status == "discarded" and summary.version == entry.version + 1
    # A query answered before the refresh is not answered again from the cache.
    after = catalog.query(every)
    assert len(before) == 7 and len(after) == 8
    assert catalog.counts() == {"open": 7, "replayed": 0, "resolved": 0, "discarded": 1}
    assert [e.last_failure for e in after] == sorted((e.last_failure for e in after), reverse=True)


def test_apps_sharing_a_dlq_shard_see_only_their_own_entries(tmp_path: Path) -> None:
    # One shard: every app's dead letters are in it.
    billing = triage_app(tmp_path, name="billing", shards=1)
    payouts = triage_app(tmp_path, name="payouts", bills=0, notes=0, shards=1)  # handles the same cells
    assert billing.queue.deadletters.shard == payouts.queue.deadletters.shard == 0
    catalog = EntryCatalog({"billing": billing.queue.deadletters, "payouts": payouts.queue.deadletters})
    catalog.refresh()
    assert len(catalog) == 14
    mine = catalog.query(Query("payouts", DLQFilter()))
    assert len(mine) == 7 and {e.app for e in mine} == {"payouts"}
    assert {e.id for e in mine} == {e.id for e in payouts.queue.list()}


def test_filters_match_like_the_cli_and_groups_count_the_open_entries(tmp_path: Path) -> None:
    billing = triage_app(tmp_path)
    catalog = EntryCatalog({"billing": billing.queue.deadletters})
    catalog.refresh()
    for fields in ({"handler": "notify"}, {"error": "carddeclined"}, {"text": "RIDER-3 "}, {"status": "open"},
                   {"handler": "bill_rider", "text": "rider-9"}):
        match = DLQFilter.build(**fields)
        assert {e.id for e in catalog.query(Query(None, match))} == {e.id for e in billing.queue.list(match)}, fields
    groups = {(g.handler, g.open) for g in catalog.groups()}
    assert groups == {("bill_rider", 4), ("notify", 3)}
    entry = billing.queue.list(handler="notify")[0]
    billing.queue.discard(entry.id, "gone")
    catalog.refresh()
    assert {(g.handler, g.open) for g in catalog.groups()} == {("bill_rider", 4), ("notify", 2)}


def summary(first: dt.datetime) -> Summary:
    return Summary("a", "id", 1, "h", "open", "E", "f", "m", 1, first, first, None, "C")


def test_the_timeline_counts_entries_by_round_intervals_up_to_now() -> None:
    now = dt.datetime(2026, 11, 25, 12, 30, 10, tzinfo=dt.UTC)
    entries = [summary(now - dt.timedelta(minutes=m)) for m in (0, 0, 1, 5, 47)]
    step, buckets = timeline(entries, now)
    assert step == dt.timedelta(minutes=1) and len(buckets) == 48
    assert buckets[-1].start == dt.datetime(2026, 11, 25, 12, 30, tzinfo=dt.UTC)
    assert [b.entries for b in buckets][-6:] == [1, 0, 0, 0, 1, 2]
    assert sum(b.entries for b in buckets) == 5
    step, buckets = timeline([summary(now - dt.timedelta(hours=30))], now)
    assert step == dt.timedelta(hours=1) and sum(b.entries for b in buckets) == 1
    step, buckets = timeline([summary(now - dt.timedelta(days=200))], now)
    assert step >= dt.timedelta(days=4) and sum(b.entries for b in buckets) == 1
    assert timeline([], now)[1] == []
