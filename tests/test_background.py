"""The one background-thread mechanism: Ahead (an iterable pulled ahead) and Worker (jobs run behind), errors raised in
the caller's thread, every thread stopped by close()."""

import threading
import time

import pytest

from dynabatch._background import Ahead, Worker


def _alive(name: str) -> bool:
    return any(t.name == name for t in threading.enumerate())


def test_items_in_order_then_none_and_nothing_pulled_before_the_first_next():
    pulled = []

    def items():
        for i in range(3):
            pulled.append(i)
            yield i

    ahead = Ahead(items(), depth=1, name="ahead-order")
    time.sleep(0.05)
    assert pulled == []
    assert [ahead.next(), ahead.next(), ahead.next(), ahead.next(), ahead.next()] == [0, 1, 2, None, None]


def test_an_error_in_the_thread_is_raised_by_the_consumer_after_the_items_before_it():
    def items():
        yield 1
        raise KeyError("broken source")

    ahead = Ahead(items(), depth=None, name="ahead-error")
    assert ahead.next() == 1
    with pytest.raises(KeyError, match="broken source"):
        ahead.next()
    assert ahead.next() is None


def test_not_ready_without_blocking_and_close_stops_a_thread_waiting_for_room():
    release = threading.Event()

    def slow():
        release.wait(5)
        yield from range(100)

    ahead = Ahead(slow(), depth=1, name="ahead-close")
    assert ahead.next(block=False) is Ahead.NOT_READY
    release.set()
    assert ahead.next() == 0
    ahead.close()  # the thread holds item 2 and waits for room: it stops
    deadline = time.monotonic() + 5
    while _alive("ahead-close") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive("ahead-close") and ahead.next() is None


def test_a_worker_runs_jobs_in_order_at_most_depth_unfinished():
    release, done, running = threading.Event(), [], []

    def job(i):
        running.append(i)
        release.wait(5)
        done.append(i)

    worker = Worker(depth=1, name="worker-order")
    worker.submit(job, 0)
    submitted = threading.Event()
    threading.Thread(target=lambda: (worker.submit(job, 1), submitted.set()), daemon=True).start()
    time.sleep(0.3)
    assert running == [0] and not submitted.is_set()  # the second waits for room: one job unfinished at most
    release.set()
    assert submitted.wait(5)
    worker.close()
    assert done == [0, 1] and not _alive("worker-order")


def test_a_jobs_error_is_raised_once_at_the_next_call_and_the_jobs_after_it_still_run():
    done = []

    def fails():
        raise OSError(28, "No space left on device")

    worker = Worker(depth=2, name="worker-error")
    worker.submit(fails)
    worker.submit(done.append, "after")
    with pytest.raises(OSError, match="No space left on device"):
        worker.wait()
    worker.wait()  # raised once
    worker.submit(fails)
    with pytest.raises(OSError, match="No space left on device"):
        worker.close()
    assert done == ["after"] and not _alive("worker-error")


def test_close_with_cancel_drops_the_waiting_jobs_and_stops_the_thread():
    release, done = threading.Event(), []

    def job(i):
        release.wait(5)
        done.append(i)

    worker = Worker(depth=3, name="worker-cancel")
    for i in range(3):
        worker.submit(job, i)
    time.sleep(0.1)
    threading.Timer(0.2, release.set).start()
    worker.close(cancel=True)  # the job in progress ends, the others are dropped
    assert done == [0] and not _alive("worker-cancel")
    with pytest.raises(RuntimeError, match="^worker-cancel: closed, it takes no more jobs$"):
        worker.submit(print)


def test_a_timed_flush_runs_between_jobs_and_while_none_comes_and_its_error_is_raised_like_a_jobs():
    flushes, jobs = [], []
    worker = Worker(depth=1, name="test-flush", flush=lambda: flushes.append(len(jobs)), every=0.02)
    worker.start()  # no job yet: the flush runs all the same
    time.sleep(0.2)
    assert len(flushes) >= 3 and set(flushes) == {0}
    worker.submit(jobs.append, "a")
    worker.wait()
    time.sleep(0.05)
    assert 1 in flushes  # after the job, and on
    worker.close()
    settled = len(flushes)
    time.sleep(0.1)
    assert len(flushes) == settled  # closed: no flush after

    calls = []

    def failing():
        calls.append(1)
        if len(calls) == 1:
            raise OSError("disk full")

    broken = Worker(depth=1, name="test-flush-error", flush=failing, every=0.01)
    broken.start()
    time.sleep(0.1)
    with pytest.raises(OSError, match="disk full"):
        broken.check()
    broken.close()  # raised once: close has nothing left to raise
    assert len(calls) > 1 and not _alive("test-flush-error")


def test_run_in_threads_stops_the_other_jobs_on_an_error_and_raises_it_once_every_thread_ended():
    from dynabatch._background import run_in_threads

    stop, ended = threading.Event(), []

    def failing():
        raise ValueError("job failed")

    def waiting():
        assert stop.wait(5)  # set by the other job's error, not by the timeout
        ended.append("waiting")

    with pytest.raises(ValueError, match="job failed"):
        run_in_threads([failing, waiting], stop, names=["example-fail", "example-wait"])
    assert ended == ["waiting"]
    assert not any(t.name.startswith("example-") for t in threading.enumerate())
