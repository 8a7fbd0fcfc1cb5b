"""The dead-letter console: ``cellstream console``, a web page over the dead letters of apps and connectors.

:mod:`~cellstream.console.catalog` follows the entries, :mod:`~cellstream.console.jobs` runs replays
and discards, :mod:`~cellstream.console.auth` logs people in, :mod:`~cellstream.console.server` serves
:mod:`~cellstream.console.views`' pages (templates in ``templates/``, the stylesheet in ``static/``).
"""

from __future__ import annotations

from cellstream.console.server import Console, ConsoleConfig

__all__ = ["Console", "ConsoleConfig"]
