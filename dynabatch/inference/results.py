"""What :func:`dynabatch.run` returns: :class:`RunResult` (in memory) or :class:`StoredRunResult` (the same rows read
from the results store on demand), both stacked through :class:`~dynabatch.inference.columns.Columns` and carrying
the :class:`Accounting` of the one accountant (:func:`account`).

Example:
    >>> import torch
    >>> from dynabatch.inference.results import RunResult
    >>> result = RunResult([torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])])
    >>> result.numpy().shape, result.stack().dtype, result.to_arrow().column_names
    ((2, 2), torch.float32, ['position', 'output'])
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from dynabatch._validation import first_few
from dynabatch.inference.report import RunReport

if TYPE_CHECKING:
    import pyarrow as pa

    from dynabatch.inference.columns import Columns
    from dynabatch.inference.store import Located

__all__ = ["Accounting", "RunResult", "StoredRunResult", "account"]

_CHUNK = 4096  # rows decoded at once when iterating a stored result


@dataclass(frozen=True)
class Accounting:
    """What a run accounts for of its ``n`` inputs (made by :func:`account`).

    ``stored``: inputs with a row; ``before``: of them, those held before the run (``now``: the others);
    ``failures``: input position -> cause, of the inputs without a row; ``missing``: positions with neither (a run
    raises for them); ``ids``: the inputs' ids (``None``: keyed by position); ``others``: rows a results store holds
    besides one per input (of inputs of an earlier, other corpus, or an input's second copy), which a reader of the
    whole store reads too.
    """

    n: int
    stored: int
    before: int
    now: int
    failures: dict[int, str]
    missing: np.ndarray
    ids: Any = None
    others: int = 0


def account(n: int, held: np.ndarray, failures: Mapping[int, str], *, before: np.ndarray | None = None,
            ids: Any = None, elsewhere: bool = False, rows: int | None = None) -> Accounting:
    """The one accountant: what a run over ``n`` inputs accounts for, from which inputs have a row (``held``), the
    causes of those that failed (``failures``; those with a row since are left out) and which were held before the
    run (``before``); ``elsewhere``: inputs held neither way are another rank's to account for; ``rows``: every row
    a results store holds (``None``: only the inputs').

    Example:
        >>> import numpy as np
        >>> from dynabatch.inference.results import account
        >>> done = account(4, np.array([True, False, True, False]), {1: "ValueError: no", 2: "retried since"},
        ...                before=np.array([True, False, False, False]))
        >>> done.stored, done.before, done.now, done.failures, done.missing.tolist()
        (2, 1, 1, {1: 'ValueError: no'}, [3])
    """
    held = np.asarray(held, dtype=bool)
    failures = {int(p): str(c) for p, c in sorted(failures.items()) if 0 <= p < n and not held[p]}
    stored = int(held.sum())
    kept = int((held & before).sum()) if before is not None and len(before) == n else 0  # stored before the run
    missing = np.zeros(0, dtype=np.int64) if elsewhere else np.setdiff1d(np.flatnonzero(~held), list(failures))
    return Accounting(n, stored, kept, stored - kept, failures, missing, ids, 0 if rows is None else rows - stored)


class _Stacking:
    """``numpy()``, ``stack()`` and ``to_arrow()`` over ``_held()`` (which inputs have a row) and ``_outputs()`` (the
    columns and their table, one row per input; ``(None, None)`` without a row)."""

    def to_arrow(self) -> pa.Table:
        """One row per input, in input order: ``position`` (and ``id``), then the output columns; no result -> null."""
        import pyarrow as pa

        ids = None if self.accounting is None else self.accounting.ids
        keys = pa.table({"position": pa.array(np.arange(len(self), dtype=np.int64)),
                         **({"id": ids} if ids is not None else {})})
        outputs = self._outputs()[1]
        return keys if outputs is None else pa.Table.from_arrays([*keys.columns, *outputs.columns],
                                                                 schema=pa.schema([*keys.schema, *outputs.schema]))

    def _stacked(self, as_tensor: bool) -> Any:
        missing = np.flatnonzero(~self._held())
        if missing.size:
            raise ValueError(f"every input should have a result to stack them, but got {missing.size} inputs without "
                             f"one (positions {first_few(missing.tolist())}; see .failed); read the others one by one "
                             "or with to_arrow()")
        columns, table = self._outputs()
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
    aside), ``failed`` (their sorted positions, each result ``None``), ``accounting`` (``None`` unless made by a
    run) and ``varying`` (the row paths of per-token outputs, cut to each input's tokens: lists in :meth:`to_arrow`
    whatever their lengths, as a results store types them)."""

    def __init__(self, results: Iterable[Any] = (), *, report: RunReport | None = None,
                 failures: Mapping[int, str] | None = None, accounting: Accounting | None = None,
                 varying: Collection[tuple] = ()) -> None:
        super().__init__(results)
        self.varying = frozenset(map(tuple, varying))
        self.report = report if report is not None else RunReport()
        self.failures = dict(sorted((failures or {}).items())) if accounting is None else accounting.failures
        self.failed = list(self.failures)
        self.accounting = accounting

    def _held(self) -> np.ndarray:
        return np.fromiter((r is not None for r in self), dtype=bool, count=len(self))

    def _outputs(self) -> tuple[Columns | None, pa.Table | None]:
        """The rows as a results store holds them, their types fixed by all of them."""
        from dynabatch.inference.columns import Columns

        held = self._held()
        rows = [r for r in self if r is not None]
        if not rows:
            return None, None
        columns = Columns.of(rows[0])
        parts = [columns.parts(rows)]
        fields = columns.fit(parts, varying=columns.at(self.varying))
        return columns, _take(columns.table(parts, list(fields.values())), np.where(held, np.cumsum(held) - 1, -1))


class StoredRunResult(Sequence, _Stacking):
    """One result per input, in input order, read from the results store on demand (``result[p]`` reads its shard,
    iterating reads the store once); not a ``list``: use :meth:`stack` rather than ``torch.stack``. ``report``,
    ``failures`` (the store's failure records), ``failed`` and ``accounting`` as in :class:`RunResult`; ``before``:
    the inputs held before the run."""

    def __init__(self, located: Located, *, report: RunReport | None = None, before: np.ndarray | None = None) -> None:
        self.path, self._located, self._where, self._columns = located.path, located, located.where, located.columns
        self._starts = np.concatenate([[0], np.cumsum(located.counts, dtype=np.int64)])
        self.report = report if report is not None else RunReport()
        self.accounting = account(len(self._where), self._where >= 0, located.failures, before=before,
                                  ids=located.ids, rows=int(self._starts[-1]))
        self.failures = self.accounting.failures
        self.failed = list(self.failures)
        self._shard: tuple[int, Any] = (-1, None)  # the last shard read, and its output columns

    def __len__(self) -> int:
        return len(self._where)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self)} inputs, {int(self._held().sum())} stored at {self.path!r})"

    def _held(self) -> np.ndarray:
        return self._where >= 0

    def _read(self, files: list[str]) -> pa.Table:
        """The output columns of ``files`` through ``pyarrow.dataset`` (the store's schema, checksums verified)."""
        import pyarrow.dataset as ds

        scan = ds.ParquetFileFormat(default_fragment_scan_options=ds.ParquetFragmentScanOptions(
            page_checksum_verification=True))
        return ds.dataset(files, schema=self._located.schema, format=scan).to_table(columns=self._columns.names)

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
            self._shard = (s, self._read([self._located.files[s]]))
        return self._columns.rows(self._shard[1].slice(row - int(self._starts[s]), 1))[0]

    def __iter__(self) -> Iterator[Any]:
        whole = self._read(self._located.files) if self._columns is not None else None  # read once, decoded in chunks
        for start in range(0, len(self), _CHUNK):
            where = self._where[start:start + _CHUNK]
            rows = self._columns.rows(_take(whole, where)) if whole is not None else where
            yield from (None if p < 0 else row for p, row in zip(where.tolist(), rows))

    def _outputs(self) -> tuple[Columns | None, pa.Table | None]:
        if self._columns is None:
            return None, None
        return self._columns, _take(self._read(self._located.files), self._where)


def _take(table: pa.Table, rows: np.ndarray) -> pa.Table:
    """``table``'s rows at ``rows``, in their order (null where ``rows`` is negative: not stored)."""
    import pyarrow as pa

    return table.take(pa.array(rows, mask=rows < 0))
