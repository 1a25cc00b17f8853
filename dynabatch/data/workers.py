"""Tokenizing on every core: how many cores, the user's ``TOKENIZERS_PARALLELISM``, and worker processes.

The tokenize stage (:mod:`dynabatch.data.tokenization`) runs on the cores this
process may use, ``len(os.sched_getaffinity(0))`` (not ``os.cpu_count()``: a
process pinned by ``taskset``, a container's CPU set), capped by the
``tokenize_cores`` argument of the loader (:func:`available_cores`). It spreads
the work one of three ways, chosen by :func:`choose_mechanism`:

* ``"threads"``: the fast tokenizer's Rust backend encodes each call on its own
  thread pool (``encode_batch``); where the backend provably gives the
  tokenizer's own rows, all cores may be used, and the user has not set
  ``TOKENIZERS_PARALLELISM`` to a false value;
* ``"processes"``: a :class:`WorkerPool` of worker processes, each handed the
  tokenizer once (pickled) and then pieces of texts, each encoding on one core
  and sending back flat ``int32`` arrays: for a tokenizer whose own call must run
  (an overridden ``__call__``, a slow tokenizer, any callable), for a cap below
  the process's cores, and where ``TOKENIZERS_PARALLELISM`` is false (the
  tokenizer's threads stay off, as its user asked; logged once);
* ``"one"``: this process, one core: one core to use, or too few texts to pay
  for starting processes (:data:`POOL_MIN_TEXTS`).

**Forks.** ``tokenizers`` disables its thread pool in a process forked after the
pool ran (the pool's threads do not survive a fork, and using it would
deadlock), and versions before 0.22.2 print a warning then, unless
``TOKENIZERS_PARALLELISM`` is set. DataLoader workers and this module's workers
fork, so once this process tokenized on several cores, :func:`guard_forks`
makes every process forked from it start with ``TOKENIZERS_PARALLELISM=false``
where the user left it unset (it is set for the fork only, and unset again in
this process): what ``tokenizers`` does in such a child anyway, without the
warning. A value the user set is never changed.

Example:
    >>> from dynabatch.data.workers import available_cores, choose_mechanism
    >>> available_cores(1)
    1
    >>> choose_mechanism(backend=True, cores=1, texts=100_000)
    'one'
"""

from __future__ import annotations

import functools
import logging
import multiprocessing
import os
import pickle
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from dynabatch._validation import check_positive_int

__all__ = ["ENV_VARIABLE", "POOL_MIN_TEXTS", "WorkerPool", "available_cores", "choose_mechanism", "guard_forks",
           "tokenizers_parallelism"]

logger = logging.getLogger(__name__)

ENV_VARIABLE = "TOKENIZERS_PARALLELISM"
"""The environment variable ``tokenizers`` reads before each batch call (unset: its thread pool is on)."""

POOL_MIN_TEXTS = 2048
"""Texts a tokenize call must hold before worker processes start for it: below, starting them (a fork and the
tokenizer unpickled in each, ~0.1-0.3 s) costs more than they save."""

_FALSE = ("", "off", "false", "f", "no", "n", "0")  # what tokenizers reads as false, lower-cased


def available_cores(limit: int | None = None) -> int:
    """The cores this process may use (``os.sched_getaffinity``; ``os.cpu_count()`` where it does not exist),
    at most ``limit`` when given.

    Raises:
        TypeError / ValueError: a ``limit`` that is not a positive int.
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    if limit is None:
        return cores
    return min(cores, check_positive_int("tokenize_cores", limit))


def tokenizers_parallelism() -> bool | None:
    """The user's ``TOKENIZERS_PARALLELISM`` as ``tokenizers`` reads it: ``None`` when unset."""
    value = os.environ.get(ENV_VARIABLE)
    return None if value is None else value.lower() not in _FALSE


@functools.cache
def _explain_parallelism_off() -> None:
    logger.info("%s=%r: the tokenizer's own threads stay off as set; dynabatch tokenizes in worker processes "
                "instead (pass tokenize_cores=1 to tokenize on one core)", ENV_VARIABLE, os.environ.get(ENV_VARIABLE))


def choose_mechanism(*, backend: bool, cores: int, texts: int) -> str:
    """How a call tokenizes ``texts`` texts on ``cores`` cores: ``"threads"``, ``"processes"`` or ``"one"``.

    Args:
        backend: the fast backend provably gives the tokenizer's rows
            (:func:`~dynabatch.data.tokenization.fast_backend`).
        cores: cores to use (:func:`available_cores`).
        texts: texts of the call (a stream's: of its largest chunk).
    """
    if cores <= 1:
        return "one"
    parallelism = tokenizers_parallelism()
    if backend and parallelism is not False and cores >= available_cores():
        return "threads"  # its pool spans every core of the process: the cap does not bind
    if texts < POOL_MIN_TEXTS:
        return "one"
    if backend and parallelism is False:
        _explain_parallelism_off()
    return "processes"


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


_WORKER_STATE: Any = None  # in a worker process: what the pool's initializer unpickled


def _start_worker(blob: bytes) -> None:
    global _WORKER_STATE
    os.environ[ENV_VARIABLE] = "false"  # one core per worker: the pool is the parallelism
    _WORKER_STATE = pickle.loads(blob)


def _run_in_worker(function: Callable[[Any, Any], Any], piece: Any) -> Any:
    return function(_WORKER_STATE, piece)


class WorkerPool:
    """Worker processes that each receive ``state`` once and then run ``function(state, piece)`` on pieces.

    Args:
        state: what every worker needs (e.g. the tokenizer and its arguments);
            pickled once here, unpickled once per worker.
        workers: worker processes.

    Raises:
        pickle.PicklingError, TypeError, AttributeError: ``state`` cannot be
            pickled (a class defined inside a function, a lambda): the caller
            tokenizes in this process instead.

    Workers are forked where the platform can (Linux: no interpreter to start, the
    caller's classes importable as they are), else spawned. :meth:`imap` keeps the
    pieces' order; an error in a worker is raised by it, and a worker that could
    not start or died raises ``concurrent.futures.process.BrokenProcessPool``.
    :meth:`close` ends every worker and the pool's thread (also on garbage collection).
    """

    def __init__(self, state: Any, workers: int) -> None:
        blob = pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)
        method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
        guard_forks()
        self.workers = workers
        self._executor: ProcessPoolExecutor | None = ProcessPoolExecutor(
            workers, mp_context=multiprocessing.get_context(method), initializer=_start_worker, initargs=(blob,))
        logger.debug("started %d tokenizer worker processes (%s, tokenizer of %d bytes)", workers, method, len(blob))

    def imap(self, function: Callable[[Any, Any], Any], pieces: Sequence[Any]) -> Iterator[Any]:
        """``function(state, piece)`` of each piece, run by the workers (all submitted at once), yielded in order."""
        if self._executor is None:
            raise RuntimeError("the worker pool is closed")
        futures = [self._executor.submit(_run_in_worker, function, piece) for piece in pieces]
        try:
            for future in futures:
                yield future.result()
        finally:
            for future in futures:
                future.cancel()

    def close(self) -> None:
        """Ends the workers and waits for them."""
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)

    def __del__(self) -> None:  # garbage-collected unclosed: end the workers without waiting here
        executor = getattr(self, "_executor", None)
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)
