"""The progress bars of the long commands (``index backfill``, ``index verify``, ``connect run --drain``,
``shards move``): drawn on stderr when it is a terminal, and never with ``--json``. Into a pipe or a log
file a bar would be a stream of ``\\r`` updates, so there the command prints its result line only.

tqdm is imported when a bar is drawn, never at ``--help``.
"""

from __future__ import annotations

import sys
from typing import Any

from cellstream.cli.common import Output


def drawn(out: Output) -> bool:
    """Whether a command writing to ``out`` draws progress bars: stderr is a terminal and --json is off."""
    isatty = getattr(sys.stderr, "isatty", None)
    return not out.as_json and callable(isatty) and bool(isatty())


class Bar:
    """One progress bar (a no-op when :func:`drawn` says no): ``show`` its state, ``close`` it once done.

    Its unit names what ``done`` and ``total`` count, which must be what the command reports at the end.
    """

    def __init__(self, out: Output, unit: str, *, desc: str | None = None, total: int | None = None,
                 leave: bool = True) -> None:
        self._bar: Any = None
        if drawn(out):
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=leave, dynamic_ncols=True)

    def show(self, done: int, total: int | None = None, postfix: str = "", desc: str | None = None) -> None:
        """Draw ``done`` of ``total`` (None: the total given before), with ``postfix`` after the counts and
        ``desc`` (None: as before) in front."""
        if self._bar is None:
            return
        if total is not None:
            self._bar.total = total
        if desc is not None:
            self._bar.set_description_str(desc, refresh=False)
        self._bar.n = done
        self._bar.set_postfix_str(postfix, refresh=False)
        self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Bar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
