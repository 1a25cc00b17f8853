import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynabatch.memory.feedback import MemoryFeedback


def drive(lengths, plan, device_bytes, **kwargs):
    """Runs the measured-mode loop over sorted lengths against a device whose peak is ``device_bytes(rows, width)``."""
    fb = MemoryFeedback(lengths, plan, **kwargs)
    start, last, sizes, peaks = 0, None, [], []
    while start < len(lengths):
        size = fb.next_size(start, last)
        peak = device_bytes(size, int(lengths[start]))
        fb.observe(size, peak)
        sizes.append(size)
        peaks.append(peak)
        start += size
        last = size
    return np.asarray(sizes), np.asarray(peaks, dtype=float)


def test_nothing_measured_follows_the_plan():
    fb = MemoryFeedback([9, 5, 5, 1, 1, 1], [1, 2, 3])
    assert [fb.next_size(0), fb.next_size(1), fb.next_size(3), fb.next_size(4)] == [1, 2, 3, 2]  # 2 remain
    fb.observe(1, 1000)  # the first batch: every later row may cost as much as its rows did
    assert (fb.budget_, fb.row_bytes_) == (1000, 1000)
    assert fb.next_size(1) == 1  # the floor (the first batch's rows), not the plan's 2


def test_a_timid_plan_grows_where_memory_is_left():
    lengths = np.sort(np.random.default_rng(0).integers(1, 129, 3000))[::-1]
    plan = [8] * (3000 // 8)
    sizes, peaks = drive(lengths, plan, lambda r, w: r * (100 + 40 * w))
    assert sizes.sum() == 3000
    assert sizes[:-1].min() >= 8 and sizes.max() > 8 * 4 and len(sizes) < 0.7 * len(plan)
    # above the 0.9 target only at the floor (texts nearly as long as the first batch's), never above its peak
    assert (sizes[peaks > 0.9 * peaks[0]] == 8).all() and (peaks <= peaks[0]).all()


@pytest.mark.parametrize("per_row", [50_000, 0])
def test_a_plan_that_overshoots_is_corrected(per_row):
    # Generate-like memory (a large per-row part that short texts do not shrink) or memory all per token.
    # The plan (a token budget) doubles rows as length halves; with a per-row part that overshoots.
    lengths = np.repeat([128, 64, 32, 16], [16, 32, 64, 128])
    plan = [16, 32, 64, 128]

    def device(r, w):
        return r * (per_row + 100 * w)

    sizes, peaks = drive(lengths, plan, device)
    if per_row:
        assert max(device(s, w) for s, w in zip(plan, [128, 64, 32, 16], strict=True)) > 1.5 * device(16, 128)
    assert (peaks[1:] <= peaks[0]).all()  # measured mode never does
    assert sizes.sum() == len(lengths)


concave = st.sampled_from([
    lambda r, w: r * (1e5 + 40 * w),  # mostly per row
    lambda r, w: r * 40 * w,  # all per token
    lambda r, w: r * (3e3 * np.sqrt(w) + 10 * w),  # falls less than linearly with length
    lambda r, w: r * (2e3 + w * w),  # eager attention: quadratic
    lambda r, w: 4096 + r * (500 + 30 * w),  # and a part that does not grow with rows
])


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 512), min_size=1, max_size=600).map(lambda x: np.sort(x)[::-1]),
    batch_size=st.integers(1, 32),
    device=concave,
    max_growth=st.floats(1, 4),
)
def test_every_text_once_and_nothing_above_the_first_batch(lengths, batch_size, device, max_growth):
    n = len(lengths)
    plan = [batch_size] * (n // batch_size) + ([n % batch_size] if n % batch_size else [])
    sizes, peaks = drive(lengths, plan, device, max_growth=max_growth)
    assert sizes.sum() == n and sizes.min() >= 1
    assert all(b <= max_growth * a + 1e-9 for a, b in itertools.pairwise(sizes))
    # memory that grows with rows and with length: the bound holds for every batch after the first,
    # under the 0.9 target unless the batch is at the floor (the first batch's rows)
    assert (peaks[1:] <= peaks[0] * (1 + 1e-9)).all()
    assert (sizes[1:][peaks[1:] > 0.9 * peaks[0] * (1 + 1e-9)] <= min(batch_size, n)).all()


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        (([1, 2], [2]), {}, ValueError, "sorted_lengths should be a 1-D array sorted longest first"),
        (([2, 1], [1]), {}, ValueError, (r"planned_sizes should be positive sizes adding up to 2 texts, but got "
                                         r"planned_sizes='1 sizes adding up to 1'")),
        (([2, 1], [2]), {"target": 1.5}, ValueError, "target should be"),
        (([2, 1], [2]), {"max_growth": 0.5}, ValueError, "max_growth should be at least 1, but got max_growth=0.5"),
    ],
)
def test_bad_arguments_are_named(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        MemoryFeedback(*args, **kwargs)


def test_a_bad_measurement_is_refused():
    fb = MemoryFeedback([2, 1], [2])
    with pytest.raises(ValueError, match="peak_bytes should be a finite number >= 0, but got peak_bytes=nan"):
        fb.observe(2, float("nan"))


def test_a_batch_run_in_parts_sets_the_budget_and_bound_from_its_parts():
    fb = MemoryFeedback([4] * 6 + [2] * 30, [4] * 9)
    fb.observe_parts([(2, 4, 1200), (1, 4, 700)])  # the first batch, split: 2 rows fitted at 1200 bytes
    assert (fb.budget_, fb.row_bytes_) == (1200, 700)  # the largest part's peak; the costliest row
    fb.observe_parts([(4, 2, 2000)])
    assert (fb.budget_, fb.row_bytes_) == (1200, 500)  # the budget stays the first batch's
    fb.observe_parts([])  # nothing measured: nothing changes
    assert (fb.budget_, fb.row_bytes_) == (1200, 500)
    with pytest.raises(ValueError, match="peak_bytes should be a finite number >= 0, but got peak_bytes=-1"):
        fb.observe_parts([(1, 2, 100), (1, 2, -1)])
    with pytest.raises(ValueError, match=r"width should be None or a number >= 0 \(a padded width\), but got width=-2"):
        fb.observe_parts([(1, -2, 100)])


def test_the_bound_takes_the_tightest_measured_batch_at_least_as_wide():
    fb = MemoryFeedback([], [])
    assert fb.bound(4, 10) is None and fb.max_rows(10, 1e9) == 0  # nothing measured
    fb.observe_parts([(4, 100, 8000), (8, 50, 6000)])  # 2000 and 750 bytes a row
    assert fb.budget_ == 8000
    assert fb.bound(2, 100) == 8000  # fewer rows than measured: that batch's peak
    assert fb.bound(6, 100) == 12000  # more: rows x its peak per row
    assert fb.bound(6, 50) == 6000 and fb.bound(16, 40) == 12000  # the narrower measurement bounds narrower rows
    assert fb.bound(1, 101) is None  # wider than anything measured
    assert fb.max_rows(50, 8000) == 10 and fb.max_rows(60, 8000) == 4 and fb.max_rows(101, 8000) == 0
    assert fb.max_rows(50, 5000) == 0  # every measured batch as wide peaked above it


def test_sparse_measuring_skips_batches_the_bound_already_covers():
    fb = MemoryFeedback([], [], sparse=True)
    assert fb.should_measure(16, 256)  # nothing measured: the first batch
    fb.observe(16, 16 * (50_000 + 100 * 256), width=256)  # 50,000 bytes a row and 100 a token
    assert not fb.should_measure(16, 250)  # the bound would loosen by 2%: not worth the tracker
    assert fb.should_measure(16, 200)  # by 22% (a row's peak taken as proportional to width)
    assert fb.should_measure(32, 250)  # twice the rows of the batch that bounds it
    fb.observe(16, 16 * (50_000 + 100 * 200), width=200)
    # The per-row slope between the two widths (100 bytes a token) says 160 tokens only loosens the bound by 6%.
    assert not fb.should_measure(16, 160)
    assert fb.should_measure(16, 100)  # half the width: always
    assert MemoryFeedback([], []).should_measure(16, 250)  # not sparse: every batch


def test_an_out_of_memory_error_caps_rows_at_every_narrower_width_until_measured_calls_raise_it():
    fb = MemoryFeedback([], [], sparse=True)
    fb.observe_parts([(4, 100, 8000)])  # 2000 bytes a row at width 100
    fb.observe_out_of_memory(rows=8, width=50)  # bound by the width-100 call: 16000 bytes, 2000 a row from now on
    assert fb.oom.failed_bytes == 16000 and fb.oom_cap(10) == 4  # the halves
    assert fb.should_measure(4, 10)  # above what ran since the error: measured, to raise the limit
    fb.observe_parts([(4, 50, 6000)])  # a half of the failed call ran: 1500 bytes a row, floored at 2000
    assert fb.oom.fitted_bytes == 8000 and fb.oom_cap(10) == 5  # 8000 + 2000 (a quarter of the gap)
    assert fb.oom_cap(400) == 5  # wider than anything measured: the floor alone
    fb.observe_parts([(5, 20, 5000)])
    assert fb.oom.fitted_bytes == 10000 and fb.oom_cap(10) == 6  # 10000 + 2000
