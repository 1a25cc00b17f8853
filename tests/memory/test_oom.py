"""The out-of-memory policy: split sizes, failed shapes, and the limit errors teach (memory/oom.py)."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dynabatch.memory.oom import OutOfMemoryLimit, call_guarded, dominating, equal_parts, failed_cap, split_sizes


@given(rows=st.integers(2, 10_000))
def test_a_failed_call_is_retried_as_two_halves(rows):
    first, second = split_sizes(rows)
    assert first + second == rows and 1 <= first <= second <= first + 1


@given(rows=st.integers(1, 10_000), cap=st.integers(0, 10_000))
def test_a_pre_split_is_the_fewest_near_equal_parts_under_the_cap(rows, cap):
    parts = equal_parts(rows, cap)
    assert sum(parts) == rows and max(parts) <= max(cap, 1) and max(parts) - min(parts) <= 1
    assert len(parts) == -(-rows // max(cap, 1))


@given(failed=st.lists(st.tuples(st.integers(1, 64), st.integers(1, 512)), max_size=6),
       rows=st.integers(1, 100), width=st.integers(1, 600))
def test_a_failed_shape_dominates_exactly_the_shapes_at_least_as_large(failed, rows, width):
    found = dominating(failed, rows, width)
    larger = [(r, w) for r, w in failed if rows >= r and width >= w]
    assert found == (larger[0] if larger else None)
    assert (rows <= int(failed_cap(np.array(width), failed))) == (found is None)


def _errors_until_settled(real_rows, first_failure):
    """Calls sized by the limit on a device that fails above ``real_rows`` rows at any width, after a first failure
    at ``first_failure`` rows and its halves; the errors, and the rows the calls settle at."""
    limit, per_row = OutOfMemoryLimit(), 1000.0  # every row predicted at the same bytes
    limit.observe_out_of_memory(first_failure, per_row)
    for half in split_sizes(first_failure):
        assert half <= limit.rows_under_limit(per_row)  # the halves it is retried as run as they are
        limit.observe_success(half, per_row)
    errors, sizes = 1, []
    for _ in range(200):
        rows = limit.rows_under_limit(per_row)
        sizes.append(rows)
        if rows > real_rows:
            errors += 1
            limit.observe_out_of_memory(rows, per_row)
        else:
            limit.observe_success(rows, per_row)
    return errors, sizes


@settings(max_examples=60, deadline=None)
@given(real_rows=st.integers(2, 300), over=st.floats(1.0, 2.0, exclude_min=True))
def test_after_an_error_calls_grow_back_to_the_most_that_fit_with_few_errors(real_rows, over):
    first_failure = min(max(real_rows + 1, int(real_rows * over)), 2 * real_rows)
    errors, sizes = _errors_until_settled(real_rows, first_failure)
    assert sizes[-1] == real_rows  # grown back to the most rows that fit, never above it once settled
    assert errors <= 5


def test_the_lower_limit_rises_only_on_successes_and_never_to_a_failed_prediction():
    limit = OutOfMemoryLimit()
    assert limit.rows_under_limit(100.0) is None
    limit.observe_out_of_memory(40, 100.0)
    assert limit.rows_under_limit(100.0) == 20  # nothing ran since: the halves
    limit.observe_success(20, 75.0)  # predicted at 20 rows x 100 bytes, the failed call's bytes a row
    assert limit.fitted_bytes == 2000.0 and limit.rows_under_limit(10.0) == 25  # a narrower width's rows are no cheaper
    limit.observe_success(50, 100.0)  # above what failed: teaches nothing
    assert limit.rows_under_limit(100.0) == 25 and limit.rows_under_limit(200.0) == 12  # a costlier row: fewer rows
    limit.observe_out_of_memory(30, 50.0)  # predicted low, but 30 rows cost 100 bytes each at least
    assert limit.failed_bytes == 3000.0 and limit.row_bytes == 100.0 and limit.rows_under_limit(100.0) == 22
    assert limit.above_fitted(23, 0.0) and not limit.above_fitted(20, 0.0) and limit.errors == 2


def test_call_guarded_returns_the_cpu_allocators_error_and_propagates_others():
    def cpu_oom(_):
        raise RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 8 bytes.")

    attempt = call_guarded(cpu_oom, 1)
    assert attempt.output is None and "DefaultCPUAllocator" in str(attempt.error)
    assert attempt.error.__traceback__ is None  # the failed call's frames are dropped
    with pytest.raises(KeyError):
        call_guarded(lambda _: {}["missing"], 1)
    cleaned = []
    ok = call_guarded(lambda n: torch.zeros(n).sum(), 4, prepare=lambda n: n * 2, finish=float,
                      cleanup=lambda: cleaned.append(1))
    assert ok.output == 0.0 and ok.error is None and cleaned == [1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_real_cuda_out_of_memory_error_is_returned_with_its_memory_freed():
    mib = 2**20

    def work(n_bytes):
        first = torch.empty(n_bytes // 2, dtype=torch.uint8, device="cuda")
        second = torch.empty(n_bytes // 2, dtype=torch.uint8, device="cuda")  # over the cap: `first` is still held
        return int(first[:1].sum() + second[:1].sum()) >= 0

    torch.cuda.empty_cache()
    held = torch.cuda.memory_allocated()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + 256 * mib) / total)
    try:
        failed = call_guarded(work, 384 * mib, measure_on="cuda")
        assert isinstance(failed.error, torch.OutOfMemoryError) and failed.output is None
        assert torch.cuda.memory_allocated() == held  # the failed call's tensors went with its traceback
        ran = call_guarded(work, 128 * mib, measure_on="cuda")  # the halves' size fits at once
        assert ran.error is None and ran.output is True and 128 * mib <= ran.peak_bytes <= 129 * mib
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
