"""The results store of ``run(..., output_path=...)``: Parquet shards on disk, one row per input.

A directory of Parquet shards: the key columns (``position``, or ``id`` where ids key the rows), ``input_hash`` and
the outputs as :mod:`dynabatch.inference.columns` encodes them, each shard's metadata saying format, key, keying and
the rows' structure; failure records under ``_failed/``; one job writing at a time (:mod:`~.store_lock`). A run opens
the store once (:func:`open_store`): which inputs it holds (``done``), the stored rows checked against the run's
inputs (:meth:`Store.check_inputs`), then writers (:meth:`Store.writer`) commit shards from background threads and
merge small ones. The rules (commit cadence, compaction, the lock, failure records, positions, column types,
checksums, shards set aside) are in ``docs/inference.md``.

Readers see rows and nothing else: rows are the ``part-*.parquet`` files at the top of the folder; everything else is
hidden and named otherwise (temporary shards ``.tmp-<host>-<pid>-<shard>.tmp``, in the folder for an atomic rename;
shards set aside ``.torn-<shard>.torn``, removed once a run over the store ends with every input stored; lock records
``.lock-*.json``), or lies in ``_failed/``. So ``pyarrow.dataset`` and pandas (which skip names starting with ``.`` and
``_``) and ``*.parquet`` globs (polars, ``datasets``: no other suffix, no sub-folder) read each row once at any time.

Example:
    >>> import tempfile
    >>> import numpy as np
    >>> import torch
    >>> from dynabatch.inference.store import open_store
    >>> path = tempfile.mkdtemp()
    >>> store = open_store(path, key="demo", n=3)
    >>> writer = store.writer("rank0")
    >>> writer.write(np.array([2, 0]), [torch.ones(2), torch.zeros(2)], np.array([7, 9]))
    >>> writer.fail(np.array([1]), np.array([8]), ["ValueError: cannot process this input"])
    >>> writer.close()
    >>> store.close()
    >>> again = open_store(path, key="demo", n=3)
    >>> again.done.tolist(), again.failures(), again.located(3).where.tolist()
    ([True, False, True], {1: 'ValueError: cannot process this input'}, [1, -1, 0])
    >>> again.close()
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import logging
import os
import re
import socket
import threading
import time
import uuid
import weakref
from collections import namedtuple
from collections.abc import Collection, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dynabatch._malloc import trim
from dynabatch._validation import bad_value
from dynabatch.inference.columns import Columns, same_field, widen
from dynabatch.inference.store_lock import PREFIX, JobLock, StoreBusyError

__all__ = ["COMPACT_SHARDS", "FAILED", "FIRST_SHARD_SECONDS", "FORMAT", "SHARD_BYTES", "SHARD_ROWS", "SHARD_SECONDS",
           "WRITE_ATTEMPTS", "Located", "Store", "StoreBusyError", "StoreWriter", "open_store"]

logger = logging.getLogger(__name__)

FORMAT = "dynabatch.store/3"
SHARD_ROWS = 1_000_000  # a shard is committed once a writer holds this many rows,
SHARD_BYTES = 16 * 2**20  # or this many bytes of Arrow data (the buffer and its Parquet encoding stay small),
FIRST_SHARD_SECONDS = 2.0  # or, for a writer's first shard, rows that finished this long ago,
SHARD_SECONDS = 10.0  # and for the later ones this long ago: a killed run loses about that much work at most
COMPACT_SHARDS = 16  # a writer's shards under SHARD_BYTES are merged into one once it has this many
WRITE_ATTEMPTS = 5  # tries of a shard write that fails (a full disk, an I/O error) before the error is raised,
RETRY_SECONDS = 0.5  # the wait before the second, doubled before each later one (7.5 s in all)
FAILED = "_failed"  # the folder of failure records: readers of the store's folder (pyarrow.dataset) skip it
TEMPORARY = ".tmp-"  # a shard being written: .tmp-<host>-<pid>-<shard>.tmp, renamed into place once whole
SET_ASIDE = ".torn-"  # a shard that cannot be read: .torn-<shard>.torn, kept until its rows are stored again
META = b"dynabatch"
_HOST = socket.gethostname().replace("-", "_").replace(".", "_")
_SHARD = re.compile(r"part-(?P<writer>[\w.]+)-(?P<first>\d+)(?:-(?P<last>\d+))?\.parquet")  # -<last>: merged
_LASTING = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.ENAMETOOLONG)


def _key(key: str | None) -> str:
    return "no key" if key is None else f"key={key!r}"


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _dead(name: str) -> bool:
    """Whether ``name`` is the temporary shard of a killed writer on this host (``.tmp-<host>-<pid>-<shard>.tmp``,
    or without ``.tmp`` as earlier versions named it)."""
    pid = name.split("-", 3)[2] if name.startswith(f"{TEMPORARY}{_HOST}-") and name.count("-") >= 3 else ""
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, ValueError):  # alive (another user's), or not a temporary shard
        pass
    return False


def _write_whole(folder: str, name: str, table: pa.Table, **options: Any) -> int:
    """Writes ``table`` as the Parquet file ``folder/name`` whole or not at all (a temporary file with page checksums,
    fsynced, renamed into place), trying a failed write :data:`WRITE_ATTEMPTS` times; its size in bytes."""
    temp, final = os.path.join(folder, f"{TEMPORARY}{_HOST}-{os.getpid()}-{name}.tmp"), os.path.join(folder, name)
    for attempt in range(1, WRITE_ATTEMPTS + 1):
        try:
            pq.write_table(table, temp, write_page_checksum=True, **options)
            _fsync(temp)
            os.replace(temp, final)
            _fsync(folder)  # the rename survives a crash
            return os.path.getsize(final)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.remove(temp)
            if attempt == WRITE_ATTEMPTS or exc.errno in _LASTING:
                exc.add_note(f"writing {final} failed {attempt} times; its rows are kept by the writer")
                raise
            logger.warning("writing %s failed (%s); trying again (%d of %d)", final, exc, attempt + 1, WRITE_ATTEMPTS)
            time.sleep(RETRY_SECONDS * 2 ** (attempt - 1))
    raise AssertionError("unreachable")


def _read_whole(file: str, columns: list[str] | None = None) -> pa.Table:
    """A shard's table (or ``columns`` of it), every page's checksum verified."""
    return pq.ParquetFile(file, page_checksum_verification=True).read(columns=columns)


def _is_shard(name: str) -> bool:
    return name.startswith("part-") and name.endswith(".parquet")


def _covered(names: Collection[str]) -> set[str]:
    """Shards that a merged shard of the same writer holds (``part-w-00003-00017`` holds ``part-w-00005``): what a
    merge cut short left behind. A merged shard is renamed into place before its parts are removed, so every row is
    in exactly one shard that is not covered. One sort: a span is covered when one starting no later reaches as far."""
    spans = sorted((match["writer"], int(match["first"]), -int(match["last"] or match["first"]), name)
                   for name in names if (match := _SHARD.fullmatch(name)))
    covered, writer, reach = set(), None, -1
    for owner, first, last, name in spans:
        if owner != writer:
            writer, reach = owner, -1
        if -last <= reach:
            covered.add(name)
        reach = max(reach, -last)
    return covered


Located = namedtuple("Located", "path files counts where columns schema ids")
_Shard = namedtuple("_Shard", "keys hashes fields")  # an indexed shard: its keys, input hashes and output fields


class Store:
    """A results store opened for a run over ``n`` inputs (``None``: as the stored positions say), keyed by position
    or by ``ids``; ``keyed_by="id"`` without ids: the inputs are the ids stored (Ray's map_texts checks each
    window's). Held for ``job`` (:class:`~dynabatch.inference.store_lock.JobLock`) until :meth:`close`, or until the
    store is dropped (garbage-collected: its writers hold it while they write). ``verify``:
    every shard read whole, checksums verified.

    Attributes: ``done`` (which inputs the store holds, bool per input), ``n``, ``ids``, ``columns`` (the rows'
    :class:`~dynabatch.inference.columns.Columns`), ``schema`` (their Arrow fields), ``files`` (the shards, in the
    order rows are numbered).
    """

    def __init__(self, path: Any, *, key: str | None, n: int | None = None, ids: pa.Array | None = None,
                 job: str | None = None, keyed_by: str | None = None, verify: bool = True) -> None:
        path = os.fspath(path)
        if os.path.exists(path) and not os.path.isdir(path):  # a socket, a device
            raise bad_value("output_path", "a directory (a Parquet results store)", path)
        os.makedirs(path, exist_ok=True)
        self.path, self.key, self.ids = path, key, ids
        self.keyed_by = keyed_by or ("position" if ids is None else "id")
        self._stored_ids = ids is None and self.keyed_by == "id"  # the inputs are the ids stored
        now = time.time()  # in this open's shard names: a later run's sort after an earlier run's
        self.run = f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime(now))}{int(now % 1 * 1e6):06d}_{uuid.uuid4().hex[:8]}"
        self.columns: Columns | None = None
        self._fields: dict[str, pa.Field] = {}  # each output column's field: as stored, widened by rows written
        self._fixed: set[str] = set()  # columns typed by a committed shard (not null)
        self._shards: dict[str, _Shard] = {}
        self._failed: dict[str, tuple[pa.Array, pa.Array]] = {}  # failure records: keys and causes per file
        self._lock = threading.RLock()
        self._writers, self._closing = 0, False
        self.lock = JobLock(path, job)
        # A store dropped unclosed holds it no longer (its writers keep it); no wait in the garbage collector.
        weakref.finalize(self, self.lock.release, False)
        try:
            self._scan(verify)
            self.ids, self.where, self._stored_hash = self._locate(n)
        except BaseException:
            self.lock.release()
            raise
        self.n, self.done = len(self.where), self.where >= 0
        self._checked = np.full(self.n, self._stored_ids)
        # Inputs not known up front (n=None: an iterable of batches) are checked batch by batch as they are built.
        self._unchecked = 0 if self._stored_ids or n is None and ids is None else int(self.done.sum())

    # -- what the store holds --------------------------------------------------------------------------------------
    @property
    def files(self) -> list[str]:
        return sorted(self._shards)

    @property
    def schema(self) -> pa.Schema | None:
        return pa.schema([self._fields[name] for name in self.columns.names]) if self.columns is not None else None

    def _stored_schema(self) -> pa.Schema:
        """The output fields of the committed shards: a column no shard typed yet is ``null``."""
        return pa.schema([self._fields[n] if n in self._fixed else pa.field(n, pa.null()) for n in self.columns.names])

    def _scan(self, verify: bool) -> None:
        """Indexes the shards and failure records not seen yet; removes killed writers' temporary files and shards a
        cut-short compaction left; sets aside unreadable shards."""
        with self._lock:
            names = sorted(os.listdir(self.path))
            kept = (TEMPORARY, SET_ASIDE, PREFIX)
            foreign = [n for n in names if not (_is_shard(n) or n == FAILED or n.startswith(kept))]
            if foreign:
                raise ValueError(f"output_path should be a new or empty directory, or a dynabatch results store, but "
                                 f"got output_path={self.path!r} holding {len(foreign)} other entries "
                                 f"({', '.join(foreign[:5])}); use another directory")
            self._index(self.path, names, self._shards, verify)
            failed = os.path.join(self.path, FAILED)
            if FAILED in names:
                self._index(failed, sorted(os.listdir(failed)), self._failed, verify)
        trim()  # the shards read (verified whole on a resume) are freed: memory stays flat

    def _index(self, folder: str, names: list[str], index: dict, verify: bool) -> None:
        """Brings ``index`` (shards or failure records, by file) up to the files of ``folder``."""
        covered = _covered(names) if self.lock.held else set()
        for name in names:
            why = "a shard a killed run did not finish" if _dead(name) else \
                "whose rows a merged shard holds (a merge cut short)" if name in covered else None
            if why is not None:
                logger.warning("output_path=%r: removing %s, %s", self.path, name, why)
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(folder, name))
        present = {os.path.join(folder, n) for n in names if _is_shard(n) and n not in covered}
        for file in set(index) - present:  # merged by a compaction, or set aside
            del index[file]
        for file in sorted(present - set(index)):
            entry = self._read(file, verify, failures=index is self._failed)
            if entry is not None:
                index[file] = entry

    def _read(self, file: str, verify: bool, *, failures: bool) -> Any:
        """One shard's (or failure record file's) index entry; ``None``: gone, or torn and set aside."""
        try:
            schema = pq.read_schema(file)
            meta = self._check(schema, os.path.basename(file))
            wanted = None if verify else [self.keyed_by, "cause" if failures else "input_hash"]
            table = _read_whole(file, wanted)
        except FileNotFoundError:  # merged by another writer of this job meanwhile
            return None
        except (OSError, pa.ArrowException) as exc:  # torn, or a page failing its checksum
            name = os.path.basename(file)
            logger.warning("output_path=%r: %s cannot be read (%s); moving it to %s%s.torn, its rows run again",
                           self.path, name, str(exc).splitlines()[0][:120], SET_ASIDE, name)
            with contextlib.suppress(FileNotFoundError):  # set aside by another process meanwhile
                os.replace(file, os.path.join(os.path.dirname(file), f"{SET_ASIDE}{name}.torn"))
            return None
        keys = table.column(self.keyed_by).combine_chunks()
        if failures:
            return keys, table.column("cause").combine_chunks()
        self._learn(meta, schema, file)
        return _Shard(keys, table.column("input_hash").to_numpy(), [schema.field(n) for n in meta["tree_names"]])

    def _learn(self, meta: dict, schema: pa.Schema, file: str) -> None:
        """Takes a shard's columns into the store's: its rows' structure, kinds and fields (widened where shards
        of writers that raced typed a column differently)."""
        self.columns = self.columns or Columns(meta["tree"], meta["kinds"])
        self.columns.kinds = {**meta["kinds"], **self.columns.kinds}
        for name in self.columns.names:
            field = schema.field(name)
            before = self._fields.get(name)
            try:
                self._fields[name] = field if before is None else widen(before, field)
            except TypeError as exc:
                raise TypeError(f"output_path={self.path!r} should hold one type per column, but got "
                                f"{os.path.basename(file)} disagreeing with the shards before it: {exc}") from None
            if before is not None and name in self._fixed and not same_field(self._fields[name], before):
                logger.warning("output_path=%r: shards typing %s differently (writers that raced); reading it as %s",
                               self.path, name, self._fields[name].type)
            if not pa.types.is_null(self._fields[name].type):
                self._fixed.add(name)

    def _check(self, schema: pa.Schema, name: str) -> dict:
        """A shard's metadata; refuses a Parquet file dynabatch did not write, or another format, key or keying."""
        meta = json.loads((schema.metadata or {}).get(META, b"null"))
        if meta is None:
            raise ValueError(f"output_path should be a dynabatch results store, but got output_path={self.path!r} "
                             f"holding {name}, a Parquet file dynabatch did not write; use another directory")
        if meta["format"] != FORMAT:
            raise ValueError(f"output_path={self.path!r} should hold results in dynabatch's format {FORMAT!r}, but got "
                             f"{meta['format']!r}: read it with the dynabatch that wrote it, or use a new directory")
        if meta["key"] != self.key:
            raise ValueError(f"key should be the key the results at output_path={self.path!r} were stored with "
                             f"({_key(meta['key'])}) to resume them, but got {_key(self.key)}: pass that key if the "
                             "model and settings are the same, or another output_path for another model or settings")
        if meta["keyed_by"] != self.keyed_by:
            rule = "given (the store keys rows by id)" if meta["keyed_by"] == "id" else \
                "None (the store keys rows by position)"
            raise ValueError(f"the loader's ids should be {rule}, as for the results at output_path={self.path!r}, "
                             f"but got rows keyed by {self.keyed_by}: use the same ids, or another output_path")
        if "tree" in meta:
            meta["tree_names"] = Columns(meta["tree"]).names
        return meta

    def _targets(self, keys: pa.Array, ids: pa.Array | None) -> np.ndarray:
        """Each stored key's input position among this run's (``-1``: not an input of this run)."""
        if ids is None:
            return np.asarray(keys.to_numpy(zero_copy_only=False), dtype=np.int64)
        if not len(keys):
            return np.zeros(0, dtype=np.int64)
        return np.asarray(pc.fill_null(pc.index_in(keys, value_set=ids), -1).to_numpy(), dtype=np.int64)  # no dict

    def _locate(self, n: int | None) -> tuple[pa.Array | None, np.ndarray, np.ndarray]:
        """The run's ids, each input's row among every shard's rows in file order (``-1``: none) and its hash."""
        entries = [self._shards[file] for file in self.files]
        keys = pa.chunked_array([e.keys for e in entries], type=entries[0].keys.type if entries else pa.int64())
        keys = keys.combine_chunks()
        ids = (pc.unique(keys) if len(keys) else pa.array([], pa.string())) if self._stored_ids else self.ids
        if ids is not None and len(keys) and keys.type != ids.type:
            raise ValueError(f"the loader's ids should be of type {keys.type}, as the ids of the results at "
                             f"output_path={self.path!r}, but got ids of type {ids.type}: use the same ids")
        target = self._targets(keys, ids)
        n = len(ids) if ids is not None else n if n is not None else int(target.max()) + 1 if target.size else 0
        inside = np.flatnonzero((target >= 0) & (target < n))
        if inside.size < target.size:
            logger.info("output_path=%r: %d stored rows are not inputs of this run", self.path,
                        target.size - inside.size)
        unique, at = np.unique(target[inside], return_index=True)  # one stored row per input: the first found
        if unique.size < inside.size:
            logger.warning("output_path=%r: %d inputs are stored more than once; reading the first copy", self.path,
                           inside.size - unique.size)
        where, stored_hash = np.full(n, -1, dtype=np.int64), np.zeros(n, dtype=np.uint64)
        where[unique] = inside[at]
        stored_hash[unique] = np.concatenate([e.hashes for e in entries])[inside[at]] if unique.size else 0
        return ids, where, stored_hash

    def _failures_at(self, where: np.ndarray, ids: pa.Array | None) -> dict[int, str]:
        """The latest failure record of each input without a row (``where``: each input's row, ``-1``: none)."""
        files = sorted(self._failed)  # in the order written: a run's shard names start with its time
        if not files:
            return {}
        keys = pa.chunked_array([self._failed[f][0] for f in files]).combine_chunks()
        causes = pa.chunked_array([self._failed[f][1] for f in files]).combine_chunks()
        target = self._targets(keys, ids)
        latest = np.flatnonzero((target >= 0) & (target < len(where)))[::-1]
        latest = latest[where[target[latest]] < 0]
        positions, first = np.unique(target[latest], return_index=True)
        return dict(zip(positions.tolist(), causes.take(pa.array(latest[first])).to_pylist()))

    def failures(self) -> dict[int, str]:
        """Each input failed and not stored since (position -> its cause, one line), from the failure records in the
        store now; a rerun runs them again (they are not :attr:`done`)."""
        with self._lock:
            self._scan(verify=False)
            ids, where, _ = self._locate(self.n)
            return self._failures_at(where, ids)

    def check_inputs(self, positions: np.ndarray, hashes: np.ndarray) -> None:
        """Refuses stored rows whose input hash differs from this run's inputs (``hashes``) at ``positions``: a
        ``ValueError`` naming how many, the first positions (or ids), the key and what to do."""
        positions = np.asarray(positions, dtype=np.int64)
        inside = positions < self.n
        positions, hashes = positions[inside], np.asarray(hashes, dtype=np.uint64)[inside]
        stored = self.done[positions]
        differ = np.sort(positions[stored & (self._stored_hash[positions] != hashes)])
        if not differ.size:
            fresh = np.unique(positions[stored & ~self._checked[positions]])
            self._checked[fresh] = True
            self._unchecked = max(0, self._unchecked - fresh.size)  # none owed where n=None: checked as built
            return
        what = "ids" if self.ids is not None else "positions"
        shown = self.ids.take(pa.array(differ[:5])).to_pylist() if self.ids is not None else differ[:5].tolist()
        shown = ", ".join(map(str, shown)) + ", ..." * (differ.size > 5)
        raise ValueError(
            f"output_path={self.path!r} should hold results of these inputs at their {what}, but got {differ.size} "
            f"stored rows computed from other inputs ({what} {shown}): the texts, their order, the tokenizer or "
            f"its settings differ from the run that stored them ({_key(self.key)}); use another output_path"
            + ("" if self.ids is not None else ", or give the loader ids= to key rows by id (a grown or reordered "
               "corpus)"))

    # -- writing -------------------------------------------------------------------------------------------------
    def writer(self, name: Any, *, ids: pa.Array | None = None, exact: bool = False) -> StoreWriter:
        """A :class:`StoreWriter` (``name``: unique per writer of this run). ``ids``: the rows' ids, which positions
        index. ``exact``: shards named ``part-<name>-<seq>``, so that a rewrite replaces them."""
        name = re.sub(r"[^\w.]", "_", str(name))
        with self._lock:
            self._writers += 1
        return StoreWriter(self, name if exact else f"{self.run}_{name}", ids)

    def _admit(self, row: Any, rows: Sequence[Any], varying: Collection[tuple]) -> dict:
        """Each column's values of ``rows`` (shaped like ``row``), checked against the store's fields and widening
        those no shard typed yet, so that a row that does not fit is refused before it is buffered."""
        with self._lock:
            self.columns = self.columns or Columns.of(row)
        parts = self.columns.parts(rows)  # the rows joined into columns outside the lock: writers convert at once
        with self._lock:
            self._fields.update(self.columns.fit([parts], self._fields, self._fixed, self._varying(varying)))
        return parts

    def _varying(self, paths: Collection[tuple]) -> set[str]:
        where = dict(_paths(self.columns.tree))
        return {where[tuple(path)] for path in paths if tuple(path) in where}

    def _shard_fields(self, parts: list[dict], varying: Collection[str]) -> tuple[list[pa.Field], str]:
        """A shard's output fields (fixing the columns it types for every later shard) and its metadata."""
        with self._lock:
            fitted = self.columns.fit(parts, self._fields, self._fixed, varying)
            self._fields.update(fitted)
            self._fixed.update(name for name, field in fitted.items() if not pa.types.is_null(field.type))
            return list(fitted.values()), self._meta()

    def _meta(self) -> str:
        meta = {"format": FORMAT, "key": self.key, "keyed_by": self.keyed_by}
        if self.columns is not None:
            meta.update(tree=self.columns.tree, kinds=dict(self.columns.kinds))
        return json.dumps(meta)

    def _keys(self, positions: np.ndarray, hashes: np.ndarray, ids: pa.Array | None) -> dict[str, pa.Array]:
        """The key columns of rows of input ``positions``: ``position`` (keyed by position) or ``id``, and the input
        hashes (``ids``: the writer's own, which positions index)."""
        ids = ids if ids is not None else self.ids
        key = pa.array(positions) if self.keyed_by == "position" else ids.take(pa.array(positions))
        return {self.keyed_by: key, "input_hash": pa.array(hashes, pa.uint64())}

    def settle(self) -> None:
        """Rewrites the shards whose columns are narrower than the store's (a column ``None`` in every row of the
        shard, typed by a later one), so that every reader of the folder, which takes one shard's schema, reads
        them all. Call it when no writer of the job writes (:meth:`located` does)."""
        with self._lock:
            if self.columns is None or not self.lock.held:
                return
            stored = self._stored_schema()
            for file, entry in list(self._shards.items()):
                if all(same_field(f, stored.field(f.name)) for f in entry.fields):
                    continue
                with contextlib.suppress(FileNotFoundError):  # merged meanwhile: the merged shard is typed
                    table = _read_whole(file)
                    keys = [table.schema.field(n) for n in table.column_names if n not in stored.names]
                    schema = pa.schema([*keys, *stored], metadata={META: self._meta()})
                    _write_whole(os.path.dirname(file), os.path.basename(file), table.cast(schema),
                                 use_dictionary=["id"] if self.keyed_by == "id" else False)
                    self._shards[file] = entry._replace(fields=list(stored))

    def located(self, n: int) -> Located:
        """Where each of ``n`` inputs' rows is in the store as it is now (every writer's committed shards), to read
        them back (:class:`~dynabatch.inference.results.StoredRunResult`); shards settled first (:meth:`settle`)."""
        with self._lock:
            self._scan(verify=False)
            self.settle()
            ids, where, _ = self._locate(n)
            if n and self.lock.held and (where >= 0).all():
                self._remove_set_aside()
            files = self.files
            return Located(self.path, files, [len(self._shards[f].keys) for f in files], where, self.columns,
                           self.schema, ids)

    def _remove_set_aside(self) -> None:
        """Removes the shards set aside as unreadable: called once every input of a run is stored again."""
        for folder in (self.path, os.path.join(self.path, FAILED)):
            with contextlib.suppress(FileNotFoundError):
                for name in os.listdir(folder):
                    if name.startswith(SET_ASIDE):
                        logger.info("output_path=%r: removing %s, set aside: every input is stored again", self.path,
                                    name)
                        with contextlib.suppress(FileNotFoundError):
                            os.remove(os.path.join(folder, name))

    def _writer_closed(self) -> None:
        with self._lock:
            self._writers -= 1
            if self._closing and not self._writers:
                self.lock.release()

    def close(self, *, job_done: bool = False) -> None:
        """Gives the store's job lock up, once every writer has closed (:meth:`StoreWriter.close`). Idempotent.
        ``job_done``: the job is over, its other processes too: their lock records are removed now."""
        with self._lock:
            self._closing = True
            if job_done:
                self.lock.release_job()
            elif not self._writers:
                self.lock.release()


