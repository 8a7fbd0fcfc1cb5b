"""The app of the growing-store test (tests/logstore/test_grow_end_to_end.py), a direct-mode app run as its own
process by ``cellstream run tests/harness/grow_app.py:app`` while the store's shards move under it.

Its name is ``GROW_NAME`` (its offsets are the consumer ``app.<name>``'s). It keeps the index of ``GROW_INDEX``
(a YAML file) and appends ``shard added_id`` to the file ``GROW_LOG`` for
every cell of column BASE it handles (a line, flushed, before the handler returns: what it handled survives
its stop). Its store is the cluster file ``GROW_STORE``, opened with the default options, as any app's is.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from indexer import App
from logstore import Cell

app = App(os.environ["GROW_NAME"], store=os.environ["GROW_STORE"], commit_interval=0.2)
app.index(Path(os.environ["GROW_INDEX"]))
_log = Path(os.environ["GROW_LOG"])
_lock = threading.Lock()


@app.trigger("BASE")
def record(cell: Cell) -> None:
    """Note the cell as handled."""
    with _lock, open(_log, "a") as fh:
        fh.write(f"{cell.shard} {cell.added_id}\n")
        fh.flush()
