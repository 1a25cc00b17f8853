"""The shards of a results store: writing one atomically (:class:`StoreWriter`), reading what a shard says.

A shard, ``part-<writer>-<seq>.parquet``, is written to a hidden temporary
name in the store's directory (``.tmp-<host>-<pid>-<shard name>``), fsynced,
and renamed into place (``os.replace``), the directory fsynced after: a shard
is whole or absent. A temporary file whose writer was killed (same host, pid
gone) is removed when a store is opened; a shard that cannot be read is moved
aside under a hidden ``.torn-`` name, with a warning, and its rows run again.

Each shard's Arrow schema metadata (key ``dynabatch``) holds the store's
format, the run's key, what rows are keyed by and the output layout, so every
shard describes itself.

A column ``None`` in every row of a shard, before its type settled, is stored
as Arrow ``null``. Once a later shard gives it a type, the shards stored
before are rewritten with that type (their nulls cast, the same way atomically:
:func:`settle_shards`), by the writer that settled it and by every store
opened on the directory, so readers see one schema.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import socket
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dynabatch._malloc import trim
from dynabatch.inference._columns import Layout

__all__ = ["META", "SHARD_BYTES", "SHARD_ROWS", "SHARD_SECONDS", "StoreWriter", "own_entry", "remove_dead_temps",
           "settle_shards", "shard_meta"]

logger = logging.getLogger(__name__)

SHARD_ROWS = 1_000_000
"""A shard is committed once its buffer holds this many rows."""
SHARD_BYTES = 16 * 2**20
"""... or this many bytes of Arrow data (16 MiB: the buffer, and the Parquet encoding of it, stay small)."""
SHARD_SECONDS = 60.0
"""... or rows that finished this many seconds ago: a killed run loses about a minute of work at most."""

META = b"dynabatch"
_HOST = socket.gethostname().replace("-", "_").replace(".", "_")


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def own_entry(name: str) -> bool:
    return (name.startswith("part-") and name.endswith(".parquet")) or name.startswith((".tmp-", ".torn-"))


def remove_dead_temps(path: str, names: list[str]) -> None:
    """Temporary shards of killed writers on this host are removed; others (live or remote writers) are left."""
    for name in names:
        if not name.startswith(".tmp-"):
            continue
        parts = name.split("-", 3)  # .tmp-<host>-<pid>-<shard name>
        host, pid = (parts[1], parts[2]) if len(parts) == 4 else ("", "")
        alive = True
        if host == _HOST and pid.isdigit():
            try:
                os.kill(int(pid), 0)
            except ProcessLookupError:
                alive = False
            except PermissionError:
                pass
        if alive:
            logger.warning("output_path=%r: ignoring %s, a shard another process is writing", path, name)
            continue
        logger.warning("output_path=%r: removing %s, a shard a killed run did not finish", path, name)
        try:
            os.remove(os.path.join(path, name))
        except FileNotFoundError:
            pass


def shard_meta(path: str, file: str) -> dict | None:
    """A shard's dynabatch metadata, or ``None`` for a torn shard (moved aside with a warning)."""
    try:
        metadata = pq.read_schema(file).metadata or {}
    except (OSError, pa.ArrowException) as exc:
        torn = os.path.join(path, ".torn-" + os.path.basename(file))
        logger.warning("output_path=%r: %s cannot be read (%s); moving it to %s, its rows run again", path,
                       os.path.basename(file), str(exc).splitlines()[0][:120], os.path.basename(torn))
        try:
            os.replace(file, torn)
        except FileNotFoundError:
            pass
        return None
    if META not in metadata:
        raise ValueError(f"output_path should be a dynabatch results store, but got output_path={path!r} holding "
                         f"{os.path.basename(file)}, a Parquet file dynabatch did not write; use another directory")
    return json.loads(metadata[META])


