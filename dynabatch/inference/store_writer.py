"""The results store's writer: rows and failure records buffered, committed as shards behind the run by one
:class:`~dynabatch._background.Worker` as :data:`COMMIT` says, small shards merged. A shard that cannot be written
stops the commits: its rows are kept, the error raised at the next call, and a later ``close()`` tries again.

Example:
    >>> from dynabatch.inference.store_writer import COMMIT
    >>> COMMIT.first_seconds, COMMIT.seconds, COMMIT.compact
    (2.0, 10.0, 16)
"""

from __future__ import annotations

import contextlib
import itertools
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
from dynabatch.inference.store_shards import FAILED, META, read_whole, shard_name, write_whole

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
            a shard is committed at, not by its Parquet file, which compression makes smaller: a shard committed
            full is never taken for a small one and read back to be merged).
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

# Rows buffered (their input positions, hashes and columns) and failure records; ``size``: what each adds to the
# bytes a shard is committed at.
_Batch = namedtuple("_Batch", "positions hashes parts size")
_Failures = namedtuple("_Failures", "positions hashes causes size")


class StoreWriter:
    """Buffers rows (:meth:`write`) and failure records (:meth:`fail`) for ``store``, committed as shards named after
    ``name``; ``ids``: the rows' ids, which positions index."""

    def __init__(self, store: Any, name: str, ids: pa.Array | None) -> None:
        self.store, self.name, self.ids, self.policy = store, name, ids, COMMIT
        self.seq, self.rows, self.bytes, self.since = 0, 0, 0, None
        self.buffer: list[_Batch | _Failures] = []  # in the order written, not a shard yet
        self.sealed: list[list] = []  # whole shards not committed yet, in order (a failed one first again)
        self._varying: set[tuple] = set()
        self._guard = threading.Lock()
        self._stalled = False  # a commit failed for good: none more until close() tries again
        self._closed = False
        self._worker: Worker | None = None
        # Small shards not merged yet, by level: (first seq, last seq, their bytes as the policy counts them).
        self._levels: list[list[tuple[int, int, int]]] = []

    # -- the caller's side -------------------------------------------------------------------------------------------
    def write(self, positions: np.ndarray, rows: list, hashes: np.ndarray, varying: Collection[tuple] = ()) -> None:
        """Adds rows (``rows[i]`` of input ``positions[i]``, input hash ``hashes[i]``; a ``None`` row is recorded
        failed, :data:`NONE_ROW`); ``varying``: row paths of per-token tensors, stored as lists. Raises for a row the
        store's columns cannot hold (nothing of the call kept), and an error of an earlier commit that failed."""
        self._check()
        positions = np.asarray(positions, dtype=np.int64)
        hashes = np.asarray(hashes if hashes is not None else np.zeros(len(rows)), dtype=np.uint64)
        keep = np.fromiter((row is not None for row in rows), dtype=bool, count=len(rows))
        if keep.any():
            parts = self.store.admit(rows[int(np.argmax(keep))], [r for r in rows if r is not None], varying)
            size = positions.nbytes * 2 + sum(p.values.nbytes for p in parts.values() if p.values is not None)
            self._add(_Batch(positions[keep], hashes[keep], parts, size), int(keep.sum()), varying)
        if not keep.all():
            self.fail(positions[~keep], hashes[~keep], [NONE_ROW] * int((~keep).sum()))

    def fail(self, positions: np.ndarray, hashes: np.ndarray | None, causes: Sequence[Any]) -> None:
        """Records inputs that failed (``causes[i]``: why input ``positions[i]`` has no row, its first line kept),
        committed with the rows."""
        self._check()
        positions = np.asarray(positions, dtype=np.int64)
        if len(causes) != len(positions):
            raise bad_value("causes", f"one per position ({len(positions)})", causes)
        lines = [(str(c).strip().splitlines() or [type(c).__name__])[0][:500] for c in causes]
        hashes = np.asarray(hashes if hashes is not None else np.zeros(len(positions)), dtype=np.uint64)
        if len(positions):
            self._add(_Failures(positions, hashes, lines, positions.nbytes * 2), len(positions), ())

    def _check(self) -> None:
        if self._worker is not None:
            self._worker.check()

    def _add(self, entry: Any, rows: int, varying: Collection[tuple]) -> None:
        with self._guard:
            self._varying.update(tuple(path) for path in varying)
            self.buffer.append(entry)
            self.rows, self.bytes = self.rows + rows, self.bytes + entry.size
            self.since = time.monotonic() if self.since is None else self.since
            full = self.rows >= self.policy.rows or self.bytes >= self.policy.bytes
            if full:
                self._seal()
            if self._worker is None:
                self._worker = Worker(depth=1, name=_THREAD, flush=self._flush_due, every=self.policy.flush_seconds)
                self._worker.start()  # the timed flush commits these rows if no shard fills
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
        if worker is None and self.sealed:  # shards a failed close() kept
            worker = Worker(depth=1, name=_THREAD)
        try:
            if worker is not None:
                try:
                    worker.check()  # a commit failed for good since the last write: raised, its rows kept
                    self._stalled = False  # the shards kept are tried again
                    worker.submit(self._commit_sealed)
                finally:
                    self._stop(worker)
        finally:
            with self._guard:
                first, self._closed = not self._closed, True
            if first:  # the store's lock is given up once every writer closed, whatever the outcome
                self.store.writer_closed()

    def _stop(self, worker: Worker) -> None:
        """Closes the worker after its commits; Ctrl-C meanwhile drops the commits not begun, so they are made here,
        then the interrupt raised: what finished lands whole, as without it."""
        try:
            worker.close()
        except KeyboardInterrupt:
            self._commit_sealed()
            raise

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

    def _commit(self, taken: list, seq: int) -> int:
        """Writes the rows and failure records ``taken`` as shard ``seq`` (each whole or not at all); its bytes as
        the policy counts them (0: no rows)."""
        store = self.store
        store.check_held()
        name = shard_name(self.name, seq)
        failures = [e for e in taken if isinstance(e, _Failures)]
        if failures:
            keys = store.key_columns(np.concatenate([e.positions for e in failures]),
                                     np.concatenate([e.hashes for e in failures]), self.ids)
            keys["cause"] = pa.array([c for e in failures for c in e.causes], pa.string())
            folder = os.path.join(store.path, FAILED)
            os.makedirs(folder, exist_ok=True)
            write_whole(folder, name, pa.table(keys).replace_schema_metadata({META: store.shard_meta()}))
        batches = [e for e in taken if isinstance(e, _Batch)]
        if not batches:
            return 0
        fields, meta = store.shard_fields([b.parts for b in batches], self._varying)
        keys = store.key_columns(np.concatenate([b.positions for b in batches]),
                                 np.concatenate([b.hashes for b in batches]), self.ids)
        outputs = store.columns.table([b.parts for b in batches], fields)
        table = pa.Table.from_arrays([*keys.values(), *outputs.columns], schema=pa.schema(
            [pa.field(k, v.type) for k, v in keys.items()] + fields, metadata={META: meta}))
        del outputs
        write_whole(store.path, name, table, use_dictionary=["id"] if "id" in keys else False,
                    write_statistics=[store.keyed_by])
        del table
        trim()  # the shard's buffers are freed: resident memory stays flat over a long run
        return sum(entry.size for entry in taken)

    def _compact(self, seq: int, size: int) -> None:
        """Merges this writer's small shards by levels, :attr:`CommitPolicy.compact` of a level into one of the next;
        a merged shard is written whole before its parts are removed, so a crash leaves each row in exactly one
        shard, and a full shard ends the merging of the smaller ones before it (ranges stay contiguous)."""
        span = (seq, seq, size)
        if size >= self.policy.bytes:
            self._levels = []
            return
        for level in itertools.count():
            if len(self._levels) == level:
                self._levels.append([])
            self._levels[level].append(span)
            if len(self._levels[level]) < self.policy.compact:
                return
            spans, self._levels[level] = self._levels[level], []
            span = (spans[0][0], spans[-1][1], sum(bytes_ for _, _, bytes_ in spans))
            parts = [shard_name(self.name, a, b) for a, b, _ in spans]
            merged = shard_name(self.name, *span[:2])
            try:
                self._merge(self.store.path, parts, merged)
                self._merge(os.path.join(self.store.path, FAILED), parts, merged)
            except OSError as exc:  # the small shards hold every row still: a slower store to open, nothing lost
                logger.warning("output_path=%r: merging %d small shards failed (%s); they stay as they are",
                               self.store.path, len(parts), exc)
                self._levels = []
                return
            self._remove(parts)
            if span[2] >= self.policy.bytes:
                del self._levels[level + 1:]  # the older, smaller shards merge no more
                return

    def _remove(self, parts: list[str]) -> None:
        """Removes merged shards and their failure records (a crash before: the next open removes them)."""
        for folder in (self.store.path, os.path.join(self.store.path, FAILED)):
            for name in parts:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(folder, name))

    def _merge(self, folder: str, parts: list[str], merged: str) -> None:
        """Writes the ``parts`` of ``folder`` that exist as one file ``merged`` (rows cast to the store's fields)."""
        files = [os.path.join(folder, p) for p in parts if os.path.exists(os.path.join(folder, p))]
        if not files:
            return
        tables = [read_whole(f) for f in files]
        schema = tables[0].schema
        if folder == self.store.path:  # rows (failure records keep their own columns)
            schema = self.store.retyped(schema)
        table = pa.concat_tables([t.cast(schema) for t in tables])
        del tables
        write_whole(folder, merged, table, use_dictionary=["id"] if "id" in schema.names else False)
