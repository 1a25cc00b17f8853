"""BudgetEstimator and its functional forms: relative and absolute modes, granularity, tokens, max_memory parsing."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dynabatch import MemoryModel
from dynabatch.memory.budget import MemoryBudget, check_memory_margin
from dynabatch.memory.budget import parse_memory as parse_max_memory
from dynabatch.sampling.estimators import plan_batch_sizes_to_budget, plan_batches_to_budget

pytestmark = pytest.mark.filterwarnings("ignore:MemoryModel extrapolates")


def _model(fixed=300_000.0, per_row=800_000.0, per_token=16_000.0):
    shapes = [(r, L) for L in (1, 4, 16, 64, 256) for r in (1, 16, 64)]
    rows, lengths = zip(*shapes)
    peaks = [max(fixed + r * (per_row + 1_000 * L), r * per_token * L) for r, L in shapes]
    return MemoryModel(device="cpu").fit(rows, lengths, peaks)


MODEL = _model()


def _starts(sizes):
    return np.cumsum(np.r_[0, sizes[:-1]]).astype(int)


lengths_st = st.lists(st.integers(1, 256), min_size=1, max_size=300)


@settings(max_examples=60, deadline=None)
@given(lengths=lengths_st, batch_size=st.integers(1, 40), margin=st.sampled_from([0.0, 0.1, 0.3]),
       granularity=st.sampled_from([None, 1, 8]))
def test_relative_mode(lengths, batch_size, margin, granularity):
    arr = np.array(lengths)
    batches = plan_batches_to_budget(arr, MODEL, batch_size=batch_size, memory_margin=margin, granularity=granularity)
    flat = np.concatenate(batches)
    assert sorted(flat.tolist()) == list(range(len(arr)))  # every index exactly once
    order = np.argsort(-arr, kind="stable")
    assert np.array_equal(flat, order)  # longest first, stable
    assert len(batches[0]) == min(batch_size, len(arr))  # the first batch is the batch_size longest
    # The budget is the first batch's peak: measured when the model measured that very shape, else predicted.
    budget = MemoryBudget(MODEL, reference_batch=(len(batches[0]), int(arr[order[0]]))).max_memory
    assert budget == (MODEL.measured_peak(len(batches[0]), int(arr[order[0]]))
                      or float(MODEL.predict(len(batches[0]), arr[order[0]])))
    for batch in batches[1:]:
        rows, width = len(batch), int(arr[batch].max())
        assert rows >= batch_size or batch is batches[-1]
        predicted = float(MODEL.predict(rows, width))
        if rows > batch_size:
            assert predicted <= (1 - margin) * budget * (1 + 1e-12)  # grown batches keep the margin
        else:  # the floor: no larger than the first batch in rows or width, so never above its peak
            assert rows <= len(batches[0]) and width <= arr[order[0]]
        fits_one = float(MODEL.predict(granularity or 1, width)) <= (1 - margin) * budget
        if granularity and rows > batch_size and batch is not batches[-1] and fits_one:
            assert rows % granularity == 0  # rounded down to a multiple where one fits
    for batch in batches[1:-1]:  # as large as the budget allows
        rows, width = len(batch), int(arr[batch].max())
        step = granularity or 1
        if rows >= batch_size:
            assert float(MODEL.predict(rows + step, width)) > (1 - margin) * budget or rows < batch_size + step \
                and float(MODEL.predict(batch_size + step, width)) > (1 - margin) * budget


@settings(max_examples=60, deadline=None)
@given(lengths=lengths_st, budget_mib=st.floats(0.5, 400), margin=st.sampled_from([0.0, 0.1]))
def test_absolute_mode(lengths, budget_mib, margin):
    arr = np.array(lengths)
    max_memory = budget_mib * 2**20
    limit = (1 - margin) * max_memory
    if float(MODEL.predict(1, int(arr.max()))) > limit:  # a budget smaller than one row of the longest text
        with pytest.raises(ValueError, match=r"max_memory should be at least one row of the longest text"):
            plan_batches_to_budget(arr, MODEL, max_memory=max_memory, memory_margin=margin)
        return
    batches = plan_batches_to_budget(arr, MODEL, max_memory=max_memory, memory_margin=margin)
    assert sorted(np.concatenate(batches).tolist()) == list(range(len(arr)))
    for batch in batches:
        rows, width = len(batch), int(arr[batch].max())
        predicted = float(MODEL.predict(rows, width))
        assert predicted <= limit * (1 + 1e-12)
        if batch is not batches[-1]:
            assert float(MODEL.predict(rows + 1, width)) > limit


def test_a_budget_smaller_than_one_row_is_refused():
    lengths = np.array([256, 256, 8, 8])
    one_row = float(MODEL.predict(1, 256))
    with pytest.raises(ValueError, match=rf"max_memory should be at least one row of the longest text \({one_row:,.0f} "
                                         r"bytes predicted for 1 x 256 tokens, planned to 0.9 of the budget\); here "
                                         r".*pass a larger max_memory.*but got max_memory='1KB'"):
        plan_batch_sizes_to_budget(lengths, MODEL, max_memory="1KB")
    sizes = plan_batch_sizes_to_budget(lengths, MODEL, max_memory=one_row, memory_margin=0)  # exactly one row
    assert sizes.tolist()[:2] == [1, 1]


def test_when_batch_size_does_not_fit_the_margin_it_is_kept():
    lengths = np.array([256] * 40)
    sizes = plan_batch_sizes_to_budget(lengths, MODEL, batch_size=16, memory_margin=0.1)
    assert sizes.tolist() == [16, 16, 8]  # 16 rows at 256 tokens are 1.0 x the budget: never fewer than batch_size


def test_batches_grow_where_rows_are_cheap():
    lengths = np.array([256] * 16 + [8] * 2000)
    sizes = plan_batch_sizes_to_budget(lengths, MODEL, batch_size=16)
    budget = float(MODEL.predict(16, 256))
    assert sizes[0] == 16 and sizes[1] == int(MODEL.max_rows(8, 0.9 * budget)) and sizes[1] > 16


def test_plans_a_million_lengths_fast():
    lengths = np.sort(np.random.default_rng(0).integers(1, 257, size=1_000_000))[::-1]
    plan_batch_sizes_to_budget(lengths[:1000], MODEL, batch_size=16)
    start = time.process_time()  # CPU time: the machine may be shared
    sizes = plan_batch_sizes_to_budget(lengths, MODEL, batch_size=16)
    assert time.process_time() - start < 0.5
    assert sizes.sum() == 1_000_000


def _slot_model(bytes_per_slot=100.0):
    """A memory model of ``bytes_per_slot`` bytes per token slot (rows x padded width), fitted from points."""
    shapes = [(r, L) for r in (1, 4, 16) for L in (8, 16, 64, 128)]
    return MemoryModel().fit(*zip(*shapes), [bytes_per_slot * r * L for r, L in shapes])


def test_batches_are_sized_at_the_width_the_collator_pads_to():
    # 16 texts of 128 tokens, then 400 of 9 tokens that a pad_to_multiple_of=8 collator pads to 16.
    mm = _slot_model()
    lengths = np.array([128] * 16 + [9] * 400)
    budget = float(mm.predict(16, 128))  # relative: the first batch of 16 x 128
    for multiple in (None, 8):
        sizes = plan_batch_sizes_to_budget(lengths, mm, batch_size=16, pad_to_multiple_of=multiple)
        starts = np.cumsum(np.r_[0, sizes[:-1]])
        widths = lengths[starts] if multiple is None else -(-lengths[starts] // multiple) * multiple
        predicted = [float(mm.predict(r, w)) for r, w in zip(sizes, widths)]
        if multiple is None:  # unpadded: 9-token rows, as planned
            assert max(predicted[1:]) <= 0.9 * budget * (1 + 1e-9)
        else:  # padded to 16: what really runs, and still within 0.9 of the budget
            assert max(predicted[1:]) <= 0.9 * budget * (1 + 1e-9)
            assert max(predicted[1:]) >= 0.8 * budget  # and not needlessly small
    unaware = plan_batch_sizes_to_budget(lengths, mm, batch_size=16)
    # The plan that ignores the padding runs its later batches at 16/9 of what it planned:
    assert float(mm.predict(unaware[1], 16)) > 1.5 * 0.9 * budget


def test_a_shape_that_ran_out_of_memory_is_never_planned():
    mm = _slot_model()
    mm.observe(8, 64, None, out_of_memory=True)
    assert int(mm.max_rows(64, 1e9)) == 7
    batches = plan_batches_to_budget(np.array([64] * 20 + [8] * 20), mm, max_memory=1e9, memory_margin=0.0)
    lengths = np.array([64] * 20 + [8] * 20)
    assert max(len(b) for b in batches if lengths[b].max() >= 64) <= 7
    budget = MemoryBudget(mm, 1e9, memory_margin=0.0)
    assert not budget.fits(np.array([8]), np.array([[64]]), np.array([[64]]))[0]
    assert budget.fits(np.array([7]), np.array([[64]]), np.array([[64]]))[0]


def test_parse_max_memory():
    assert parse_max_memory("12GB") == 12e9
    assert parse_max_memory("12gb") == 12e9
    assert parse_max_memory("512MiB") == 512 * 2**20
    assert parse_max_memory("1.5 GiB") == 1.5 * 2**30
    assert parse_max_memory("100") == parse_max_memory(100) == 100.0
    assert parse_max_memory(None) is None
    for bad in ("12XB", "GB", "", "-1GB", "1e400", "twelve"):
        with pytest.raises(ValueError, match=rf"max_memory should be a number of bytes > 0.*max_memory={bad!r}"):
            parse_max_memory(bad)
    for bad in (0, -5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="max_memory should be a number of bytes > 0"):
            parse_max_memory(bad)
    with pytest.raises(TypeError, match="max_memory should be .* of type bool"):
        parse_max_memory(True)
    with pytest.raises(ValueError, match=r"max_memory should be a percentage in \(0%, 100%\].*'150%'"):
        parse_max_memory("150%")


def test_a_percentage_is_of_the_cuda_devices_free_memory(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"max_memory should be bytes or a size such as '20GB' on cpu \(no device "
                                         r"memory is known there: a percentage is a share of a device's free memory\), "
                                         r"but got max_memory='80%'"):
        parse_max_memory("80%")
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: asked.append(device) or (10 * 2**30, 16 * 2**30))
    assert parse_max_memory("80%") == 8 * 2**30
    assert parse_max_memory("50%", device="cuda:1") == 5 * 2**30
    assert asked == [torch.device("cuda"), torch.device("cuda:1")]
    with pytest.raises(ValueError, match=r"on cpu \(no device memory is known there.* max_memory='50%'"):
        parse_max_memory("50%", device="cpu")


def test_bad_input():
    lengths = np.array([8, 4])
    with pytest.raises(ValueError, match=r"memory_margin should be a number in \[0, 1\), but got memory_margin=1"):
        plan_batch_sizes_to_budget(lengths, MODEL, batch_size=2, memory_margin=1)
    with pytest.raises(ValueError, match=r"memory_margin should be a number in \[0, 1\), but got memory_margin=-0.1"):
        check_memory_margin(-0.1)
    with pytest.raises(TypeError, match="memory_margin should be a number"):
        check_memory_margin("10%")
    with pytest.raises(ValueError, match="max_memory should be a number of bytes > 0.*max_memory=0"):
        plan_batch_sizes_to_budget(lengths, MODEL, max_memory=0)
    with pytest.raises(ValueError, match="batch_size should be a positive integer in relative mode"):
        plan_batch_sizes_to_budget(lengths, MODEL)
    with pytest.raises(ValueError, match=r"^sorted_lengths\[1\] should be at most sorted_lengths\[0\]=4 \(sorted longest "
                                         r"first\), but got sorted_lengths\[1\]=8$"):
        plan_batch_sizes_to_budget(np.array([4, 8]), MODEL, batch_size=1)
    with pytest.raises(TypeError, match="memory_model should be a MemoryModel"):
        plan_batch_sizes_to_budget(lengths, object(), batch_size=1)
    with pytest.raises(ValueError, match="granularity should be a positive integer, but got granularity=0"):
        plan_batch_sizes_to_budget(lengths, MODEL, batch_size=1, granularity=0)
    with pytest.raises(TypeError, match="lengths should be a 1-D sequence of integer token lengths"):
        plan_batches_to_budget("abc", MODEL, batch_size=1)


@settings(max_examples=40, deadline=None)
@given(lengths=lengths_st, batch_size=st.integers(1, 16), spare=st.floats(1.0, 6.0), absolute=st.booleans(),
       multiple=st.sampled_from([None, 8]))
def test_no_batch_exceeds_max_tokens_and_the_memory_rule_still_holds(lengths, batch_size, spare, absolute, multiple):
    arr = np.array(lengths)
    width = -(-int(arr.max()) // (multiple or 1)) * (multiple or 1)
    first = 1 if absolute else min(batch_size, len(arr))
    max_tokens = int(first * width * spare)
    memory = {"max_memory": 2e8} if absolute else {"batch_size": batch_size}
    batches = plan_batches_to_budget(arr, MODEL, max_tokens=max_tokens, pad_to_multiple_of=multiple, **memory)
    uncapped = plan_batches_to_budget(arr, MODEL, pad_to_multiple_of=multiple, **memory)
    assert sorted(np.concatenate(batches).tolist()) == list(range(len(arr)))
    padded = [len(b) * -(-int(arr[b].max()) // (multiple or 1)) * (multiple or 1) for b in batches]
    assert max(padded) <= max_tokens
    assert len(batches) >= len(uncapped)  # the cap only ever takes rows away from what memory allows
    if not absolute:
        assert len(batches[0]) == min(batch_size, len(arr))  # the first batch is still the batch_size longest


def test_a_max_tokens_below_one_row_of_the_longest_text_is_refused_in_absolute_mode():
    with pytest.raises(ValueError, match=r"^max_tokens should be at least 1 x 256 = 256 padded tokens \(the longest "
                                         r"text, 256 tokens wide\); pass a larger max_tokens"):
        plan_batch_sizes_to_budget(np.array([256, 8]), MODEL, max_memory=1e9, max_tokens=255)
    assert plan_batch_sizes_to_budget(np.array([256, 8]), MODEL, max_memory=1e9, max_tokens=256).tolist() == [1, 1]


@pytest.mark.parametrize("refit", [False, True])
@pytest.mark.parametrize("chunked", [False, True])
def test_a_restart_plans_with_the_callers_memory_model_as_built_unless_refit(refit, chunked):
    # A pass's measured peaks and out-of-memory shapes refine the estimator's model; without refit that is a copy
    # (the caller's model is byte-equal after it) and the next pass starts from the caller's model again.
    from dynabatch.sampling.chunked_planner import ChunkedPlanner
    from dynabatch.sampling.estimators import BudgetEstimator
    from dynabatch.sampling.planner import BatchPlanner, PlanSettings

    mm = _model()
    before = mm.coef_.tobytes(), repr(mm.probes_)
    estimator = BudgetEstimator(mm, refit=refit)
    lengths = np.array([64] * 4 + [16] * 40)
    if chunked:
        chunks = iter([(np.arange(len(lengths)), lengths)])
        planner = ChunkedPlanner(lambda block=True: next(chunks, None), PlanSettings(4, 64), estimator)
    else:
        planner = BatchPlanner(lengths, PlanSettings(4, 64), estimator)
    for _ in range(2):
        planner.restart()
        first = planner.next_batch()
        planner.observe(len(first), 64, 3 * float(mm.predict(len(first), 64)))
        planner.observe_out_of_memory(32, 16)
        assert (estimator.memory_model is mm) is refit
        assert ((mm.coef_.tobytes(), repr(mm.probes_)) == before) is not refit
    planner.restart()
    assert estimator.memory_model is mm  # refitted in place (refit) or as built: the caller's either way


def test_refit_is_a_bool():
    from dynabatch.sampling.estimators import BudgetEstimator

    with pytest.raises(TypeError, match=r"refit should be a bool, but got refit='yes'"):
        BudgetEstimator(_model(), refit="yes")
