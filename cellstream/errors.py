"""The CLI's own error: bad command-line input. Every other error comes from the packages below,
all under :class:`logstore.errors.CellstreamError`."""

from __future__ import annotations

from logstore.errors import CellstreamError


class UsageError(CellstreamError):
    """Bad command-line input: reported as one line, exit code 2."""
