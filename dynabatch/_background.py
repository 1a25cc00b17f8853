"""The one background-thread mechanism: work that runs ahead of the consumer (:class:`Ahead`) or behind the producer
(:class:`Worker`), in one daemon thread each.

* :class:`Ahead` pulls an iterable into a bounded queue: a plain iterable's batches read ahead of the device
  (:func:`dynabatch.run`), a streamed corpus tokenized chunk by chunk
  (:class:`~dynabatch.data.streaming.ChunkFeed`).
* :class:`Worker` runs the jobs handed to it, one at a time and in order, at most ``depth`` of them unfinished, and
  a timed flush between them: the next batches built ahead (:class:`~dynabatch.inference.loop.Prefetcher`), shards
  written behind the run, the rows that waited long enough committed by the flush
  (:class:`~dynabatch.inference.store_writer.StoreWriter`).

* :func:`ordered_map` calls a function on each item of a list on several threads and yields the results in order: a
  fast tokenizer's backend (which releases the GIL) called on every core where its own thread pool is off.

* :class:`Ticker` calls a function every few seconds until it is closed: the progress display's timed refresh, so
  it moves while a long batch runs; the heartbeat of the results stores' job locks.

Either way an error the thread meets is raised in the caller's thread (at the next :meth:`Ahead.next`, or the next
:meth:`Worker.submit`, :meth:`Worker.wait` or :meth:`Worker.close`), and ``close()`` stops the thread (after the item or
job in progress, even while it waits for room) and joins it, so no thread outlives the run that started it, Ctrl-C
included. Waits in the caller's thread are timed, so Ctrl-C reaches it.

Every stage that runs here is timed, once, in this module (the run's bottleneck report reads it,
:mod:`dynabatch.inference.meter`): :func:`stage_seconds` gives, per thread name, the seconds the run's threads spent
working and the seconds they waited for room ahead of their consumer; :func:`waited` gives, for the calling thread,
the seconds it waited on each thread name (for an item not ready, or for room to hand a job). The stage seconds are
the run's own: :func:`timing_stages` gives the calling thread a counter of its own, which every thread started here
carries from the thread that started it, so two runs at once in one process (in two threads) never count each
other's threads; threads started outside it are not timed. The counters add up; a reader takes differences.

Example:
    >>> from dynabatch._background import Ahead, Worker
    >>> ahead = Ahead(iter([1, 2, 3]), depth=2, name="example")
    >>> [ahead.next(), ahead.next(), ahead.next(), ahead.next()]
    [1, 2, 3, None]
    >>> done = []
    >>> worker = Worker(depth=1, name="example-worker")
    >>> worker.submit(done.append, "a"); worker.submit(done.append, "b"); worker.close()
    >>> done
    ['a', 'b']
"""

from __future__ import annotations

import contextlib
import functools
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from dynabatch._validation import check_positive_int

__all__ = ["Ahead", "StopRequested", "Ticker", "Worker", "ordered_map", "progress_bar", "run_in_threads",
           "stage_seconds", "timing_stages", "waited"]

_END = object()
_POLL = 0.1  # seconds a wait blocks at a time: a stop request (or Ctrl-C in the caller) is seen this soon


