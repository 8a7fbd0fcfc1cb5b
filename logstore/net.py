"""Networking helpers shared by cellstream's own servers (the worker node, the console); no server library."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` listens on this machine only: ``localhost`` or a loopback address (IPv4 or IPv6).

    Args:
        host: a host name or an IP address, as given to ``--bind``.

    Returns:
        True for ``localhost`` and loopback addresses; False for any other name (it is not resolved) or address.
    """
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
