"""The one background-thread mechanism: Ahead (an iterable pulled ahead) and Worker (jobs run behind), errors raised in
the caller's thread, every thread stopped by close()."""

import threading
import time

import pytest

from dynabatch._background import Ahead, Worker, ordered_map, run_in_threads, stage_seconds, timing_stages


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


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("n", [0, 1, 7, 40])  # none, one item, fewer than the room ahead, many more
def test_ordered_map_yields_every_result_once_in_order_whatever_finishes_first(threads, n):
    from dynabatch._background import ordered_map

    def slow_when_even(x):  # later items often finish before earlier ones
        time.sleep(0.004 if x % 2 == 0 else 0.0)
        return x * 10

    assert list(ordered_map(slow_when_even, list(range(n)), threads=threads, name="test-map")) == [
        x * 10 for x in range(n)]
    assert not _alive("test-map")
    with pytest.raises(ValueError, match=r"^threads should be a positive integer, but got threads=0$"):
        next(ordered_map(slow_when_even, list(range(n)), threads=0, name="test-map"))  # none would run: refused


def test_ordered_map_runs_at_most_twice_its_threads_ahead_of_the_caller():
    from dynabatch._background import ordered_map

    started = []
    results = ordered_map(started.append, list(range(100)), threads=2, name="test-map-ahead")
    next(results)
    time.sleep(0.2)  # room for every item, were it unbounded
    assert 2 <= len(started) <= 1 + 2 * 2  # the one taken, and the room ahead of it
    results.close()  # the caller stops early: the threads end, joined
    assert not _alive("test-map-ahead") and len(started) <= 1 + 2 * 2


def test_ordered_maps_error_is_raised_in_its_turn_after_the_results_before_it_and_no_thread_is_left():
    from dynabatch._background import ordered_map

    def failing_at_five(x):
        if x == 5:
            raise ValueError("item five")
        time.sleep(0.002)
        return x

    got = []
    with pytest.raises(ValueError, match="^item five$"):
        for value in ordered_map(failing_at_five, list(range(50)), threads=3, name="test-map-error"):
            got.append(value)
    assert got == [0, 1, 2, 3, 4]
    assert not _alive("test-map-error")


def test_ordered_map_runs_its_items_on_several_threads_at_once():
    from dynabatch._background import ordered_map

    barrier = threading.Barrier(2, timeout=10)  # each of the first two items waits for the other: one thread deadlocks

    def meet(x):
        if x < 2:
            barrier.wait()
        return threading.current_thread().name

    assert set(ordered_map(meet, [0, 1, 2], threads=2, name="test-map-two")) == {"test-map-two"}


def test_each_timed_block_counts_only_the_threads_started_from_it_at_once_in_two_threads():
    # two runs at once in one process: each thread's block sleeps in threads of the same names, the other's at the
    # same time; each block's stage seconds are its own threads' (the first's 0.3 s, the second's 0.03 s, a name)
    seen, both = {}, threading.Barrier(2)

    def timed(key, seconds):
        def job():
            with timing_stages():
                both.wait(10)  # both blocks open at once
                ahead = Ahead((time.sleep(seconds) or i for i in range(3)), depth=1, name="test-stage-ahead")
                worker = Worker(name="test-stage-worker")
                while (item := ahead.next()) is not None:
                    worker.submit(time.sleep, seconds)
                worker.close()
                list(ordered_map(time.sleep, [seconds] * 3, threads=2, name="test-stage-map"))
                both.wait(10)  # the other's threads have done all their work too
                seen[key] = stage_seconds()
        return job

    run_in_threads([timed("slow", 0.1), timed("fast", 0.01)], threading.Event(), names=["slow", "fast"])
    for key, low, high in [("slow", 0.28, 0.6), ("fast", 0.025, 0.25)]:
        assert set(seen[key]) == {"test-stage-ahead", "test-stage-worker", "test-stage-map"}
        for name, (working, _) in seen[key].items():
            assert low <= working < high, (key, name, seen[key])
    assert stage_seconds() == {}  # outside any block: none timed


def test_a_thread_counts_for_the_block_that_starts_it_and_an_inner_block_for_itself():
    ahead = Ahead(iter([1, 2]), depth=None, name="test-made-before")  # made outside: its thread starts in the block
    with timing_stages():
        worker = Worker(name="test-outer")
        worker.submit(time.sleep, 0.05)
        with timing_stages():
            assert ahead.next() == 1
            inner = Worker(name="test-inner")
            inner.submit(time.sleep, 0.05)
            inner.close()
            assert set(stage_seconds()) == {"test-made-before", "test-inner"}
        worker.close()  # a job of the outer block's thread, run while the inner block was open
        ahead.close()
        assert set(stage_seconds()) == {"test-outer"} and stage_seconds()["test-outer"][0] >= 0.04
