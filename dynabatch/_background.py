"""Items of an iterable produced ahead in a background thread: :class:`Ahead`.

The one mechanism behind reading a plain iterable's batches ahead of the device
(:func:`dynabatch.run`) and tokenizing a streamed corpus behind it
(:class:`~dynabatch.data.streaming.ChunkFeed`): a daemon thread pulls the
iterable into a bounded queue, an error it meets is raised in the consumer's
thread at its next :meth:`Ahead.next`, and :meth:`Ahead.close` stops it even
while it waits for room, and joins it.

Example:
    >>> from dynabatch._background import Ahead
    >>> ahead = Ahead(iter([1, 2, 3]), depth=2, name="example")
    >>> [ahead.next(), ahead.next(), ahead.next(), ahead.next()]
    [1, 2, 3, None]
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable
from typing import Any

__all__ = ["Ahead"]

_END = object()


class Ahead:
    """Pulls ``items`` in a daemon thread, at most ``depth`` ahead of :meth:`next` (``None``: no bound).

    The thread starts at the first :meth:`next` (or :meth:`start`), so an
    ``Ahead`` no one reads pulls nothing. Items must not be ``None``:
    :meth:`next` returns ``None`` at the end.
    """

    NOT_READY = object()

    def __init__(self, items: Iterable[Any], *, depth: int | None, name: str) -> None:
        self._items = iter(items)
        self._name = name
        self._queue: queue.Queue = queue.Queue(maxsize=depth or 0)
        self._stop = threading.Event()
        self._done = False
        self._held: list = []  # an item pulled while pausing, put first when the thread starts again
        self._thread = threading.Thread(target=self._pull, name=name, daemon=True)

    def start(self) -> None:
        if self._thread.ident is None:
            self._thread.start()

    def _put(self, entry: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(entry, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _pull(self) -> None:
        try:
            while self._held and self._put(self._held[0]):
                self._held.pop()
            for item in self._items:
                if not self._put(item):
                    self._held.append(item)  # kept for the thread that resumes
                    return
        except BaseException as exc:  # noqa: BLE001 (handed to the consuming thread, raised there)
            self._put(exc)
        self._put(_END)

    def next(self, block: bool = True) -> Any:
        """The next item, ``None`` at the end; without ``block``, :attr:`NOT_READY` when none is ready yet."""
        if self._done:
            return None
        self.start()
        try:
            got = self._queue.get(block=block)
        except queue.Empty:
            return self.NOT_READY
        if got is _END or isinstance(got, BaseException):
            self._done = True
        if isinstance(got, BaseException):
            raise got
        return None if got is _END else got

    def pause(self) -> None:
        """Stops the thread after the item in progress (kept) and waits for it; the next :meth:`next` starts
        another one where this one left off."""
        if self._thread.ident is None or self._done:
            return
        self._stop.set()
        self._thread.join()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._pull, name=self._name, daemon=True)

    def close(self) -> None:
        """Stops pulling after the item in progress, and waits for the thread to end (so that no thread of the
        library outlives the run that started it)."""
        self._stop.set()
        self._done = True
        if self._thread.ident is not None and self._thread is not threading.current_thread():
            self._thread.join()
