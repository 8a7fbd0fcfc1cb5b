"""``cellstream migrate diff``: the source table against the cells, row by row ("validation, validation,
validation").

The cells' side is read first: the latest cell of every (row, column) of the migration's columns, from one scan
of the store's logs. Then the source is read in key chunks and each row's cells are compared with what it maps
to. A row is *missing* when a cell column has no cell or a tombstone, *different* when a body differs (the
fields are named), and *extra* when the store holds a live row the source does not. A row the source changed
after the cells were read can show as different: run it with the change lag at 0, or run it again.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any, NamedTuple

from connectors.migration.mapping import RowMapper, is_tombstone, tombstone
from connectors.migration.source import Key, MigrationSource
from connectors.migration.spec import MigrationSpec
from logstore import Store
from logstore.errors import CorruptCellError

LISTED = 100  # differences listed in a report; all are counted


class Difference(NamedTuple):
    """A row that differs: its source key (None for an extra row), its row key, the cell column, and the
    fields whose values differ (empty for a missing or extra row)."""

    key: Key | None
    row_key: uuid.UUID
    column: str
    fields: list[str]


class DiffReport(NamedTuple):
    rows: int  # source rows compared
    missing: int
    different: int
    extra: int
    listed: list[tuple[str, Difference]]  # the first LISTED, each with its kind
    ahead: int = 0  # cells newer than the source's read of their row (changed meanwhile): not compared

    @property
    def clean(self) -> bool:
        return not (self.missing or self.different or self.extra)


def latest_cells(store: Store, columns: list[str], page: int = 5000) -> dict[tuple[uuid.UUID, str], tuple[int, Any]]:
    """The latest (ref_key, body) of every (row key, column) of ``columns`` in the store, from one pass over
    every shard's log.

    Raises:
        CorruptCellError: a cell of those columns cannot be read.
    """
    latest: dict[tuple[uuid.UUID, str], tuple[int, Any]] = {}
    todo = dict.fromkeys(range(store.shard_count), 0)
    while todo:
        pages = store.get_cells_for_shards(todo, page, columns=columns)
        for shard, cells in pages.items():
            if isinstance(cells, CorruptCellError):
                raise cells
            for cell in cells:
                at = (cell.row_key, cell.column)
                if cell.ref_key >= latest.get(at, (-1, None))[0]:
                    latest[at] = (cell.ref_key, cell.body)
            if len(cells) < page:
                del todo[shard]
            else:
                todo[shard] = cells[-1].added_id
    return latest


def diff(spec: MigrationSpec, source: MigrationSource, store: Store, *, chunk_rows: int = 1000,
         progress: Callable[[int], None] | None = None, repair: bool = False) -> DiffReport:
    """Compare the source table with the cells of ``spec``; with ``repair``, also write what makes the cells
    match (``cellstream migrate repair``): a missing or different row's cells as the source holds it, at the
    chunk's position (a version one above the newest stored, when versioned by a column), and a tombstone for an
    extra row above its newest cell. A row whose newest cell is above the chunk's position changed after the
    chunk was read: the cells are ahead of that read, and the row is counted as ``ahead``, not compared nor
    rewritten (run the diff again to compare it).

    Returns:
        What differed (before the repair, when repairing).

    Raises:
        MigrationSourceError: the source cannot be read (retriable when unavailable). ConversionError: a source
        row has no cells' form. CorruptCellError: a cell cannot be read. StorageUnavailableError: a repair's
        write did not reach the store (retriable: run it again).
    """
    mapper = RowMapper(spec)
    latest = latest_cells(store, list(spec.columns))
    listed: list[tuple[str, Difference]] = []
    counts = {"missing": 0, "different": 0, "extra": 0, "ahead": 0}
    fixes: list[tuple[uuid.UUID, str, int, dict[str, Any]]] = []

    def note(kind: str, difference: Difference) -> None:
        counts[kind] += 1
        if len(listed) < LISTED:
            listed.append((kind, difference))

    def write() -> None:
        if fixes:
            store.put_cells(fixes)
            fixes.clear()

    seen: set[uuid.UUID] = set()
    rows, after, position = 0, None, 0
    while True:
        chunk = source.read_chunk(after, chunk_rows)
        position = max(position, chunk.position)
        for row in chunk.rows:
            for cell in mapper.cells(row, chunk.position):
                seen.add(cell.row_key)
                found = latest.get((cell.row_key, cell.column))
                if found is not None and mapper.versioned_by_position and found[0] > chunk.position:
                    counts["ahead"] += 1  # changed after this read, and the cells have it
                    continue
                if found is None or is_tombstone(found[1]):
                    note("missing", Difference(row.key, cell.row_key, cell.column, []))
                elif found[1] != cell.body:
                    stored = found[1]
                    fields = sorted(k for k in cell.body.keys() | stored.keys() if cell.body.get(k) != stored.get(k))
                    note("different", Difference(row.key, cell.row_key, cell.column, fields))
                else:
                    continue
                ref_key = cell.ref_key if found is None or cell.ref_key > found[0] else found[0] + 1
                fixes.append((cell.row_key, cell.column, ref_key, cell.body))
        if repair:
            write()
        else:
            fixes.clear()
        rows += len(chunk.rows)
        if progress is not None:
            progress(rows)
        if chunk.last is None or len(chunk.rows) < chunk_rows:
            break
        after = chunk.last
    for (row_key, column), (ref_key, body) in latest.items():
        if row_key not in seen and not is_tombstone(body):
            note("extra", Difference(None, row_key, column, []))
            fixes.append((row_key, column, max(ref_key + 1, position), tombstone(None)))
    if repair:
        write()
    return DiffReport(rows, counts["missing"], counts["different"], counts["extra"], listed, counts["ahead"])
