"""The sinks of :func:`dynabatch.run`: where finished rows go, and the one place results are assembled.

A sink takes what it needs as arguments (positions, rows, input hashes; the number of inputs and the failed ones at
the end) and never reads the source. :class:`MemorySink` keeps rows in memory (gathered on rank 0 under
``torch.distributed``); the results store of ``output_path``
(:func:`open_sink`, :mod:`dynabatch.inference.store`) writes them to Parquet shards and reads them back. Either way
:meth:`result` is the run's result.

Example:
    >>> import numpy as np
    >>> from dynabatch.inference.sink import MemorySink
    >>> sink = MemorySink()
    >>> writer = sink.writer("cpu")
    >>> writer.write(np.array([2, 0]), ["c", "a"], None)
    >>> writer.close()
    >>> list(sink.result(3, failed=[1]))
    ['a', None, 'c']
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from typing import Any

import numpy as np

from dynabatch.inference.report import RunReport
from dynabatch.inference.results import RunResult, StoredRunResult

__all__ = ["MemorySink", "StoreSink", "open_sink", "ranks_job"]

logger = logging.getLogger(__name__)


def _unrecorded(failed: Any) -> dict[int, str]:
    """The failed positions, each with a cause this sink was not told."""
    return {int(p): "failed (no cause recorded)" for p in failed}


class MemorySink:
    """Rows kept in memory, one per input position.

    Args:
        gather: under a process group of more than one rank, :meth:`result` is a collective that brings every
            rank's rows to rank 0 (other ranks keep their own); each rank answers for the rows it wrote and the
            positions it names as failed.
    """

    def __init__(self, *, gather: bool = False) -> None:
        self.rows: dict[int, Any] = {}
        self.gather = gather
        self._lock = threading.Lock()  # several devices' workers write at once

    def writer(self, name: str) -> MemorySink:
        """The writer of one worker: this sink itself (writes are kept in one dict)."""
        return self

    def write(self, positions: np.ndarray, rows: list, hashes: np.ndarray | None, varying: Any = ()) -> None:
        with self._lock:
            self.rows.update(zip(positions.tolist(), rows))

    def close(self, commit: bool = True) -> None:
        """Nothing is buffered: every written row is kept."""

    def result(self, n: int, *, report: RunReport | None = None, failed: list[int] = ()) -> RunResult:
        """One result per input position (``None`` where none), in input order."""
        if not self.gather:
            return RunResult((self.rows.get(p) for p in range(n)), report=report, failures=_unrecorded(failed))
        from dynabatch.inference.distributed import gather_results

        failed_set = set(failed)
        mine = np.union1d(np.fromiter(self.rows, dtype=np.int64, count=len(self.rows)),
                          np.asarray(failed, dtype=np.int64))
        pairs = gather_results(mine, [(self.rows.get(p), p in failed_set) for p in mine.tolist()], n)
        if pairs is None:  # not rank 0: only this rank's rows
            return RunResult((self.rows.get(p) for p in range(n)), report=report, failures=_unrecorded(failed))
        return RunResult((value for value, _ in pairs), report=report,
                         failures=_unrecorded(p for p, (_, flag) in enumerate(pairs) if flag))


class StoreSink:
    """Rows written to the results store at ``output_path`` (:mod:`dynabatch.inference.store`) and read back."""

    def __init__(self, store: Any, *, owned: bool = True) -> None:
        self.store, self.owned = store, owned  # owned: opened by the run (else its caller closes it)
        self.done = store.done  # which inputs it holds: a resumed run takes them out

    def writer(self, name: str) -> Any:
        """A writer of this run's rows (its shards named after ``name``): ``write``, ``close(commit)``."""
        return self.store.writer(name)

    def result(self, n: int, *, report: RunReport | None = None, failed: list[int] | None = None) -> StoredRunResult:
        """The rows of ``n`` inputs, read from the store as it is now (``failed=None``: every input without a row);
        read with the store's job lock still held (shards settled), which :meth:`release` gives up; each failed
        input's cause from the store's failure records."""
        located, recorded = self.store.located(n), self.store.failures()
        missing = np.flatnonzero(located.where < 0).tolist() if failed is None else failed
        failures = {**_unrecorded(missing), **{p: recorded[p] for p in missing if p in recorded}}
        return StoredRunResult.of(located, report=report, failures=failures)

    def release(self) -> None:
        """Gives the store's job lock up (once its writers have closed) where the run opened it; reading the result
        needs none."""
        if self.owned:
            self.store.close()


def open_sink(output_path: str | None, *, key: str | None, n: int | None, ids: Any, gather: bool,
              inputs_at: Any) -> Any:
    """The run's sink: a :class:`MemorySink`, or the results store at ``output_path`` checked before any row is
    written.

    ``inputs_at(positions) -> (positions, hashes)`` gives the input hashes of this run's inputs among the stored
    positions: a stored row computed from other inputs is refused now, before this run writes a row.
    """
    if output_path is None:
        return MemorySink(gather=gather)
    from dynabatch.inference.store import Store, open_store

    store = output_path if isinstance(output_path, Store) else open_store(
        output_path, key=key, n=n, ids=ids, job=ranks_job() if gather else None)
    try:
        if store is output_path:
            _check_opened(store, key, n, ids)
        stored = np.flatnonzero(store.done)
        if stored.size:
            positions, hashes = inputs_at(stored)
            store.check_inputs(positions, hashes)
            logger.info("output_path=%r holds %d of this run's rows: they are not run again", output_path,
                        stored.size)
    except BaseException:
        if store is not output_path:
            store.close()
        raise
    return StoreSink(store, owned=store is not output_path)


def _check_opened(store: Any, key: str | None, n: int | None, ids: Any) -> None:
    """Refuses a store opened (``output_path=open_store(...)``) for other inputs or another key than the run's."""
    same_ids = (ids is None) == (store.ids is None) and (ids is None or store.ids.equals(ids))
    if (key is not None and key != store.key) or (n is not None and n != store.n) or not same_ids:
        raise ValueError(f"output_path should be a store opened for this run's inputs and key (n={n}, key={key!r}, "
                         f"ids {'given' if ids is not None else 'None'}), but got one opened with n={store.n}, "
                         f"key={store.key!r}, {'other ids' if store.ids is not None else 'ids None'}: open it with "
                         "the loader's ids (plan.ids) and the run's key")


def ranks_job() -> str | None:
    """One job string for the ranks of this job, so that they share the results store (``None``: not several ranks):
    under ``torchrun`` its rendezvous (``MASTER_ADDR:MASTER_PORT`` and run id: one live job each), readable before
    the process group starts; else, under ``torch.distributed``, rank 0's token, broadcast (a collective)."""
    if "MASTER_ADDR" in os.environ and "TORCHELASTIC_RUN_ID" in os.environ:
        return (f"torchrun {os.environ['MASTER_ADDR']}:{os.environ.get('MASTER_PORT')} "
                f"{os.environ['TORCHELASTIC_RUN_ID']}")
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    token = [uuid.uuid4().hex if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(token, src=0)
    return f"torch.distributed {token[0]}"
