"""The shard map as the instance's own live state: its storage nodes and where its shards are, versioned.

Every storage node that can give and take shards keeps a copy of each version (``cellstream_map``). A process
opens with the cluster file (or URL) that names where to connect, reads the newest version any node holds, and
connects to the nodes it names that the file does not (``cellstream nodes add``). Version 0 is the cluster
file itself: an instance whose map never changed records nothing.

Where a shard is comes from two records: the version's placement (each shard's node when the version was
written) and, since then, the shard moves each node records (``moved_to``, :mod:`logstore.backends.mysql.moves`),
followed from node to node. A placement read before a move still leads to the shard's node through its move
record, so a version need not be written for a move, only when nodes change.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from logstore.config import ClusterConfig, NodeConfig
from logstore.errors import ConfigurationError
from logstore.registry import url_password, with_password, without_password

NodeState = Literal["active", "draining", "removed"]
Range = tuple[int, int, str]  # first shard, last shard, node


class MapNode(BaseModel):
    """A storage node as the map records it: where to connect (never a password: a node's password comes from
    the cluster file, ``password_env`` or ``password_file`` of each process), its home range and its state."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    url: str
    replicas: list[str] = Field(default_factory=list)
    password_env: str | None = None
    password_file: str | None = None
    home: str | None = None  # the range it was created with; None: it joined a running instance
    state: NodeState = "active"  # draining: its shards are moving away; removed: it holds nothing, not used
    fenced: list[str] = Field(default_factory=list)  # its former primaries (a replica promoted): never opened

    @property
    def where(self) -> tuple[str, tuple[str, ...]]:
        """Its primary's and replicas' URLs (without passwords): what a process connects to."""
        return self.url, tuple(self.replicas)

    def config_over(self, file_node: NodeConfig | None) -> NodeConfig:
        """How a process opens the node: the cluster file's entry (``file_node``) while the map names the same
        URLs; once they differ (a replica promoted), the map's URLs with the passwords the file gives them
        (a replica's own, else the primary's, else its password_env or password_file); the map's entry alone
        for a node the file does not name.

        Raises:
            ConfigurationError: the entry does not make a valid node here.
        """
        if file_node is None:
            return self.config()
        if where_of(file_node) == self.where:
            return file_node
        known = {without_password(u): u for u in (file_node.url, *file_node.replicas)}
        password = url_password(file_node.url)

        def full(url: str) -> str:
            return known.get(url) or (with_password(url, password) if password else url)
        return file_node.model_copy(update={"url": full(self.url), "replicas": [full(u) for u in self.replicas]})

    def config(self) -> NodeConfig:
        """The node as the cluster file would give it (its password read from where the entry says).

        Raises:
            ConfigurationError: the entry does not make a valid node here (e.g. its password_env is unset).
        """
        try:
            return NodeConfig(name=self.name, url=self.url, shards=self.home, replicas=self.replicas,
                              password_env=self.password_env, password_file=self.password_file)
        except ValidationError as exc:
            first = exc.errors()[0]
            raise ConfigurationError(f"storage node {self.name} of the shard map: "
                                     f"{'.'.join(map(str, first['loc'])) or 'node'}: {first['msg']}") from None

    @classmethod
    def of(cls, node: NodeConfig) -> MapNode:
        """The map's entry for a node of the cluster file (passwords left out)."""
        return cls(name=node.name, url=without_password(node.url),
                   replicas=[without_password(u) for u in node.replicas], password_env=node.password_env,
                   password_file=str(node.password_file) if node.password_file is not None else None,
                   home=node.shards)


def where_of(node: NodeConfig) -> tuple[str, tuple[str, ...]]:
    """A cluster file node's primary and replica URLs, without passwords (:attr:`MapNode.where`)."""
    return without_password(node.url), tuple(without_password(u) for u in node.replicas)


class ShardMapDoc(BaseModel):
    """One version of the shard map."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: int = Field(ge=0)
    nodes: list[MapNode]
    placement: list[Range] | None = None  # None: the nodes' home ranges

    def node(self, name: str) -> MapNode | None:
        return next((n for n in self.nodes if n.name == name), None)

    @property
    def live(self) -> list[MapNode]:
        """The nodes in use (not removed), by name."""
        return sorted((n for n in self.nodes if n.state != "removed"), key=lambda n: n.name)

    def base(self, shards: int) -> list[str]:
        """Each shard's node by this version (before the moves recorded since)."""
        out = [""] * shards
        ranges = self.placement if self.placement is not None else [
            (*_range(n.home), n.name) for n in self.nodes if n.home is not None]
        for first, last, name in ranges:
            out[first:last + 1] = [name] * (last - first + 1)
        return out

    def to_json(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_json(cls, text: str | bytes) -> ShardMapDoc:
        """Raises ConfigurationError when a node holds a map this version of cellstream cannot read."""
        try:
            return cls.model_validate_json(text)
        except ValidationError as exc:
            raise ConfigurationError(f"the shard map recorded on the nodes cannot be read: {exc.errors()[0]['msg']}"
                                     " (written by a newer cellstream?)") from None


def _range(home: str) -> tuple[int, int]:
    first, last = home.split("-")
    return int(first), int(last)


def seed(cluster: ClusterConfig) -> ShardMapDoc:
    """Version 0: the cluster file's nodes and home ranges."""
    return ShardMapDoc(version=0, nodes=[MapNode.of(n) for n in cluster.nodes])


def ranges(node_of: Sequence[str]) -> list[Range]:
    """Each shard's node, as runs of consecutive shards on one node."""
    out: list[Range] = []
    for shard, name in enumerate(node_of):
        if out and out[-1][2] == name and out[-1][1] == shard - 1:
            out[-1] = (out[-1][0], shard, name)
        else:
            out.append((shard, shard, name))
    return out
