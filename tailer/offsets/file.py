"""Offsets kept in a standalone tailer's offsets file (``tail --offsets PATH``): JSON, replaced atomically.
The running tailer holds an exclusive lock on ``PATH.lock``; a reset takes the same lock, so it is refused
while the tailer runs (naming the process, found in ``/proc/locks``) and a tailer cannot start during it."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from logstore import Store
from logstore.files import private_opener
from tailer.coordinators.local import published_path, read_offsets
from tailer.errors import ConsumerNotFoundError, ConsumerRunningError
from tailer.offsets.history import new_reset_id
from tailer.offsets.places import ConsumerPositions, ResetPlan, ShardOffsetsPlace, shard_rows


class FileOffsets(ShardOffsetsPlace):
    """The one consumer of an offsets file, named by the file's path."""

    kind = "file"

    def __init__(self, store: Store, path: str | os.PathLike[str]) -> None:
        self.store = store
        self.path = Path(path)
        self.where = str(self.path)
        self._lock_path = self.path.with_name(self.path.name + ".lock")

    def consumers(self) -> list[str]:
        return [str(self.path)] if self.path.exists() else []

    def _offsets(self, name: str) -> dict[int, dict[str, Any]]:
        if name != str(self.path) or not self.path.exists():
            raise ConsumerNotFoundError(f"no offsets file at {self.path}" if name == str(self.path) else
                                        f"the offsets file {self.path} holds one consumer, named by its path")
        return {int(shard): doc for shard, doc in read_offsets(self.path).items()}

    def holders(self) -> list[str]:
        """The processes holding the file's lock (a running standalone tailer)."""
        try:
            inode = os.stat(self._lock_path).st_ino
        except FileNotFoundError:
            return []
        out = []
        with contextlib.suppress(OSError), open("/proc/locks") as locks:
            for line in locks:
                parts = line.split()
                # "1: FLOCK  ADVISORY  WRITE 12345 08:01:1234567 0 EOF"; a blocked waiter's line has "->".
                if len(parts) >= 6 and parts[1] == "FLOCK" and "->" not in parts \
                        and parts[5].rsplit(":", 1)[-1] == str(inode):
                    out.append(f"pid {parts[4]} ({_command(parts[4])})")
        return out

    def positions(self, name: str) -> ConsumerPositions:
        offsets = self._offsets(name)
        holders = self.holders()
        published: dict[int, int] = {}
        if holders:  # a report left by a tailer that has stopped is stale: its offsets say where it stopped
            with contextlib.suppress(OSError, ValueError):
                published = {int(s): int(at) for s, at in json.loads(published_path(self.path).read_text()).items()}
        rows = shard_rows(self.store, {
            shard: (offsets[shard].get("location"), "standalone", published.get(shard)) if shard in offsets
            else (None, None, published.get(shard)) for shard in range(self.store.shard_count)})
        return ConsumerPositions(name, self.kind, self.where, rows, holders)

    @contextlib.contextmanager
    def _locked(self, name: str) -> Iterator[None]:
        with open(self._lock_path, "wb", opener=private_opener) as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holders = self.holders()
                raise ConsumerRunningError(f"{name} is held by a running tailer ({', '.join(holders) or 'a process'}"
                                           f" holds {self._lock_path}): stop it, then reset its offsets",
                                           holders) from None
            yield

    def execute(self, plan: ResetPlan) -> ResetPlan:
        reset_id = new_reset_id()
        with self._locked(plan.name):
            offsets = {str(shard): doc for shard, doc in self._offsets(plan.name).items()}
            for key, _before, after in plan.changes:
                doc = offsets.get(key, {})
                offsets[key] = {**doc, "location": after, "version": int(doc.get("version", 0)) + 1,
                                "reset": reset_id}
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.unlink(missing_ok=True)
            with open(tmp, "w", opener=private_opener) as fh:
                fh.write(json.dumps({"shards": offsets}, separators=(",", ":")))
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)
        plan.reset_id = reset_id
        return plan


def _command(pid: str, width: int = 80) -> str:
    """The process's command line, cut after a whole word within ``width`` characters."""
    try:
        line = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"
    return line if len(line) <= width else line[:width].rsplit(" ", 1)[0] + " ..."
