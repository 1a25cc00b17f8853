"""Tokenizing on every core: how many cores, the user's ``TOKENIZERS_PARALLELISM``, and worker processes.

The tokenize stage (:mod:`dynabatch.data.tokenization`) runs on the cores this
process may use, ``len(os.sched_getaffinity(0))`` (not ``os.cpu_count()``: a
process pinned by ``taskset``, a container's CPU set), fewer where its cgroup's
CPU quota allows fewer (a container's ``--cpus``), shared among the ranks of
a ``torchrun`` job on this node (``LOCAL_WORLD_SIZE``) and capped by the
``tokenize_cores`` argument of the loader (:func:`available_cores`). It spreads
the work one of four ways, chosen by :func:`choose_mechanism`:

* ``"threads"``: the fast tokenizer's Rust backend encodes each call on its own
  thread pool (``encode_batch``), where the backend provably gives the
  tokenizer's own rows, all cores may be used, and the user has not set
  ``TOKENIZERS_PARALLELISM`` to a false value;
* ``"parallel calls"``: where the backend rule holds and the user has set
  ``TOKENIZERS_PARALLELISM`` to a false value, the tokenizer's thread pool
  stays off, as asked (logged once), and as many of this process's threads as
  there are cores each call the backend on a piece at a time
  (:func:`~dynabatch._background.ordered_map`): the backend releases the GIL
  while it encodes, and with its pool off each call runs on the calling thread
  alone, so the cores are used with no process to start (1,000 KJV passages:
  32 ms on two threads against 58 ms on one; 10,000: 0.32 s against 0.60 s);
  they end with the call, so no thread of the tokenizer outlives it or meets a
  fork;
* ``"shared"``: this thread tokenizes piece after piece, and worker processes
  join it where they pay (:class:`Pieces`, the cost rule: the rest of the job
  (the call's pieces, and a stream's chunks still to come), at the speed
  measured on the call's first piece, would take one thread at least
  :data:`POOL_MIN_SECONDS` where a core stood idle beside it meanwhile (five
  times that where none did), and that first piece did not already keep several
  cores busy): for a tokenizer whose own call must run (an overridden
  ``__call__``, a slow tokenizer, any callable: its Python holds the GIL), and
  for a cap below the process's cores where the tokenizer's own pool is on (it
  would span every core);
* ``"one"``: this thread alone: one core to use.

**The worker processes** (:class:`WorkerPool`) are this process's: started by the
first call that needs them and reused by the next (loaders built one after
another), ended by :func:`release_pool` (a run's end), at interpreter exit, and
with this process however it ends (SIGKILL included: see
:func:`_die_with_parent`). Each holds the ends of its own pipes only, so no
worker keeps another alive.

**Forks.** ``tokenizers`` disables its thread pool in a process forked after the
pool ran (the pool's threads do not survive a fork, and using it would
deadlock), and versions before 0.22.2 print a warning then, unless
``TOKENIZERS_PARALLELISM`` is set. DataLoader workers and this module's workers
fork, so once this process tokenized on several cores, :func:`guard_forks`
makes every process forked from it start with ``TOKENIZERS_PARALLELISM=false``
where the user left it unset (it is set for the fork only, and unset again in
this process): what ``tokenizers`` does in such a child anyway, without the
warning. A value the user set is never changed. A process forked from this one
(a DataLoader worker) closes its copy of the pool's pipes and starts no pool.

Example:
    >>> from dynabatch.data.workers import available_cores, choose_mechanism
    >>> available_cores(1)
    1
    >>> choose_mechanism(backend=True, cores=1)
    'one'
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import ctypes
import functools
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection
from typing import Any

from dynabatch._background import Ahead, Ticker
from dynabatch._digest import fingerprint
from dynabatch._validation import check_positive_int

__all__ = ["BUSY_FACTOR", "ENV_VARIABLE", "IDLE_CORE", "POOL_MIN_SECONDS", "WORKERS_LOSE_BELOW", "Pieces", "WorkerPool",
           "available_cores", "cgroup_cores", "choose_mechanism", "guard_forks", "idle_seconds", "local_ranks",
           "release_pool", "shared_pool", "tokenizers_parallelism"]

logger = logging.getLogger(__name__)

ENV_VARIABLE = "TOKENIZERS_PARALLELISM"
"""The environment variable ``tokenizers`` reads before each batch call (unset: its thread pool is on)."""

POOL_MIN_SECONDS = 0.2
"""One-thread CPU seconds the rest of a call must hold (measured on its first piece, on this thread: the work, not the
wall a busy machine stretches) before worker processes join it, where a core stood idle beside this thread while the
first piece ran (:func:`idle_seconds`); :data:`BUSY_FACTOR` times as many where none did, or where that cannot be read.
Below, a fork of this process and the tokenizer pickled here and unpickled in each worker (~30 ms for a slow BERT
tokenizer on an idle core; up to 1 s on a busy machine; see docs/inference.md) cost more than they save."""

BUSY_FACTOR = 5.0
"""How many times :data:`POOL_MIN_SECONDS` the rest of a call must hold where no core stood idle beside this thread
(another job's busy loop: a worker takes this thread's core as much as the other job's; a slow tokenizer on 1,000
texts beside one ran 1.15x its call with workers, dropped half-way by the judgement, and 1.06x on one thread)."""

IDLE_CORE = 0.5
"""Cores idle on average beside this thread while a call's first piece ran, at least, for :data:`POOL_MIN_SECONDS`
to apply. The kernel counts idle time in clock ticks (10 ms on Linux), so a first piece of a few ticks reads it
coarsely: half a core tells a core left idle from one another job keeps busy."""

WORKERS_LOSE_BELOW = 1.0
"""The speed, as a multiple of one thread's (measured on the call's first piece), below which the shared part of a
call says the workers lose (see :class:`Pieces`): once a worker has answered a piece, the texts done since the sharing
began, at one thread's speed, would have taken less than the wall that passed. Then the workers get no more pieces
(this thread takes the rest) and the tokenizer's later calls run on this thread: a busy machine, a tokenizer that is
slow to unpickle or to start in a fresh process, threads that convoy on the GIL."""

_FALSE = ("", "off", "false", "f", "no", "n", "0")  # what tokenizers reads as false, lower-cased


def local_ranks() -> int:
    """Processes of this job on this node that tokenize at once: torchrun's ``LOCAL_WORLD_SIZE`` (1 when unset or not
    a positive int)."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "1")
    return int(value) if value.isdigit() and int(value) > 0 else 1


