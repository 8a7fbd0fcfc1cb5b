"""An app keeping indexes current: their versions' batch handlers and the hook that marks them live and
measures their lag. :meth:`App.index <indexer.runtime.app.App.index>` calls :func:`keep`."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from indexer.indexes.applier import IndexApplier, lag
from indexer.indexes.catalog import IndexCatalog
from indexer.indexes.definitions import IndexDefinition, load_indexes
from indexer.runtime.hooks import Hook
from logstore import LogstoreError

if TYPE_CHECKING:
    from indexer.runtime.app import App

logger = logging.getLogger(__name__)


class IndexKeeper(Hook):
    """The app's hook for the index versions it keeps: each is marked live in the catalog when the app starts
    (so a drop or an activation knows an app maintains it), and its lag gauges are set every
    ``index_lag_interval`` seconds."""

    def __init__(self, app: App, appliers: Sequence[IndexApplier]) -> None:
        self.app = app
        self.appliers = list(appliers)
        self.interval = app.config.index_lag_interval

    def started(self) -> None:
        catalog = IndexCatalog(self.app.store)
        for applier in self.appliers:
            catalog.mark_live(applier.definition.name, applier.definition.version, self.app.name)

    def tick(self) -> None:
        """Set the lag gauges of every version kept (see :func:`indexer.indexes.applier.lag`)."""
        metrics = self.app.metrics
        for applier in self.appliers:
            if applier.dropped:
                continue
            definition = applier.definition
            try:
                cells, seconds = lag(self.app.store, definition)
            except LogstoreError as exc:  # the next tick measures again
                logger.warning("app %s: could not measure the lag of index %s version %d: %s",
                               self.app.name, definition.name, definition.version, exc)
                continue
            labels = (self.app.name, definition.name, str(definition.version))
            metrics.index_lag_cells.labels(*labels).set(cells)
            metrics.index_lag_seconds.labels(*labels).set(seconds)


def keep(app: App, definitions: str | Path | Sequence[IndexDefinition]) -> list[IndexDefinition]:
    """Register the definitions (a YAML file or a list) in the catalog and have ``app`` keep every maintained
    version of those indexes current; return the versions kept."""
    loaded = load_indexes(Path(definitions)) if isinstance(definitions, str | Path) else list(definitions)
    store = app.store
    catalog = IndexCatalog(store)
    for definition in loaded:
        catalog.register(definition)
    appliers: list[IndexApplier] = []
    for name in dict.fromkeys(d.name for d in loaded):
        for definition in catalog.get(name).maintained():
            applier = IndexApplier(store, definition)
            app.batch_handler(applier.name, definition.column, applier, applier.apply_one)
            appliers.append(applier)
    if appliers:
        app.add_hook(IndexKeeper(app, appliers))
    return [applier.definition for applier in appliers]
