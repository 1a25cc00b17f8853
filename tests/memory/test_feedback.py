"""MemoryFeedback: the budget the first measured batch sets and the bound measured batches put on later ones.

How measured mode sizes batches from this bound is tested with the planner (tests/sampling/test_planner.py).
"""

import logging

import pytest

from dynabatch.memory.feedback import MemoryFeedback


def test_sparse_must_be_a_bool():
    with pytest.raises(TypeError, match=r"^sparse should be a bool, but got sparse=1 of type int$"):
        MemoryFeedback(sparse=1)


def test_a_bad_measurement_is_refused():
    fb = MemoryFeedback()
    with pytest.raises(ValueError, match="peak_bytes should be a finite number >= 0, but got peak_bytes=nan"):
        fb.observe(2, None, float("nan"))


def test_a_batch_run_in_parts_sets_the_budget_and_bound_from_its_parts():
    fb = MemoryFeedback()
    fb.observe_parts([(2, 4, 1200), (1, 4, 700)])  # the first batch, split: 2 rows fitted at 1200 bytes
    assert (fb.budget, fb.row_bytes_) == (1200, 700)  # the largest part's peak; the costliest row
    fb.observe_parts([(4, 2, 2000)])
    assert (fb.budget, fb.row_bytes_) == (1200, 500)  # the budget stays the first batch's
    fb.observe_parts([])  # nothing measured: nothing changes
    assert (fb.budget, fb.row_bytes_) == (1200, 500)
    with pytest.raises(ValueError, match="peak_bytes should be a finite number >= 0, but got peak_bytes=-1"):
        fb.observe_parts([(1, 2, 100), (1, 2, -1)])
    with pytest.raises(ValueError, match=r"^padded_length should be None or a number >= 0 \(a padded width\), but got "
                                         r"padded_length=-2$"):
        fb.observe_parts([(1, -2, 100)])


def test_the_bound_takes_the_tightest_measured_batch_at_least_as_wide():
    fb = MemoryFeedback()
    assert fb.bound(4, 10) is None and fb.max_rows(10, 1e9) == 0  # nothing measured
    fb.observe_parts([(4, 100, 8000), (8, 50, 6000)])  # 2000 and 750 bytes a row
    assert fb.budget == 8000
    assert fb.bound(2, 100) == 8000  # fewer rows than measured: that batch's peak
    assert fb.bound(6, 100) == 12000  # more: rows x its peak per row
    assert fb.bound(6, 50) == 6000 and fb.bound(16, 40) == 12000  # the narrower measurement bounds narrower rows
    assert fb.bound(1, 101) is None  # wider than anything measured
    assert fb.max_rows(50, 8000) == 10 and fb.max_rows(60, 8000) == 4 and fb.max_rows(101, 8000) == 0
    assert fb.max_rows(50, 5000) == 0  # every measured batch as wide peaked above it


def test_sparse_measuring_skips_batches_the_bound_already_covers():
    fb = MemoryFeedback(sparse=True)
    assert fb.should_measure(16, 256)  # nothing measured: the first batch
    fb.observe(16, 256, 16 * (50_000 + 100 * 256))  # 50,000 bytes a row and 100 a token
    assert not fb.should_measure(16, 250)  # the bound would loosen by 2%: not worth the tracker
    assert fb.should_measure(16, 200)  # by 22% (a row's peak taken as proportional to width)
    assert fb.should_measure(32, 250)  # twice the rows of the batch that bounds it
    fb.observe(16, 200, 16 * (50_000 + 100 * 200))
    # The per-row slope between the two widths (100 bytes a token) says 160 tokens only loosens the bound by 6%.
    assert not fb.should_measure(16, 160)
    assert fb.should_measure(16, 100)  # half the width: always
    assert MemoryFeedback().should_measure(16, 250)  # not sparse: every batch