def _write_atomically(table: pa.Table, path: str, name: str) -> None:
    """Writes ``table`` as shard ``name`` of the store at ``path``: a temporary file, fsynced, renamed into place."""
    temp = os.path.join(path, f".tmp-{_HOST}-{os.getpid()}-{name}")
    keys = ["position", "id"] if "id" in table.column_names else ["position"]
    pq.write_table(table, temp, use_dictionary=keys[1:] or False, write_statistics=keys)  # floats: neither pays
    _fsync_path(temp)
    os.replace(temp, os.path.join(path, name))
    _fsync_path(path)  # the rename itself survives a crash


def settle_shards(path: str, layout: Layout, shards: list[tuple[str, dict]] | None = None) -> None:
    """Rewrites the shards (``(file, metadata)`` each; ``None``: every shard at ``path``) stored while columns that
    ``layout`` has a type for were untyped: their null columns cast to that type, their metadata given ``layout``."""
    if shards is None:
        files = sorted(glob.glob(os.path.join(glob.escape(path), "part-*.parquet")))
        shards = [(file, meta) for file in files if (meta := shard_meta(path, file)) is not None]
    text = layout.to_json()
    for file, meta in shards:
        if meta.get("layout") == text or Layout.merge([Layout.from_json(meta["layout"]), layout]) != layout:
            continue  # as typed as the layout already, or typed otherwise (the store refuses that when opened)
        table = pq.read_table(file)
        types = {f.name: f.type for f in layout.fields()}
        columns = [column.cast(types[name]) if name in types else column
                   for name, column in zip(table.column_names, table.columns)]
        schema = pa.schema([pa.field(name, column.type) for name, column in zip(table.column_names, columns)],
                           metadata={META: json.dumps({**meta, "layout": text})})
        _write_atomically(pa.Table.from_arrays(columns, schema=schema), path, os.path.basename(file))
        logger.info("output_path=%r: %s rewritten with the types its None-only columns settled to", path,
                    os.path.basename(file))


