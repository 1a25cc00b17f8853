"""What :func:`dynabatch.run` returns and raises: :class:`RunResult`, :class:`StoredRunResult` and an error.

In memory (a ``list``), or read from the results store on demand exactly as the in-memory run gives them; both stack
every row through one encoding (:class:`~dynabatch.inference.columns.Columns`).

Example:
    >>> import torch
    >>> from dynabatch.inference.results import RunResult
    >>> result = RunResult([torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])])
    >>> result.numpy().shape, result.stack().dtype, result.to_arrow().column_names
    ((2, 2), torch.float32, ['position', 'output'])
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from dynabatch.inference.report import RunReport

if TYPE_CHECKING:
    import pyarrow as pa

    from dynabatch.inference.columns import Columns
    from dynabatch.inference.store import Located

__all__ = ["RunResult", "StoredRunResult"]

_CHUNK = 4096  # rows decoded at once when iterating a stored result


def _with_outputs(n: int, ids: pa.Array | None, outputs: pa.Table | None) -> pa.Table:
    """``position`` (and ``id``) of ``n`` inputs, then the output columns."""
    import pyarrow as pa

    keys = pa.table({"position": pa.array(np.arange(n, dtype=np.int64)), **({"id": ids} if ids is not None else {})})
    return keys if outputs is None else pa.Table.from_arrays([*keys.columns, *outputs.columns],
                                                             schema=pa.schema([*keys.schema, *outputs.schema]))


class _Stacking:
    """``numpy()``, ``stack()`` and ``to_arrow()`` over ``_table()``: the columns and one row per input."""

    def to_arrow(self) -> pa.Table:
        """One row per input, in input order: ``position`` (and ``id``), then the output columns; no result -> null."""
        return self._table()[1]

    def _stacked(self, as_tensor: bool) -> Any:
        missing = self._missing()
        if missing.size:
            shown = ", ".join(str(p) for p in missing[:5].tolist()) + (", ..." if missing.size > 5 else "")
            raise ValueError(f"every input should have a result to stack them, but got {missing.size} inputs without "
                             f"one (positions {shown}; see .failed); read the others one by one or with to_arrow()")
        columns, table = self._table()
        if columns is None:
            raise ValueError("the inputs should have results to stack, but got none (no input)")
        return columns.stack(table, as_tensor=as_tensor)

    def numpy(self) -> Any:
        """Every row stacked into one numpy array ``(n_inputs, *row shape)`` (``bfloat16`` as ``float32``; maybe Arrow's
        read-only memory); ``ValueError`` for an input without a result, or rows of different shapes."""
        return self._stacked(as_tensor=False)

    def stack(self) -> Any:
        """Every row stacked into one tensor (dtype kept, ``bfloat16`` too), like ``torch.stack(rows)``."""
        return self._stacked(as_tensor=True)


class RunResult(list, _Stacking):
    """One result per input text, in input order: a plain ``list`` (``result[p]`` is input ``p``'s), with ``report``
    (the :class:`~dynabatch.inference.report.RunReport`), ``failures`` (input position -> cause, for the inputs set
    aside: rows out of memory on their own with ``on_oom="skip"``, rows ``fn`` raised on with ``on_error="skip"``,
    inputs skipped as bad) and ``failed``, their sorted positions (each result ``None``)."""

    def __init__(self, results: Iterable[Any] = (), *, report: RunReport | None = None,
                 failures: Mapping[int, str] | None = None) -> None:
        super().__init__(results)
        self.report = report if report is not None else RunReport()
        self.failures = dict(sorted((failures or {}).items()))
        self.failed = list(self.failures)

    def _missing(self) -> np.ndarray:
        return np.flatnonzero(np.fromiter((r is None for r in self), dtype=bool, count=len(self)))

    def _table(self) -> tuple[Columns | None, pa.Table]:
        """The rows as a results store holds them, their types fixed by all of them."""
        import pyarrow as pa

        from dynabatch.inference.columns import Columns

        present = np.fromiter((r is not None for r in self), dtype=bool, count=len(self))
        rows = [r for r in self if r is not None]
        if not rows:
            return None, _with_outputs(len(self), None, None)
        columns = Columns.of(rows[0])
        outputs = columns.table([columns.parts(rows)]).take(pa.array(np.cumsum(present) - 1, mask=~present))
        return columns, _with_outputs(len(self), None, outputs)


class StoredRunResult(Sequence, _Stacking):
    """One result per input, in input order, read from the results store at ``path`` on demand, through
    ``pyarrow.dataset``: ``result[p]`` reads its shard (the last one is kept), iterating reads the store once. Not
    a ``list``: use :meth:`stack` rather than ``torch.stack``. ``report``, ``failures`` (the store's failure
    records) and ``failed`` as in :class:`RunResult`."""

    def __init__(self, path: str, files: list[str], counts: list[int], where: np.ndarray, columns: Columns | None,
                 schema: pa.Schema | None, ids: pa.Array | None, *, report: RunReport | None = None,
                 failures: Mapping[int, str] | None = None) -> None:
        self.path, self._files, self._where, self._columns, self._schema, self._ids = \
            path, files, where, columns, schema, ids
        self._starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        self.report = report if report is not None else RunReport()
        self.failures = dict(sorted((failures or {}).items()))
        self.failed = list(self.failures)
        self._shard: tuple[int, Any] = (-1, None)  # the last shard read, and its output columns

    @classmethod
    def of(cls, located: Located, *, report: RunReport | None = None,
           failures: Mapping[int, str] | None = None) -> StoredRunResult:
        """The result over a store's rows as :meth:`~dynabatch.inference.store.Store.located` found them."""
        return cls(*located, report=report, failures=failures)

    def __len__(self) -> int:
        return len(self._where)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self)} inputs, {int((self._where >= 0).sum())} stored at {self.path!r})"

    def _missing(self) -> np.ndarray:
        return np.flatnonzero(self._where < 0)

    def _read(self, files: list[str]) -> pa.Table:
        """The output columns of ``files`` through ``pyarrow.dataset`` (the store's schema, checksums verified)."""
        import pyarrow.dataset as ds

        scan = ds.ParquetFileFormat(default_fragment_scan_options=ds.ParquetFragmentScanOptions(
            page_checksum_verification=True))
        return ds.dataset(files, schema=self._schema, format=scan).to_table(columns=self._columns.names)

    def _ordered(self, start: int = 0, stop: int | None = None, whole: pa.Table | None = None) -> pa.Table:
        """The output rows of inputs ``start:stop``, in input order (null: not stored)."""
        import pyarrow as pa

        rows = self._where[start:stop]
        return (self._read(self._files) if whole is None else whole).take(pa.array(rows, mask=rows < 0))

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        n, i = len(self), int(index)
        if not -n <= i < n:
            raise IndexError(f"index should be in range(-{n}, {n}), but got index={index!r}")
        row = int(self._where[i % n])
        if row < 0:
            return None
        s = int(np.searchsorted(self._starts, row, side="right")) - 1
        if self._shard[0] != s:
            self._shard = (s, self._read([self._files[s]]))
        return self._columns.rows(self._shard[1].slice(row - int(self._starts[s]), 1))[0]

    def __iter__(self) -> Iterator[Any]:
        whole = self._read(self._files) if self._columns is not None else None  # read once, decoded in chunks
        for start in range(0, len(self), _CHUNK):
            where = self._where[start:start + _CHUNK].tolist()
            rows = self._columns.rows(self._ordered(start, start + _CHUNK, whole)) if whole is not None else where
            yield from (None if p < 0 else row for p, row in zip(where, rows))

    def _table(self) -> tuple[Columns | None, pa.Table]:
        outputs = self._ordered() if self._columns is not None else None
        return self._columns, _with_outputs(len(self), self._ids, outputs)
