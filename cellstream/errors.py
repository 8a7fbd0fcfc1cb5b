"""The errors of the CLI and the console: bad command-line input, a refused login. Every other error comes
from the packages below, all under :class:`logstore.errors.CellstreamError`."""

from __future__ import annotations

from logstore.errors import CellstreamError


class UsageError(CellstreamError):
    """Bad command-line input: reported as one line, exit code 2."""


class LoginError(CellstreamError):
    """A console login refused (no name, a wrong token): shown on the login page, with what was wrong."""


class LoginThrottled(LoginError):
    """Too many wrong tokens from this client's address (or from all): the token was not even compared."""

    def __init__(self, wait: float) -> None:
        self.wait = wait
        super().__init__(f"too many wrong tokens from your address or from all: try again in {wait:.0f} s")
