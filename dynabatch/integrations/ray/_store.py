"""A predictor's results store: each window's new rows as one shard of :func:`dynabatch.run`'s store, keyed by id.

A predictor given ``output_path`` opens the store of ``run(..., output_path=...)``
(:mod:`dynabatch.inference.store`: Parquet shards committed atomically, each
row with its id, its input hash and the output columns, every shard naming the
``key``) keyed by the window's id column. For every window it runs only the
rows whose id the store does not hold yet, checks that the rows it holds were
computed from the same inputs (their input hashes, from the window's texts
tokenized as the loader tokenizes them), and commits the rows it ran as one
shard named after their ids and input hashes, so that a window Ray runs again
(an actor that died after committing it) replaces its shard instead of adding a
second copy, while the same ids of other texts (an id in two windows) do not
replace the first window's rows.

Example:
    >>> import tempfile
    >>> from dynabatch.integrations.ray._store import WindowStore
    >>> store = WindowStore(tempfile.mkdtemp(), key="demo", id_column="id")
    >>> held, _ = store.held(store.window_ids([3, 4]))
    >>> held.tolist()
    [False, False]
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

import numpy as np

from dynabatch._digest import fingerprint
from dynabatch._validation import bad_type, bad_value
from dynabatch.data.ids import check_ids
from dynabatch.data.input_hashes import token_store_hashes
from dynabatch.inference.options import check_store_arguments
from dynabatch.inference.store import Store
from dynabatch.inference.store import open_store as open_results_store
from dynabatch.integrations.ray._columns import check_column

__all__ = ["SUMMARY", "WindowStore", "check_id_type", "check_store_options", "column_ids"]

logger = logging.getLogger(__name__)

SUMMARY = ("rows", "held", "ran", "failed")
"""The columns a predictor with ``output_path`` returns, one row per window: its rows, those the store held
already, those run now, and those of them without a result (not stored: a rerun tries them again)."""


KEYED_BY = ("id", "position")


def check_store_options(output_path: Any, key: Any, id_column: Any, keyed_by: Any = "id", job: Any = None,
                        report_column: Any = None) -> None:
    """Refuses a bad ``output_path``, ``key`` (a str, only with ``output_path``), ``id_column``, ``keyed_by`` (one
    of :data:`KEYED_BY`), ``job`` or ``report_column`` (a str, only with ``output_path``)."""
    check_store_arguments(output_path, key)
    check_column("id_column", id_column)
    if keyed_by not in KEYED_BY:
        raise bad_value("keyed_by", f"one of {KEYED_BY}", keyed_by)
    for name, value in (("job", job), ("report_column", report_column)):
        if value is None:
            continue
        if not isinstance(value, str) or not value:
            raise (bad_type if not isinstance(value, str) else bad_value)(name, "None or a non-empty str", value)
        if output_path is None:
            raise bad_value(name, "None without output_path", value)


def column_ids(values: Any, id_column: str) -> Any:
    """``values``, the ``id_column`` column of a window or a whole dataset, checked by :func:`check_ids` (the one rule
    of ids, :func:`dynabatch.run`'s and the command line's: one unique str or int per row, none missing); its refusal
    names the column first, as the command line's names ``--id-column``.

    Example:
        >>> column_ids([3, None], "doc")
        Traceback (most recent call last):
        ...
        ValueError: id_column='doc': ids should give every text an id, but got 1 missing (None, NaN) at positions 1
    """
    try:
        return check_ids(values, len(values))
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"id_column={id_column!r}: {exc}") from exc


def check_id_type(store: Store, kind: Any, id_column: str) -> None:
    """Refuses (``ValueError``) ids of Arrow type ``kind`` (``string`` or ``int64``, as :func:`check_ids` makes
    them) for a ``store`` keyed by ids of the other type; a store holding no ids takes either."""
    if len(store.ids) and kind != store.ids.type:
        raise ValueError(f"the id_column={id_column!r} column should hold ids of type {store.ids.type}, as the ids "
                         f"of the results at output_path={store.path!r}, but got ids of type {kind}: use the same "
                         "ids")


def open_store(output_path: Any, key: str | None, *, verify: bool = True, keyed_by: str = "id",
               job: str | None = None) -> Store:
    """The results store at ``output_path`` keyed by id (its inputs every id it holds) or by position (refuses
    another ``key``), held for ``job`` (``None``: this Ray job, the driver and every actor); ``verify``: every shard
    read whole, its page checksums verified (the driver does it once, not each actor)."""
    return open_results_store(os.path.abspath(os.fspath(output_path)), key=key, keyed_by=keyed_by, verify=verify,
                              job=job if job is not None else _ray_job())


def _ray_job() -> str:
    """The job string of this process's Ray job, which its driver and actors share; outside Ray (predictors called
    in one process, as windows of one job), this process's."""
    try:
        import ray
    except ImportError:
        ray = None
    if ray is not None and ray.is_initialized():
        return f"ray job {ray.get_runtime_context().get_job_id()}"
    return f"ray predictors of process {socket.gethostname()}:{os.getpid()}"


