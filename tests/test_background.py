"""Ahead: an iterable pulled in a background thread, errors raised in the consumer, stopped by close()."""

import threading
import time

import pytest

from dynabatch._background import Ahead


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
