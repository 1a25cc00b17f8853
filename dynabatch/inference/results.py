"""What :func:`dynabatch.run` returns: :class:`RunResult`, :class:`StoredRunResult`.

Without ``output_path`` the rows are in memory: a :class:`RunResult`, a plain
``list`` (so ``torch.stack(result)`` works). With ``output_path`` they are in
the results store and a :class:`StoredRunResult` reads them back on demand:
``result[p]`` gives exactly what the in-memory run gives (tensors with their
dtype and shape, dicts, tuples). Both stack every row in one call:
``result.numpy()``, ``result.stack()`` (torch, ``bfloat16`` kept) and
``result.to_arrow()`` (one row per input, in input order).

Example:
    >>> import torch
    >>> from dynabatch.inference.results import RunResult
    >>> result = RunResult([torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])])
    >>> result.numpy().shape, result.stack().dtype, result.to_arrow().column_names
    ((2, 2), torch.float32, ['position', 'output'])
"""

from __future__ import annotations

import collections
import collections.abc
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from dynabatch.inference.report import RunReport

if TYPE_CHECKING:
    import pyarrow as pa

    from dynabatch.inference._columns import Layout
    from dynabatch.inference.store import ResultsStore

__all__ = ["RunResult", "StoredRunResult"]

_CHUNK = 4096  # rows decoded at once when iterating a stored result
_CACHED_SHARDS = 2


class _Stacking:
    """``numpy()``, ``stack()`` and ``to_arrow()`` over ``_table()``: the layout and one row per input."""

    failed: list[int]

    def _table(self) -> tuple[Layout | None, pa.Table]:
        raise NotImplementedError

    def _missing(self) -> np.ndarray:
        raise NotImplementedError

    def to_arrow(self) -> pa.Table:
        """One row per input, in input order: ``position`` (and ``id``), then the output columns; no result -> null."""
        return self._table()[1]

    def _stacked(self, as_tensor: bool) -> Any:
        from dynabatch.inference._decode import stack_columns

        missing = self._missing()
        if missing.size:
            shown = ", ".join(str(p) for p in missing[:5].tolist()) + (", ..." if missing.size > 5 else "")
            raise ValueError(
                f"every input should have a result to stack them, but got {missing.size} inputs without one "
                f"(positions {shown}; see .failed); read the others one by one or with to_arrow()")
        layout, table = self._table()
        if layout is None:
            raise ValueError("the inputs should have results to stack, but got none (no input)")
        return stack_columns(layout, {name: table.column(name) for name in layout.specs}, as_tensor=as_tensor)

    def numpy(self) -> Any:
        """Every row stacked into one numpy array, ``(n_inputs, *row shape)`` (a dict, tuple or list of them for
        such rows); ``bfloat16`` comes as ``float32`` (numpy has no ``bfloat16``). The array shares Arrow's
        read-only memory (no second copy of every row): ``np.array(...)`` it to write into it.

        Raises:
            ValueError: an input without a result (failed), or rows of different shapes.
        """
        return self._stacked(as_tensor=False)

    def stack(self) -> Any:
        """Every row stacked into one tensor (dtype kept, ``bfloat16`` too), like ``torch.stack(rows)``."""
        return self._stacked(as_tensor=True)


class RunResult(list, _Stacking):
    """One result per input text, in input order, with what the run did.

    A plain ``list`` otherwise: ``result[p]`` belongs to input ``p``.

    Attributes:
        report: the :class:`~dynabatch.inference.report.RunReport` of the batches that ran.
        failed: sorted input positions without a result: rows that ran out of
            memory on their own (``on_oom="skip"``) and inputs the loader
            skipped as bad (``on_bad_input="skip"``); their results are ``None``.
    """

    def __init__(
        self, results: Iterable[Any] = (), *, report: RunReport | None = None, failed: Iterable[int] = ()
    ) -> None:
        super().__init__(results)
        self.report = report if report is not None else RunReport()
        self.failed = sorted(failed)

    def _missing(self) -> np.ndarray:
        return np.flatnonzero(np.fromiter((r is None for r in self), dtype=bool, count=len(self)))

    def _table(self) -> tuple[Layout | None, pa.Table]:
        import pyarrow as pa

        from dynabatch.inference._columns import Layout

        present = np.fromiter((r is not None for r in self), dtype=bool, count=len(self))
        rows = [r for r in self if r is not None]
        columns = {"position": pa.array(np.arange(len(self), dtype=np.int64))}
        if not rows:
            return None, pa.table(columns)
        layout = Layout.infer(rows)
        take = np.cumsum(present) - 1
        indices = pa.array(take, mask=~present)
        for name, array in layout.encode(rows).items():
            columns[name] = array.take(indices)
        return layout, pa.table(columns)


