"""Test an app's handlers with no server: a temporary embedded store, a fake clock, and what came of each cell.

>>> from indexer.testing import AppHarness
>>> with AppHarness(billing.app) as harness:                        # doctest: +SKIP
...     trip = harness.write("BASE", {"rider": "r1", "fare": 12.5})
...     harness.drain()
...     assert harness.cell(trip.row_key, "STATUS").body["is_completed"]

The ``app_harness`` pytest fixture (registered through the ``pytest11`` entry point, so
installing cellstream is enough) makes harnesses that are closed after the test. See
docs/testing.md, "Testing your handlers".
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from logstore.lazy import lazy_exports

if TYPE_CHECKING:
    from indexer.testing.clock import FakeClock
    from indexer.testing.harness import AppHarness, Retry

__all__ = ["AppHarness", "FakeClock", "Retry"]

# Imported on first use: pytest loads indexer.testing.plugin in every session where cellstream is installed.
_LAZY = {"AppHarness": "indexer.testing.harness", "Retry": "indexer.testing.harness",
         "FakeClock": "indexer.testing.clock"}

__getattr__ = lazy_exports(__name__, _LAZY)
