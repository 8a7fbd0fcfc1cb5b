"""Networking helpers shared by cellstream's servers and clients (the worker node, the console, URLs in messages)."""

from __future__ import annotations

import ipaddress
import re


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


# A URL's user part with its password or token (``user:SECRET@``, ``TOKEN@``), as messages quote URLs.
_USERINFO = re.compile(r"(?<=//)[^@/\s\"']*@|([A-Za-z0-9._~%!$&()*+,;=-]*:)[^@/\s\"']*@")


def mask_userinfo(text: str) -> str:
    """``text`` with the secret of every URL user part in it replaced by ``***`` (``user:***@``, ``***@``)."""
    return _USERINFO.sub(lambda m: f"{m.group(1)}***@" if m.group(1) is not None else "***@", text)