class StoredRunResult(collections.abc.Sequence, _Stacking):
    """One result per input, in input order, read from the results store on demand (``run(..., output_path=...)``).

    ``result[p]`` is exactly what the run without ``output_path`` gives for
    input ``p`` (``None`` for an input without a result). Iterating reads the
    store once and decodes rows in chunks. It is not a ``list``:
    ``torch.stack(result)`` needs a list, so use :meth:`stack` (or ``list(result)``).

    Attributes:
        path: the store's directory.
        report: the :class:`~dynabatch.inference.report.RunReport` of the batches that ran (in this process).
        failed: sorted input positions without a result (failed or skipped inputs), as in :class:`RunResult`.
    """

    def __init__(self, store: ResultsStore, *, report: RunReport | None = None,
                 failed: Iterable[int] | None = None) -> None:
        self.path = store.path
        self._files = store.files
        self._layout = store.layout
        self._shard_of = store.shard_of
        self._row_of = store.row_of
        self._ids = store.ids
        self.report = report if report is not None else RunReport()
        self.failed = sorted(failed) if failed is not None else np.flatnonzero(self._shard_of < 0).tolist()
        self._cache: collections.OrderedDict[int, pa.Table] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._shard_of)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({len(self)} inputs, {int((self._shard_of >= 0).sum())} stored at "
                f"{self.path!r})")

    def _missing(self) -> np.ndarray:
        return np.flatnonzero(self._shard_of < 0)

    def _columns(self) -> list[str]:
        return list(self._layout.specs) if self._layout is not None else []

    def _shard(self, s: int) -> pa.Table:
        import pyarrow.parquet as pq

        if s not in self._cache:
            self._cache[s] = pq.read_table(self._files[s], columns=self._columns())
            while len(self._cache) > _CACHED_SHARDS:
                self._cache.popitem(last=False)
        self._cache.move_to_end(s)
        return self._cache[s]

    def __getitem__(self, index: Any) -> Any:
        from dynabatch.inference._decode import decode_rows

        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        n = len(self)
        i = int(index)
        if not -n <= i < n:
            raise IndexError(f"index should be in range(-{n}, {n}), but got index={index!r}")
        i %= n
        s = int(self._shard_of[i])
        if s < 0:
            return None
        table = self._shard(s).slice(int(self._row_of[i]), 1)
        return decode_rows(self._layout, {name: table.column(name) for name in self._columns()})[0]

    def _whole(self) -> tuple[pa.Table, np.ndarray]:
        """Every shard's output columns in one table, and each input's row in it (``-1``: none)."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        tables = [pq.read_table(f, columns=self._columns()) for f in self._files]
        starts = np.zeros(len(tables) + 1, dtype=np.int64)
        np.cumsum([t.num_rows for t in tables], out=starts[1:])
        stored = self._shard_of >= 0
        where = np.where(stored, starts[np.maximum(self._shard_of, 0)] + self._row_of, -1)
        if not tables:
            return pa.table({}), where
        return pa.concat_tables(tables), where

    def __iter__(self) -> Iterator[Any]:
        import pyarrow as pa

        from dynabatch.inference._decode import decode_rows

        if self._layout is None:
            yield from (None for _ in range(len(self)))
            return
        table, where = self._whole()
        for start in range(0, len(self), _CHUNK):
            rows = where[start:start + _CHUNK]
            chunk = table.take(pa.array(rows, mask=rows < 0))
            yield from decode_rows(self._layout, {name: chunk.column(name) for name in self._columns()})

    def _table(self) -> tuple[Layout | None, pa.Table]:
        import pyarrow as pa

        columns: dict[str, Any] = {"position": pa.array(np.arange(len(self), dtype=np.int64))}
        if self._ids is not None:
            columns["id"] = self._ids
        if self._layout is None:
            return None, pa.table(columns)
        table, where = self._whole()
        ordered = table.take(pa.array(where, mask=where < 0))
        for name in self._columns():
            columns[name] = ordered.column(name)
        return self._layout, pa.table(columns)
