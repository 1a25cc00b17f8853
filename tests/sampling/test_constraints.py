import itertools
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynabatch.sampling.constraints import (
    AllOf,
    FixedBatchSize,
    LengthDifference,
    MemoryBudget,
    TokenBudget,
    as_constraint,
)
from dynabatch.sampling.smart import SmartBatchSampler, plan_constrained


class _LinearMemory:
    """bytes = rows * (fixed + per_token * padded_length): a stand-in with the MemoryModel interface."""

    def __init__(self, fixed=1000.0, per_token=10.0):
        self.fixed, self.per_token = fixed, per_token

    def predict(self, rows, padded_length):
        return np.asarray(rows, float) * (self.fixed + self.per_token * np.asarray(padded_length, float))

    def __repr__(self):
        return f"_LinearMemory({self.fixed}, {self.per_token})"


def _breaks(constraint, batch_lengths):
    """Checks one batch directly from its rows (no planner code): the rule each constraint documents."""
    rows, longest, shortest = len(batch_lengths), batch_lengths.max(axis=0), batch_lengths.min(axis=0)
    if isinstance(constraint, FixedBatchSize):
        return rows > constraint.batch_size
    if isinstance(constraint, LengthDifference):
        return rows > constraint.batch_size or bool(np.any(longest - shortest > constraint.max_diff))
    if isinstance(constraint, TokenBudget):
        tokens = rows * longest
        total = tokens.sum() if constraint.combine == "sum" else tokens.max()
        return total > constraint.max_tokens or (constraint.batch_size is not None and rows > constraint.batch_size)
    if isinstance(constraint, MemoryBudget):
        memory = constraint.memory_model.predict(rows, longest[constraint.field])
        return memory > constraint.budget_bytes or (constraint.batch_size is not None and rows > constraint.batch_size)
    if isinstance(constraint, AllOf):
        return any(_breaks(c, batch_lengths) for c in constraint.constraints)
    raise AssertionError(constraint)


constraints_st = st.one_of(
    st.builds(FixedBatchSize, st.integers(1, 12)),
    st.builds(LengthDifference, st.integers(0, 20), st.integers(1, 12)),
    st.builds(TokenBudget, st.integers(200, 600), st.one_of(st.none(), st.integers(1, 20)),
              combine=st.sampled_from(["each", "sum"])),
    st.builds(MemoryBudget, st.just(_LinearMemory()), st.floats(2e4, 2e5),
              memory_margin=st.floats(0, 0.5), batch_size=st.one_of(st.none(), st.integers(1, 30))),
    st.builds(AllOf, st.builds(FixedBatchSize, st.integers(1, 12)),
              st.builds(LengthDifference, st.integers(0, 20), st.integers(1, 12))),
)


@settings(max_examples=300, deadline=None)
@given(
    constraint=constraints_st,
    lengths=st.lists(st.lists(st.integers(0, 100), min_size=2, max_size=2), min_size=0, max_size=200),
    fields=st.sampled_from([1, 2]),
    window=st.one_of(st.none(), st.integers(1, 5)),
    shuffle=st.booleans(),
    seed=st.integers(0, 3),
    epoch=st.integers(0, 3),
)
def test_no_batch_breaks_the_constraint_and_every_row_appears_once(
        constraint, lengths, fields, window, shuffle, seed, epoch):
    array = np.asarray(lengths, dtype=np.int64).reshape(-1, 2)[:, :fields]
    batches = plan_constrained(array, constraint, window_batches=window, shuffle=shuffle, seed=seed, epoch=epoch)
    assert sorted(np.concatenate(batches).tolist() if batches else []) == list(range(len(array)))
    for b in batches:
        assert len(b) > 0
        assert not _breaks(constraint, array[b]), (constraint, array[b].tolist())


