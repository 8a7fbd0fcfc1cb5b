"""The worker node over TLS (``cellstream serve --tls-cert --tls-key``): a client trusting the node's CA
(``https://host:port?ssl_ca=FILE``) gets the whole API; one that does not is refused at once with a typed
error naming the fix, not retried."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

import logstore
from tests.harness.tls import PKI, make_pki
from tests.harness.worker_support import worker_node

SHARDS = 8
TOKEN = "tls-token-0123456789abcdef"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    return make_pki(tmp_path_factory.mktemp("pki"))


def test_a_client_trusting_the_ca_uses_the_node_over_https(sqlite_url: str, pki: PKI) -> None:
    with worker_node(sqlite_url, SHARDS, token=TOKEN, tls_cert=pki.server.cert, tls_key=pki.server.key) as node:
        assert node.url.startswith("https://")
        row = uuid.uuid4()
        with logstore.open(f"{node.url}?ssl_ca={pki.ca}", token=TOKEN) as store:
            cell = store.put_cell(row, "BASE", 1, {"over": "tls"})
            assert store.get_cell_latest(row, "BASE") == cell
        for ca, why in ((None, "not trusted"), (pki.other_ca, "not trusted")):
            url = node.url if ca is None else f"{node.url}?ssl_ca={ca}"
            with pytest.raises(logstore.ConfigurationError, match=why) as refused:
                logstore.open(url, token=TOKEN)
            assert "ssl_ca" in str(refused.value) and not refused.value.retriable
        with pytest.raises(logstore.StorageUnavailableError):  # plain HTTP gets no answer from a TLS port
            logstore.open(node.url.replace("https://", "http://"), token=TOKEN, connect_timeout=2.0)


def serve(store: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "cellstream", "serve", "--store", store, "--json", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "CELLSTREAM_TOKEN": TOKEN})


def test_cellstream_serve_with_tls(sqlite_url: str, pki: PKI) -> None:
    with logstore.open(sqlite_url, shards=SHARDS):
        pass
    process = serve(sqlite_url, "--bind", "127.0.0.1:0", "--tls-cert", str(pki.server.cert),
                    "--tls-key", str(pki.server.key))
    try:
        assert process.stdout is not None
        started = json.loads(process.stdout.readline())
        assert started["url"].startswith("https://127.0.0.1:")
        with logstore.open(f"{started['url']}?ssl_ca={pki.ca}", token=TOKEN) as client:
            assert client.shard_count == SHARDS
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
    finally:
        process.kill()


@pytest.mark.parametrize(("args", "code", "message"), [
    (["--tls-cert", "CERT"], 2, "TLS needs both a certificate and its key"),
    (["--tls-cert", "CERT", "--tls-key", "/nonexistent.key"], 4, "cannot be loaded"),
])
def test_cellstream_serve_refuses_bad_tls_settings_in_one_line(sqlite_url: str, pki: PKI, args: list[str],
                                                                 code: int, message: str) -> None:
    with logstore.open(sqlite_url, shards=SHARDS):
        pass
    argv = [str(pki.server.cert) if a == "CERT" else a for a in args]
    process = serve(sqlite_url, "--bind", "127.0.0.1:0", *argv)
    _out, err = process.communicate(timeout=60)
    assert process.returncode == code and err.count("\n") == 1 and message in err, err


def test_a_tls_url_takes_only_ssl_ca(tmp_path: Path) -> None:
    with pytest.raises(logstore.InvalidArgumentError, match="unknown parameter 'sslca'"):
        logstore.open("https://127.0.0.1:1?sslca=x")
    with pytest.raises(logstore.InvalidArgumentError, match="needs an https:// URL"):
        logstore.open(f"http://127.0.0.1:1?ssl_ca={tmp_path}")