class WindowStore:
    """The results store a predictor writes its windows to (see the module).

    Args:
        output_path: the store's directory, reachable from every actor (a local or shared file system).
        key: what computes the rows (model, revision, settings); must equal the stored one.
        id_column: the column of the windows holding each row's id (str or int, unique in the dataset), or its
            position in the corpus (``keyed_by="position"``).
        keyed_by: ``"id"`` or ``"position"`` (see :class:`~dynabatch.integrations.ray.DynamicBatchPredictor`).
        job: the job the store's lock is held for (``None``: this Ray job).

    Raises:
        ValueError: the store holds rows of another ``key`` or keying, or is no dynabatch store.
    """

    def __init__(self, output_path: Any, *, key: str | None, id_column: str, keyed_by: str = "id",
                 job: str | None = None) -> None:
        self.store = open_store(output_path, key, verify=False, keyed_by=keyed_by, job=job)
        self.path, self.key, self.id_column, self.keyed_by = self.store.path, key, id_column, keyed_by
        self._index: Any = None  # stored id -> its place in store.ids, built at the first window
        if int(self.store.done.sum()):
            logger.info("output_path=%r holds %d rows (key=%r)", self.path, int(self.store.done.sum()), key)

    def window_ids(self, values: Any) -> Any:
        """The window's ids as an Arrow array, checked: one unique str or int per row, of the stored ids' type (or,
        keyed by position, int positions >= 0)."""
        ids = column_ids(values, self.id_column)
        if self.keyed_by == "position":
            import pyarrow as pa
            import pyarrow.compute as pc

            if len(ids) and not (pa.types.is_integer(ids.type) and pc.min(ids).as_py() >= 0):
                raise bad_value("id_column", "a column of int positions >= 0 with keyed_by='position'",
                                self.id_column)
            return ids
        if len(ids):
            check_id_type(self.store, ids.type, self.id_column)
        return ids

    def held(self, ids: Any) -> tuple[np.ndarray, np.ndarray]:
        """Which of the window's rows the store holds (bool per row), and each one's input position in the store."""
        if self.keyed_by == "position":
            where = np.asarray(ids.to_numpy(zero_copy_only=False), dtype=np.int64)
            held = np.zeros(len(where), dtype=bool)
            inside = where < self.store.n
            held[inside] = self.store.done[where[inside]]
            return held, where
        if not len(self.store.ids):
            return np.zeros(len(ids), dtype=bool), np.full(len(ids), -1, dtype=np.int64)
        if self._index is None:  # built once per actor: a lookup per window stays O(window), not O(store)
            import pandas as pd

            self._index = pd.Index(self.store.ids.to_numpy(zero_copy_only=False))
        where = np.asarray(self._index.get_indexer(ids.to_numpy(zero_copy_only=False)), dtype=np.int64)
        return where >= 0, where

    def check(self, where: np.ndarray, tokenized: Any) -> None:
        """Refuses held rows whose inputs (``tokenized``, one row each) differ from those their rows were computed from."""
        self.store.check_inputs(where, token_store_hashes(tokenized))

    def write(self, ids: Any, results: list[Any], failures: dict[int, str], tokenized: Any) -> int:
        """Commits the rows that have a result as one shard, and a failure record of each row without one (its
        cause: ``failures``, row -> cause; a rerun runs it again); returns how many rows. ``results[i]`` is row
        ``ids[i]``'s, tokenized as ``tokenized``'s row ``i``."""
        import pyarrow as pa

        failed = np.asarray(sorted(failures), dtype=np.int64)
        keep = np.ones(len(results), dtype=bool)
        keep[failed] = False
        rows = np.flatnonzero(keep)
        if not len(results):
            return 0
        values = ids.to_numpy() if pa.types.is_integer(ids.type) else ids.to_pylist()
        hashes = token_store_hashes(tokenized)
        # The same rows written again (a window Ray runs again) replace their shard; the same ids of other inputs
        # (an id in two windows) do not, so that the store holds both copies for its reader to refuse.
        name = "w" + fingerprint(self.key, values, hashes)
        if self.keyed_by == "position":
            writer, where = self.store.writer(name, exact=True), np.asarray(values, dtype=np.int64)
        else:
            writer, where = self.store.writer(name, ids=ids, exact=True), np.arange(len(results))
        try:
            writer.write(where[rows], [results[i] for i in rows], hashes[rows])
            writer.fail(where[failed], hashes[failed], [failures[int(i)] for i in failed])
        finally:
            writer.close()
        return int(rows.size)