@settings(max_examples=150, deadline=None)
@given(constraint=constraints_st, lengths=st.lists(st.integers(0, 100), min_size=1, max_size=150))
def test_one_window_cuts_the_sorted_rows_into_maximal_batches(constraint, lengths):
    """Without windows or shuffling the batches are consecutive runs of the rows sorted longest first,
    and each is as large as the constraint allows: adding the next row would break it."""
    array = np.asarray(lengths)
    order = np.argsort(-array, kind="stable")
    batches = plan_constrained(array, constraint, window_batches=None, shuffle=False)
    position = np.empty(len(array), int)
    position[order] = np.arange(len(array))
    runs = sorted(batches, key=lambda b: position[b[0]])
    assert np.concatenate(runs).tolist() == order.tolist()
    for run, following in itertools.pairwise(runs):
        assert _breaks(constraint, array[np.append(run, following[0])][:, None])
    costs = [len(b) * int(array[b].max()) for b in batches]
    if not isinstance(constraint, MemoryBudget):
        assert costs[0] == max(costs)  # the heaviest batch comes first


def test_fixed_batch_size_fills_every_batch_but_the_last_of_each_window():
    lengths = np.random.default_rng(0).integers(1, 50, size=103)
    batches = plan_constrained(lengths, FixedBatchSize(10), window_batches=None)
    assert sorted(len(b) for b in batches) == [3] + [10] * 10
    windowed = plan_constrained(lengths, FixedBatchSize(10), window_batches=4)  # windows of 40 rows
    assert sorted(len(b) for b in windowed) == [3] + [10] * 10


def test_length_difference_keeps_each_field_within_max_diff():
    # sorted by source, longest first: 31, 30 | 12 (target 50) | 11, 10
    lengths = {"source": [10, 11, 12, 30, 31], "target": [5, 6, 50, 7, 8]}
    batches = plan_constrained(lengths, LengthDifference(max_diff=2, batch_size=8), window_batches=None)
    assert sorted(sorted(b.tolist()) for b in batches) == [[0, 1], [2], [3, 4]]


def test_token_budget_sum_counts_both_fields():
    lengths = np.array([[10, 10]] * 8)
    each = plan_constrained(lengths, TokenBudget(40), window_batches=None)
    total = plan_constrained(lengths, TokenBudget(40, combine="sum"), window_batches=None)
    assert [len(b) for b in each] == [4, 4] and [len(b) for b in total] == [2, 2, 2, 2]


def test_memory_budget_uses_the_models_prediction_and_margin():
    model = _LinearMemory(fixed=0.0, per_token=1.0)  # bytes = rows * length
    lengths = np.full(20, 10)
    assert [len(b) for b in plan_constrained(lengths, MemoryBudget(model, 100, memory_margin=0.0), window_batches=None)] \
        == [10, 10]
    assert [len(b) for b in plan_constrained(lengths, MemoryBudget(model, 100, memory_margin=0.5), window_batches=None)] \
        == [5, 5, 5, 5]


@pytest.mark.parametrize(
    "constraint",
    [TokenBudget(50), MemoryBudget(_LinearMemory(0.0, 1.0), 50, memory_margin=0.0)],
    ids=["tokens", "memory"],
)
def test_a_row_that_breaks_the_budget_alone_is_refused_when_the_sampler_is_built(constraint):
    match = (r"^constraint should be able to hold every row alone \(row 1, lengths=60, is the longest of the 2 rows it "
             r"cannot hold: raise its limit to hold that row, or truncate or drop such rows first\), but got "
             rf"constraint={re.escape(repr(constraint))}$")
    with pytest.raises(ValueError, match=match):
        SmartBatchSampler([5, 60, 7, 55], constraint)  # at construction, not at the first batch
    with pytest.raises(ValueError, match=match):
        plan_constrained([5, 60, 7, 55], constraint)


def test_a_row_too_long_for_one_key_field_is_named_with_every_field():
    with pytest.raises(ValueError, match=r"\(row 2, source=30, target=90, is the longest of the 1 row it cannot hold"):
        SmartBatchSampler({"source": [10, 20, 30], "target": [10, 20, 90]}, TokenBudget(max_tokens=64))


