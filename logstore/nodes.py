"""Storage nodes joining and leaving a running instance (``cellstream nodes``): Citus's ``citus_add_node`` and
``citus_remove_node`` over the shard map (:mod:`logstore.shard_map`).

A node joins empty and takes shards only by moves (a rebalance); it leaves only once it holds nothing: every
shard moved away and the source copies dropped. Each change is a new version of the map, which every process
follows at its next refresh (``map_refresh``, 5 s by default) without a restart.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from logstore.config import NodeConfig
from logstore.errors import ConfigurationError, InvalidArgumentError, StorageUnavailableError
from logstore.persistence import NodeMeta, NodeRecorder
from logstore.registry import url_password
from logstore.shard_map import MapNode, NodeState, ShardMapDoc
from logstore.store import Store

logger = logging.getLogger(__name__)


class NodeInfo(NamedTuple):
    """A storage node as ``cellstream nodes list`` shows it."""

    name: str
    state: NodeState
    url: str  # without its password
    replicas: list[str]
    shards: int  # the shards the map places on it now
    cells: int  # cells of those shards
    bytes: int | None  # its tables on disk (source copies of moved shards too), None when it does not answer
    health: str  # "ok", or why it does not answer


def _check_grows(store: Store) -> None:
    if not any(r.supports_moves for r in map(store.node_recorder, store.nodes) if r is not None):
        raise ConfigurationError("this store is a single-node one (SQLite is embedded, a worker node serves "
                                 "another store): storage nodes join a MySQL/MariaDB instance only")


def list_nodes(store: Store) -> list[NodeInfo]:
    """Every node of the shard map (removed ones left out), with what it holds now.

    Raises:
        StorageError: the store is closed.
    """
    store.refresh_map()
    counts = store.cell_counts()
    placement = store.placement()
    out = []
    for entry in store.shard_map.live:
        recorder = store.node_recorder(entry.name)
        shards = [s for s, name in enumerate(placement) if name == entry.name]
        size: int | None = None
        health = "not open in this process (see its log)"
        if recorder is not None:
            try:
                size = recorder.stored_bytes()
                health = "ok"
            except StorageUnavailableError as exc:
                health = str(exc)
        out.append(NodeInfo(entry.name, entry.state, _shown(entry.url), [_shown(u) for u in entry.replicas],
                            len(shards), sum(counts.get(s, 0) for s in shards), size, health))
    return out


def _shown(url: str) -> str:
    from logstore.registry import parse_node_url

    try:
        return parse_node_url(url).redacted()
    except InvalidArgumentError:
        return "(an unreadable URL)"


def add_node(store: Store, name: str, url: str, *, replicas: list[str] | None = None,
             password_env: str | None = None, password_file: str | None = None) -> MapNode:
    """Make an empty storage node part of the running instance: its schema created, then a new map version
    naming it. Adding a node the map names already, at the same URL, changes nothing.

    Args:
        name: the node's name (letters, digits, ``_.-``).
        url: where it is, a ``mysql://`` URL without a password (the map, kept on every node, holds no secret).
        replicas: URLs of its replicas, read when it does not answer.
        password_env / password_file: where every process finds its password.

    Returns:
        The node as the map records it.

    Raises:
        ConfigurationError: a single-node store; a database that holds cells or another instance's node.
        InvalidArgumentError: a URL holding a password, a bad name or URL, a name taken by another node.
        StorageUnavailableError: the node or the map's first node does not answer.
    """
    _check_grows(store)
    if any(url_password(u) is not None for u in (url, *(replicas or []))):
        raise InvalidArgumentError("the node's URL holds a password: give it with --password-env or "
                                   "--password-file (the shard map, kept on every node, records no secret)")
    try:
        entry = MapNode(name=name, url=url, replicas=replicas or [], password_env=password_env,
                        password_file=password_file)
    except ValueError as exc:
        raise InvalidArgumentError(f"node {name!r}: {exc}") from None
    try:
        config = entry.config()
    except ConfigurationError as exc:
        raise InvalidArgumentError(str(exc)) from None
    store.refresh_map()
    known = store.shard_map.node(name)
    if known is not None and known.state != "removed":
        if known.url == url:
            return known
        raise InvalidArgumentError(f"a storage node named {name} is in the instance already, at another URL")
    _prepare(store, config)

    def change(doc: ShardMapDoc, placement: list[str]) -> ShardMapDoc:
        if (other := doc.node(name)) is not None and other.state != "removed":
            raise InvalidArgumentError(f"a storage node named {name} joined meanwhile")
        return doc.model_copy(update={"nodes": [*(n for n in doc.nodes if n.name != name), entry]})

    store.publish_map(change)
    logger.info("storage node %s added at %s", name, config.target.redacted())
    return entry


def _prepare(store: Store, config: NodeConfig) -> None:
    """Create the joining node's schema after checking that it holds nothing of any instance."""
    from logstore.opening import open_recorder

    recorder: NodeRecorder = open_recorder(config, store.options)
    try:
        if not recorder.supports_moves:
            raise ConfigurationError(f"node {config.name}: shards move only between MySQL/MariaDB nodes")
        meta = recorder.read_meta()
        joined = NodeMeta(store.shard_count, 0, -1)
        if meta is not None and meta != joined:
            raise ConfigurationError(f"{config.target.redacted()} is a storage node created with shards "
                                     f"{meta.first}-{meta.last} of {meta.shard_count}: add an empty database")
        if meta is not None and _holds_cells(recorder):
            raise ConfigurationError(f"{config.target.redacted()} holds cells: add an empty database")
        recorder.initialize(joined)
    finally:
        recorder.close()


