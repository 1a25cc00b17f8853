"""The sinks of :func:`dynabatch.run` (``docs/architecture.md``, Sink): rows (``writer.write``) and failed inputs
(``writer.fail``) kept in memory or in the results store; ``result(n)``: the run's result and the positions held
neither way.

Example:
    >>> import numpy as np
    >>> from dynabatch.inference.sink import MemorySink
    >>> sink = MemorySink()
    >>> writer = sink.writer("cpu")
    >>> writer.write(np.array([2, 0]), ["c", "a"], None)
    >>> writer.fail(np.array([1]), None, ["ValueError: not this one"])
    >>> writer.close()
    >>> result, missing = sink.result(3)
    >>> list(result), result.failures, missing.tolist()
    (['a', None, 'c'], {1: 'ValueError: not this one'}, [])
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from dynabatch.inference.report import RunReport
from dynabatch.inference.results import RunResult, StoredRunResult, account

__all__ = ["MemorySink", "StoreSink", "open_sink"]


class MemorySink:
    """Rows kept in memory, one per input position, and the inputs that failed with their causes.

    Args:
        gather: with several ranks, :meth:`result` is a collective that brings every rank's rows and failures to
            rank 0 (the other ranks answer for their own).
    """

    stored = None  # holds nothing before the run

    def __init__(self, *, gather: bool = False) -> None:
        self.rows: dict[int, Any] = {}
        self.failures: dict[int, str] = {}
        self.varying: set[tuple] = set()  # row paths of per-token outputs: lists in the result's Arrow table
        self.gather = gather
        self._lock = threading.Lock()  # several devices' workers write at once

    def writer(self, name: str) -> MemorySink:
        """The writer of one worker: this sink itself (writes are kept in one dict)."""
        return self

    def write(self, positions: np.ndarray, rows: list, hashes: np.ndarray | None, varying: Any = ()) -> None:
        with self._lock:
            self.rows.update(zip(positions.tolist(), rows))
            self.varying.update(map(tuple, varying))

    def fail(self, positions: np.ndarray, hashes: np.ndarray | None, causes: list[str]) -> None:
        with self._lock:
            self.failures.update(zip(np.asarray(positions).tolist(), causes))

    def close(self, commit: bool = True) -> None:
        """Nothing is buffered: every written row is kept."""

    def result(self, n: int, *, report: RunReport | None = None,
               gather: bool = True) -> tuple[RunResult, np.ndarray]:
        """One result per input position (``None`` where none), in input order, and the positions neither returned
        nor failed; ``gather=False``: this rank's rows only (no collective: a result while the other ranks are not
        in step, as an error's partial result). Ranks other than 0 account for their own rows only."""
        rows, failures, mine_only = self.rows, self.failures, False
        if self.gather and gather:
            from dynabatch.inference.distributed import gather_results

            mine = sorted({*rows, *failures})
            every = gather_results(mine, [(rows.get(p), failures.get(p), p in rows) for p in mine], n, cover=False)
            if every is not None:  # rank 0: every rank's
                rows = {p: got[0] for p, got in enumerate(every) if got is not None and got[2]}
                failures = {p: got[1] for p, got in enumerate(every) if got is not None and got[1] is not None}
            mine_only = every is None  # this rank's share is accounted for on rank 0
        held = np.zeros(n, dtype=bool)
        held[np.fromiter(rows, dtype=np.int64, count=len(rows))] = True  # every position written is in range(n)
        accounting = account(n, held, failures, elsewhere=mine_only)
        result = RunResult((rows.get(p) for p in range(n)), report=report, accounting=accounting, varying=self.varying)
        return result, accounting.missing

    def end(self) -> None:
        """Nothing to release."""


class StoreSink:
    """Rows written to the results store at ``output_path`` (:mod:`dynabatch.inference.store`) and read back;
    ``stored``: the inputs it held before the run (not run again); ``unchecked``, ``check_inputs`` and ``writer``:
    the store's own."""

    def __init__(self, store: Any, *, owned: bool = True) -> None:
        self.store, self.owned = store, owned  # owned: opened by the run (else its caller closes it)
        self.stored = store.done
        self.unchecked, self.check_inputs, self.writer = store.unchecked, store.check_inputs, store.writer

    def result(self, n: int, *, report: RunReport | None = None,
               gather: bool = True) -> tuple[StoredRunResult, np.ndarray]:
        """The rows of ``n`` inputs, read from the store as it is now (one scan), with the store's failure records of
        the inputs it holds no row for; and the positions the store holds neither way."""
        result = StoredRunResult(self.store.located(n), report=report, before=self.stored)
        return result, result.accounting.missing

    def end(self) -> None:
        """The run is done with the store: its job lock is released where the run opened it (a store the caller
        opened is the caller's to close)."""
        if self.owned:
            self.store.close()


def open_sink(output_path: str | None, *, key: str | None, n: int | None, ids: Any, gather: bool,
              job: str | None) -> MemorySink | StoreSink:
    """The run's sink: a :class:`MemorySink`, or the results store at ``output_path`` (taken for ``job``: the ranks
    of one job pass the same token; ``None``: this run alone); a store the caller opened (``open_store``) is
    refused if opened for other inputs or another key than the run's."""
    if output_path is None:
        return MemorySink(gather=gather)
    from dynabatch.inference.store import Store, open_store

    if not isinstance(output_path, Store):
        return StoreSink(open_store(output_path, key=key, n=n, ids=ids, job=job))
    store = output_path
    same_ids = (ids is None) == (store.ids is None) and (ids is None or store.ids.equals(ids))
    if (key is not None and key != store.key) or (n is not None and n != store.n) or not same_ids:
        raise ValueError(f"output_path should be a store opened for this run's inputs and key (n={n}, key={key!r}, "
                         f"ids {'given' if ids is not None else 'None'}), but got one opened with n={store.n}, "
                         f"key={store.key!r}, {'other ids' if store.ids is not None else 'ids None'}: open it with "
                         "the loader's ids (plan.ids) and the run's key")
    return StoreSink(store, owned=False)
