"""The results store's writer: rows and failure records buffered, committed as shards behind the run by one
:class:`~dynabatch._background.Worker` as :data:`COMMIT` says, small shards merged. A shard that cannot be written
stops the commits: its rows are kept, the error raised at the next call, and a later ``close()`` tries again.

Example:
    >>> from dynabatch.inference.store_writer import COMMIT
    >>> COMMIT.first_seconds, COMMIT.seconds, COMMIT.compact
    (2.0, 10.0, 16)
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import namedtuple
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from dynabatch._background import Worker
from dynabatch._malloc import trim
from dynabatch._validation import bad_value
from dynabatch.inference.store_shards import (FAILED, merged_name, merging_name, read_whole, remove, rename, shard_name,
                                              write_whole)

__all__ = ["COMMIT", "NONE_ROW", "CommitPolicy", "StoreWriter"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CommitPolicy:
    """When a writer commits its rows as a shard, and when it merges its small shards.

    Attributes:
        rows: a shard is committed once a writer holds this many rows,
        bytes: or this many bytes of Arrow data (the buffer and its Parquet encoding stay small),
        first_seconds: or, for a writer's first shard, rows that finished this long ago,
        seconds: and for the later ones this long ago;
        compact: a writer's shards under ``bytes`` are merged into one once it has this many (judged by the bytes
            a shard is committed at, not by its compressed file: a shard committed full is never merged).
        flush_seconds: how often the timed flush looks at the buffer's age.
    """

    rows: int = 1_000_000
    bytes: int = 16 * 2**20
    first_seconds: float = 2.0
    seconds: float = 10.0
    compact: int = 16
    flush_seconds: float = 0.1


COMMIT = CommitPolicy()  # every writer's, read as it starts
NONE_ROW = "fn(batch) gave None for this row: a results store holds no row for it"
"""The cause a results store records for a row ``fn`` gave as ``None`` (in memory it is the row's result)."""
_THREAD = "dynabatch-store"

# Rows buffered (input positions, hashes and either the columns or the failures' causes); ``size``: what they add to
# the bytes a shard is committed at.
_Entry = namedtuple("_Entry", "positions hashes parts causes size")


class StoreWriter:
    """Buffers rows (:meth:`write`) and failure records (:meth:`fail`) for ``store``, committed as shards named after
    ``name``; ``ids``: the rows' ids, which positions index."""

    def __init__(self, store: Any, name: str, ids: pa.Array | None) -> None:
        self.store, self.name, self.ids, self.policy = store, name, ids, COMMIT
        self.seq, self.rows, self.bytes, self.since = 0, 0, 0, None
        self.buffer: list[_Entry] = []  # in the order written, not a shard yet
        self.sealed: list[list[_Entry]] = []  # whole shards not committed yet, in order (a failed one first again)
        self._varying: set[tuple] = set()
        self._reading_known = True  # every write said which paths vary (a Ray window's does not)
        self._guard = threading.Lock()
        self._stalled = False  # a commit failed for good: none more until close() tries again
        self._closed = False
        self._worker: Worker | None = None
        # Small shards not merged yet, oldest first: (first seq, last seq, bytes as the policy counts them, level).
        self._spans: list[tuple[int, int, int, int]] = []

    # -- the caller's side -------------------------------------------------------------------------------------------
    def write(self, positions: np.ndarray, rows: list, hashes: np.ndarray,
              varying: Collection[tuple] | None = None) -> None:
        """Adds rows (``rows[i]`` of input ``positions[i]``, input hash ``hashes[i]``; a ``None`` row is recorded
        failed, :data:`NONE_ROW`); ``varying``: row paths of per-token tensors, stored as lists (``None``: not known,
        and not checked against the rows stored). Raises for a row the
        store's columns cannot hold (nothing of the call kept), and an error of an earlier commit that failed."""
        if self._worker is not None:
            self._worker.check()
        positions = np.asarray(positions, dtype=np.int64)
        hashes = np.asarray(hashes if hashes is not None else np.zeros(len(rows)), dtype=np.uint64)
        keep = np.fromiter((row is not None for row in rows), dtype=bool, count=len(rows))
        self._reading_known &= varying is not None
        if keep.any():
            parts = self.store.admit([row for row in rows if row is not None], varying)
            size = positions.nbytes * 2 + sum(p.values.nbytes for p in parts.values() if p.values is not None)
            self._add(_Entry(positions[keep], hashes[keep], parts, None, size), varying or ())
        if not keep.all():
            self.fail(positions[~keep], hashes[~keep], [NONE_ROW] * int((~keep).sum()))

    def fail(self, positions: np.ndarray, hashes: np.ndarray | None, causes: Sequence[Any]) -> None:
        """Records inputs that failed (``causes[i]``: why input ``positions[i]`` has no row, its first line kept),
        committed with the rows."""
        if self._worker is not None:
            self._worker.check()
        positions = np.asarray(positions, dtype=np.int64)
        if len(causes) != len(positions):
            raise bad_value("causes", f"one per position ({len(positions)})", causes)
        lines = [(str(c).strip().splitlines() or [type(c).__name__])[0][:500] for c in causes]
        hashes = np.asarray(hashes if hashes is not None else np.zeros(len(positions)), dtype=np.uint64)
        if len(positions):
            self._add(_Entry(positions, hashes, None, lines, positions.nbytes * 2), ())

    def _add(self, entry: _Entry, varying: Collection[tuple]) -> None:
        with self._guard:
            self._varying.update(tuple(path) for path in varying)
            self.buffer.append(entry)
            self.rows, self.bytes = self.rows + len(entry.positions), self.bytes + entry.size
            self.since = time.monotonic() if self.since is None else self.since
            full = self.rows >= self.policy.rows or self.bytes >= self.policy.bytes
            if full:
                self._seal()
            if self._worker is None:  # its timed flush commits these rows if no shard fills
                self._worker = Worker(depth=1, name=_THREAD, flush=self._flush_due, every=self.policy.flush_seconds)
                self._worker.start()
            worker = self._worker
        if full:  # waits while the shard before is being written: the disk is behind, rows wait here
            worker.submit(self._commit_sealed)

    def _seal(self) -> None:
        """Makes the buffer a whole shard to commit (called holding the guard)."""
        if self.buffer:
            self.sealed.append(self.buffer)
        self.buffer, self.rows, self.bytes, self.since = [], 0, 0, None

    def close(self, commit: bool = True) -> None:
        """Ends the writer, its worker stopped: the buffered rows committed (``commit=True``) or dropped; raises the
        error of a commit that failed for good (its rows stay for a later ``close()``)."""
        with self._guard:
            self.buffer = self.buffer if commit else []
            self._seal()
            worker, self._worker = self._worker, None
        try:
            if worker is not None or self.sealed:
                worker = worker or Worker(depth=1, name=_THREAD)  # or the shards a failed close() kept
                try:
                    worker.check()  # a commit failed for good since the last write: raised, its rows kept
                    self._stalled = False  # the shards kept are tried again
                    worker.submit(self._commit_sealed)
                finally:
                    try:
                        worker.close()
                    except KeyboardInterrupt:  # the commits not begun are dropped: made here, so what finished lands
                        self._commit_sealed()
                        raise
        finally:
            with self._guard:
                first, self._closed = not self._closed, True
            if first:  # the store's lock is given up once every writer closed, whatever the outcome
                self.store.writer_closed()

    # -- the worker's side ---------------------------------------------------------------------------------------
    def _flush_due(self) -> None:
        """The timed flush: commits the buffer once its first rows are old enough (see :class:`CommitPolicy`)."""
        with self._guard:
            wait = self.policy.first_seconds if self.seq == 0 else self.policy.seconds
            if self.since is None or time.monotonic() - self.since < wait:
                return
            self._seal()
        self._commit_sealed()

    def _commit_sealed(self) -> None:
        """Commits the whole shards in order, each then merged with the small ones before (:meth:`_compact`); a
        shard that cannot be written stays first, and stops the commits until :meth:`close`."""
        while True:
            with self._guard:
                if self._stalled or not self.sealed:
                    return
                taken, seq, self.seq = self.sealed[0], self.seq, self.seq + 1
            try:
                size = self._commit(taken, seq)
            except BaseException:
                self._stalled = True
                raise  # kept by the worker, raised in the caller's thread at its next write or close
            with self._guard:
                self.sealed.pop(0)
            self._compact(seq, size)

    def _commit(self, taken: list[_Entry], seq: int) -> int:
        """Writes the rows and failure records ``taken`` as shard ``seq`` (each file whole or not at all); its bytes
        as the policy counts them (0: no rows)."""
        store, name = self.store, shard_name(self.name, seq)
        store.check_held()
        failures, batches = [e for e in taken if e.causes is not None], [e for e in taken if e.causes is None]
        if failures:
            causes = pa.table({"cause": pa.array([c for e in failures for c in e.causes], pa.string())})
            os.makedirs(os.path.join(store.path, FAILED), exist_ok=True)
            write_whole(os.path.join(store.path, FAILED), name, self._table(failures, causes))
        if not batches:
            return 0
        fields = store.fit([b.parts for b in batches], self._varying, fix=True, check=self._reading_known)
        table = self._table(batches, store.columns.table([b.parts for b in batches], fields))
        write_whole(store.path, name, table, write_statistics=[store.keyed_by])
        del table
        trim()  # the shard's buffers are freed: resident memory stays flat over a long run
        return sum(entry.size for entry in taken)

    def _table(self, entries: list[_Entry], outputs: pa.Table) -> pa.Table:
        return self.store.shard(np.concatenate([e.positions for e in entries]),
                                np.concatenate([e.hashes for e in entries]), self.ids, outputs)

    def _compact(self, seq: int, size: int) -> None:
        """Merges this writer's small shards by levels, :attr:`CommitPolicy.compact` of a level into one of the next;
        a merged shard is written whole before its parts are removed, so a crash leaves each row in exactly one
        shard, and a full shard ends the merging of the smaller ones before it (ranges stay contiguous)."""
        spans, compact = self._spans, self.policy.compact
        spans.append((seq, seq, size, 0))
        while size < self.policy.bytes and len(spans) >= compact and spans[-compact][3] == spans[-1][3]:
            merging = spans[-compact:]
            del spans[-compact:]
            first, last, size = merging[0][0], merging[-1][1], sum(span[2] for span in merging)
            parts = [shard_name(self.name, a, b) for a, b, _, _ in merging]
            merged = shard_name(self.name, first, last)
            try:
                written = [self._merge(folder, parts, merged)
                           for folder in (self.store.path, os.path.join(self.store.path, FAILED))]
            except OSError as exc:  # the small shards hold every row still: a slower store to open, nothing lost
                logger.warning("output_path=%r: merging %d small shards failed (%s); they stay as they are",
                               self.store.path, len(parts), exc)
                spans.clear()
                return
            # The merged shards are hidden until their parts are gone: a reader of the folder meanwhile misses these
            # rows rather than reading them twice. A crash between: the next open on this host renames them in place.
            self._remove(parts)
            for hidden in filter(None, written):
                rename(hidden, merged_name(os.path.basename(hidden)))
            spans.append((first, last, size, merging[0][3] + 1))
        if size >= self.policy.bytes:  # a full shard: the older, smaller ones merge no more
            spans.clear()

    def _remove(self, parts: list[str]) -> None:
        """Removes merged shards and their failure records (a crash before: the next open removes them)."""
        for folder in (self.store.path, os.path.join(self.store.path, FAILED)):
            for name in parts:
                remove(os.path.join(folder, name))

    def _merge(self, folder: str, parts: list[str], merged: str) -> str | None:
        """Writes the ``parts`` of ``folder`` that exist as one file ``merged`` (rows cast to the store's fields), under
        its hidden name (:func:`merging_name`), which it returns (``None``: no part existed)."""
        files = [os.path.join(folder, p) for p in parts]
        tables = [read_whole(file) for file in files if os.path.exists(file)]
        if not tables:
            return None
        schema = self.store.retyped(tables[0].schema) if folder == self.store.path else tables[0].schema
        write_whole(folder, merging_name(merged), pa.concat_tables([t.cast(schema) for t in tables]))
        return os.path.join(folder, merging_name(merged))
