"""What :func:`dynabatch.run` returns and raises: :class:`RunResult`, :class:`BatchOutOfMemoryError`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from dynabatch.inference.report import RunReport

__all__ = ["BatchOutOfMemoryError", "RunResult"]


class RunResult(list):
    """One result per input text, in input order, with what the run did.

    A plain ``list`` otherwise: ``result[p]`` belongs to input ``p``.

    Attributes:
        report: the :class:`~dynabatch.inference.report.RunReport` of the batches that ran.
        failed: sorted input positions that ran out of memory on their own and
            were skipped (``on_oom="skip"``); their results are ``None``.
    """

    def __init__(
        self, results: Iterable[Any] = (), *, report: RunReport | None = None, failed: Iterable[int] = ()
    ) -> None:
        super().__init__(results)
        self.report = report if report is not None else RunReport()
        self.failed = sorted(failed)


class BatchOutOfMemoryError(RuntimeError):
    """A single row ran out of memory on its own (``on_oom="raise"``).

    Chained from the original out-of-memory error.

    Attributes:
        position: the input position of the row.
        partial: the :class:`RunResult` so far: finished rows filled, the others ``None``.
    """

    def __init__(self, message: str, *, position: int | None = None, partial: RunResult | None = None) -> None:
        super().__init__(message)
        self.position = position
        self.partial = partial

    def __reduce__(self) -> tuple:
        return type(self), (str(self),), {"position": self.position, "partial": self.partial}