class StoreWriter:
    """Buffers finished rows and commits them as shards: :meth:`write`, :meth:`flush`, :meth:`close`.

    A full buffer becomes a shard written by one background thread while the
    run goes on (one shard in flight at most: the next waits for it); rows are
    checked and converted to numpy in :meth:`write`, so a row Arrow cannot
    store raises at once, and become Arrow columns once per shard. A small object with no reference to the run, so that a worker can own it.

    ``name``: the writer's name in its shards' names (``None``: the time, a
    random part and ``rank``); a writer named after the rows it writes
    commits the same shard name when they are written again, replacing it.
    ``positions=False``: the ``position`` column holds ``-1`` (rows with no
    input position, keyed by ``ids``; ``write``'s positions then index ``ids``).

    Attributes:
        layout: the rows' :class:`~dynabatch.inference._columns.Layout` once
            every column's type is known; ``None`` before (a column ``None`` in
            every row so far still wants the rows' real tokens, to tell a
            per-token output when its first values come).
    """

    def __init__(self, path: str, meta: dict, layout: Layout | None, ids: pa.Array | None, *, rank: int | str = 0,
                 name: str | None = None, positions: bool = True) -> None:
        self.path, self.meta, self._layout, self.ids = path, meta, layout, ids
        self._untyped = layout.untyped if layout is not None else set()  # columns untyped in the shards so far
        self.name = name or f"{time.strftime('%Y%m%dT%H%M%S')}_{uuid.uuid4().hex[:8]}_rank{rank}"
        self.positions = positions
        self.seq = 0
        self.buffer: list[tuple] = []  # (positions, input hashes, each column's part) per batch
        self.rows = self.bytes = 0
        self.since: float | None = None
        self.shards_written = 0
        self._thread: ThreadPoolExecutor | None = None  # writes one shard at a time, beside the run
        self._pending: Future | None = None

    @property
    def layout(self) -> Layout | None:
        return self._layout if self._layout is not None and not self._layout.untyped else None

    @property
    def stored_layout(self) -> Layout | None:
        """The layout the rows are stored with so far, untyped columns included (``None`` before any row)."""
        return self._layout

    def _schema(self, layout: Layout) -> pa.Schema:
        fields = [pa.field("position", pa.int64())]
        if self.ids is not None:
            fields.append(pa.field("id", self.ids.type))
        fields += [pa.field("input_hash", pa.uint64()), *layout.fields()]
        return pa.schema(fields, metadata={META: json.dumps({**self.meta, "layout": layout.to_json()})})

    def write(self, positions: np.ndarray, rows: list, hashes: np.ndarray, real_lengths: np.ndarray | None = None,
              ragged: Any = None) -> None:
        """Adds finished rows (``rows[i]`` for input ``positions[i]``); commits a shard when the buffer is full.

        Raises:
            TypeError: a row Arrow cannot store (the type is named).
            ValueError: rows that do not fit the stored layout (another structure, dtype or shape).
        """
        if not len(positions):
            return
        if self._layout is None:
            self._layout = Layout.infer(rows, real_lengths)
            self._untyped = self._layout.untyped
        try:
            parts = self._layout.convert(rows, real_lengths)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{exc} (output_path={self.path!r} stores rows as {self._layout.describe()})") from exc
        positions = np.asarray(positions, dtype=np.int64)
        self.buffer.append((positions, np.asarray(hashes, dtype=np.uint64), parts))
        self.rows += len(positions)
        self.bytes += positions.nbytes * 2 + sum(part.nbytes for part in parts.values())
        self.since = time.monotonic() if self.since is None else self.since
        if self.rows >= SHARD_ROWS or self.bytes >= SHARD_BYTES or time.monotonic() - self.since >= SHARD_SECONDS:
            self._submit()

    def _submit(self) -> None:
        """Hands the buffered rows to the background thread as one shard, once the shard before it is on disk."""
        if not self.buffer:
            return
        buffer, name = self.buffer, f"part-{self.name}-{self.seq:05d}.parquet"
        self.seq += 1
        self.buffer, self.rows, self.bytes, self.since = [], 0, 0, None
        layout = Layout.from_json(self._layout.to_json())  # as the buffered rows were converted (write goes on)
        self._wait()
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dynabatch-store")
        self._pending = self._thread.submit(self._commit, buffer, name, layout)

    def _table(self, buffer: list, layout: Layout) -> pa.Table:
        """The buffered batches as one table: each column concatenated once."""
        positions = np.concatenate([b[0] for b in buffer])
        stored = positions if self.positions else np.full(len(positions), -1, dtype=np.int64)
        keys = [pa.array(stored)] + ([self.ids.take(pa.array(positions))] if self.ids is not None else [])
        hashes = pa.array(np.concatenate([b[1] for b in buffer]))
        columns = layout.to_arrow([b[2] for b in buffer])
        return pa.Table.from_arrays([*keys, hashes, *columns.values()], schema=self._schema(layout))

    def _commit(self, buffer: list, name: str, layout: Layout) -> None:
        """Writes one shard atomically (Arrow and Parquet's writer release the GIL: this runs beside the next
        batches); the shards stored before are rewritten when a column settled since."""
        table = self._table(buffer, layout)
        _write_atomically(table, self.path, name)
        self.shards_written += 1
        del table
        trim()  # the shard's buffers are freed: resident memory stays flat over a long run
        untyped = layout.untyped
        if self._untyped - untyped:
            try:
                settle_shards(self.path, layout)
            except (OSError, ValueError, pa.ArrowException) as exc:  # the rows are stored: opening the store retries
                logger.warning("output_path=%r: shards stored before a column's type settled were not rewritten "
                               "(%s); opening the store again rewrites them", self.path, exc)
        self._untyped = untyped

    def _wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()  # a failed write raises here

    def flush(self) -> None:
        """Commits the buffered rows as one shard and waits until every shard of this writer is on disk."""
        self._submit()
        self._wait()

    def close(self, commit: bool = True) -> None:
        """Commits what is buffered (``commit=False``: drops it), waits for it, and stops the background thread."""
        if not commit:
            self.buffer, self.rows, self.bytes, self.since = [], 0, 0, None
        try:
            self.flush()
        finally:
            if self._thread is not None:
                self._thread.shutdown(wait=True)
                self._thread = None