def test_an_out_of_memory_error_caps_rows_at_every_narrower_width_until_measured_calls_raise_it():
    fb = MemoryFeedback(sparse=True)
    fb.observe_parts([(4, 100, 8000)])  # 2000 bytes a row at width 100
    fb.observe_out_of_memory(rows=8, width=50)  # bound by the width-100 call: 16000 bytes, 2000 a row from now on
    assert fb.oom.failed_bytes == 16000 and fb.oom_cap(10) == 4  # the halves
    assert fb.should_measure(4, 10)  # above what ran since the error: measured, to raise the limit
    fb.observe_parts([(4, 50, 6000)])  # a half of the failed call ran: 1500 bytes a row, floored at 2000
    assert fb.oom.fitted_bytes == 8000 and fb.oom_cap(10) == 5  # 8000 + 2000 (a quarter of the gap)
    assert fb.oom_cap(400) == 5  # wider than anything measured: the floor alone
    fb.observe_parts([(5, 20, 5000)])
    assert fb.oom.fitted_bytes == 10000 and fb.oom_cap(10) == 6  # 10000 + 2000


def test_an_absolute_budget_is_set_before_any_batch_and_the_first_peak_does_not_replace_it():
    fb = MemoryFeedback(budget=10_000)
    assert fb.absolute and fb.budget == 10_000 and not fb.measured and fb.should_measure(4, 64)
    fb.observe(rows=4, padded_length=64, peak_bytes=2_000)  # the first batch: 500 bytes a row
    assert fb.budget == 10_000 and fb.measured
    assert fb.max_rows(64, 0.9 * fb.budget) == 18  # grown to the budget, not held at the first peak
    relative = MemoryFeedback()
    relative.set_budget(None)  # the relative rule: nothing set
    relative.observe(rows=4, padded_length=64, peak_bytes=2_000)
    assert relative.budget == 2_000 and not relative.absolute
    with pytest.raises(RuntimeError, match=r"^MemoryFeedback.set_budget after a batch was measured"):
        relative.set_budget(10_000)
    with pytest.raises(ValueError, match=r"^budget should be None or a finite number of bytes > 0, but got budget=0$"):
        MemoryFeedback(budget=0)
    # a type is a TypeError (it was a ValueError: the check was its own, beside check_positive_number; review)
    with pytest.raises(TypeError, match=r"^budget should be None or a finite number of bytes > 0, but got "
                                        r"budget='1GB'"):
        MemoryFeedback(budget="1GB")
    with pytest.raises(ValueError, match=r"^budget should be None or a finite number of bytes > 0, but got budget=inf"):
        MemoryFeedback(budget=float("inf"))


def test_a_call_measured_above_an_absolute_budget_is_warned_of_once(caplog):
    # Without a memory model nothing refuses a max_memory under one row: rows ran alone above it, silently.
    fb = MemoryFeedback(budget=1_000)
    with caplog.at_level(logging.WARNING, logger="dynabatch.memory.feedback"):
        fb.observe(rows=4, padded_length=32, peak_bytes=900)  # under the budget: nothing to say
        assert caplog.text == ""
        fb.observe_parts([(2, 32, 24_576), (1, 16, 12_288)])
        fb.observe(rows=1, padded_length=8, peak_bytes=6_000)
    assert caplog.text.count("above the absolute budget") == 1
    assert ("a call of 2 rows x 32 tokens peaked at 24,576 bytes, above the absolute budget of 1,000 bytes "
            "(max_memory)") in caplog.text and "pass a larger max_memory" in caplog.text
    relative = MemoryFeedback()  # the first peak is the budget: later peaks above it are not the user's budget
    with caplog.at_level(logging.WARNING, logger="dynabatch.memory.feedback"):
        relative.observe(rows=4, padded_length=32, peak_bytes=900)
        relative.observe(rows=8, padded_length=32, peak_bytes=1_800)
    assert caplog.text.count("above the absolute budget") == 1