def open_store(path: Any, *, key: str | None, n: int | None = None, ids: pa.Array | None = None,
               job: str | None = None, keyed_by: str | None = None, verify: bool = True) -> Store:
    """The results store at ``path``, opened for a run over ``n`` inputs (or ``ids``) and held for ``job`` (one string
    for every process of a job, e.g. a token rank 0 broadcasts; ``None``: this open alone, one run) until
    ``store.close()``: another open without this job string is refused while it holds it, in this process too.

    Raises:
        StoreBusyError: another live job writes the store (``.holder`` names it).
        ValueError: not a results store, or one of another ``key``, keying or format.
        TypeError: shards that type a column differently.
    """
    return Store(path, key=key, n=n, ids=ids, job=job, keyed_by=keyed_by, verify=verify)


def _paths(node: Any, path: tuple = ()) -> list[tuple[tuple, str]]:
    """``(row path, column)`` of every column of a rows' structure ``node`` (a path: dict keys and indices)."""
    return [(path, node)] if isinstance(node, str) else \
        [leaf for key, child in node[1] for leaf in _paths(child, (*path, key))]


_Batch = namedtuple("_Batch", "positions hashes parts")  # rows buffered: their input positions, hashes and columns
_Failures = namedtuple("_Failures", "positions hashes causes")


