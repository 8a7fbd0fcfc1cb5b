"""The seed's trigger example: bill the rider when a trip's BASE cell is written.

    CELLSTREAM_STORE=sqlite:///./data cellstream run cellstream.demo.examples.billing:app
    cellstream dlq --app cellstream.demo.examples.billing:app stats

Billing is idempotent: the handler looks at the trip's STATUS first and charges only
a trip that is not completed yet, and the card provider takes the trip as its
idempotency key, so a cell delivered twice (at least once) never charges twice.
The fake card provider times out now and then (retried) and declines blocked riders
(non-retriable: the cell goes to the dead-letter queue at once, to be replayed once
the rider's card is fixed).

The handler reads and writes through its context (``ctx.store``), the app's store: the
one named by CELLSTREAM_STORE when it runs, a temporary one when a test runs it under
:class:`indexer.testing.AppHarness` (tests/examples/test_billing.py).
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any

from indexer import App, Context, NonRetriableError
from logstore import Cell, CellConflictError


class CardDeclined(NonRetriableError):
    """The provider refused the card: retrying will not help until someone fixes it."""


class ProviderTimeout(Exception):
    """The provider did not answer in time: worth another attempt."""

    retriable = True


class CardProvider:
    """A fake card provider: charges are keyed by trip; every ``flaky_every``-th call times out."""

    def __init__(self, blocked: set[str] | None = None, flaky_every: int = 4) -> None:
        self.blocked = set(blocked or ())
        self.flaky_every = flaky_every
        self.charges: dict[str, tuple[str, float]] = {}
        self.calls = 0
        self._lock = threading.Lock()

    def charge(self, rider: str, trip: str, amount: float) -> None:
        with self._lock:
            self.calls += 1
            if self.flaky_every and self.calls % self.flaky_every == 0:
                raise ProviderTimeout(f"card provider timed out charging {rider}")
            if rider in self.blocked:
                raise CardDeclined(f"card of {rider} declined")
            self.charges.setdefault(trip, (rider, amount))  # the trip is the idempotency key


def build(store: Any, provider: CardProvider, **options: Any) -> App:
    """The billing app over ``store`` (a URL or an open logstore.Store)."""
    app = App("billing", store=store, **options)

    @app.trigger("BASE", max_attempts=5)
    def bill_rider(cell: Cell, ctx: Context) -> None:
        rider = cell.body.get("rider")
        if not isinstance(rider, str):
            raise NonRetriableError(f"trip {cell.row_key} has no rider to bill")
        status = ctx.store.get_cell_latest(cell.row_key, "STATUS")
        if status is not None and status.body.get("is_completed"):
            return  # billed already (or paid elsewhere): nothing to do
        fare = float(cell.body["fare"])
        provider.charge(rider, str(cell.row_key), fare)
        # A conflict means another delivery of this cell wrote that STATUS version first.
        with contextlib.suppress(CellConflictError):
            ctx.store.put_cell(cell.row_key, "STATUS", (status.ref_key if status else 0) + 1,
                               {"is_completed": True, "charged": fare})

    return app


provider = CardProvider(blocked={"rider-blocked"})
app = build(os.environ.get("CELLSTREAM_STORE", "sqlite:///./billing-data"), provider)