class _StageTimes:
    """One run's stage seconds: thread name -> [seconds working, seconds waiting for room], added to by its threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seconds: dict[str, list[float]] = {}


class _PerThread(threading.local):
    def __init__(self) -> None:
        self.waits: dict[str, float] = {}  # name of what this thread waited on -> seconds
        self.stages: _StageTimes | None = None  # the run's counter this thread adds its stage seconds to


_THREAD = _PerThread()


class _Thread(threading.Thread):
    """Every thread this module starts: a daemon that carries the stage counter of the thread that started it (at
    :meth:`start`, so a thread made ahead of its run still counts for the run that starts it)."""

    def __init__(self, target: Callable[[], Any], name: str) -> None:
        super().__init__(target=target, name=name, daemon=True)
        self.stages: _StageTimes | None = None

    def start(self) -> None:
        self.stages = _THREAD.stages
        super().start()

    def run(self) -> None:
        _THREAD.stages = self.stages
        super().run()


def _add_wait(name: str, seconds: float) -> None:
    _THREAD.waits[name] = _THREAD.waits.get(name, 0.0) + seconds


def _add_stage(name: str, working: float, blocked: float) -> None:
    stages = _THREAD.stages
    if stages is None:  # a thread started outside any timed run: no run's report holds it
        return
    with stages.lock:
        entry = stages.seconds.setdefault(name, [0.0, 0.0])
        entry[0] += working
        entry[1] += blocked


@contextlib.contextmanager
def timing_stages() -> Iterator[None]:
    """Within the block, :func:`stage_seconds` in the calling thread counts the seconds of the threads started here
    from it (and from those threads, and so on), from zero: one run's stages, none of another run's at the same time
    in another thread. A block within another times its own threads apart; the outer counter is the calling
    thread's again after it.

    Example:
        >>> from dynabatch._background import Worker, stage_seconds, timing_stages
        >>> with timing_stages():
        ...     worker = Worker(depth=1, name="example-timed")
        ...     worker.submit(time.sleep, 0.05); worker.close()
        ...     stage_seconds()["example-timed"][0] > 0.02
        True
    """
    outer, _THREAD.stages = _THREAD.stages, _StageTimes()
    try:
        yield
    finally:
        _THREAD.stages = outer


def waited() -> dict[str, float]:
    """Seconds the calling thread has waited so far on each background thread (by its name): for an item that was
    not ready (:meth:`Ahead.next`), for room to hand a job or for jobs to finish (:class:`Worker`).

    Example:
        >>> from dynabatch._background import Worker, waited
        >>> worker = Worker(depth=1, name="example-waits")
        >>> worker.submit(time.sleep, 0.05); worker.wait()
        >>> waited()["example-waits"] > 0.02
        True
        >>> worker.close()
    """
    return dict(_THREAD.waits)


def stage_seconds() -> dict[str, tuple[float, float]]:
    """Per background thread name, ``(seconds working, seconds waiting for room ahead of its consumer)`` so far in
    the calling thread's :func:`timing_stages` block (threads of one name add up); outside any, empty."""
    stages = _THREAD.stages
    if stages is None:
        return {}
    with stages.lock:
        return {name: (working, blocked) for name, (working, blocked) in stages.seconds.items()}


def progress_bar(shown: bool, **tqdm_kwargs: Any) -> contextlib.AbstractContextManager:
    """A tqdm bar made with ``tqdm_kwargs`` where it is ``shown``, else a context of ``None`` (no bar at all): tqdm
    starts its monitor thread with its first bar, a disabled one too, and keeps it for the process's life, a thread
    a call that shows nothing would leave behind.

    Example:
        >>> with progress_bar(False, total=3) as bar:
        ...     bar is None
        True
    """
    if not shown:
        return contextlib.nullcontext()
    from tqdm.auto import tqdm

    return tqdm(**tqdm_kwargs)


class StopRequested(BaseException):
    """Raised by work that watches a stop event (an :class:`Ahead`'s ``stop``) when it is set part-way through: the
    work in progress is dropped, to be done again when it is asked for again. Not an ``Exception``: no handler of
    errors takes a stop for a failure."""


