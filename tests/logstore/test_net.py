from __future__ import annotations

import pytest

from logstore.net import is_loopback


@pytest.mark.parametrize(("host", "loopback"), [
    ("localhost", True), ("127.0.0.1", True), ("127.8.9.10", True), ("::1", True),
    ("0.0.0.0", False), ("::", False), ("10.1.2.3", False), ("example.org", False), ("", False),
])
def test_a_bind_is_loopback_only_on_localhost_and_loopback_addresses(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback
