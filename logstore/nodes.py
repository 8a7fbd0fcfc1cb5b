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
            health += "".join(f"; former primary {_shown(url)} answers: its writes are refused (fenced)"
                              for url in _fence_returned(store, entry, recorder))
        out.append(NodeInfo(entry.name, entry.state, _shown(entry.url), [_shown(u) for u in entry.replicas],
                            len(shards), sum(counts.get(s, 0) for s in shards), size, health))
    return out


def _fence_returned(store: Store, entry: MapNode, recorder: NodeRecorder) -> list[str]:
    """The former primaries of ``entry`` (a replica promoted) that answer again, each fenced now."""
    from logstore.backends.mysql.promotion import fence_former
    from logstore.backends.mysql.recorder import MySQLRecorder
    from logstore.backends.mysql.target import MySQLTarget

    if not entry.fenced or not isinstance(recorder, MySQLRecorder):
        return []
    out = []
    for url in entry.fenced:
        try:
            target = store.node_config(entry.model_copy(update={"url": url, "replicas": []})).target
        except ConfigurationError:
            continue
        if isinstance(target, MySQLTarget) and fence_former(recorder, target, entry.name):
            out.append(url)
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


class Promotion(NamedTuple):
    """What ``cellstream nodes promote`` did."""

    node: str
    primary: str  # the new primary (a URL without its password)
    former: str  # the former primary, fenced in the map
    former_fenced: bool  # it answered, and refuses writes now (else: fenced if it ever answers to `nodes list`)
    burnt_shards: int  # shards whose next ids skip ``burn`` ids
    burn: int
    restored: int  # acknowledged cells the replica lacked, written from their durable copies with their ids
    replayed: int  # cells buffered for the node while its primary was down, written to the new one


def _match(entry: MapNode, replica: str) -> str:
    """The map's URL of ``entry``'s replica (or primary) named ``replica`` (its URL, or host:port)."""
    from logstore.registry import parse_node_url

    for url in [*entry.replicas, entry.url]:
        target = parse_node_url(url)
        if replica in (url, _shown(url), f"{getattr(target, 'host', '')}:{getattr(target, 'port', '')}"):
            return url
    known = ", ".join(_shown(u) for u in entry.replicas) or "none"
    raise InvalidArgumentError(f"node {entry.name} has no replica {replica!r} (its replicas: {known})")


def _restore_copies(store: Store, name: str, config: NodeConfig) -> int:
    """The durable copies the promoted replica lacks, written into it on a recorder of its own."""
    from logstore.durable import restore_copies
    from logstore.opening import open_recorder

    recorder = open_recorder(config, store.options)
    try:
        return restore_copies(store, name, recorder)
    finally:
        recorder.close()


def promote_node(store: Store, name: str, replica: str, *, wait: float = 60.0, burn: int | None = None) -> Promotion:
    """Make a replica of node ``name`` its primary (:mod:`logstore.backends.mysql.promotion`): it applies what it
    received, stops replicating and takes writes; its shards' next ids skip ``burn`` ids; a new map version
    names it the node's primary and fences the former one, which every process follows at its next refresh
    (and at once on a write refused by the former one); the durable copies of acknowledged cells it lacks
    (durable buffered writes) are written to it with their ids, and the cells buffered for the node go to it.

    Args:
        name: the node.
        replica: its replica to promote: the URL as ``nodes list`` shows it, or ``host:port``.
        wait: seconds the replica may take to apply what it received.
        burn: ids skipped per shard (default :data:`~logstore.backends.mysql.promotion.BURN`).

    Raises:
        ConfigurationError: a single-node store, or a node that is not MySQL/MariaDB.
        InvalidArgumentError: no such node, or no such replica of it.
        PromotionError: the replica cannot apply what it received, or not within ``wait``.
        StorageUnavailableError: the replica does not answer.
    """
    from logstore.backends.mysql.promotion import BURN, fence_former, make_primary
    from logstore.backends.mysql.recorder import MySQLRecorder
    from logstore.backends.mysql.target import MySQLTarget
    _check_grows(store)
    store.refresh_map()
    entry = _live(store.shard_map, name)
    url = _match(entry, replica)
    if url == entry.url:  # promoted already (the command run again)
        return Promotion(name, _shown(url), _shown(entry.fenced[-1]) if entry.fenced else "", False, 0, 0, 0, 0)
    recorder = store.node_recorder(name)
    if not isinstance(recorder, MySQLRecorder):
        raise ConfigurationError(f"node {name} is not open here as a MySQL/MariaDB node: it cannot be promoted")
    promoted = entry.model_copy(update={"url": url, "replicas": [u for u in entry.replicas if u != url],
                                        "fenced": [*entry.fenced, entry.url]})
    config = store.node_config(promoted)
    new, former = config.target, store.node_config(entry).target
    if not isinstance(new, MySQLTarget) or not isinstance(former, MySQLTarget):
        raise ConfigurationError(f"node {name} is not a MySQL/MariaDB node: it cannot be promoted")
    burn = BURN if burn is None else burn
    if burn < 0:
        raise InvalidArgumentError(f"burn must be 0 or more ids, got {burn}")
    burnt = make_primary(recorder, new, wait=wait, burn=burn)
    # Nothing writes to it before the copies are in: no process has it as the node's primary yet.
    restored = _restore_copies(store, name, config)
    store.reopen_node(name, config)

    def change(doc: ShardMapDoc, placement: list[str]) -> ShardMapDoc:
        now = _live(doc, name)
        if now.url == url:
            return doc  # promoted already (this command run again)
        done = now.model_copy(update={"url": url, "replicas": [u for u in now.replicas if u != url],
                                      "fenced": [*now.fenced, now.url]})
        return doc.model_copy(update={"nodes": [done if n.name == name else n for n in doc.nodes]})

    store.publish_map(change)
    fenced = fence_former(recorder, former, name)
    replayed = store.replay_pending().replayed if store.buffers_writes else 0
    logger.warning("node %s promoted: primary %s (was %s)", name, _shown(url), _shown(entry.url))
    return Promotion(name, _shown(url), _shown(entry.url), fenced, burnt, burn, restored, replayed)
