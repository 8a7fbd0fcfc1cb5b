"""``cellstream migrate diff``: the source table against the cells, row by row ("validation, validation,
validation").

The cells' side is read first: the latest cell of every (row, column) of the migration's columns, from one scan
of the store's logs. Then the source is read in key chunks and each row's cells are compared with what it maps
to. A row is *missing* when a cell column has no cell or a tombstone, *different* when a body differs (the
fields are named), and *extra* when the store holds a live row the source does not. A row the source changed
after the cells were read can show as different: run it with the change lag at 0, or run it again.

A *sampled* diff (``--sample 0.01``) compares about that share of the rows in chunks drawn at random, and reads
each compared row's cells by point reads: a check cheap enough to run on a busy source while the migration goes
on (pt-table-checksum's spirit), which finds a steady drift but not every row.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Callable
from typing import Any, NamedTuple

from connectors.migration.mapping import RowMapper, tombstone
from connectors.migration.source import Chunk, Key, MigrationSource
from connectors.migration.spec import MigrationSpec
from logstore import Store
from logstore.cell import is_tombstone
from logstore.errors import CorruptCellError, InvalidArgumentError
from logstore.jobs import Throttle, ThrottleSettings

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
         progress: Callable[[int], None] | None = None, repair: bool = False, sample: float | None = None,
         rate: float | None = None, seed: int | None = None) -> DiffReport:
    """Compare the source table with the cells of ``spec``; with ``repair``, also write what makes the cells
    match (``cellstream migrate repair``): a missing or different row's cells as the source holds it, at the
    chunk's position (a version one above the newest stored, when versioned by a column), and a tombstone for an
    extra row above its newest cell. A row whose newest cell is above the chunk's position changed after the
    chunk was read: the cells are ahead of that read, and the row is counted as ``ahead``, not compared nor
    rewritten (run the diff again to compare it).

    Args:
        sample: compare about that share of the rows (0 < sample <= 1), in chunks drawn at random: read from
            random points of the key when it is one integer column (:meth:`MigrationSource.key_span`), else
            chosen while stepping over the others by their keys alone (:meth:`MigrationSource.skip_keys`). Each
            compared row's cells are read by point reads instead of a scan of the store. Extra rows are looked
            for only without a sample.
        rate: source rows compared a second at most (the jobs' token bucket; None: no limit).
        seed: the seed of the sample's draw (None: random).

    Returns:
        What differed (before the repair, when repairing).

    Raises:
        MigrationSourceError: the source cannot be read (retriable when unavailable). ConversionError: a source
        row has no cells' form. CorruptCellError: a cell cannot be read. StorageUnavailableError: a repair's
        write did not reach the store (retriable: run it again).
    """
    if sample is not None and not 0 < sample <= 1:
        raise InvalidArgumentError(f"a diff's sample is a share of the rows, 0 < sample <= 1, not {sample}")
    mapper = RowMapper(spec)
    latest = latest_cells(store, list(spec.columns)) if sample is None else {}

    def newest(row_key: uuid.UUID, column: str) -> tuple[int, Any] | None:
        if sample is None:
            return latest.get((row_key, column))
        cell = store.get_cell_latest(row_key, column)
        return None if cell is None else (cell.ref_key, cell.body)

    draw = random.Random(seed)
    throttle = Throttle(ThrottleSettings(rate=rate))
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
    compared: set[Key] = set()  # a sample's probes may read a row twice: compared once
    rows, position = 0, 0

    def compare(chunk: Chunk) -> None:
        nonlocal rows, position
        position = max(position, chunk.position)
        fresh = [row for row in chunk.rows if row.key not in compared]
        if sample is not None:
            compared.update(row.key for row in fresh)
        for row in fresh:
            for cell in mapper.cells(row, chunk.position):
                seen.add(cell.row_key)
                found = newest(cell.row_key, cell.column)
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
        rows += len(fresh)
        if progress is not None:
            progress(rows)
        throttle.wait(len(fresh))

    span = source.key_span() if sample is not None else None
    if sample is not None and span is not None:
        # Probes: chunks read from random points of an integer key, a range read of the key's index each, so
        # the source does the sample's work and no more (stepping over the rest reads its whole index).
        low, high, estimate = span
        for start in sorted(draw.randint(low, high) for _ in range(max(1, round(estimate * sample / chunk_rows)))):
            compare(source.read_chunk((start - 1,), chunk_rows))
    else:
        after: Key | None = None
        while True:
            if sample is not None and draw.random() >= sample:
                after = source.skip_keys(after, chunk_rows)
                if after is None:
                    break
                continue
            chunk = source.read_chunk(after, chunk_rows)
            compare(chunk)
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