class StoreWriter:
    """Buffers rows checked at :meth:`write` and failure records (:meth:`fail`); one background thread commits them
    as shards (a full buffer at once, else rows :data:`FIRST_SHARD_SECONDS` old for the first shard and
    :data:`SHARD_SECONDS` for the later ones) and merges small ones; :meth:`close`."""

    def __init__(self, store: Store, name: str, ids: pa.Array | None) -> None:
        self.store, self.name, self.ids = store, name, ids
        self.seq, self.rows, self.bytes, self.since = 0, 0, 0, None
        self.buffer: list[_Batch | _Failures] = []  # in the order written, not a shard yet
        self.sealed: list[list] = []  # full shards handed to the thread, in order (a failed one first again)
        self._varying: set[tuple] = set()
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._writing = False  # the thread is writing a shard
        self._closing, self._closed, self._error = False, False, None
        self._levels: list[list[tuple[int, int]]] = []  # small shards not merged yet, by level: (first, last seq)

    # -- the caller's side -------------------------------------------------------------------------------------------
    def write(self, positions: np.ndarray, rows: list, hashes: np.ndarray, varying: Collection[tuple] = ()) -> None:
        """Adds rows (``rows[i]`` of input ``positions[i]``, input hash ``hashes[i]``; ``None`` rows are not stored);
        ``varying``: row paths (keys and indices; ``()``: the row) of per-token tensors, stored as lists. Raises
        ``TypeError`` / ``ValueError`` naming the column for a row the store's columns cannot hold (nothing of the
        call kept), ``RuntimeError`` before check_inputs, and an error of an earlier commit that failed for good."""
        self._raise_error()
        keep = [i for i, row in enumerate(rows) if row is not None]
        if not keep:
            return
        if self.store._unchecked:
            raise RuntimeError(f"output_path={self.store.path!r}: {self.store._unchecked} stored rows of this run's "
                               "inputs should be checked (store.check_inputs) before the run writes, so that a run "
                               "over other inputs is refused before it writes a row")
        parts = self.store._admit(rows[keep[0]], [rows[i] for i in keep], varying)
        positions = np.asarray(positions, dtype=np.int64)[keep]
        hashes = np.asarray(hashes if hashes is not None else np.zeros(len(rows)), dtype=np.uint64)[keep]
        size = positions.nbytes * 2 + sum(p.values.nbytes for p in parts.values() if p.values is not None)
        self._add(_Batch(positions, hashes, parts), len(positions), size, varying)

    def fail(self, positions: np.ndarray, hashes: np.ndarray | None, causes: Sequence[Any]) -> None:
        """Records inputs that failed (``causes[i]``: why input ``positions[i]`` has no row, its first line kept),
        committed with the rows: :meth:`Store.failures` reports them until a row is stored for them."""
        self._raise_error()
        positions = np.asarray(positions, dtype=np.int64)
        if len(causes) != len(positions):
            raise bad_value("causes", f"one per position ({len(positions)})", causes)
        lines = [(str(c).strip().splitlines() or [type(c).__name__])[0][:500] for c in causes]
        hashes = np.asarray(hashes if hashes is not None else np.zeros(len(positions)), dtype=np.uint64)
        if len(positions):
            self._add(_Failures(positions, hashes, lines), len(positions), positions.nbytes * 2, ())

    def _add(self, entry: Any, rows: int, size: int, varying: Collection[tuple]) -> None:
        with self._wake:
            while self.sealed and self._writing and self._error is None:
                self._wake.wait(0.1)  # the disk is behind: rows wait here rather than pile up in memory
            self._varying.update(tuple(path) for path in varying)
            self.buffer.append(entry)
            self.rows, self.bytes = self.rows + rows, self.bytes + size
            self.since = time.monotonic() if self.since is None else self.since
            if self.rows >= SHARD_ROWS or self.bytes >= SHARD_BYTES:
                self._seal()
            self._start()
            self._wake.notify_all()

    def _seal(self) -> None:
        """Hands the buffer to the thread as one shard."""
        if self.buffer:
            self.sealed.append(self.buffer)
        self.buffer, self.rows, self.bytes, self.since = [], 0, 0, None

    def _start(self) -> None:
        """Starts the committing thread where there are rows and none runs."""
        if self._thread is None and (self.sealed or self.buffer):
            self._thread = threading.Thread(target=self._commit_loop, name=f"dynabatch-store-{self.name}",
                                            daemon=True)
            self._thread.start()

    def _raise_error(self) -> None:
        with self._wake:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def close(self, commit: bool = True) -> None:
        """Ends the writer: the buffered rows committed (``commit=True``) or dropped; full shards handed to the
        thread land whole either way. Raises the error of a commit that failed for good (after
        :data:`WRITE_ATTEMPTS` tries; its rows stay, and a later ``close()`` tries them again). The thread has
        stopped when this returns."""
        with self._wake:
            if commit:
                self._seal()
            self.buffer, self.rows, self.bytes, self.since = [], 0, 0, None
            self._closing = True
            if self._error is None:
                self._start()
            self._wake.notify_all()
            thread = self._thread
        try:
            if thread is not None:
                thread.join()
        finally:
            if thread is not None:
                thread.join()  # again where Ctrl-C cut the first wait short: stopped when this returns
            with self._wake:
                first, self._closed = not self._closed, True
            if first:  # the store's lock is given up once every writer closed, whatever the outcome
                self.store._writer_closed()
        self._raise_error()

    # -- the committing thread -------------------------------------------------------------------------------------
    def _commit_loop(self) -> None:
        """Commits each shard handed over, and the buffer once its rows are old enough, until the writer closes or a
        commit fails for good."""
        while True:
            with self._wake:
                while not self.sealed and not (self._closing and not self.buffer):
                    wait = FIRST_SHARD_SECONDS if self.seq == 0 else SHARD_SECONDS
                    if self.since is not None and time.monotonic() - self.since >= wait:
                        self._seal()
                        break
                    self._wake.wait(None if self.since is None else max(0.01, self.since + wait - time.monotonic()))
                if not self.sealed:
                    self._thread = None
                    return
                taken, seq, self._writing, self.seq = self.sealed.pop(0), self.seq, True, self.seq + 1
            try:
                size = self._commit(taken, seq)
            except BaseException as exc:  # noqa: BLE001 (raised in the caller's thread at its next write or close)
                with self._wake:
                    self.sealed.insert(0, taken)  # kept, in order, for a later close() to try again
                    self._writing, self._error, self._thread = False, exc, None
                    self._wake.notify_all()
                return
            with self._wake:
                self._writing = False
                self._wake.notify_all()
            self._compact(seq, size)

    def _commit(self, taken: list, seq: int) -> int:
        """Writes the rows and failure records ``taken`` as shard ``seq`` (each whole or not at all); the rows'
        shard's size in bytes (0: none)."""
        store = self.store
        if not store.lock.held:
            raise StoreBusyError(f"output_path={store.path!r} should be held by this job while it writes, but "
                                 + ("another job took it over (this process's heartbeat was not refreshed for longer "
                                    "than the lease)" if store.lock.lost else "the store was closed")
                                 + "; the rows not committed are not stored")
        name = f"part-{self.name}-{seq:05d}.parquet"
        failures = [e for e in taken if isinstance(e, _Failures)]
        if failures:
            keys = store._keys(np.concatenate([e.positions for e in failures]),
                               np.concatenate([e.hashes for e in failures]), self.ids)
            keys["cause"] = pa.array([c for e in failures for c in e.causes], pa.string())
            folder = os.path.join(store.path, FAILED)
            os.makedirs(folder, exist_ok=True)
            _write_whole(folder, name, pa.table(keys).replace_schema_metadata({META: store._meta()}))
        batches = [e for e in taken if isinstance(e, _Batch)]
        if not batches:
            return 0
        fields, meta = store._shard_fields([b.parts for b in batches], store._varying(self._varying))
        keys = store._keys(np.concatenate([b.positions for b in batches]),
                           np.concatenate([b.hashes for b in batches]), self.ids)
        outputs = store.columns.table([b.parts for b in batches], fields)
        table = pa.Table.from_arrays([*keys.values(), *outputs.columns], schema=pa.schema(
            [pa.field(k, v.type) for k, v in keys.items()] + fields, metadata={META: meta}))
        del outputs
        size = _write_whole(store.path, name, table, use_dictionary=["id"] if "id" in keys else False,
                            write_statistics=[store.keyed_by])
        del table
        trim()  # the shard's buffers are freed: resident memory stays flat over a long run
        return size

    def _compact(self, seq: int, size: int) -> None:
        """Merges this writer's small shards (under :data:`SHARD_BYTES`) by levels: :data:`COMPACT_SHARDS` shards of
        a level into one of the next (each row rewritten once per level, a few times in all). A merged shard
        ``part-<writer>-<first>-<last>`` is written whole before its parts are removed (see :func:`_covered`), so a
        crash at any point leaves each row in exactly one shard. Merged ranges stay contiguous: a full shard ends the
        merging of the smaller ones before it."""
        span = (seq, seq)
        if size >= SHARD_BYTES:
            self._levels = []
            return
        for level in itertools.count():
            if len(self._levels) == level:
                self._levels.append([])
            self._levels[level].append(span)
            if len(self._levels[level]) < COMPACT_SHARDS:
                return
            spans, self._levels[level] = self._levels[level], []
            span = (spans[0][0], spans[-1][1])
            parts = [f"part-{self.name}-{a:05d}{'' if a == b else f'-{b:05d}'}.parquet" for a, b in spans]
            merged = f"part-{self.name}-{span[0]:05d}-{span[1]:05d}.parquet"
            try:
                size = self._merge(self.store.path, parts, merged, rows=True)
                self._merge(os.path.join(self.store.path, FAILED), parts, merged, rows=False)
            except OSError as exc:  # the small shards hold every row still: a slower store to open, nothing lost
                logger.warning("output_path=%r: merging %d small shards failed (%s); they stay as they are",
                               self.store.path, len(parts), exc)
                self._levels = []
                return
            self._remove(parts)
            if size >= SHARD_BYTES:
                del self._levels[level + 1:]  # the older, smaller shards merge no more
                return

    def _remove(self, parts: list[str]) -> None:
        """Removes merged shards and their failure records (a crash before: the next open removes them)."""
        for folder in (self.store.path, os.path.join(self.store.path, FAILED)):
            for name in parts:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(folder, name))

    def _merge(self, folder: str, parts: list[str], merged: str, *, rows: bool) -> int:
        """Writes the ``parts`` of ``folder`` that exist as one file ``merged`` (rows cast to the store's fields)."""
        files = [os.path.join(folder, p) for p in parts if os.path.exists(os.path.join(folder, p))]
        if not files:
            return 0
        tables = [_read_whole(f) for f in files]
        schema = tables[0].schema
        if rows:
            with self.store._lock:
                stored = self.store._stored_schema()
                meta = self.store._meta()
            keys = [f for f in schema if f.name not in stored.names]
            schema = pa.schema([*keys, *stored], metadata={META: meta})
        table = pa.concat_tables([t.cast(schema) for t in tables])
        del tables
        return _write_whole(folder, merged, table, use_dictionary=["id"] if "id" in schema.names else False)
