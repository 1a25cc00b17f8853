import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynabatch.feedback import MemoryFeedback


def drive(lengths, plan, device_bytes, **kwargs):
    """Runs the measured-mode loop over sorted lengths against a device whose peak is ``device_bytes(rows, width)``."""
    fb = MemoryFeedback(lengths, plan, **kwargs)
    start, last, sizes, peaks, fitted = 0, None, [], [], []
    while start < len(lengths):
        size = fb.next_size(start, last)
        width = int(lengths[start])
        peak = device_bytes(size, width)
        fitted.append(fb.per_row_ is not None)
        fb.observe(size, width, peak)
        sizes.append(size)
        peaks.append(peak)
        start += size
        last = size
    return fb, sizes, np.asarray(peaks, dtype=float), np.asarray(fitted)


def test_nothing_measured_follows_the_plan():
    fb = MemoryFeedback([9, 5, 5, 1, 1, 1], [1, 2, 3])
    assert [fb.next_size(0), fb.next_size(1), fb.next_size(3), fb.next_size(4)] == [1, 2, 3, 2]  # 2 remain
    fb.observe(1, 9, 1000)  # one width measured: every row costs what the measured ones did
    assert fb.budget_ == 1000 and (fb.per_row_, fb.per_token_) == (1000, 0)
    assert fb.next_size(1) == 1  # the floor (the first batch's rows), not the plan's 2


def test_a_timid_plan_grows_where_memory_is_left():
    lengths = np.sort(np.random.default_rng(0).integers(1, 129, 3000))[::-1]
    plan = [8] * (3000 // 8)
    _fb, sizes, peaks, fitted = drive(lengths, plan, lambda r, w: r * (100 + 40 * w))
    assert sum(sizes) == 3000
    assert min(sizes[:-1]) >= 8 and max(sizes) > 8 * 4 and len(sizes) < 0.7 * len(plan)
    # above the 0.9 target only at the floor (texts nearly as long as the first batch's), never above its peak
    over = peaks > 0.9 * peaks[0]
    assert (np.asarray(sizes)[over & fitted] == 8).all() and (peaks <= peaks[0]).all()


def test_a_spike_in_the_plan_is_corrected():
    # Generate-like memory: a large per-row part that short texts do not shrink. The plan (a token budget)
    # doubles rows as length halves, which overshoots; the measured model shrinks the batches back.
    lengths = np.repeat([128, 64, 32, 16], [16, 32, 64, 128])
    plan = [16, 32, 64, 128]

    def device(r, w):
        return r * (50_000 + 100 * w)

    fb, _sizes, peaks, _fitted = drive(lengths, plan, device)
    planned_peaks = [device(16, 128), device(32, 64), device(64, 32), device(128, 16)]
    assert max(planned_peaks[1:]) > 1.5 * planned_peaks[0]  # the plan alone overshoots the first batch
    assert (peaks[1:] <= peaks[0]).all()  # measured mode never does
    assert fb.per_row_ == pytest.approx(50_000) and fb.per_token_ == pytest.approx(100)


@settings(max_examples=50, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 512), min_size=1, max_size=600).map(lambda x: np.sort(x)[::-1]),
    batch_size=st.integers(1, 32),
    per_row=st.floats(0, 1e6),
    per_token=st.floats(1, 1e4),
    max_growth=st.floats(1, 4),
)
def test_every_text_once_and_fitted_batches_stay_under_the_target(lengths, batch_size, per_row, per_token,
                                                                   max_growth):
    n = len(lengths)
    plan = [batch_size] * (n // batch_size) + ([n % batch_size] if n % batch_size else [])
    _fb, sizes, peaks, fitted = drive(lengths, plan, lambda r, w: r * (per_row + per_token * w),
                                     max_growth=max_growth)
    assert sum(sizes) == n and min(sizes) >= 1
    assert all(b <= max_growth * a + 1e-9 for a, b in itertools.pairwise(sizes))
    # once fitted, the model is exact for memory linear in width: nothing above the target but batches
    # of at most the first batch's rows (the planner's floor), and those never above the first batch's peak
    sizes = np.asarray(sizes)
    over = peaks > 0.9 * peaks[0] * (1 + 1e-9)
    assert not (over & fitted & (sizes > min(batch_size, n))).any()
    assert not (fitted & (peaks > peaks[0] * (1 + 1e-9))).any()


@pytest.mark.parametrize(
    "args, kwargs, error, match",
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
        fb.observe(2, 2, float("nan"))
