"""The pytest plugin (entry point ``pytest11``): the ``app_harness`` fixture.

    def test_bills_a_trip(app_harness):
        harness = app_harness(billing.app)
        trip = harness.write("BASE", {"rider": "r1", "fare": 12.5})
        assert harness.drain().processed == 1

Loaded by pytest in every session where cellstream is installed, so it imports nothing heavy
until a test asks for the fixture.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from indexer.runtime.app import App
    from indexer.testing.harness import AppHarness
    from logstore import Store


@pytest.fixture
def app_harness() -> Iterator[Callable[..., AppHarness]]:
    """A factory of harnesses (:class:`~indexer.testing.AppHarness`):
    ``app_harness(app_or_builder, shards=..., clock=...)``; each is closed after the test (the app given back
    as it was, the temporary store deleted)."""
    from indexer.testing.harness import AppHarness

    made: list[AppHarness] = []

    def make(app: App | Callable[[Store], App], **options: Any) -> AppHarness:
        harness = AppHarness(app, **options)
        made.append(harness)
        return harness

    yield make
    for harness in reversed(made):
        harness.close()
