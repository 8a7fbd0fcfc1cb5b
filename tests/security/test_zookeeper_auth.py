"""ZooKeeper digest authentication and ACLs, against the real ZooKeeper of `make test` (digest needs no server
setting): with credentials, every node a tailer or an app creates carries an ACL for that user alone, so an
anonymous client or one with another password can neither read nor change the offsets, and a worker given
the wrong password stops with an AuthenticationError instead of waiting forever for shards."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from kazoo.client import KazooClient
from kazoo.exceptions import NoAuthError
from kazoo.security import make_digest_acl

import logstore
from indexer import App
from tailer.coordinators.zookeeper import tailer_path
from tailer.publishers.directory import read_topic
from tests.harness import REPO
from tests.harness.cli_process import run_until

USER, PASSWORD = "cellstream", "zk-s3cret"
SHARDS = 8


@pytest.fixture
def secured(zk_chroot: str) -> Iterator[str]:
    """The chroot, removed at the end by a client with the credentials (the fixture's own cannot)."""
    yield zk_chroot
    hosts, _, chroot = zk_chroot.partition("/")
    with client(hosts, f"{USER}:{PASSWORD}") as authed:
        authed.delete(f"/{chroot}", recursive=True)


@contextlib.contextmanager
def client(hosts: str, auth: str | None = None) -> Iterator[KazooClient]:
    """A kazoo client of the test's own, anonymous or with digest credentials ``user:password``."""
    zk = KazooClient(hosts=hosts, timeout=10, auth_data=[("digest", auth)] if auth else None)
    zk.start(timeout=15)
    try:
        yield zk
    finally:
        zk.stop()
        zk.close()


def cli(*args: str, auth: Path | None = None) -> list[str]:
    return [sys.executable, "-m", "cellstream", *args, *(["--zookeeper-auth-file", str(auth)] if auth else [])]


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}


def test_a_tailer_with_credentials_keeps_its_nodes_to_that_user(
        secured: str, sqlite_url: str, tmp_path: Path) -> None:
    auth = tmp_path / "zk-auth"
    auth.write_text(f"{USER}:{PASSWORD}\n")
    with logstore.open(sqlite_url, shards=SHARDS) as store:
        written = {(c.shard, c.added_id) for c in store.put_cells(
            [(uuid.uuid4(), "BASE", 1, {"n": n}) for n in range(30)])}
    out = tmp_path / "topics"
    output = run_until(
        ["tail", "-v", "--store", sqlite_url, "--zookeeper", secured, "--out", str(out), "--name", "secure",
         "--partitions", "2", "--zookeeper-auth-file", str(auth)],
        lambda: {(r["headers"]["shard"], r["headers"]["added_id"]) for _, r in read_topic(out, "cells.BASE")}
        == {(str(s), str(a)) for s, a in written})
    assert PASSWORD not in output

    hosts, root = tailer_path(secured, "secure")
    only_us = [make_digest_acl(USER, PASSWORD, all=True)]
    with client(hosts, f"{USER}:{PASSWORD}") as authed:
        for path in ("/" + secured.partition("/")[2], root, f"{root}/offsets", f"{root}/assignment",
                     *(f"{root}/offsets/{s}" for s in authed.get_children(f"{root}/offsets"))):
            assert authed.get_acls(path)[0] == only_us, path
    with client(hosts) as anonymous:
        with pytest.raises(NoAuthError):
            anonymous.get_children(f"{root}/offsets")
        with pytest.raises(NoAuthError):
            anonymous.set(f"{root}/assignment", b"{}")
    with client(hosts, f"{USER}:other") as impostor, pytest.raises(NoAuthError):
        impostor.get(f"{root}/assignment")
    with client(hosts, f"{USER}:{PASSWORD}") as authed:
        locations = {int(s): json.loads(authed.get(f"{root}/offsets/{s}")[0])["location"]
                     for s in authed.get_children(f"{root}/offsets")}
    # Every shard with cells is committed at its last cell; one that got none of the 30, if committed, at 0.
    assert locations == {s: max((a for t, a in written if t == s), default=0) for s in {*locations, *dict(written)}}

    status = subprocess.run(cli("tail", "status", "secure", "--store", sqlite_url, "--zookeeper", secured,
                                "--json", auth=auth), capture_output=True, text=True, env=env(), timeout=60)
    assert status.returncode == 0, status.stderr
    assert all(row["lag_cells"] == 0 for row in json.loads(status.stdout)["shards"])
    refused = subprocess.run(cli("tail", "status", "secure", "--store", sqlite_url, "--zookeeper", secured),
                             capture_output=True, text=True, env=env(), timeout=60)
    assert refused.returncode == 4
    assert refused.stderr.startswith("cellstream: error: ZooKeeper refused an unauthenticated client access to")


def test_a_worker_with_the_wrong_password_stops_with_an_authentication_error(
        secured: str, sqlite_url: str, tmp_path: Path) -> None:
    hosts, root = tailer_path(secured, "secure")
    with client(hosts, f"{USER}:{PASSWORD}") as authed:
        authed.default_acl = [make_digest_acl(USER, PASSWORD, all=True)]
        authed.ensure_path(f"{root}/workers")  # the tailer's nodes, made by its rightful user
    wrong = tmp_path / "zk-auth"
    wrong.write_text(f"{USER}:not-the-password\n")
    logstore.open(sqlite_url, shards=SHARDS).close()
    done = subprocess.run(cli("tail", "--store", sqlite_url, "--zookeeper", secured, "--out", str(tmp_path / "t"),
                              "--name", "secure", auth=wrong), capture_output=True, text=True, env=env(), timeout=90)
    assert done.returncode == 4, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("cellstream: error:")]
    assert errors == [f"cellstream: error: ZooKeeper refused user '{USER}' access to {root} (NoAuthError): its "
                      "nodes' ACL names other credentials (give the right user:password, see docs/security.md)"]
    assert "not-the-password" not in done.stderr


def test_a_direct_mode_app_with_credentials_keeps_its_nodes_to_that_user(secured: str, sqlite_url: str) -> None:
    with logstore.open(sqlite_url, shards=SHARDS) as store:
        store.put_cells([(uuid.uuid4(), "BASE", 1, {"n": n}) for n in range(20)])
        app = App("zk-app", store=store, zookeeper=secured, zookeeper_auth=f"{USER}:{PASSWORD}")
        app.trigger("BASE")(lambda cell: None)
        assert app.drain(timeout=60).processed == 20
    hosts, root = tailer_path(secured, "app.zk-app")
    with client(hosts, f"{USER}:{PASSWORD}") as authed:
        assert authed.get_acls(f"{root}/offsets")[0] == [make_digest_acl(USER, PASSWORD, all=True)]
        assert len(authed.get_children(f"{root}/offsets")) == SHARDS
    with client(hosts) as anonymous, pytest.raises(NoAuthError):
        anonymous.get_children(f"{root}/offsets")
