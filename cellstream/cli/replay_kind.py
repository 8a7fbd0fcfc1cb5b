"""The ``replay`` job kind as the command line runs it (:mod:`indexer.runtime.replay`): its jobs name their app as
``cellstream run`` takes it (MODULE:APP) or a connector's YAML, and this loads it again, for ``cellstream replay``
and ``cellstream jobs resume --run``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from indexer import App
    from indexer.runtime.replay import Replay
    from logstore import Store


def load_replayed(params: dict[str, Any], store: Store) -> tuple[App, Callable[[], None]]:
    """The app a replay job's parameters name (``app``: MODULE:APP, ``connector``: a connector's YAML, run
    over ``store``), and what closes it.

    Raises:
        ConfigurationError: the app or connector does not load.
    """
    import indexer

    if params.get("connector"):
        from connectors.config import load_connector
        from connectors.runtime import connector_app

        app, applier = connector_app(load_connector(Path(params["connector"])), store)

        def close() -> None:
            app.close()
            applier.sink.close()
        return app, close
    from cellstream.cli.apps import load_app

    spec = params.get("app")
    if not isinstance(spec, str):
        raise indexer.ConfigurationError(f"a replay job needs its app (MODULE:APP) in its parameters, got {spec!r}")
    cwd = params.get("cwd")
    if isinstance(cwd, str) and cwd not in sys.path:
        sys.path.append(cwd)  # where `cellstream replay` imported the module from
    app = load_app(spec)
    return app, app.close


def replay_kind(store: Store) -> Replay:
    """The ``replay`` job kind for ``store`` (``cellstream jobs resume --run``)."""
    from indexer.runtime.replay import Replay

    return Replay(store, lambda params: load_replayed(params, store))