def available_cores(limit: int | None = None) -> int:
    """The cores this process may use (``os.sched_getaffinity``; ``os.cpu_count()`` where it does not exist), fewer
    where its cgroup's CPU quota allows fewer (:func:`cgroup_cores`), at most ``limit`` when given. Where torchrun runs
    several ranks on this node and this one is not pinned to cores of its own (its affinity is its launcher's: the
    machine's, or a container's or Slurm job's CPU set that holds every rank), each gets its share
    (``cores // LOCAL_WORLD_SIZE``, at least 1): ranks tokenize at the same time.

    Raises:
        TypeError / ValueError: a ``limit`` that is not a positive int.
    """
    try:
        affinity = os.sched_getaffinity(0)
    except AttributeError:  # not on Linux
        affinity = None
    cores = (os.cpu_count() or 1) if affinity is None else len(affinity)
    pinned = affinity is not None and _pinned_apart(affinity)
    cores = min(cores, cgroup_cores() or cores)
    if not pinned:
        cores = max(1, cores // local_ranks())
    if limit is None:
        return cores
    return min(cores, check_positive_int("tokenize_cores", limit))


def _pinned_apart(affinity: set[int]) -> bool:
    """Whether this process was pinned to cores of its own: its affinity is narrower than its parent's (a launcher
    that binds each rank, such as torchrun's ``--numa-binding``), or than the machine where the parent's cannot be
    read. A CPU set the launcher shares with every rank (a container's, a Slurm job's) is no pinning apart."""
    try:
        return affinity < os.sched_getaffinity(os.getppid())
    except OSError:  # the parent is gone or not ours to read
        return len(affinity) < (os.cpu_count() or len(affinity))


_PROC_CGROUP = "/proc/self/cgroup"
_MOUNTINFO = "/proc/self/mountinfo"


def cgroup_cores() -> int | None:
    """The cores this process's cgroup CPU quota (a container's ``--cpus``, a Kubernetes CPU limit, systemd's
    ``CPUQuota``) lets it keep busy: the smallest ``quota // period`` (at least 1) of its cgroup and the cgroups above
    it (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` and ``cpu.cfs_period_us``), as Rust's
    ``available_parallelism`` counts them for the tokenizer's own thread pool; ``None`` where none is set or it cannot
    be read (not Linux). The affinity does not show a quota: a process limited to 2 CPUs of a 64-core host sees 64."""
    try:
        with open(_PROC_CGROUP) as file:
            groups = [line.rstrip("\n").split(":", 2) for line in file]
        with open(_MOUNTINFO) as file:
            mounts = [line.split() for line in file]
    except OSError:
        return None
    limits = []
    for fields in mounts:  # mount id, parent, dev, root, mount point, options..., "-", fs type, source, super options
        if "-" not in fields:
            continue
        kind, options = fields[fields.index("-") + 1], fields[-1].split(",")
        version = 2 if kind == "cgroup2" else 1 if kind == "cgroup" and "cpu" in options else None
        for group in groups:
            if len(group) == 3 and version == (2 if group[0] == "0" and not group[1] else 1) and (
                    version == 2 or "cpu" in group[1].split(",")):
                limits += _quota_cores(fields[4], fields[3], group[2], version)
    return min(limits) if limits else None


def _quota_cores(mount_point: str, mount_root: str, group: str, version: int) -> list[int]:
    """The cores each quota set from ``group`` up to the mount's root allows (see :func:`cgroup_cores`)."""
    if mount_root != "/" and group.startswith(mount_root):  # a container's mount of its own subtree
        group = group[len(mount_root):]
    path = os.path.join(mount_point, group.lstrip("/"))
    limits = []
    while True:
        try:
            if version == 2:
                with open(os.path.join(path, "cpu.max")) as file:
                    quota, period = file.read().split()[:2]
            else:
                with open(os.path.join(path, "cpu.cfs_quota_us")) as file:
                    quota = file.read().strip()
                with open(os.path.join(path, "cpu.cfs_period_us")) as file:
                    period = file.read().strip()
            if quota not in ("max", "-1") and int(period) > 0:
                limits.append(max(1, int(quota) // int(period)))
        except (OSError, ValueError):  # no such file at this level (the mount's root), or unreadable
            pass
        above = os.path.dirname(path.rstrip("/"))
        if os.path.normpath(path) == os.path.normpath(mount_point) or above == path:
            return limits
        path = above


def idle_seconds() -> float | None:
    """Seconds the cores this process may use have stood idle since boot, summed over them (``/proc/stat``: idle and
    iowait of each CPU in ``os.sched_getaffinity``); ``None`` where that cannot be read (not Linux). Two readings
    ``wall`` seconds apart give the cores idle on average in between: ``(later - earlier) / wall``."""
    try:
        cpus = os.sched_getaffinity(0)
        with open("/proc/stat", "rb") as file:
            lines = file.read().splitlines()
        ticks = 0
        for line in lines:
            if line.startswith(b"cpu") and line[3:4].isdigit():
                fields = line.split()
                if int(fields[0][3:]) in cpus:
                    ticks += int(fields[4]) + int(fields[5])
        return ticks / os.sysconf("SC_CLK_TCK")
    except (AttributeError, OSError, ValueError, IndexError):
        return None


def tokenizers_parallelism() -> bool | None:
    """The user's ``TOKENIZERS_PARALLELISM`` as ``tokenizers`` reads it: ``None`` when unset."""
    value = os.environ.get(ENV_VARIABLE)
    return None if value is None else value.lower() not in _FALSE


@functools.cache
def _explain_parallelism_off() -> None:
    logger.info("%s=%r: the tokenizer's own thread pool stays off as set; dynabatch calls its backend from a thread "
                "of its own per core, one call each at a time (pass tokenize_cores=1 to tokenize on one core)",
                ENV_VARIABLE, os.environ.get(ENV_VARIABLE))


def choose_mechanism(*, backend: bool, cores: int) -> str:
    """How a call tokenizes on ``cores`` cores: ``"threads"``, ``"parallel calls"``, ``"shared"`` or ``"one"`` (see
    the module docs).

    Args:
        backend: the fast backend provably gives the tokenizer's rows
            (:func:`~dynabatch.data.tokenization.fast_backend`).
        cores: cores to use (:func:`available_cores`).
    """
    if cores <= 1:
        return "one"
    parallelism = tokenizers_parallelism()
    if backend and parallelism is not False and cores >= available_cores():
        return "threads"  # its pool spans every core of the process: the cap does not bind
    if backend and parallelism is False:
        _explain_parallelism_off()
        return "parallel calls"
    return "shared"


_guard_lock = threading.Lock()
_guarded = False
_set_for_fork = threading.local()


def _before_fork() -> None:
    _set_for_fork.value = ENV_VARIABLE not in os.environ
    if _set_for_fork.value:
        os.environ[ENV_VARIABLE] = "false"


def _after_fork_in_parent() -> None:
    if getattr(_set_for_fork, "value", False):
        os.environ.pop(ENV_VARIABLE, None)
        _set_for_fork.value = False


def guard_forks() -> None:
    """From now on, a process forked from this one starts with ``TOKENIZERS_PARALLELISM=false`` when the user left it
    unset (see the module's docstring); once per process, a no-op where ``os.register_at_fork`` does not exist."""
    global _guarded
    with _guard_lock:
        if _guarded or not hasattr(os, "register_at_fork"):
            return
        os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent)
        _guarded = True


_POLL = 0.1  # seconds a wait blocks at a time: Ctrl-C, a stop request and a dead parent are seen this soon
_PR_SET_PDEATHSIG = 1  # prctl option (linux/prctl.h)
_OWN_THREADS_SHARE = 0.5
"""The share of a first piece's CPU time spent off the calling thread above which the call already spans cores by
itself (a tokenizer on its own thread pool). A share, not CPU seconds per wall second: on a busy machine the pool's
threads get less than a core each, and the share holds where the ratio does not (a custom ``__call__`` of a fast
tokenizer measured 0.9 cores per wall second under load and still ran on the pool)."""


def _die_with_parent(parent: int, by_main_thread: bool) -> None:
    """In a worker: end the moment ``parent`` does, whatever way it ends (SIGKILL included).

    On Linux the kernel sends SIGKILL when the thread that forked us ends (``PR_SET_PDEATHSIG``): right only when the
    main thread forked us (a pool started from a thread that ends would lose its workers), so only then; and the parent
    may have died before the call, so the parent is checked after it. Everywhere, a daemon thread checks the parent
    every :data:`_POLL` seconds (a worker re-parented to init or a subreaper sees another parent)."""
    if by_main_thread and sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):  # no prctl to call: the watchdog alone
            pass
    if os.getppid() != parent:
        os._exit(0)

    def watch() -> None:
        if os.getppid() != parent:
            os._exit(0)

    Ticker(watch, seconds=_POLL, name="dynabatch-parent-watch").start()  # lives as long as the worker process


@contextlib.contextmanager
def _sigint_blocked() -> Iterator[None]:
    """SIGINT blocked in this thread while it starts workers: a fork inherits the block, so a Ctrl-C that reaches a
    worker before it ignores SIGINT (in :func:`_worker_main`) waits and is dropped there, instead of raising in the
    worker's start-up. This process's own Ctrl-C is not lost: another thread takes it, or it comes when unblocked."""
    if not hasattr(signal, "pthread_sigmask"):  # Windows: no process group signals to block
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def _worker_main(tasks: Connection, results: Connection, parent: int, by_main_thread: bool,
                 inherited: list[Connection]) -> None:
    """A worker process: the tasks its pipe brings, one at a time, each answered on its result pipe."""
    # A terminal's Ctrl-C reaches the whole process group: the parent decides (it stops, or a notebook goes on and
    # calls again); a worker that raised it would print a traceback to the user's terminal and leave the pool. It
    # was blocked from the fork on (see _sigint_blocked): one that came since is dropped as it is ignored.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    for connection in inherited:  # the parent's ends of every pipe, forked with it: held here, they would keep a
        connection.close()        # sibling's pipe open after the parent died
    _die_with_parent(parent, by_main_thread)
    os.environ[ENV_VARIABLE] = "false"  # one core per worker: the pool is the parallelism
    state: Any = None
    while True:
        try:
            task = tasks.recv()
        except (EOFError, OSError):  # the parent closed its end, or is gone
            return
        if task is None:
            return
        blob, function, piece = task
        if blob is not None:
            try:
                state = pickle.loads(blob)
            except Exception as exc:  # noqa: BLE001 (its class not importable here: the parent does the piece)
                state = None
                results.send(("unusable", f"{type(exc).__name__}: {exc}"))
                continue
        try:
            answer = ("done", function(state, piece))
        except Exception as exc:  # noqa: BLE001 (raised in the parent's thread)
            answer = ("error", exc)
        try:
            results.send(answer)
        except (pickle.PicklingError, TypeError, AttributeError) as exc:  # an error that does not pickle
            results.send(("error", RuntimeError(f"{answer[1]!r} ({exc})")))


class _Worker:
    """The parent's side of a worker process: its pipes, the state it holds, the tasks it has not answered."""

    def __init__(self, process: Any, tasks: Connection, results: Connection) -> None:
        self.process, self.tasks, self.results = process, tasks, results
        self.key: str | None = None  # the fingerprint of the state it holds
        self.pending: collections.deque = collections.deque()  # (call, piece index) sent, not answered yet
        self.answered = -1  # the last call it answered a piece of (a worker that has not may still be starting)
        self.usable = True


class WorkerPool:
    """Worker processes that each run ``function(state, piece)`` on pieces handed out by :meth:`share`.

    Args:
        workers: worker processes.

    Workers are forked where the platform can (Linux: no interpreter to start, the caller's classes importable as
    they are), else spawned; each holds the ends of its own two pipes only, and ends with this process however it
    ends (see :func:`_die_with_parent`), when :meth:`close` runs, and at interpreter exit. A state is pickled once
    and sent to a worker once (it keeps the last one it got: a deep copy of the same tokenizer is not sent again).
    One call at a time uses the pool (:attr:`lock`).
    """

    def __init__(self, workers: int) -> None:
        check_positive_int("workers", workers)
        method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
        context = multiprocessing.get_context(method)
        guard_forks()
        by_main_thread = threading.current_thread() is threading.main_thread()
        self.owner = os.getpid()
        self.lock = threading.Lock()
        self._workers: list[_Worker] = []
        self._calls = itertools.count()
        self._state: Any = None
        self._blob: tuple[str, bytes] | None = None
        parent_ends: list[Connection] = []
        try:
            with _sigint_blocked():
                for _ in range(workers):
                    task_read, task_write = context.Pipe(duplex=False)
                    result_read, result_write = context.Pipe(duplex=False)
                    parent_ends += [task_write, result_read]
                    inherited = list(parent_ends) if method == "fork" else []
                    process = context.Process(target=_worker_main, name="dynabatch-tokenizer", daemon=True,
                                              args=(task_read, result_write, os.getpid(), by_main_thread, inherited))
                    process.start()
                    task_read.close()
                    result_write.close()
                    self._workers.append(_Worker(process, task_write, result_read))
        except BaseException:
            self.close()
            raise
        logger.debug("started %d tokenizer worker processes (%s)", workers, method)

    @property
    def workers(self) -> int:
        """Worker processes that can take pieces."""
        return sum(w.usable for w in self._workers)

    @property
    def pids(self) -> list[int]:
        """The worker processes' ids."""
        return [w.process.pid for w in self._workers]

    def _pickled(self, state: Any) -> tuple[str, bytes]:
        """``state``'s fingerprint and pickle, kept for the last state (one tokenizer pickled once per pool)."""
        if self._blob is None or self._state is not state:
            blob = pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)
            self._state, self._blob = state, (fingerprint(blob), blob)
        return self._blob

    def share(self, function: Callable[[Any, Any], Any], state: Any, pieces: Sequence[Any],
              indices: Sequence[int]) -> _Sharing:
        """Iterates ``(index, function(state, pieces[index]))`` for every index, in the order they finish, run by this
        thread and the workers together (see :class:`_Sharing`; its ``failed`` says whether a worker failed).

        Raises:
            pickle.PicklingError, TypeError, AttributeError: ``state`` cannot be pickled (before any piece runs).
        """
        if not self._workers:
            raise RuntimeError("the worker pool is closed")
        return _Sharing(self, next(self._calls), function, state, self._pickled(state), pieces, indices)

    def close(self) -> None:
        """Ends the workers (a stop message, then SIGKILL for one that is still busy) and waits for them."""
        workers, self._workers = self._workers, []
        for worker in workers:
            try:
                worker.tasks.send(None)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 1.0
        for worker in workers:
            worker.process.join(max(0.0, deadline - time.monotonic()))
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join()
            worker.tasks.close()
            worker.results.close()

    def forget(self) -> None:
        """In a process forked from the pool's owner: closes this copy of the pipes' ends (the workers are not ours)."""
        for worker in self._workers:
            worker.tasks.close()
            worker.results.close()
        self._workers = []