class Ahead:
    """Pulls ``items`` in a daemon thread, at most ``depth`` ahead of :meth:`next` (``None``: no bound).

    The thread starts at the first :meth:`next` (or :meth:`start`), so an
    ``Ahead`` no one reads pulls nothing. Items must not be ``None``:
    :meth:`next` returns ``None`` at the end.

    ``stop``: the event :meth:`pause` and :meth:`close` set (cleared when a paused thread starts again), for items
    whose one item is long work that watches it: they yield :attr:`STOPPED` when they dropped the item in progress
    at its request (:class:`StopRequested`), and go on with that item when the thread starts again, so a pause waits
    for a part of the item, not the whole of it.
    """

    NOT_READY = object()
    STOPPED = object()

    def __init__(self, items: Iterable[Any], *, depth: int | None, name: str,
                 stop: threading.Event | None = None) -> None:
        self._items = iter(items)
        self._name = name
        self._queue: queue.Queue = queue.Queue(maxsize=depth or 0)
        self._stop = threading.Event() if stop is None else stop
        self._done = False
        self._held: list = []  # an item pulled while pausing, put first when the thread starts again
        self._thread = _Thread(self._pull, name)

    def start(self) -> None:
        if self._thread.ident is None:
            self._thread.start()

    def _put(self, entry: Any) -> bool:
        start = time.perf_counter()
        try:
            while not self._stop.is_set():
                try:
                    self._queue.put(entry, timeout=_POLL)
                    return True
                except queue.Full:
                    continue
            return False
        finally:
            _add_stage(self._name, 0.0, time.perf_counter() - start)

    def _pull(self) -> None:
        try:
            while self._held and self._put(self._held[0]):
                self._held.pop()
            items = iter(self._items)
            while True:
                start = time.perf_counter()
                item = next(items, _END)
                _add_stage(self._name, time.perf_counter() - start, 0.0)
                if item is _END:
                    break
                if item is self.STOPPED:  # the item in progress dropped at the stop: the items go on from it
                    return
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
        got = self.NOT_READY
        start = time.perf_counter()
        while got is self.NOT_READY:
            try:
                got = self._queue.get(timeout=_POLL) if block else self._queue.get_nowait()
            except queue.Empty:
                if not block:
                    return self.NOT_READY
        if block:
            _add_wait(self._name, time.perf_counter() - start)
        if got is _END or isinstance(got, BaseException):
            self._done = True
        if isinstance(got, BaseException):
            raise got
        return None if got is _END else got

    def pause(self) -> None:
        """Stops the thread after the item in progress (kept; or dropped part-way by items that watch ``stop``, and
        done again) and waits for it; the next :meth:`next` starts another one where this one left off."""
        if self._thread.ident is None or self._done:
            return
        self._stop.set()
        self._thread.join()
        self._stop.clear()  # the one event, which the items may hold
        self._thread = _Thread(self._pull, self._name)

    def close(self, *, wait: bool = True) -> None:
        """Stops pulling after the item in progress (or part-way, see ``stop``), and waits for the thread to end (so
        that no thread of the library outlives the run that started it); without ``wait``, returns at once (a
        finalizer, which may run on any thread, even one the item in progress waits for)."""
        self._stop.set()
        self._done = True
        if wait and self._thread.ident is not None and self._thread is not threading.current_thread():
            self._thread.join()


