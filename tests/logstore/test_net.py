from __future__ import annotations

import pytest

import logstore
from logstore.net import is_loopback, mask_userinfo


@pytest.mark.parametrize(("host", "loopback"), [
    ("localhost", True), ("127.0.0.1", True), ("127.8.9.10", True), ("::1", True),
    ("0.0.0.0", False), ("::", False), ("10.1.2.3", False), ("example.org", False), ("", False),
])
def test_a_bind_is_loopback_only_on_localhost_and_loopback_addresses(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


@pytest.mark.parametrize(("url", "shown"), [
    ("http://bob:TOKEN-1234@127.0.0.1:8080", "http://***@127.0.0.1:8080"),
    ("http://TOKEN-1234@127.0.0.1:8080/x", "http://***@127.0.0.1:8080/x"),
    ("http://[::1:TOKEN-1234@", "http://***@"),
])
def test_a_worker_node_url_with_a_user_part_is_refused_without_echoing_it(url: str, shown: str) -> None:
    with pytest.raises(logstore.InvalidArgumentError) as refused:
        logstore.open(url)
    assert "TOKEN" not in str(refused.value) and shown in str(refused.value), str(refused.value)


def test_mask_userinfo_hides_the_secret_of_every_url_user_part() -> None:
    text = 'after "loader:hunter2@127.0.0.1/w" and in "postgresql://loader:hunter2@[::1/w"'
    assert mask_userinfo(text) == 'after "loader:***@127.0.0.1/w" and in "postgresql://***@[::1/w"'
    assert mask_userinfo("no user part: a:b c@d, http://h:1/") == "no user part: a:b c@d, http://h:1/"