class _Sharing:
    """One call's pieces shared between the calling thread and the pool's workers.

    The workers take pieces from the front, one at a time each, and the calling thread from the back; a background
    thread (:class:`~dynabatch._background.Ahead`) sends and receives for the workers, so neither waits on the other's
    pipe. When no piece is left to take, the calling thread takes over a piece of a worker that has not answered any
    piece of this call yet (one still unpickling the state): it never waits on a worker that has not shown it runs,
    so the call takes about what one thread takes at worst, whatever the workers cost to start. A worker that dies or
    cannot unpickle the state leaves its piece to this thread (logged); an error raised in a worker is raised here.
    """

    def __init__(self, pool: WorkerPool, call: int, function: Callable[[Any, Any], Any], state: Any,
                 pickled: tuple[str, bytes], pieces: Sequence[Any], indices: Sequence[int]) -> None:
        self.pool, self.call, self.function, self.state = pool, call, function, state
        self.key, self.blob = pickled
        self.pieces = pieces
        self.todo = collections.deque(indices)
        self.running: dict[int, _Worker] = {}  # piece index -> the worker running it
        self.done: set[int] = set()
        self.lock = threading.Lock()  # todo and running, shared with the background thread
        self.talking = True  # the background thread runs (a worker holds a piece or may take one)
        self.failed = False  # a worker died or could not unpickle the state
        self.from_workers = 0  # pieces the workers answered in this call
        self.stopped = False  # the workers take no more pieces: this thread takes the rest

    def stop_workers(self) -> None:
        """From now on no worker gets a piece, and this thread takes over those they hold rather than wait (the first
        answer of a piece counts; a worker's later one is dropped)."""
        with self.lock:
            self.stopped = True

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        total = len(self.todo)
        talk = Ahead(self._talk(), depth=None, name="dynabatch-tokenize-workers")
        talk.start()
        try:
            while len(self.done) < total:
                yield from self._answers(talk, block=False)
                if len(self.done) >= total:
                    break
                index = self._take()
                if index is not None:
                    result = self.function(self.state, self.pieces[index])
                    if index not in self.done:
                        self.done.add(index)
                        yield index, result
                elif self.talking:
                    yield from self._answers(talk, block=True)
                else:  # nothing left to take, and no worker holds a piece: a piece was lost (a bug, not an input)
                    raise RuntimeError(f"{total - len(self.done)} pieces of {total} were lost between the tokenizer "
                                       "worker processes and this process")
        finally:
            talk.close()

    def _take(self) -> int | None:
        """The next piece for this thread: the last one no worker took, else one of a worker not yet answering (any
        worker's, once the workers lost: this thread does not wait on them)."""
        with self.lock:
            if self.todo:
                return self.todo.pop()
            for index, worker in list(self.running.items()):
                if (self.stopped or worker.answered < self.call) and index not in self.done:
                    del self.running[index]
                    return index
        return None

    def _answers(self, talk: Ahead, *, block: bool) -> Iterator[tuple[int, Any]]:
        """The workers' answers ready now (with ``block``: at least one event first)."""
        got = talk.next(block=block)
        while got is not Ahead.NOT_READY and got is not None:
            if got is not _TICK:
                kind, index, payload = got
                if kind == "error":
                    raise payload
                if kind == "done" and index not in self.done:
                    self.done.add(index)
                    self.from_workers += 1
                    yield index, payload
                elif kind in ("died", "unusable"):
                    logger.warning("tokenizer worker processes failed (%s): this process tokenizes their pieces",
                                   payload)
                    self.failed = True
                    if index not in self.done:
                        with self.lock:
                            self.todo.append(index)
                if block:
                    return
            got = talk.next(block=False)
        if got is None:
            self.talking = False

    def _feed(self, worker: _Worker) -> None:
        with self.lock:
            if self.stopped or not self.todo or not worker.usable or worker.pending:
                return
            index = self.todo.popleft()
            self.running[index] = worker
        blob = self.blob if worker.key != self.key else None
        try:
            worker.tasks.send((blob, self.function, self.pieces[index]))
        except OSError as exc:  # it died: its piece goes back, to whoever takes it
            worker.usable = False
            logger.warning("tokenizer worker processes failed (%s): this process tokenizes their pieces", exc)
            self.failed = True
            with self.lock:
                self.running.pop(index, None)
                self.todo.append(index)
            return
        worker.key = self.key
        worker.pending.append((self.call, index))

    def _talk(self) -> Iterator[Any]:
        """In the background thread: keeps each worker busy with one piece, and passes its answers on."""
        workers = [w for w in self.pool._workers if w.usable]
        for worker in workers:
            self._feed(worker)
        while True:
            listening = {w.results: w for w in workers if w.pending}
            if not listening:
                return
            ready = multiprocessing.connection.wait(list(listening), timeout=_POLL)
            if not ready:
                yield _TICK
            for connection in ready:
                worker = listening[connection]
                call, index = worker.pending.popleft()
                try:
                    kind, payload = connection.recv()
                except (EOFError, OSError):
                    worker.usable = False
                    kind, payload = "died", f"exit code {worker.process.exitcode}"
                if kind == "unusable":
                    worker.usable, worker.key = False, None
                with self.lock:
                    if self.running.get(index) is worker:
                        del self.running[index]
                if call == self.call:
                    worker.answered = self.call
                    yield kind, index, payload
                self._feed(worker)