class Worker:
    """Runs the jobs handed to :meth:`submit` in a daemon thread, one at a time and in order.

    Args:
        depth: jobs submitted and not finished, at most: :meth:`submit` waits for room (``1``: each job waits for
            the one before it, so one runs behind the caller).
        name: the thread's name.
        flush: a timed flush: ``flush()`` is called in the thread after each job and whenever ``every`` seconds
            pass without one (the results store's writer commits the rows that waited long enough there).
        every: seconds between timed flushes.

    The thread starts at the first :meth:`submit` (or :meth:`start`). A job's (or the flush's) error is kept and
    raised in the caller's thread at the next :meth:`check`, :meth:`submit`, :meth:`wait` or :meth:`close` (once);
    the jobs after it still run.
    """

    def __init__(self, *, depth: int = 1, name: str, flush: Callable[[], Any] | None = None,
                 every: float = _POLL) -> None:
        self._name = name
        self._flush, self._every = flush, every
        self._jobs: queue.Queue = queue.Queue()
        self._room = threading.Semaphore(max(1, depth))
        self._unfinished = 0
        self._idle = threading.Condition()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread: _Thread | None = None

    def check(self) -> None:
        """Raises the error a job (or the flush) met and not raised yet, if any."""
        error, self._error = self._error, None
        if error is not None:
            raise error

    def start(self) -> None:
        """Starts the thread now (with a ``flush``: the timed flushes begin before the first job)."""
        if self._thread is None:
            self._thread = _Thread(self._run, self._name)
            self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Hands ``fn(*args)`` to the thread, once fewer than ``depth`` jobs are unfinished; first raises the error
        of a job before it, if any."""
        self.check()
        start = time.perf_counter()
        while True:
            if self._stop.is_set():
                raise RuntimeError(f"{self._name}: closed, it takes no more jobs")
            if self._room.acquire(timeout=_POLL):
                break
        _add_wait(self._name, time.perf_counter() - start)
        with self._idle:
            self._unfinished += 1
        self.start()
        self._jobs.put((fn, args))

    def _call(self, fn: Callable[..., Any], args: tuple) -> None:
        start = time.perf_counter()
        try:
            if not self._stop.is_set():
                fn(*args)
        except BaseException as exc:  # noqa: BLE001 (handed to the caller's thread, raised there)
            self._error = self._error or exc
        finally:
            _add_stage(self._name, time.perf_counter() - start, 0.0)

    def _run(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=self._every) if self._flush is not None else self._jobs.get()
            except queue.Empty:
                self._call(self._flush, ())
                continue
            if job is _END:
                return
            try:
                self._call(*job)
            finally:
                del job  # a job's arguments (a shard's rows, a batch) are not kept until the next one
                self._room.release()
                with self._idle:
                    self._unfinished -= 1
                    self._idle.notify_all()
            if self._flush is not None:
                self._call(self._flush, ())

    def wait(self) -> None:
        """Waits until every job submitted has finished; raises the first error one of them met."""
        start = time.perf_counter()
        with self._idle:
            while self._unfinished:
                self._idle.wait(_POLL)
        _add_wait(self._name, time.perf_counter() - start)
        self.check()

    def close(self, *, cancel: bool = False) -> None:
        """Ends the thread and waits for it: after every job submitted (``cancel=False``, then raises a job's error
        not raised yet), or after the job in progress, the others dropped (``cancel=True``, errors dropped too:
        the caller is stopping for a reason of its own)."""
        if cancel:
            self._stop.set()
        if self._thread is not None:
            self._jobs.put(_END)
            try:
                while self._thread.is_alive():
                    self._thread.join(_POLL)
            except BaseException:  # Ctrl-C while the jobs finish: the rest are dropped, the thread still ends
                self._stop.set()
                self._thread.join()
                raise
            self._thread = None
        self._stop.set()
        if cancel:
            self._error = None
        self.check()


class Ticker:
    """Calls ``fn()`` every ``seconds`` in a daemon thread, from :meth:`start` until :meth:`close`.

    ``fn`` must not raise: an error it raises is kept and raised by :meth:`close`, and the ticking stops.

    Example:
        >>> from dynabatch._background import Ticker
        >>> ticks = []
        >>> ticker = Ticker(lambda: ticks.append(1), seconds=0.01, name="example-ticker")
        >>> ticker.start(); time.sleep(0.1); ticker.close()
        >>> len(ticks) >= 2
        True
    """

    def __init__(self, fn: Callable[[], Any], *, seconds: float, name: str) -> None:
        self._fn, self._seconds = fn, seconds
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = _Thread(self._tick, name)

    def start(self) -> None:
        if self._thread.ident is None:
            self._thread.start()

    def _tick(self) -> None:
        while not self._stop.wait(self._seconds):
            try:
                self._fn()
            except BaseException as exc:  # noqa: BLE001 (raised by close, in the caller's thread)
                self._error = exc
                return

    def close(self, wait: bool = True) -> None:
        """Stops the ticking and waits for the thread (after a call in progress); raises the error ``fn`` raised.
        ``wait=False``: stops it without waiting (from a garbage collector's finalizer or at exit)."""
        self._stop.set()
        if not wait:
            return
        if self._thread.ident is not None and self._thread is not threading.current_thread():
            self._thread.join()
        error, self._error = self._error, None
        if error is not None:
            raise error


@contextlib.contextmanager
def _joined(targets: Sequence[Callable[[], Any]], stop: threading.Event, names: Sequence[str]) -> Iterator[list]:
    """The stop-and-join protocol of :func:`run_in_threads` and :func:`ordered_map`: a daemon thread per target
    (``names``: theirs), started; on leaving the block, however it is left (done, an error, Ctrl-C, a generator
    closed early), ``stop`` set, then every thread that started joined (each ends its work in progress first)."""
    threads = [_Thread(target, name) for target, name in zip(targets, names)]
    try:
        for thread in threads:
            thread.start()
        yield threads
    finally:
        stop.set()
        for thread in threads:
            if thread.ident is not None:
                thread.join()


def run_in_threads(jobs: Sequence[Callable[[], Any]], stop: threading.Event, *, names: Sequence[str]) -> None:
    """Runs each of ``jobs`` in a daemon thread of its own (``names``: theirs) and returns once every one has ended.

    One stop-and-join protocol (:func:`ordered_map`'s too): a job that raises sets ``stop`` (the others end their work
    in progress and return), and its error is raised here once every thread has ended; Ctrl-C in the caller sets
    ``stop`` and waits for the threads the same way. The caller's waits are timed, so Ctrl-C reaches it while a job
    runs.

    Example:
        >>> import threading
        >>> from dynabatch._background import run_in_threads
        >>> done = []
        >>> run_in_threads([lambda: done.append(1), lambda: done.append(2)], threading.Event(), names=["a", "b"])
        >>> sorted(done)
        [1, 2]
    """
    errors: list[BaseException] = []

    def guarded(job: Callable[[], Any]) -> None:
        try:
            job()
        except BaseException as exc:  # noqa: BLE001 (raised by run_in_threads, in the caller's thread)
            errors.append(exc)
            stop.set()

    with _joined([functools.partial(guarded, job) for job in jobs], stop, names) as threads:
        for thread in threads:
            while thread.is_alive():
                thread.join(_POLL)
    if errors:
        raise errors[0]


def ordered_map(fn: Callable[[Any], Any], items: Sequence[Any], *, threads: int, name: str) -> Iterator[Any]:
    """``fn(item)`` for each of ``items`` on ``threads`` daemon threads (``name``: theirs), yielded in order.

    Worth it where ``fn`` releases the GIL for most of its time (a Rust tokenizer's batch encode). A thread takes the
    next item only while fewer than ``2 * threads`` results wait to be yielded, so memory stays bounded by what the
    caller has not yet taken. An error ``fn`` raises travels as a value: the threads take no more items, and it is
    raised here when its item's turn comes (the results before it are yielded first). The threads end, joined, when
    the last result is yielded, when the caller stops early (the generator closed) or on Ctrl-C; each finishes the
    call in progress first (:func:`run_in_threads`' stop-and-join protocol).

    Example:
        >>> from dynabatch._background import ordered_map
        >>> list(ordered_map(lambda x: x * x, [1, 2, 3, 4], threads=2, name="example-map"))
        [1, 4, 9, 16]
    """
    stop = threading.Event()
    state = _Ordered(len(items), ahead=2 * check_positive_int("threads", threads), stop=stop)  # none: nothing ran

    def job() -> None:
        while (index := state.take()) is not None:
            start = time.perf_counter()
            try:
                state.put(index, fn(items[index]))
            except BaseException as exc:  # noqa: BLE001 (a value: raised in the caller's thread, in its turn)
                state.put(index, _Failed(exc))
            _add_stage(name, time.perf_counter() - start, 0.0)

    count = min(threads, len(items))
    with _joined([job] * count, stop, [name] * count):
        try:
            for index in range(len(items)):
                start = time.perf_counter()
                got = state.result(index)
                _add_wait(name, time.perf_counter() - start)
                if isinstance(got, _Failed):
                    raise got.error
                yield got
        finally:
            state.stop()  # a thread waiting for room ahead wakes now, not at its next timed wait


class _Failed:
    """An error one of :func:`ordered_map`'s threads met, kept as its item's result."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class _Ordered:
    """The state :func:`ordered_map`'s threads and caller share: the next item to hand out, the results not yet
    yielded, and the run's ``stop`` (set by an error or by the caller leaving); one condition guards it."""

    def __init__(self, n: int, *, ahead: int, stop: threading.Event) -> None:
        self._n, self._ahead, self._stop = n, ahead, stop
        self._next = 0  # the next item to hand out
        self._yielded = 0  # items the caller has taken
        self._results: dict[int, Any] = {}
        self._changed = threading.Condition()

    def take(self) -> int | None:
        """The next item's index for a thread, once there is room ahead of the caller; ``None``: no more."""
        with self._changed:
            while not self._stop.is_set() and self._next < self._n and self._next - self._yielded >= self._ahead:
                self._changed.wait(_POLL)
            if self._stop.is_set() or self._next >= self._n:
                return None
            self._next += 1
            return self._next - 1

    def put(self, index: int, result: Any) -> None:
        with self._changed:
            self._results[index] = result
            if isinstance(result, _Failed):
                self._stop.set()  # no more items are taken; those in progress finish
            self._changed.notify_all()

    def result(self, index: int) -> Any:
        """Item ``index``'s result, once a thread has put it (waits timed, so Ctrl-C reaches the caller)."""
        with self._changed:
            while index not in self._results:
                self._changed.wait(_POLL)
            self._yielded = index + 1
            self._changed.notify_all()
            return self._results.pop(index)

    def stop(self) -> None:
        """Sets the stop and wakes every thread waiting for room."""
        with self._changed:
            self._stop.set()
            self._changed.notify_all()
