"""The results store of ``run(..., output_path=...)``: a directory of Parquet shards, one row per input.

Each shard, ``part-<writer>-<seq>.parquet``, holds finished rows: ``position``
(``int64``; ``-1`` for rows of a Ray Data job, which have no input position),
``id`` (when the loader was given ``ids=``, or a Ray Data job's id column), ``input_hash`` (a
64-bit hash of the row's inputs, :func:`dynabatch._digest.row_hashes`) and the
output columns (:mod:`dynabatch.inference._columns`). Its Arrow schema
metadata holds the store's format, the run's ``key``, what rows are keyed by
and the output layout, so every shard describes itself and the directory holds
nothing but Parquet files: pandas, polars, ``datasets`` and
``pyarrow.dataset`` read it as it is. (A separate manifest file would make
``polars.read_parquet(path)`` refuse the directory, and could only learn the
output layout by being rewritten, a race between processes.)

Shards are written whole or not at all (:mod:`dynabatch.inference._shards`),
by any number of processes (ranks, reruns), each under its own writer name.

:class:`ResultsStore` opens a store for a run (:func:`open_store`): it refuses
another ``key``, another keying, a JSONL results file of earlier versions, or
stored rows whose input hash differs from this run's inputs; it says which
rows are done, and gives a :class:`~dynabatch.inference._shards.StoreWriter`
for this run's rows and a
:class:`~dynabatch.inference.results.StoredRunResult` reading them back.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dynabatch._validation import bad_value
from dynabatch.inference._columns import Layout
from dynabatch.inference._shards import StoreWriter, own_entry, remove_dead_temps, settle_shards, shard_meta

__all__ = ["FORMAT", "ResultsStore", "open_store", "refuse_jsonl"]

logger = logging.getLogger(__name__)

FORMAT = "dynabatch.store/1"
_FEW = 5


def _few(values: Any) -> str:
    values = list(values)
    return ", ".join(str(v) for v in values[:_FEW]) + (", ..." if len(values) > _FEW else "")


def refuse_jsonl(path: str) -> None:
    """Refuses what earlier versions of ``run`` wrote (a JSONL file, per-rank JSONL files) or a path meant for them."""
    root, ext = os.path.splitext(path)
    ranks = sorted(glob.glob(glob.escape(root) + ".rank*-of-*" + glob.escape(ext))) if ext else []
    if os.path.isfile(path):
        what = "a file of JSONL results written by an earlier dynabatch" if ext.lower() == ".jsonl" else "a file"
    elif ranks:
        what = f"per-rank JSONL files ({_few(os.path.basename(r) for r in ranks)})"
    elif ext.lower() in (".jsonl", ".json"):
        what = f"a path ending in {ext}"
    else:
        return
    raise ValueError(
        f"output_path should be a directory for a Parquet results store (say 'results/'), but got "
        f"output_path={path!r}, {what}: results are now stored as Parquet shards with a key; pass a new "
        "directory (rerunning there recomputes the rows: a JSONL file cannot tell which model made it)"
    )


def _describe_key(key: str | None) -> str:
    return "no key" if key is None else f"key={key!r}"


class ResultsStore:
    """A results store opened for one run over ``n`` inputs (``None``: as many as the store's positions say).

    Args:
        path: the store's directory (created when missing; an existing one must
            be empty or a dynabatch store).
        key: what computed the rows (model, revision, settings); must equal the stored one.
        n: the run's number of inputs.
        ids: one id per input (an Arrow array of str or int64), or ``None`` to key rows by position.
        keyed_by: ``"id"`` with ``ids=None``: the run's inputs are every id the store holds (a job whose ids
            stream in, :func:`dynabatch.ray.map_texts`); ``None``: by ``ids``.

    Attributes:
        layout: the stored output :class:`~dynabatch.inference._columns.Layout`, or ``None`` for an empty store.
        done: which of this run's inputs the store holds (bool per input position).
        shard_of, row_of: where each input's stored row is (``-1``: not stored).
        stored_hash: each stored row's input hash.
    """

    def __init__(self, path: str, *, key: str | None, n: int | None, ids: pa.Array | None = None,
                 keyed_by: str | None = None) -> None:
        refuse_jsonl(path)
        self.path, self.key, self.ids = path, key, ids
        self.keyed_by = keyed_by or ("position" if ids is None else "id")
        self._stored_ids = ids is None and self.keyed_by == "id"  # the inputs are the ids stored
        if os.path.exists(path) and not os.path.isdir(path):  # a socket, a device
            raise bad_value("output_path", "a directory (a Parquet results store)", path)
        os.makedirs(path, exist_ok=True)
        self._open(n)

    def _open(self, n: int | None) -> None:
        """Lists the shards, checks what they were stored with, and indexes this run's inputs in them."""
        path = self.path
        names = sorted(os.listdir(path))
        foreign = [name for name in names if not own_entry(name)]
        if foreign:
            raise ValueError(f"output_path should be a new or empty directory, or a dynabatch results store, but got "
                             f"output_path={path!r} holding {len(foreign)} other entries ({_few(foreign)}); use "
                             "another directory")
        remove_dead_temps(path, names)
        self.files: list[str] = []
        metas = []
        for name in names:
            if name.startswith("part-"):
                meta = shard_meta(path, os.path.join(path, name))
                if meta is not None:
                    self.files.append(os.path.join(path, name))
                    metas.append(meta)
        self.layout = self._check(metas)
        if len({m["layout"] for m in metas}) > 1:  # shards stored before a column's type settled: one schema again
            settle_shards(path, self.layout, list(zip(self.files, metas)))
        self._index(n)

    def _check(self, metas: list[dict]) -> Layout | None:
        if not metas:
            return None
        for field_name, value in (("format", FORMAT), ("key", self.key), ("keyed_by", self.keyed_by)):
            found = sorted({json.dumps(m.get(field_name)) for m in metas})
            if found == [json.dumps(value)]:
                continue
            stored = [json.loads(f) for f in found]
            if field_name == "format":
                raise ValueError(f"output_path={self.path!r} should hold results in dynabatch's format {FORMAT!r}, "
                                 f"but got {stored}: read it with the dynabatch that wrote it, or use a new directory")
            if field_name == "key":
                keys = " and ".join(_describe_key(k) for k in stored)
                raise ValueError(
                    f"key should be the key the results at output_path={self.path!r} were stored with ({keys}) to "
                    f"resume them, but got {_describe_key(self.key)}: pass that key if the model and settings are "
                    "the same, or another output_path for another model or settings")
            rule = "given (the store keys rows by id)" if stored == ["id"] else "None (the store keys rows by position)"
            raise ValueError(f"the loader's ids should be {rule}, as for the results at output_path={self.path!r}, "
                             f"but got rows keyed by {self.keyed_by}: use the same ids, or another output_path")
        layouts = sorted({m["layout"] for m in metas})
        merged = Layout.merge([Layout.from_json(text) for text in layouts])  # columns that settled in later shards
        if merged is None:
            raise ValueError(f"output_path={self.path!r} should hold rows of one layout, but got {len(layouts)}: "
                             f"{layouts}; use another output_path")
        return merged

    def _index(self, n: int | None) -> None:
        """Reads every shard's keys and input hashes: where each of this run's inputs is stored, if it is."""
        key_column = self.keyed_by
        tables = [pq.read_table(file, columns=[key_column, "input_hash"]) for file in self.files]
        if self._stored_ids:
            self.ids = self._every_stored_id(tables)
            n = len(self.ids)
        shards, rows, targets, hashes = [], [], [], []
        for s, table in enumerate(tables):
            keys = table.column(key_column)
            if self.ids is None:
                target = keys.to_numpy()
            elif keys.type != self.ids.type:
                raise ValueError(f"the loader's ids should be of type {keys.type}, as the ids of the results at "
                                 f"output_path={self.path!r}, but got ids of type {self.ids.type}: use the same ids")
            else:  # the stored ids' positions in this run, through Arrow (no dict per row); -1: not in this run
                target = pc.fill_null(pc.index_in(keys, value_set=self.ids), -1).to_numpy()
            shards.append(np.full(len(target), s, dtype=np.int32))
            rows.append(np.arange(len(target), dtype=np.int64))
            targets.append(np.asarray(target, dtype=np.int64))
            hashes.append(table.column("input_hash").to_numpy())
        target = np.concatenate(targets) if targets else np.zeros(0, dtype=np.int64)
        if n is None:
            n = int(target.max()) + 1 if target.size else 0
        self.n = n
        inside = (target >= 0) & (target < n)
        if (~inside).any():
            logger.info("output_path=%r: %d stored rows are not inputs of this run", self.path, int((~inside).sum()))
        first = np.flatnonzero(inside)
        unique, at = np.unique(target[first], return_index=True)  # one stored row per input: the first found
        if len(unique) < len(first):
            logger.warning("output_path=%r: %d inputs are stored more than once; reading the first copy", self.path,
                           len(first) - len(unique))
        chosen = first[at]
        self.shard_of = np.full(n, -1, dtype=np.int32)  # the attribute ``done`` below is shard_of >= 0
        self.row_of = np.zeros(n, dtype=np.int64)
        self.stored_hash = np.zeros(n, dtype=np.uint64)
        if chosen.size:
            self.shard_of[unique] = np.concatenate(shards)[chosen]
            self.row_of[unique] = np.concatenate(rows)[chosen]
            self.stored_hash[unique] = np.concatenate(hashes)[chosen]
        self.done = self.shard_of >= 0  # which of this run's inputs the store holds

    def _every_stored_id(self, tables: list[pa.Table]) -> pa.Array:
        """Every id the shards hold, once (in the order first stored); an empty ``null`` array for an empty store."""
        types = sorted({str(table.column("id").type) for table in tables})
        if len(types) > 1:
            raise ValueError(f"output_path={self.path!r} should hold ids of one type, but got ids of types {types}: "
                             "use another output_path")
        if not tables:
            return pa.array([], type=pa.null())
        return pc.unique(pa.chunked_array([table.column("id") for table in tables]).combine_chunks())

    def check_inputs(self, positions: np.ndarray, hashes: np.ndarray) -> None:
        """Refuses stored rows whose input hash differs from this run's input at the same position (or id)."""
        positions = np.asarray(positions, dtype=np.int64)
        inside = positions < self.n
        positions, hashes = positions[inside], np.asarray(hashes)[inside]
        stored = self.shard_of[positions] >= 0
        differ = positions[stored & (self.stored_hash[positions] != hashes)]
        if not differ.size:
            return
        differ.sort()
        where = (f"ids {_few(self.ids.take(pa.array(differ[:_FEW])).to_pylist())}" if self.ids is not None
                 else f"positions {_few(differ.tolist())}")
        raise ValueError(
            f"output_path={self.path!r} should hold results of these inputs at their "
            f"{'ids' if self.ids is not None else 'positions'}, but got {differ.size} stored rows computed from "
            f"other inputs ({where}): the texts, their order, the tokenizer or its settings differ from the run "
            f"that stored them ({_describe_key(self.key)}); use another output_path"
            + ("" if self.ids is not None else ", or give the loader ids= to key rows by id (a grown or "
               "reordered corpus)")
        )

    def result(self, n: int, *, report: Any = None, failed: list[int] | None = None) -> Any:
        """A :class:`~dynabatch.inference.results.StoredRunResult` of ``n`` inputs over the store as it is now
        (shards every writer committed so far; ``failed=None``: every input without a stored row)."""
        from dynabatch.inference.results import StoredRunResult

        self._open(n)
        return StoredRunResult(self, report=report, failed=failed)

    def meta(self) -> dict:
        """What every shard of this store says about itself, but its layout."""
        return {"format": FORMAT, "key": self.key, "keyed_by": self.keyed_by}

    def writer(self, name: str) -> StoreWriter:
        """A :class:`StoreWriter` for this run's rows (``name`` in its shards' names), continuing the stored layout."""
        return StoreWriter(self.path, self.meta(), self.layout, self.ids, rank=name)


def open_store(output_path: Any, *, key: str | None, n: int | None, ids: Any = None) -> ResultsStore:
    """The results store at ``output_path`` for a run over ``n`` inputs (``None``: as many as stored), keyed by
    ``ids`` or by position; refuses another key, another keying or what is not a store."""
    return ResultsStore(os.fspath(output_path), key=key, n=n, ids=ids)
