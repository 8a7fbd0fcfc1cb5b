"""The stream-processing part of the demo: ``examples/billing.py`` (beside this module) in direct mode, a poison cell
dead-lettered, then replayed after the fix. Offsets live in the store; no server is needed."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import TextIO

import logstore
from logstore.retry import RetryPolicy

EXAMPLE = Path(__file__).resolve().parent / "examples" / "billing.py"


def _say(out: TextIO, text: str = "") -> None:
    print(text, file=out, flush=True)


def load_billing() -> ModuleType:
    spec = importlib.util.spec_from_file_location("cellstream_demo_billing", EXAMPLE)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"the billing example is missing: {EXAMPLE}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def app_demo(store: logstore.Store, out: TextIO, blocked: str) -> None:
    billing = load_billing()
    provider = billing.CardProvider(blocked={blocked}, flaky_every=4)
    fast = RetryPolicy(initial=0.01, maximum=0.05, deadline=None)
    with billing.build(store, provider, backoff=fast) as app:
        _say(out, "\n== 8. a stream processor: cellstream.demo.examples.billing bills the rider of every BASE cell")
        _say(out, f"   direct mode on the embedded store; the card provider times out every 4th call and "
                  f"declines {blocked}")
        counts = app.drain(timeout=60)
        _say(out, f"   drain: processed {counts.processed}, retried {counts.retried}, "
                  f"dead-lettered {counts.dead_lettered}; {len(provider.charges)} trips charged")
        [entry] = app.dlq.list(status="open")
        _say(out, f"   dead letter {entry.id}: handler {entry.handler}, {entry.error_type}: {entry.message}")
        _say(out, f"     source shard {entry.source['shard']} added_id {entry.source['added_id']}, "
                  f"cell {entry.cell['row_key']}/{entry.cell['column']}@{entry.cell['ref_key']}, "
                  f"attempts {entry.attempts}")
        for group in app.dlq.stats():
            _say(out, f"   dlq stats: {group['count']} x {group['handler']} {group['error_type']} "
                      f"[{group['fingerprint']}], {group['open']} open")
        again = app.drain(timeout=60)
        _say(out, f"   drain again: processed {again.processed} (offsets were committed after each cell)")

        provider.blocked.discard(blocked)
        _say(out, "   the rider's card is fixed; replay: cellstream dlq --app cellstream.demo.examples.billing:app"
                  f" replay {entry.id}")
        [result] = app.dlq.replay(entry.id)
        replayed = app.dlq.show(entry.id)
        _say(out, f"   {result.id}: {result.before} -> {result.after}; history "
                  + " -> ".join(event.status for event in replayed.history))
        status = store.get_cell_latest(entry.cell["row_key"], "STATUS")
        _say(out, f"   trip {entry.cell['row_key']} STATUS@{status.ref_key if status else '-'}: "
                  f"{status.body if status else None}")
        [same] = app.dlq.replay(entry.id)
        _say(out, f"   replaying it again changes nothing: {same.before} -> {same.after}")