def _holds_cells(recorder: NodeRecorder) -> bool:
    from logstore.backends.mysql.recorder import MySQLRecorder

    if not isinstance(recorder, MySQLRecorder):
        return False
    return bool(recorder.run("check cells", lambda cur: cur.execute("SELECT 1 FROM cells LIMIT 1")))


def set_state(store: Store, name: str, state: NodeState) -> MapNode:
    """Mark a node draining (a rebalance moves its shards away and none to it) or active again.

    Raises:
        InvalidArgumentError: no such node in the map.
    """
    _check_grows(store)

    def change(doc: ShardMapDoc, placement: list[str]) -> ShardMapDoc:
        entry = _live(doc, name)
        return doc.model_copy(update={"nodes": [n.model_copy(update={"state": state}) if n is entry else n
                                                for n in doc.nodes]})

    store.refresh_map()
    if _live(store.shard_map, name).state == state:
        return _live(store.shard_map, name)
    return _live(store.publish_map(change), name)


def remove_node(store: Store, name: str) -> MapNode:
    """Take a node that holds nothing out of the instance: no shard placed on it, no copy of a moved shard
    left on it (``cellstream shards drop-moved``). Its database is left as it is, for the operator to drop.

    Raises:
        InvalidArgumentError: no such node in the map; the last node.
        ConfigurationError: it holds shards or cells.
        StorageUnavailableError: it does not answer (what it holds cannot be checked).
    """
    _check_grows(store)
    store.refresh_map()
    entry = _live(store.shard_map, name)
    if len(store.shard_map.live) == 1:
        raise InvalidArgumentError(f"node {name} is the instance's last storage node")
    if held := [s for s, node in enumerate(store.placement()) if node == name]:
        raise ConfigurationError(f"node {name} holds {len(held)} shards: move them away first "
                                 f"(cellstream nodes drain {name})")
    recorder = store.node_recorder(name)
    if recorder is None:
        raise StorageUnavailableError(f"node {name} is not open in this process: what it holds cannot be checked")
    if _holds_cells(recorder):
        raise ConfigurationError(f"node {name} still holds the cells of shards moved away: drop them first "
                                 f"(`cellstream nodes drain {name}` ends by dropping them)")

    def change(doc: ShardMapDoc, placement: list[str]) -> ShardMapDoc:
        _live(doc, name)
        return doc.model_copy(update={"nodes": [n.model_copy(update={"state": "removed"}) if n.name == name else n
                                                for n in doc.nodes]})

    store.publish_map(change)
    logger.info("storage node %s removed from the instance", name)
    return entry.model_copy(update={"state": "removed"})


def _live(doc: ShardMapDoc, name: str) -> MapNode:
    entry = doc.node(name)
    if entry is None or entry.state == "removed":
        names = ", ".join(n.name for n in doc.live)
        raise InvalidArgumentError(f"no storage node {name!r} in the instance (nodes: {names})")
    return entry
