"""Keeping devices busy for :func:`dynabatch.run`: batches built ahead, and one worker per device.

:class:`Prefetcher` builds the next batches (collating, pinning) in a
background thread while the device runs the current one, at most ``depth``
ahead. In measured mode the planner sizes a batch only once the peaks before
it are measured, so the batches built ahead are the planner's answer *as it
stands* (:meth:`~dynabatch.inference._queue.BatchQueue.peek`); a batch that a
later peak re-sized is built again, never run stale (``rebuilt`` counts them).

:func:`run_devices` runs one loop per device (the next item, the rows a
resumed run already has taken out, the call split on out-of-memory errors, the
peaks back to the queue), each in its own thread over the one shared queue (longest first), so no device
idles while work remains: its own ``fn`` (``make_fn(device)``, called in that
thread), its own measured peaks and first-batch budget, its own out-of-memory
splits. Threads, not processes: torch releases the GIL while a device works,
nothing needs a ``__main__`` guard, and it runs in a notebook. A worker whose
``fn`` raises (anything but out of memory) stops, and the batch it held goes
back to the queue once; a batch that crashes a second worker raises.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from dynabatch._background import Ahead
from dynabatch.data.collate import Batch
from dynabatch.inference._execute import Executor
from dynabatch.inference._queue import BatchQueue, Item
from dynabatch.memory.device import make_current

logger = logging.getLogger(__name__)

PREFETCH_DEPTH = 2
"""Batches built ahead of the one running: enough to hide collation, few enough to bound host memory."""


class Prefetcher:
    """Hands out ``(item, batch)`` pairs, building the next ``depth`` batches in a background thread.

    Args:
        executor: the device's executor (its queue lane, its ``build`` and the rows a store already holds).
        depth: batches built ahead (0: each batch is built when it is needed).
    """

    def __init__(self, executor: Executor, depth: int = PREFETCH_DEPTH) -> None:
        self.executor, self.queue, self.depth = executor, executor.queue, depth
        self.ahead: deque[tuple[np.ndarray, Batch]] = deque()  # positions -> their batch, built ahead
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dynabatch-prefetch") if depth else None
        self._filling: Future | None = None  # the background thread's turn: asks the planner, builds
        self.rebuilt = 0  # batches built ahead that a measured peak re-sized
        self._reader = None
        if self._pool is not None and self.queue.stream is not None:
            self._reader = self.queue.stream = _read_ahead(self.queue.stream, depth)  # batches that come built

    def _build(self, positions: np.ndarray) -> Batch:
        return self.executor.build(Item(-1, positions))

    def next(self) -> tuple[Item, Batch | None] | None:
        """The next item still to run (rows already stored taken out) and its batch, or ``None`` when done."""
        while (item := self.queue.next_item(self.executor.lane)) is not None:
            todo = self.executor.skip_done(item)
            if todo is None:
                self.executor.join_step(item)
                continue
            batch = self._take(todo.positions) if todo.batch is None else None
            self._refill()
            return todo, batch
        return None

    def _take(self, positions: np.ndarray) -> Batch | None:
        """The batch built ahead for exactly ``positions``; those built for batches a measured peak re-sized since
        are dropped (and counted), and the batch is built again."""
        self._wait()
        while self.ahead:
            built, batch = self.ahead.popleft()
            if np.array_equal(built, positions):
                return batch
            self.rebuilt += 1
        return None

    def _refill(self) -> None:
        """Starts the background thread's turn: the planner's next batches as they stand, built (off the device's
        thread: asking the planner costs time too)."""
        if self._pool is not None:
            self._filling = self._pool.submit(self._fill)

    def _fill(self) -> None:
        for positions in self.queue.peek(self.depth, self.executor.lane)[len(self.ahead):]:
            if self.executor.stored(positions).any():
                break  # rows a resumed run has: built once they are taken out
            self.ahead.append((positions, self._build(positions)))

    def _wait(self) -> None:
        filling, self._filling = self._filling, None
        if filling is not None:
            filling.result()  # an error building a batch raises here

    def close(self) -> None:
        self.ahead.clear()
        if self._reader is not None:
            self._reader.close()  # its thread stops reading (after a run that raised, too)
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


def _read_ahead(stream: Any, depth: int) -> Any:
    """Reads ``stream`` (a plain iterable's batches) up to ``depth`` items ahead in a background thread, which
    stops when the generator is closed or collected."""
    ahead = Ahead(stream, depth=depth, name="dynabatch-read-ahead")
    try:
        while (item := ahead.next()) is not None:
            yield item
    finally:
        ahead.close()


class WorkerCrash(RuntimeError):
    """A device's worker failed on a batch that had already made another worker fail."""


def run_devices(devices: Sequence[Any], make_executor: Callable[[Any, int], Executor], queue: BatchQueue) -> None:
    """Runs the queue on every device at once, one thread each, until it is empty.

    ``make_executor(device, i)`` is called in the device's thread (so is the
    ``make_fn`` inside it), once that device is current there.
    """
    errors: list[BaseException] = []  # what stops the run
    crashes: list[BaseException] = []  # what stopped one worker, its batch re-queued
    busy = [0]  # workers holding a batch (one that crashes puts it back: the others wait for that)
    lock, stop = threading.Lock(), threading.Event()

    def next_item(prefetcher: Prefetcher) -> tuple[Item, Batch | None] | None:
        while not stop.is_set():
            with lock:
                got = prefetcher.next()
                if got is not None or not busy[0]:
                    busy[0] += got is not None
                    return got
            stop.wait(0.01)  # the queue is empty while another worker runs: it may put a batch back
        return None

    def work(i: int, device: Any) -> None:
        try:
            make_current(device)
            executor = make_executor(device, i)
        except BaseException as exc:  # noqa: BLE001 (raised by run, in the calling thread)
            logger.error("device %s: its worker could not start: %s", device, exc)
            errors.append(exc)
            stop.set()
            return
        prefetcher = Prefetcher(executor, depth=0)  # the other devices' threads build beside this one's calls
        try:
            while (got := next_item(prefetcher)) is not None:
                item, batch = got
                try:
                    queue.observe_item(item, executor.run_item(item, batch), executor.lane)
                except Exception as exc:  # noqa: BLE001 (a worker's crash: its batch goes back once)
                    if _requeue(queue, item, device, exc):
                        crashes.append(exc)
                    else:
                        errors.append(exc)
                        stop.set()
                    return
                finally:
                    with lock:
                        busy[0] -= 1
        except BaseException as exc:  # noqa: BLE001 (raised by run, in the calling thread)
            errors.append(exc)
            stop.set()

    threads = [threading.Thread(target=work, args=(i, d), name=f"dynabatch-{d}", daemon=True)
               for i, d in enumerate(devices)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    left = queue.next_item()
    if left is not None:  # every worker stopped, each on another batch
        raise WorkerCrash(f"every device's worker stopped with batches left (batch {left.number} first): "
                          f"{type(crashes[0]).__name__}: {crashes[0]}") from crashes[0]


def _requeue(queue: BatchQueue, item: Item, device: Any, exc: BaseException) -> bool:
    """Puts a batch whose worker crashed back once (``True``); ``False`` on its second crash."""
    if item.crashes:
        logger.error("device %s: batch %d failed again (%s: %s); it made another worker fail before",
                     device, item.number, type(exc).__name__, exc)
        return False
    logger.error("device %s: its worker stopped on batch %d (%s: %s); the batch goes back to the queue",
                 device, item.number, type(exc).__name__, exc)
    item.crashes += 1
    queue.requeue(item)
    return True