@pytest.mark.parametrize(
    "build, error, match",
    [
        (lambda: FixedBatchSize(0), ValueError, "batch_size should be a positive integer, but got batch_size=0"),
        (lambda: FixedBatchSize(2.0), TypeError, "batch_size should be a positive integer"),
        (lambda: LengthDifference(-1, 4), ValueError, "max_diff should be a non-negative integer, but got max_diff=-1"),
        (lambda: LengthDifference(1.5, 4), TypeError, "max_diff should be a non-negative integer"),
        (lambda: TokenBudget(0), ValueError, "max_tokens should be a positive integer"),
        (lambda: TokenBudget(10, combine="max"), ValueError, "combine should be 'each' or 'sum', but got combine='max'"),
        (lambda: MemoryBudget(object(), 1e9), TypeError, r"memory_model should be a MemoryModel \(or any object with predict"),
        (lambda: MemoryBudget(_LinearMemory(), -1), ValueError, "max_memory should be a number of bytes > 0"),
        (lambda: MemoryBudget(_LinearMemory(), "12XB"), ValueError, "max_memory should be a number of bytes > 0"),
        (lambda: MemoryBudget(_LinearMemory()), ValueError, "max_memory should be given, or None with reference_batch"),
        (lambda: MemoryBudget(_LinearMemory(), 1e9, reference_batch=(4, 8)), ValueError, "not both"),
        (lambda: MemoryBudget(_LinearMemory(), reference_batch=(0, 8)), ValueError,
         r"reference_batch\[0\] should be a positive integer"),
        (lambda: MemoryBudget(_LinearMemory(), 1e9, memory_margin=1.0), ValueError,
         r"memory_margin should be a number in \[0, 1\)"),
        (lambda: MemoryBudget(_LinearMemory(), 1e9, field=-1), ValueError, "field should be a non-negative integer"),
        (lambda: AllOf(), ValueError, "constraints should be at least one constraint"),
        (lambda: as_constraint("tokens"), TypeError, "constraint should be a constraint"),
    ],
)
def test_bad_constraint_arguments(build, error, match):
    with pytest.raises(error, match=match):
        build()


def test_memory_budget_relative_to_a_reference_batch_and_as_a_size():
    model = _LinearMemory(fixed=0.0, per_token=1.0)  # bytes = rows * length
    relative = MemoryBudget(model, reference_batch=(4, 50), memory_margin=0.0)  # 200 bytes
    assert relative.budget_bytes == 200
    assert [len(b) for b in plan_constrained(np.full(40, 20), relative, window_batches=None)] == [10] * 4
    assert MemoryBudget(model, "1KiB", memory_margin=0.5).budget_bytes == 512


def test_memory_budget_field_beyond_the_key_fields_is_refused():
    with pytest.raises(ValueError, match=r"field should be below the number of key fields \(1\), but got field=1"):
        plan_constrained([1, 2, 3], MemoryBudget(_LinearMemory(), 1e9, field=1))


def test_the_memory_budget_never_plans_a_shape_that_ran_out_of_memory():
    from dynabatch.memory.model import MemoryModel

    shapes = [(r, L) for r in (1, 8, 32) for L in (8, 32, 64)]
    mm = MemoryModel().fit(*zip(*shapes), [1000 + 10 * r * L for r, L in shapes])
    mm.observe(8, 64, None, out_of_memory=True)
    assert int(mm.max_rows(64, 1e9)) == 7
    lengths = np.array([64] * 20 + [8] * 20)
    batches = plan_constrained(lengths, MemoryBudget(mm, 1e9, batch_size=32), window_batches=None, shuffle=False)
    assert max(len(b) for b in batches if lengths[b].max() == 64) <= 7
    assert sorted(np.concatenate(batches).tolist()) == list(range(40))
