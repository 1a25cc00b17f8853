"""The results store of ``run(..., output_path=...)``: Parquet shards on disk, one row per input.

A run opens the store once (:func:`open_store`), checks the stored rows against its inputs (:meth:`Store.check_inputs`),
writes through :meth:`Store.writer`, and finds every row in one scan at the end (:meth:`Store.located`). The rules
(columns, failure records, one job at a time: :mod:`~.store_lock`) are in ``docs/inference.md``.

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
    >>> located = again.located(3)
    >>> again.done.tolist(), located.failures, located.where.tolist()
    ([True, False, True], {1: 'ValueError: cannot process this input'}, [1, -1, 0])
    >>> again.close()
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import pathlib
import re
import threading
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
from dynabatch._validation import bad_value, first_few
from dynabatch.inference.columns import Columns, arrow_names, same_field, widen
from dynabatch.inference.store_lock import PREFIX, JobLock, StoreBusyError
from dynabatch.inference.store_shards import (CHECK, FAILED, FORMAT, MERGING, META, SET_ASIDE, TEMPORARY, TornFooter,
                                              checked_meta, covered, footer_check, is_dead, is_shard, later_shard,
                                              merged_name, read_whole, remove, rename, write_whole)
from dynabatch.inference.store_writer import StoreWriter

__all__ = ["FAILED", "FORMAT", "META", "Located", "Store", "StoreBusyError", "StoreWriter", "foreign_entries",
           "open_store"]

logger = logging.getLogger(__name__)


def foreign_entries(names: list[str]) -> list[str]:
    """The entries of a store's folder (``names``) that are not the store's own: its shards, failure records,
    temporaries, merges in progress, torn shards set aside and job locks are. In a folder that holds a store, a hidden
    entry not named ``.parquet`` (macOS's ``.DS_Store``, an editor's backup) is left alone too: no reader of the store
    reads it (pyarrow.dataset skips hidden names; a ``*.parquet`` glob does not match it)."""
    ours = (TEMPORARY, MERGING, SET_ASIDE, PREFIX)
    store = FAILED in names or any(map(is_shard, names))
    return [n for n in names if not (is_shard(n) or n == FAILED or n.startswith(ours)
                                     or store and n.startswith(".") and not n.endswith(".parquet"))]


def _key(key: str | None) -> str:
    return "no key" if key is None else f"key={key!r}"


Located = namedtuple("Located", "path files counts where columns schema ids failures")
_Shard = namedtuple("_Shard", "keys hashes fields")  # an indexed shard: its keys, input hashes and output fields


class Store:
    """The results store at ``path``, opened for a run over ``n`` inputs (``None``: as the stored positions say), keyed
    by position or by ``ids`` (``keyed_by="id"`` without ids: the inputs are the ids stored), held for ``job`` (one
    string for every process of a job; ``None``: this open alone) until :meth:`close` or until dropped; ``verify``:
    every shard read whole, checksums verified. Attributes: ``done`` (which inputs it holds), ``n``, ``ids``,
    ``columns``, ``schema``, ``files`` (in the order rows are numbered), ``repeated`` (the inputs stored more than
    once, their positions among ``ids``: read as their first copy).

    Raises:
        StoreBusyError: another live job writes the store (``.holder`` names it).
        ValueError: not a results store, or one of another ``key``, keying or format.
        TypeError: shards that type a column differently.
    """

    def __init__(self, path: Any, *, key: str | None, n: int | None = None, ids: pa.Array | None = None,
                 job: str | None = None, keyed_by: str | None = None, verify: bool = True) -> None:
        # "~" is the home directory, as pyarrow (which writes the shards) and pandas read it: one folder for both.
        path = os.path.expanduser(os.fspath(path))
        if os.path.exists(path) and not os.path.isdir(path):  # a socket, a device
            raise bad_value("output_path", "a directory (a Parquet results store)", path)
        os.makedirs(path, exist_ok=True)
        self.path, self.key, self.ids = path, key, ids
        self.keyed_by = keyed_by or ("position" if ids is None else "id")
        self._stored_ids = ids is None and self.keyed_by == "id"  # the inputs are the ids stored
        # In this open's shard names: a later run's sort after an earlier run's.
        self.run = f"{datetime.datetime.now(datetime.timezone.utc):%Y%m%dT%H%M%S%f}_{uuid.uuid4().hex[:8]}"
        self.columns: Columns | None = None
        self._fields: dict[str, pa.Field] = {}  # each output column's field: as stored, widened by rows written
        self._fixed: set[str] = set()  # columns typed by a committed shard (not null)
        self._varied: dict[str, bool] = {}  # whether run read a column's rows as varying (per token, one per row)
        self._shards: dict[str, _Shard] = {}
        self._failed: dict[str, tuple[pa.Array, pa.Array]] = {}  # failure records: keys and causes per file
        self._lock = threading.RLock()
        self._writers, self._closing = 0, False
        self.lock = JobLock(path, job)
        # A store dropped unclosed holds it no longer (its writers keep it); no wait in the garbage collector.
        weakref.finalize(self, self.lock.release, False)
        try:
            self._scan(verify)
            self.ids, where, self._stored_hash = self._locate(n)
        except BaseException:
            self.lock.release()
            raise
        self.n, self.done = len(where), where >= 0
        self._checked = np.full(self.n, self._stored_ids)
        # Inputs not known up front (n=None: an iterable of batches) are checked batch by batch as they are built.
        self._unchecked = 0 if self._stored_ids or n is None and ids is None else int(self.done.sum())

    @property
    def files(self) -> list[str]:
        return sorted(self._shards)

    @property
    def schema(self) -> pa.Schema | None:
        return pa.schema([self._fields[name] for name in self.columns.names]) if self.columns is not None else None

    # -- reading the store -------------------------------------------------------------------------------------
    def _scan(self, verify: bool) -> None:
        """Indexes the shards and failure records not seen yet."""
        with self._lock:
            names = sorted(os.listdir(self.path))
            if foreign := foreign_entries(names):
                raise ValueError(f"output_path should be a new or empty directory, or a dynabatch results store, but "
                                 f"got output_path={self.path!r} holding {len(foreign)} other entries "
                                 f"({first_few(foreign)}); remove them, or use another directory")
            self._index(self.path, names, self._shards, verify)
            if FAILED in names:
                failed = os.path.join(self.path, FAILED)
                self._index(failed, sorted(os.listdir(failed)), self._failed, verify)
        trim()  # the shards read (verified whole on a resume) are freed: memory stays flat

    def _index(self, folder: str, names: list[str], index: dict, verify: bool) -> None:
        """Brings ``index`` (shards or failure records, by file) up to the files of ``folder``."""
        finished = [n for n in names if self.lock.held and is_dead(n, MERGING)]
        for name in finished:  # a killed writer's merged shard, hidden while its parts were removed: holds their rows
            later = later_shard(merged_name(name), names)
            if later is not None:  # a run since ran the removed parts' rows again: renamed now, they would be twice
                logger.warning("output_path=%r: removing %s, a merge a killed run did not finish, whose rows a later "
                               "run (%s) ran again", self.path, name, later)
                remove(os.path.join(folder, name))
                continue
            logger.warning("output_path=%r: renaming %s to %s, a merge a killed run did not finish", self.path, name,
                           merged_name(name))
            rename(os.path.join(folder, name), merged_name(name))
        names = sorted(os.listdir(folder)) if finished else names
        merged = covered(names) if self.lock.held else set()
        for name in names:
            why = "a shard a killed run did not finish" if is_dead(name) else \
                "whose rows a merged shard holds (a merge cut short)" if name in merged else None
            if why is not None:
                logger.warning("output_path=%r: removing %s, %s", self.path, name, why)
                remove(os.path.join(folder, name))
        present = {os.path.join(folder, n) for n in names if is_shard(n) and n not in merged}
        for file in set(index) - present:  # merged by a compaction, or set aside
            del index[file]
        for file in sorted(present - set(index)):
            entry = self._read(file, verify, failures=index is self._failed)
            if entry is not None:
                index[file] = entry

    def _read(self, file: str, verify: bool, *, failures: bool) -> Any:
        """One shard's (or failure record file's) index entry; ``None``: gone, or torn and set aside."""
        try:
            schema = arrow_names(pq.read_schema(file))  # its lists' items named as the rows written name them
            meta = self._check(schema, os.path.basename(file))
            table = read_whole(file, None if verify else [self.keyed_by, "cause" if failures else "input_hash"])
        except FileNotFoundError:  # merged by another writer of this job meanwhile
            return None
        except (OSError, pa.ArrowException, TornFooter) as exc:  # torn, a page or the footer failing its checksum
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
        return _Shard(keys, table.column("input_hash").to_numpy(), [schema.field(n) for n in self.columns.names])

    def _learn(self, meta: dict, schema: pa.Schema, file: str) -> None:
        """Takes a shard's rows' structure, kinds and fields into the store's (widened where writers raced)."""
        self.columns = self.columns or Columns(meta["tree"], meta["kinds"])
        self.columns.kinds = {**meta["kinds"], **self.columns.kinds}
        self._varied = {**meta.get("varied", {}), **self._varied}  # shards of earlier versions: not known
        for name in self.columns.names:
            before = self._fields.get(name)
            try:
                self._fields[name] = schema.field(name) if before is None else widen(before, schema.field(name))
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
        meta = checked_meta(schema.metadata, schema.names)
        if meta is None:
            raise ValueError(f"output_path should be a dynabatch results store, but got output_path={self.path!r} "
                             f"holding {name}, a Parquet file dynabatch did not write; use another directory")
        try:
            meta = json.loads(meta)
        except ValueError as exc:  # not JSON, not UTF-8: a flipped byte in a footer written before CHECK was
            raise TornFooter(f"its metadata is not JSON ({exc})") from None
        if not (isinstance(meta, dict) and {"format", "key", "keyed_by"} <= meta.keys()):
            raise TornFooter(f"its metadata is not a dynabatch shard's ({str(meta)[:60]})")
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
        return meta

    def _targets(self, keys: pa.Array, ids: pa.Array | None, n: int | None) -> np.ndarray:
        """Each stored key's input position among this run's (``-1``: not an input of this run, ``n`` or more)."""
        if ids is None:
            target = np.asarray(keys.to_numpy(zero_copy_only=False), dtype=np.int64)
        elif len(keys):  # no dictionary built of the keys: one hash table of the ids
            target = np.asarray(pc.fill_null(pc.index_in(keys, value_set=ids), -1).to_numpy(), dtype=np.int64)
        else:
            target = np.zeros(0, dtype=np.int64)
        return target if n is None else np.where(target < n, target, -1)

    def _locate(self, n: int | None) -> tuple[pa.Array | None, np.ndarray, np.ndarray]:
        """The run's ids, each input's row among every shard's rows in file order (``-1``: none) and its hash."""
        entries = [self._shards[file] for file in self.files]
        keys = pa.concat_arrays([e.keys for e in entries]) if entries else pa.array([], pa.int64())
        ids = (pc.unique(keys) if len(keys) else pa.array([], pa.string())) if self._stored_ids else self.ids
        if ids is not None and len(keys) and keys.type != ids.type:
            raise ValueError(f"the loader's ids should be of type {keys.type}, as the ids of the results at "
                             f"output_path={self.path!r}, but got ids of type {ids.type}: use the same ids")
        n = len(ids) if ids is not None else n
        target = self._targets(keys, ids, n)
        n = n if n is not None else int(target.max(initial=-1)) + 1
        inside = np.flatnonzero(target >= 0)
        if inside.size < target.size:
            logger.info("output_path=%r: %d stored rows are not inputs of this run", self.path,
                        target.size - inside.size)
        unique, at, copies = np.unique(target[inside], return_index=True, return_counts=True)  # the first found
        self.repeated = unique[copies > 1]  # inputs stored more than once, for a caller that must refuse them
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
        target = self._targets(pa.concat_arrays([self._failed[f][0] for f in files]), ids, len(where))
        latest = np.flatnonzero(target >= 0)[::-1]
        latest = latest[where[target[latest]] < 0]
        positions, first = np.unique(target[latest], return_index=True)
        causes = pa.concat_arrays([self._failed[f][1] for f in files])
        return dict(zip(positions.tolist(), causes.take(pa.array(latest[first])).to_pylist()))

    def unchecked(self) -> np.ndarray:
        """The ``int64`` positions of the stored rows not yet checked against this run's inputs (:meth:`check_inputs`):
        a run hashes only these, so that a caller who checked them before (the command line, before its model
        loads) costs no second tokenization of them."""
        return np.flatnonzero(self.done & ~self._checked)

    def check_inputs(self, positions: np.ndarray, hashes: np.ndarray) -> None:
        """Refuses (``ValueError``) stored rows whose input hash differs from this run's ``hashes`` at ``positions``."""
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
        shown = first_few(differ[:6].tolist() if self.ids is None else self.ids.take(pa.array(differ[:6])).to_pylist())
        raise ValueError(
            f"output_path={self.path!r} should hold results of these inputs at their {what}, but got {differ.size} "
            f"stored rows computed from other inputs ({what} {shown}): the texts, their order, the tokenizer or "
            f"its settings differ from the run that stored them ({_key(self.key)}); use another output_path"
            + ("" if self.ids is not None else ", or give the loader ids= to key rows by id (a grown or reordered "
               "corpus)"))

    # -- writing -------------------------------------------------------------------------------------------------
    def writer(self, name: Any, *, ids: pa.Array | None = None, exact: bool = False) -> StoreWriter:
        """A :class:`StoreWriter` (``name``: unique per writer of this run; ``ids``: the rows' ids, which positions
        index; ``exact``: shards named ``part-<name>-<seq>``, so that a rewrite replaces them)."""
        name = re.sub(r"[^\w.]", "_", str(name))
        with self._lock:
            self._writers += 1
        return StoreWriter(self, name if exact else f"{self.run}_{name}", ids)

    def admit(self, rows: Sequence[Any], varying: Collection[tuple] | None) -> dict:
        """Each column's values of ``rows``, fitted to the store's fields before they are buffered; a
        ``RuntimeError`` before :meth:`check_inputs`."""
        if self._unchecked:
            raise RuntimeError(f"output_path={self.path!r}: {self._unchecked} stored rows of this run's inputs should "
                               "be checked (store.check_inputs) before the run writes, so that a run over other "
                               "inputs is refused before it writes a row")
        with self._lock:
            self.columns = self.columns or Columns.of(rows[0])
        parts = self.columns.parts(rows)  # the rows joined into columns outside the lock: writers convert at once
        self.fit([parts], varying or (), check=varying is not None)
        return parts

    def fit(self, parts: list[dict], varying: Collection[tuple], *, fix: bool = False,
            check: bool = True) -> list[pa.Field]:
        """The output fields holding ``parts`` and the rows before them (widening those no shard typed yet;
        ``varying``: the row paths of per-token tensors; ``check``: whether they are known, to check against the rows
        stored); ``fix``: a shard's, typing its columns for every later one."""
        with self._lock:
            declared = self.columns.at(varying)
            if check:
                self._check_reading([n for n in self.columns.names if any(p[n].kind is not None for p in parts)],
                                    declared)
            fitted = self.columns.fit(parts, self._fields, self._fixed, declared)
            self._fields.update(fitted)
            if fix:
                self._fixed.update(name for name, field in fitted.items() if not pa.types.is_null(field.type))
            return list(fitted.values())

    def _check_reading(self, names: list[str], declared: set[str]) -> None:
        """Refuses rows of a column read otherwise than the rows stored (cut per token, or given one per row, against
        kept whole as the batch gave them): another ``fn`` or ``token_outputs``, whose rows the types can hide."""
        for name in names:
            if self._varied.setdefault(name, name in declared) != (name in declared):
                said = {True: "each its own length (cut per token by the attention mask, generated ids, or given one "
                              "per row)", False: "whole (each row as its batch gave it)"}
                raise ValueError(
                    f"{name} should be read as the rows stored at output_path={self.path!r} were, "
                    f"{said[self._varied[name]]}, but got rows read {said[name in declared]}: fn's output or "
                    "token_outputs differ from the run that stored them, and the two would mix in one column; use the "
                    "same fn and token_outputs, or another output_path")

    def _schema(self, fields: list[pa.Field]) -> pa.Schema:
        """A shard's schema of ``fields``, its metadata: format, key, keying and the rows' structure, under ``META``,
        and their checksum with the column names, under ``CHECK`` (the footer has no checksum of its own)."""
        meta = {"format": FORMAT, "key": self.key, "keyed_by": self.keyed_by}
        if self.columns is not None:
            meta.update(tree=self.columns.tree, kinds=dict(self.columns.kinds), varied=dict(self._varied))
        encoded = json.dumps(meta).encode()
        return pa.schema(fields, metadata={META: encoded, CHECK: footer_check(encoded, [f.name for f in fields])})

    def shard(self, positions: np.ndarray, hashes: np.ndarray, ids: pa.Array | None, outputs: pa.Table) -> pa.Table:
        """A shard's table: the key columns (``position`` or ``id``, ``input_hash``) of rows of input ``positions``
        (``ids``: the writer's own, which positions index), then ``outputs``, with the shard's metadata."""
        key = pa.array(positions) if self.keyed_by == "position" else (self.ids if ids is None else ids).take(positions)
        schema = self._schema([pa.field(self.keyed_by, key.type), pa.field("input_hash", pa.uint64()), *outputs.schema])
        return pa.Table.from_arrays([key, pa.array(hashes, pa.uint64()), *outputs.columns], schema=schema)

    def retyped(self, schema: pa.Schema) -> pa.Schema:
        """A shard's ``schema`` with the output fields as the committed shards type them (``null``: none typed it yet),
        so that rewritten or merged shards share one schema."""
        with self._lock:
            stored = [self._fields[n] if n in self._fixed else pa.field(n, pa.null()) for n in self.columns.names]
            keys = [field for field in schema if field.name not in self.columns.names]
            return self._schema([*keys, *stored])

    def check_held(self) -> None:
        """Refuses a commit once the store is no longer held by this job (:class:`StoreBusyError`)."""
        if not self.lock.held:
            raise StoreBusyError(f"output_path={self.path!r} should be held by this job while it writes, but "
                                 + ("another job took it over (this process's heartbeat was not refreshed for longer "
                                    "than the lease)" if self.lock.lost else "the store was closed")
                                 + "; the rows not committed are not stored")

    def writer_closed(self) -> None:
        """One writer fewer: the store's lock is given up after the last, once the store is closed."""
        with self._lock:
            self._writers -= 1
            if self._closing and not self._writers:
                self.lock.release()

    def settle(self) -> None:
        """Rewrites the shards whose columns are narrower than the store's (``None`` in every row of the shard), so
        that a reader taking one shard's schema reads them all; with no writer writing."""
        with self._lock:
            if self.columns is None or not self.lock.held:
                return
            for file, entry in list(self._shards.items()):
                schema = self.retyped(pa.schema(entry.fields))
                if all(same_field(f, schema.field(f.name)) for f in entry.fields):
                    continue
                with contextlib.suppress(FileNotFoundError):  # merged meanwhile: the merged shard is typed
                    table = read_whole(file)
                    write_whole(os.path.dirname(file), os.path.basename(file), table.cast(self.retyped(table.schema)))
                    self._shards[file] = entry._replace(fields=list(schema))

    def located(self, n: int) -> Located:
        """Where each of ``n`` inputs' rows is, and the latest cause of each input failed and not stored since: the
        end of a run's one scan of the store, shards settled first."""
        with self._lock:
            self._scan(verify=False)
            self.settle()
            ids, where, _ = self._locate(n)
            if n and self.lock.held and (where >= 0).all():  # the shards set aside are stored again: removed
                folder = pathlib.Path(self.path)
                for torn in [*folder.glob(f"{SET_ASIDE}*"), *folder.joinpath(FAILED).glob(f"{SET_ASIDE}*")]:
                    logger.info("output_path=%r: removing %s, set aside: every input is stored again", self.path,
                                torn.name)
                    remove(torn)
            files = self.files
            return Located(self.path, files, [len(self._shards[f].keys) for f in files], where, self.columns,
                           self.schema, ids, self._failures_at(where, ids))

    def close(self, *, job_done: bool = False) -> None:
        """Gives the store's job lock up once every writer has closed; ``job_done``: the job is over, every record of
        it removed now. Idempotent."""
        with self._lock:
            self._closing = True
            if job_done:
                self.lock.release_job()
            elif not self._writers:
                self.lock.release()


open_store = Store  # the results store at a path, opened: see Store
