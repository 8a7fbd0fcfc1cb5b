""":func:`logstore.open`: a Store over the storage nodes of a URL or a cluster file, each node's recorder made by
its backend, found by the URL's scheme in :data:`logstore.registry.BACKENDS`."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from logstore.config import (
    DEFAULT_SHARDS,
    MAX_SHARDS,
    ClusterConfig,
    NodeConfig,
    StoreOptions,
    load_cluster_file,
    single_node,
)
from logstore.errors import (
    CellstreamError,
    ConfigurationError,
    InvalidArgumentError,
    StorageUnavailableError,
    StoreNotFoundError,
)
from logstore.extras import require
from logstore.persistence import NodeRecorder
from logstore.registry import BACKENDS, Backend, NodeTarget, backend_of, is_url, load, prefixes
from logstore.shard_map import ShardMapDoc
from logstore.store import Store, node_meta

logger = logging.getLogger(__name__)
FIRST_LOOK = 0.25  # seconds the open waits for each node of several before opening without it


def open(target: str | os.PathLike[str], shards: int | None = None, *,  # noqa: A001
         token: str | None = None, create: bool = True, **options: Any) -> Store:
    """Open a logstore instance, creating it when missing.

    Args:
        target: a store URL, ``sqlite:///dir``, ``mysql://user:pw@host:port/db`` or ``http://host:port`` (a
            worker node, ``cellstream serve``: the same API over HTTP), or the path of a cluster file.
        shards: the shard count, fixed when the instance is created (default 4096; when omitted, an existing
            instance's).
        token: a worker node's Bearer token (default: the CELLSTREAM_TOKEN environment variable).
        create: False to create nothing: a missing instance raises StoreNotFoundError (for commands that only
            read).
        **options: the fields of :class:`~logstore.config.StoreOptions`.

    Returns:
        The open Store, safe to share between threads; close it (or use it in a ``with``) when done.

    Raises:
        InvalidArgumentError: a bad option, shard count or URL (an unknown scheme: naming the known ones), or a
            token for a URL other than a worker node's.
        ConfigurationError: a cluster file that cannot be read or is invalid, or an instance created with
            another shard count or shard range.
        MissingExtraError: the backend's extra is not installed (e.g. ``cellstream[mysql]``).
        StoreNotFoundError: ``create=False`` and there is no instance.
        StorageUnavailableError: the store's only storage node does not answer.
    """
    try:
        opts = StoreOptions(**options)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise InvalidArgumentError(f"store option {'.'.join(map(str, first['loc']))}: {first['msg']}") from None
    if shards is not None and (type(shards) is not int or not 1 <= shards <= MAX_SHARDS):
        raise InvalidArgumentError(f"shards must be an integer in [1, {MAX_SHARDS}], got {shards!r}")
    text = os.fspath(target)
    recorders: dict[str, NodeRecorder] = {}
    try:
        cluster = _url_node(text, shards, token, opts, recorders) if is_url(text) else _cluster_nodes(
            text, shards, opts, recorders)
        _initialize(text, cluster, recorders, opts, create)
    except BaseException:
        for recorder in recorders.values():
            recorder.close()
        raise
    return Store(cluster, recorders, opts, connect=lambda node: _join(cluster, node, opts))


def _removed(cluster: ClusterConfig, recorders: dict[str, NodeRecorder]) -> set[str]:
    """The nodes of the cluster file that the newest shard map its nodes hold marks removed (``cellstream nodes
    remove``): not opened, their databases perhaps gone."""
    newest: tuple[int, str] | None = None
    for recorder in recorders.values():
        if not recorder.supports_moves:
            continue
        try:
            found = recorder.read_map()
        except CellstreamError:  # down, or not created yet: its map is read again once the store is open
            continue
        if found is not None and (newest is None or found[0] > newest[0]):
            newest = found
    if newest is None:
        return set()
    doc = ShardMapDoc.from_json(newest[1])
    return {n.name for n in doc.nodes if n.state == "removed" and n.name in recorders}


def open_recorder(node: NodeConfig, options: StoreOptions) -> NodeRecorder:
    """The recorder of a storage node (not initialized): for a node about to join (:mod:`logstore.nodes`)."""
    return _recorder(backend_of(node.url), node.name, node.target, options, replicas=node.replica_targets)


def _join(cluster: ClusterConfig, node: NodeConfig, options: StoreOptions) -> NodeRecorder:
    """A recorder of a node the shard map names (``cellstream nodes add``): opened and checked as the cluster
    file's nodes are, initialized later when it does not answer now."""
    recorder = open_recorder(node, options)
    meta = node_meta(cluster, node)
    try:
        recorder.initialize(meta, options.retry.model_copy(update={"deadline": options.buffer_after or 2.0}))
    except StorageUnavailableError as exc:
        logger.warning("storage node %s does not answer (%s); opening without it", node.name, exc)
        recorder.defer_initialize(meta)
    except BaseException:
        recorder.close()
        raise
    return recorder


def _url_node(url: str, shards: int | None, token: str | None, options: StoreOptions,
              recorders: dict[str, NodeRecorder]) -> ClusterConfig:
    """The one storage node of a store URL, its recorder put in ``recorders``."""
    backend = backend_of(url)
    target = backend.parse(url)
    if token is not None and not backend.token:
        holders = {b.what for b in BACKENDS.values() if b.token}
        raise InvalidArgumentError(f"a token is for {' or '.join(sorted(holders))}'s "
                                   f"{prefixes(lambda b: b.token)} URL only")
    recorder = recorders["node0"] = _recorder(backend, "node0", target, options, token=token)
    found = recorder.read_meta()
    return single_node(url, shards or (found.shard_count if found else DEFAULT_SHARDS))


def _cluster_nodes(path: str, shards: int | None, options: StoreOptions,
                   recorders: dict[str, NodeRecorder]) -> ClusterConfig:
    """The storage nodes of a cluster file, their recorders put in ``recorders``."""
    cluster = load_cluster_file(Path(path))
    if shards is not None and shards != cluster.shards:
        raise ConfigurationError(f"cluster file {path} gives {cluster.shards} shards, opened with {shards}")
    for node in cluster.nodes:
        recorders[node.name] = _recorder(backend_of(node.url), node.name, node.target, options,
                                         replicas=node.replica_targets)
    return cluster


def _recorder(backend: Backend, name: str, target: NodeTarget, options: StoreOptions, *, token: str | None = None,
              replicas: Sequence[NodeTarget] = ()) -> NodeRecorder:
    """The recorder of storage node ``name``, made by its backend; MissingExtraError before the backend's driver
    is imported when its extra is not installed."""
    if backend.extra is not None:
        require(backend.extra, backend.what)
    takes: dict[str, Any] = {}
    if backend.replicas:
        takes["replicas"] = replicas
    if backend.token:
        takes["token"] = token
    recorder: NodeRecorder = load(backend.recorder)(name, target, options, **takes)
    return recorder


def _initialize(text: str, cluster: ClusterConfig, recorders: dict[str, NodeRecorder], options: StoreOptions,
                create: bool) -> None:
    """Each node's schema and metadata created or checked (with ``create`` False: StoreNotFoundError where there
    is none). One node of several that does not answer soon is opened without: its writes are buffered on the
    others, its reads go to its replicas meanwhile; a store of one node must answer."""
    several = len(cluster.nodes) > 1
    # A short look: waiting longer made every command on a cluster with a node down wait for it, and bought
    # nothing: the node's first statement initializes it, under that statement's own policy
    # (a write still waits buffer_after before it is buffered).
    soon = options.retry.model_copy(update={"deadline": min(FIRST_LOOK, options.buffer_after or 2.0)}) \
        if several else None
    removed = _removed(cluster, recorders) if several else set()
    if removed and removed >= set(recorders):
        raise ConfigurationError(f"every storage node of {text} was removed from the instance: name one in use "
                                 "(`cellstream nodes list`)")
    for name in removed:  # the file records where the instance started; the shard map, what it is now
        recorders.pop(name).close()
    for node in cluster.nodes:
        if node.name in removed:
            continue
        recorder, meta = recorders[node.name], node_meta(cluster, node)
        try:
            if not create and recorder.read_meta(soon) is None:
                where = node.target.redacted()
                if not is_url(text):
                    where = f"storage node {node.name} ({where}) of cluster file {text}"
                raise StoreNotFoundError(f"no store at {where} (create one with `cellstream init`)")
            recorder.initialize(meta, soon)
        except StorageUnavailableError as exc:
            if not several:
                raise
            logger.warning("storage node %s does not answer (%s); opening without it", node.name, exc)
            recorder.defer_initialize(meta)
