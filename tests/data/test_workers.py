"""How many cores, which mechanism, the user's TOKENIZERS_PARALLELISM, forks, and the worker pool."""

import logging
import multiprocessing
import os
import pickle

import pytest

from dynabatch.data import workers
from dynabatch.data.workers import WorkerPool, available_cores, choose_mechanism, guard_forks, tokenizers_parallelism


def test_cores_are_the_affinity_capped_by_the_argument():
    assert available_cores() == len(os.sched_getaffinity(0))
    assert available_cores(1) == 1 and available_cores(10**6) == available_cores()
    with pytest.raises(ValueError, match=r"^tokenize_cores should be a positive integer, but got tokenize_cores=0$"):
        available_cores(0)


@pytest.mark.parametrize("value, parsed", [(None, None), ("false", False), ("0", False), ("OFF", False),
                                           ("", False), ("true", True), ("1", True)])
def test_the_environment_variable_is_read_as_tokenizers_reads_it(monkeypatch, value, parsed):
    if value is None:
        monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    else:
        monkeypatch.setenv("TOKENIZERS_PARALLELISM", value)
    assert tokenizers_parallelism() is parsed


def test_the_mechanism(monkeypatch, caplog):
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    monkeypatch.setattr(workers, "available_cores", lambda limit=None: 4 if limit is None else min(4, limit))
    big, small = 10**6, workers.POOL_MIN_TEXTS - 1
    assert choose_mechanism(backend=True, cores=4, texts=small) == "threads"
    assert choose_mechanism(backend=True, cores=2, texts=big) == "processes"  # a cap below the pool's cores
    assert choose_mechanism(backend=False, cores=4, texts=big) == "processes"
    assert choose_mechanism(backend=False, cores=4, texts=small) == "one"  # too few texts to start processes
    assert choose_mechanism(backend=True, cores=1, texts=big) == "one"
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")  # the user's: the backend's threads stay off
    workers._explain_parallelism_off.cache_clear()
    with caplog.at_level(logging.INFO, logger="dynabatch.data.workers"):
        assert choose_mechanism(backend=True, cores=4, texts=big) == "processes"
        assert choose_mechanism(backend=True, cores=4, texts=big) == "processes"
    said = [r.getMessage() for r in caplog.records if "TOKENIZERS_PARALLELISM" in r.getMessage()]
    assert len(said) == 1 and "tokenize_cores=1" in said[0]  # once, with the way to one core
    assert os.environ["TOKENIZERS_PARALLELISM"] == "false"  # never turned on


def _double(state, piece):
    return [state * value for value in piece]


def _fail(state, piece):
    raise ValueError(f"bad piece {piece}")


def test_the_pool_keeps_the_order_raises_errors_and_leaves_no_process():
    pool = WorkerPool(2, workers=2)
    try:
        assert list(pool.imap(_double, [[1, 2], [3], [4, 5, 6]])) == [[2, 4], [6], [8, 10, 12]]
        with pytest.raises(ValueError, match=r"^bad piece \[7\]$"):
            list(pool.imap(_fail, [[7]]))
    finally:
        pool.close()
    assert multiprocessing.active_children() == []
    with pytest.raises(RuntimeError, match="closed"):
        list(pool.imap(_double, [[1]]))


def test_a_state_that_cannot_be_pickled_is_refused_before_any_process_starts():
    with pytest.raises((pickle.PicklingError, AttributeError)):  # by version: a local object is either
        WorkerPool(lambda: None, workers=2)
    assert multiprocessing.active_children() == []


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_process_forked_after_guard_forks_starts_with_parallelism_off(monkeypatch):
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    guard_forks()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: tell the parent what it sees
        os.write(write, os.environ.get("TOKENIZERS_PARALLELISM", "unset").encode())
        os._exit(0)
    os.close(write)
    seen = os.read(read, 100).decode()
    os.close(read)
    os.waitpid(pid, 0)
    assert seen == "false"  # configured in the child: tokenizers neither warns nor uses its pool there
    assert "TOKENIZERS_PARALLELISM" not in os.environ  # this process: as the user left it
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")  # a value the user set is never changed
    pid = os.fork()
    if pid == 0:
        os._exit(0 if os.environ.get("TOKENIZERS_PARALLELISM") == "true" else 1)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
