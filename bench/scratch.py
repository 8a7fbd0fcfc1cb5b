"""A fresh MariaDB database, ZooKeeper chroot and Kafka topic prefix for one benchmark run, removed after."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import NamedTuple

import pymysql
from kazoo.client import KazooClient

from logstore.backends.mysql.target import MySQLTarget
from logstore.config import parse_node_url
from tailer.coordinators.zookeeper import tailer_path
from tests.harness.kafka_support import delete_topics


class Scratch(NamedTuple):
    url: str  # mysql://.../<database>
    zookeeper: str  # host:port/<chroot>
    prefix: str  # topic prefix


def drop_database(url: str) -> None:
    """Drop the database of a mysql:// URL, if it exists."""
    target = parse_node_url(url)
    if not isinstance(target, MySQLTarget):
        raise ValueError(f"not a mysql:// URL: {url}")
    conn = pymysql.connect(host=target.host, port=target.port, user=target.user, password=target.password)
    with conn.cursor() as cur:
        cur.execute(f"DROP DATABASE IF EXISTS `{target.database}`")
    conn.close()


@contextlib.contextmanager
def scratch_database(server: str, name: str) -> Iterator[str]:
    """The mysql:// URL of a database that does not exist yet (the store creates it), dropped on exit."""
    url = f"{server}/bench_{name}_{uuid.uuid4().hex[:8]}"
    try:
        yield url
    finally:
        drop_database(url)


@contextlib.contextmanager
def scratch(server: str, zookeeper: str, kafka: str, name: str) -> Iterator[Scratch]:
    """``server`` is a mysql:// URL without a database; everything made under ``name`` is dropped on exit."""
    tag = uuid.uuid4().hex[:8]
    database, chroot = f"bench_{name}_{tag}", f"/bench-{tag}"
    url = f"{server}/{database}"
    try:
        yield Scratch(url, zookeeper + chroot, f"bench{tag}")
    finally:
        drop_database(url)
        client = KazooClient(hosts=zookeeper)
        client.start(timeout=10)
        client.delete(chroot, recursive=True)
        client.stop()
        delete_topics(kafka, f"bench{tag}")


def wait_claimed(zk: str, name: str, shards: int, tailer: subprocess.Popen[bytes], timeout: float) -> None:
    """Until the tailer holds a claim (its ZooKeeper claims/<shard> node) on each of the ``shards`` shards:
    with thousands of shards, claiming and positioning them at their heads takes a while."""
    hosts, root = tailer_path(zk, name)
    client = KazooClient(hosts=hosts)
    client.start(timeout=10)
    try:
        deadline = time.monotonic() + timeout
        while not client.exists(f"{root}/claims") or len(client.get_children(f"{root}/claims")) < shards:
            assert time.monotonic() < deadline and tailer.poll() is None, "the tailer did not claim its shards"
            time.sleep(0.2)
    finally:
        client.stop()
        client.close()


@contextlib.contextmanager
def served(url: str) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """A worker node (`cellstream serve`, a process of its own) in front of the store at ``url``: its base URL
    and its process, stopped on exit."""
    node = subprocess.Popen([sys.executable, "-m", "cellstream", "serve", "--store", url, "--bind", "127.0.0.1:0",
                             "--json"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert node.stdout is not None
        yield json.loads(node.stdout.readline())["url"], node
    finally:
        node.terminate()
        node.wait(30)