_TICK = object()  # the background thread's sign of life while no answer comes (so it can be stopped)

_shared_lock = threading.Lock()
_shared: WorkerPool | None = None


def shared_pool(workers: int) -> WorkerPool | None:
    """This process's worker pool with at least ``workers`` workers, started at the first call that needs it and kept
    for the next (loaders built one after another share it) until :func:`release_pool`, interpreter exit, or this
    process's end; ``None`` where no pool can run: in a daemonic process (a DataLoader worker). A call that will use it
    takes it with :func:`_claimed_pool` instead."""
    with _shared_lock:
        return _current_pool(workers)


def _claimed_pool(workers: int) -> WorkerPool | None:
    """:func:`shared_pool`, its :attr:`~WorkerPool.lock` taken for the caller (who releases it), in the one step under
    the module's lock: a pool taken apart from its lock could be closed in between by another thread's
    :func:`release_pool` (a run ending there), and the call would meet a closed pool. ``None`` where no pool can run,
    or where another thread's call is using it (the caller tokenizes alone)."""
    with _shared_lock:
        pool = _current_pool(workers)
        return pool if pool is not None and pool.lock.acquire(blocking=False) else None


def _current_pool(workers: int) -> WorkerPool | None:
    """:func:`shared_pool`'s pool; the caller holds ``_shared_lock``."""
    global _shared
    if multiprocessing.current_process().daemon:
        return None
    if _shared is not None and _shared.owner != os.getpid():  # inherited without a fork hook: not ours to end
        _shared.forget()
        _shared = None
    if _shared is not None and _shared.workers < workers and _shared.lock.acquire(blocking=False):
        _shared.lock.release()  # too few workers (a cap raised, a worker died): a new pool, none in use
        _shared.close()
        _shared = None
    if _shared is None:
        _shared = WorkerPool(workers)
    return _shared


def release_pool() -> None:
    """Ends this process's worker pool unless a call is using it (that call's own release ends it)."""
    global _shared
    with _shared_lock:
        pool = _shared
        if pool is None or not pool.lock.acquire(blocking=False):
            return
        try:
            pool.close()
            _shared = None
        finally:
            pool.lock.release()


def _forget_pool_in_child() -> None:
    global _shared
    if _shared is not None:
        _shared.forget()
        _shared = None


atexit.register(release_pool)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_in_child)


class Pieces:
    """``function(state, piece)`` of every piece, in order: on this thread, joined by worker processes where the cost
    rule says they pay.

    Args:
        function: a top-level function (workers import it by name).
        state: what ``function`` needs besides the piece (the tokenizer and its arguments), picklable to use workers.
        pieces: the pieces, each a sequence (of texts): their lengths weigh the cost.
        cores: cores to use (this thread and ``cores - 1`` workers at most).
        later: the work of the calls still to come for the same job (a stream's later chunks), as a multiple of this
            call's: the pool outlives the call, so it is weighed with the call's rest.
        alone_size: where no worker joins, the pieces after the first are joined into pieces of this many items
            (lists joined: ``function`` takes any run of them), fewer calls than the sharing's small pieces; ``None``:
            the pieces as given.

    **The cost rule.** This thread runs the first piece, timed. Workers join only where the rest (and ``later``) would
    take one thread at least :data:`POOL_MIN_SECONDS` of CPU at that piece's CPU seconds a text where at least
    :data:`IDLE_CORE` cores stood idle beside this thread while the first piece ran (:func:`idle_seconds`; else
    :data:`BUSY_FACTOR` times that: a worker would take a core another job holds), the first piece did
    not already keep threads of its own busy (:data:`_OWN_THREADS_SHARE`: a tokenizer call on its own thread pool,
    such as a fast tokenizer's custom ``__call__``), and the process's pool is free (:func:`shared_pool`). Then this
    thread and the workers share the rest (:class:`_Sharing`): this thread never waits on a worker that has not
    answered yet, so a call costs what one thread costs, plus a fork the first time, even where the workers take long
    to start.

    **Judged as it runs.** The rule predicts; the shared part is then measured against the prediction: once a worker
    has answered a piece, each finished piece compares the texts done since the sharing began, at the first piece's
    one-thread speed, with the wall that passed; below :data:`WORKERS_LOSE_BELOW` times that speed the workers lose,
    get no more pieces, and this thread tokenizes the rest, those they hold included (``lost``; each piece once).

    Attributes (after iterating): ``used_workers`` (workers that took pieces), ``unpicklable`` (the state could not be
    pickled), ``failed`` (a worker died or could not unpickle the state), ``lost`` (the workers ran slower than one
    thread): the caller keeps workers off for this state's later calls where any of the last three holds.
    """

    def __init__(self, function: Callable[[Any, Any], Any], state: Any, pieces: Sequence[Sequence[Any]], *,
                 cores: int, later: float = 0.0, alone_size: int | None = None) -> None:
        self.function, self.state, self.pieces = function, state, pieces
        self.cores, self.later, self.alone_size = cores, later, alone_size
        self.used_workers = 0
        self.unpicklable = self.failed = self.lost = False

    def __iter__(self) -> Iterator[Any]:
        if not self.pieces:
            return
        if self.cores < 2 or len(self.pieces) < 2:  # no worker can join: nothing to time, the kernel not asked
            yield self.function(self.state, self.pieces[0])
            yield from self._alone()
            return
        idle = idle_seconds()
        wall, cpu, own = time.perf_counter(), time.process_time(), time.thread_time()
        yield self.function(self.state, self.pieces[0])
        wall, cpu, own = time.perf_counter() - wall, time.process_time() - cpu, time.thread_time() - own
        now = idle_seconds()
        idle_beside = (now - idle) / wall if idle is not None and now is not None and wall > 0 else None
        total = sum(map(len, self.pieces))
        first = max(1, len(self.pieces[0]))
        # The rule weighs this thread's CPU seconds (the work, which a busy machine does not grow, where it stretches
        # the wall); the judgement of the shared part weighs the wall (the outcome)
        rest = own / first * (total - len(self.pieces[0]) + self.later * total)
        per_text = wall / first
        pool = self._pool(rest, max(0.0, cpu - own) / cpu if cpu > 0 else 0.0, idle_beside)
        if pool is None:
            yield from self._alone()
            return
        try:
            yield from self._shared(pool, per_text)
        finally:
            pool.lock.release()

    def _alone(self) -> Iterator[Any]:
        """The results of the pieces after the first, on this thread alone: joined into pieces of :attr:`alone_size`
        items, where given."""
        rest = self.pieces[1:]
        if self.alone_size is not None and len(rest) > 1:
            items = [item for piece in rest for item in piece]
            rest = [items[start : start + self.alone_size] for start in range(0, len(items), self.alone_size)]
        for piece in rest:
            yield self.function(self.state, piece)

    def _pool(self, rest: float, elsewhere: float, idle_beside: float | None) -> WorkerPool | None:
        """The process's pool, locked for this call, where the cost rule says workers pay; else ``None``."""
        idle = idle_beside is not None and idle_beside >= IDLE_CORE
        if rest < POOL_MIN_SECONDS * (1.0 if idle else BUSY_FACTOR) or elsewhere > _OWN_THREADS_SHARE:
            logger.debug("tokenizing on one thread: the rest takes ~%.2f s there; %.0f%% of the CPU time off this "
                         "thread; %s cores idle beside it", rest, 100 * elsewhere,
                         "unknown" if idle_beside is None else f"{idle_beside:.2f}")
            return None
        return _claimed_pool(self.cores - 1)

    def _shared(self, pool: WorkerPool, per_text: float) -> Iterator[Any]:
        try:
            sharing = pool.share(self.function, self.state, self.pieces, range(1, len(self.pieces)))
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            self.unpicklable = True
            logger.warning("the tokenizer cannot be pickled for worker processes (%s): tokenizing on one core "
                           "(define its class at the top level of a module to tokenize on every core)", exc)
            yield from self._alone()
            return
        self.used_workers = pool.workers
        finished: dict[int, Any] = {}
        following, texts, began = 1, 0, time.perf_counter()
        for index, result in sharing:
            finished[index] = result
            texts += len(self.pieces[index])
            if not sharing.stopped and sharing.from_workers and self._losing(texts, per_text, began):
                sharing.stop_workers()
                self.lost = True
            while following in finished:
                yield finished.pop(following)
                following += 1
        self.failed = sharing.failed

    def _losing(self, texts: int, per_text: float, began: float) -> bool:
        """Whether the shared part runs below :data:`WORKERS_LOSE_BELOW` times one thread's speed (logged once)."""
        wall = time.perf_counter() - began
        speed = texts * per_text / wall if wall > 0 else float("inf")
        if speed >= WORKERS_LOSE_BELOW:
            return False
        logger.info("tokenizer worker processes lose: this thread and the workers ran at %.2fx one thread's speed "
                    "(%d texts in %.2f s): this thread tokenizes the rest, and this tokenizer's later calls", speed,
                    texts, wall)
        return True
