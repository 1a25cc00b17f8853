"""size_aware_batching and SizeAwareBatchSampler: bionemo's API, its edge cases and errors."""

import logging
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, DistributedSampler, SequentialSampler, default_collate

from dynabatch.compat.bionemo import SizeAwareBatchSampler, size_aware_batching


def _greedy_reference(sizes, max_total_size):
    """The batches bionemo documents: in order, oversize elements skipped, a batch closed before it would overflow."""
    batches, batch, total = [], [], 0
    for i, s in enumerate(sizes):
        if s > max_total_size:
            continue
        if batch and total + s > max_total_size:
            batches.append(batch)
            batch, total = [], 0
        batch.append(i)
        total += s
    if batch:
        batches.append(batch)
    return batches


def test_size_aware_batching_lists_without_collate_fn():
    data = [torch.tensor([1, 2]), torch.tensor([3, 4, 5]), torch.tensor([6])]
    batches = list(size_aware_batching(data, lambda x: x.numel(), 4))
    assert [[t.tolist() for t in b] for b in batches] == [[[1, 2]], [[3, 4, 5], [6]]]


def test_size_aware_batching_with_default_collate_stacks_tensors():
    data = [torch.tensor([i, i + 1]) for i in range(0, 10, 2)]
    batches = list(size_aware_batching(data, lambda x: x.numel(), 4, collate_fn=default_collate))
    assert [b.tolist() for b in batches] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8, 9]]]


def test_oversize_elements_are_skipped_and_reported_through_warn_logger():
    sizes = [3, 9, 2, 2, 10, 1]
    warned, informed = [], []
    batches = list(
        size_aware_batching(
            range(len(sizes)), sizes, 5, info_logger=informed.append, warn_logger=warned.append
        )
    )
    assert batches == [[0, 2], [3, 5]]
    # one call per skipped element, then one summary
    assert len(warned) == 3
    assert "Size of element 1 exceeds max_total_size (9 > 5), skipping" in warned[0]
    assert "element 4 exceeds max_total_size (10 > 5)" in warned[1]
    assert "4 samples were batched from 6" in warned[2]
    assert informed == [informed[0]] and "Batched 4 samples into 2 batches" in informed[0]


def test_warn_logger_can_be_warnings_warn():
    with pytest.warns(UserWarning) as records:
        list(size_aware_batching([1, 5], lambda x: x, 3, warn_logger=warnings.warn))
    messages = [str(r.message) for r in records]
    assert "exceeds max_total_size (5 > 3)" in messages[0]
    assert "1 samples were batched from 2" in messages[1]


def test_without_loggers_messages_go_to_the_module_logger(caplog):
    with caplog.at_level(logging.DEBUG, logger="dynabatch.compat.bionemo.size_aware"):
        assert list(size_aware_batching([1, 5, 2], lambda x: x, 3)) == [[1, 2]]
    text = caplog.text
    assert "exceeds max_total_size (5 > 3)" in text
    assert "2 samples were batched from 3" in text
    assert "Batched 2 samples into 1 batches" in text


def test_no_warning_summary_when_nothing_is_skipped():
    warned = []
    assert list(size_aware_batching([1, 1, 1], lambda x: x, 2, warn_logger=warned.append)) == [[1, 1], [1]]
    assert warned == []


def test_empty_input_yields_nothing():
    informed = []
    assert list(size_aware_batching([], lambda x: x, 3, info_logger=informed.append)) == []
    assert "Batched 0 samples into 0 batches" in informed[0]
    assert list(SizeAwareBatchSampler(SequentialSampler([]), lambda i: 1, 100)) == []


def test_generators_are_consumed_once():
    def numbers():
        yield from [2, 2, 3, 1]

    assert list(size_aware_batching(numbers(), lambda x: x, 4)) == [[2, 2], [3, 1]]
    sampler = SizeAwareBatchSampler((i for i in range(4)), [1, 1, 1, 1], 2)
    assert list(sampler) == [[0, 1], [2, 3]]
    assert list(sampler) == []  # a generator is an iterable of one epoch


def test_max_total_size_zero_in_the_function_batches_only_size_zero_elements():
    assert list(size_aware_batching([0, 1, 0], lambda x: x, 0)) == [[0, 0]]


@pytest.mark.parametrize(
    "sizeof",
    [
        [3, 1, 2, 2],
        (3, 1, 2, 2),
        {0: 3, 1: 1, 2: 2, 3: 2},
        torch.tensor([3, 1, 2, 2]),
        np.array([3.0, 1.0, 2.0, 2.0]),
        lambda i: [3, 1, 2, 2][i],
    ],
    ids=["list", "tuple", "dict", "tensor", "ndarray", "callable"],
)
def test_sizeof_as_callable_mapping_or_sequence(sizeof):
    sampler = SizeAwareBatchSampler(SequentialSampler(range(4)), sizeof, 4)
    assert list(sampler) == [[0, 1], [2, 3]]
    assert list(size_aware_batching(range(4), sizeof, 4)) == [[0, 1], [2, 3]]


def test_mapping_missing_an_index_raises_runtime_error_that_is_a_key_error():
    sampler = SizeAwareBatchSampler(range(3), {0: 1, 1: 1}, 4)
    with pytest.raises(RuntimeError, match="sizeof raises error at data=2.*no entry for index 2"):
        list(sampler)
    with pytest.raises(KeyError):
        list(sampler)


@pytest.mark.parametrize("index", [5, -1])
def test_sequence_missing_an_index_raises_runtime_error_that_is_an_index_error(index):
    sampler = SizeAwareBatchSampler([0, index], [1, 1, 1], 4)
    with pytest.raises(RuntimeError, match=f"no entry for index {index}; valid indices are 0..2"):
        list(sampler)
    with pytest.raises(IndexError):
        list(sampler)


def test_sizeof_raising_becomes_runtime_error_naming_the_element():
    def sizeof(i):
        raise ValueError("boom")

    with pytest.raises(RuntimeError, match="sizeof raises error at data=0: boom"):
        list(SizeAwareBatchSampler(range(3), sizeof, 1))


def test_sizeof_returning_a_non_number_raises_type_error():
    with pytest.raises(TypeError, match=r"sizeof should return a number comparable with max_total_size=1, but got '0' of type str.*not int or float.*'>' not supported"):
        list(SizeAwareBatchSampler(range(3), lambda i: str(i), 1))
    with pytest.raises(TypeError, match="but got None of type NoneType"):
        list(size_aware_batching([1], lambda x: None, 1))


def test_sizeof_returning_nan_raises_value_error():
    with pytest.raises(ValueError, match="sizeof should return a number, but got NaN for data=1"):
        list(size_aware_batching([0, 1], [1.0, float("nan")], 3))


@pytest.mark.parametrize("max_total_size", [0, -1, -0.5])
def test_sampler_with_a_non_positive_max_total_size_constructs_and_skips_every_sized_element(max_total_size):
    # bionemo checks only that max_total_size is a real number (its docs promise more); its own
    # tests build SizeAwareBatchSampler(sampler, sizeof, 0) and expect a warning per skipped element
    warned, informed = [], []
    sampler = SizeAwareBatchSampler(
        SequentialSampler(range(4)), [10, 20, 30, 10], max_total_size,
        info_logger=informed.append, warn_logger=warned.append,
    )
    for _ in range(2):  # every epoch the same, and the sampler stays usable
        warned.clear()
        assert list(sampler) == []
        assert len(warned) == 5  # one per element, then the summary
        assert f"Size of element 2 exceeds max_total_size (30 > {max_total_size}), skipping" in warned[2]
        assert "0 samples were batched from 4" in warned[4]
    assert "Batched 0 samples into 0 batches" in informed[-1]


def test_sampler_with_max_total_size_zero_warns_through_warnings_warn_and_keeps_size_zero_elements():
    sampler = SizeAwareBatchSampler(range(4), [0, 5, 0, 1], 0, warn_logger=warnings.warn)
    with pytest.warns(UserWarning) as records:
        assert list(sampler) == [[0, 2]]
    messages = [str(r.message) for r in records]
    assert len(messages) == 3
    assert "Size of element 1 exceeds max_total_size (5 > 0), skipping" in messages[0]
    assert "Size of element 3 exceeds max_total_size (1 > 0), skipping" in messages[1]
    assert "2 samples were batched from 4" in messages[2]


def test_sampler_with_max_total_size_zero_in_a_data_loader_gives_no_batch():
    data = torch.arange(6.0)
    loader = DataLoader(data, batch_sampler=SizeAwareBatchSampler(SequentialSampler(data), lambda i: 1, 0))
    assert list(loader) == []


_REAL_NUMBER_RULE = r"max_total_size should be a real number \(int or float, not NaN\), but got max_total_size="


def test_sampler_refuses_a_nan_max_total_size():
    with pytest.raises(ValueError, match=_REAL_NUMBER_RULE + "nan"):
        SizeAwareBatchSampler(range(3), lambda i: 1, float("nan"))


@pytest.mark.parametrize("max_total_size", ["10", None, True, {}])
def test_sampler_refuses_a_non_number_max_total_size_with_value_error(max_total_size):
    with pytest.raises(ValueError, match=_REAL_NUMBER_RULE):
        SizeAwareBatchSampler(range(3), lambda i: 1, max_total_size)


def test_max_total_size_beyond_the_float_range_is_accepted():
    # an int too large for a float is still a real number (checking it for NaN must not overflow)
    huge = 10**400
    assert list(size_aware_batching([1, 2, 3], lambda x: x, huge)) == [[1, 2, 3]]
    assert list(SizeAwareBatchSampler(range(3), [1, 2, 3], huge)) == [[0, 1, 2]]


@pytest.mark.parametrize("sampler", ["not a sampler", 3, None])
def test_sampler_must_be_a_sampler_or_iterable(sampler):
    with pytest.raises(TypeError, match="sampler should be an instance of torch.utils.data.Sampler or Iterable, but got sampler="):
        SizeAwareBatchSampler(sampler, lambda i: 1, 3)


@pytest.mark.parametrize("sizeof", [" invalid type", 3, None, {1, 2}])
def test_sizeof_must_be_callable_dict_or_sequence(sizeof):
    with pytest.raises(TypeError, match="sizeof must be a callable, a dictionary or a sequence container, but got sizeof="):
        SizeAwareBatchSampler(range(3), sizeof, 3)
    with pytest.raises(TypeError, match="sizeof must be a callable"):
        size_aware_batching(range(3), sizeof, 3)


def test_function_checks_collate_fn_dataset_and_loggers_at_the_call():
    with pytest.raises(TypeError, match="collate_fn should be a callable or None, but got collate_fn=3"):
        size_aware_batching([1], lambda x: x, 3, collate_fn=3)
    with pytest.raises(TypeError, match="dataset should be an iterable, but got dataset=5"):
        size_aware_batching(5, lambda x: x, 3)
    with pytest.raises(TypeError, match="warn_logger should be a callable taking a str or None"):
        size_aware_batching([1], lambda x: x, 3, warn_logger="log")


def test_size_aware_batch_sampler_has_no_len_and_repeats_its_batches():
    sampler = SizeAwareBatchSampler(SequentialSampler(range(5)), lambda i: i, 5)
    assert not hasattr(sampler, "__len__")
    with pytest.raises(TypeError):
        len(sampler)
    first = list(sampler)
    assert first == [[0, 1, 2], [3], [4]]
    assert list(sampler) == first


def test_data_loader_with_size_aware_batch_sampler():
    data = [torch.full((n,), n) for n in (1, 2, 3, 1, 1)]
    loader = DataLoader(
        data, batch_sampler=SizeAwareBatchSampler(SequentialSampler(data), lambda i: data[i].numel(), 3),
        collate_fn=lambda rows: [r.tolist() for r in rows],
    )
    assert list(loader) == [[[1], [2, 2]], [[3, 3, 3]], [[1], [1]]]


def test_set_epoch_is_passed_to_a_distributed_sampler():
    data = list(range(8))
    inner = DistributedSampler(data, num_replicas=2, rank=0, shuffle=True, seed=3)
    sampler = SizeAwareBatchSampler(inner, lambda i: 1, 2)
    sampler.set_epoch(0)
    epoch0 = list(sampler)
    sampler.set_epoch(1)
    epoch1 = list(sampler)
    assert inner.epoch == 1
    assert sorted(sum(epoch0, [])) == sorted(sum(epoch1, [])) or epoch0 != epoch1
    assert epoch0 != epoch1  # the shuffle changed with the epoch
    SizeAwareBatchSampler(range(3), [1, 1, 1], 2).set_epoch(5)  # no set_epoch underneath: nothing happens


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(min_value=0, max_value=50), max_size=60),
    max_total_size=st.integers(min_value=1, max_value=120),
)
def test_property_batches_stay_under_the_maximum_and_keep_every_fitting_index_once(sizes, max_total_size):
    batches = list(SizeAwareBatchSampler(range(len(sizes)), sizes, max_total_size))
    assert all(sum(sizes[i] for i in b) <= max_total_size for b in batches)
    assert all(b for b in batches)
    flat = [i for b in batches for i in b]
    # every index exactly once, in input order, except the documented skipped oversize elements
    assert flat == [i for i, s in enumerate(sizes) if s <= max_total_size]
    # greedy: a batch was closed only because its next element did not fit
    for b, nxt in zip(batches, batches[1:]):
        assert sum(sizes[i] for i in b) + sizes[nxt[0]] > max_total_size
    assert batches == _greedy_reference(sizes, max_total_size)


@settings(max_examples=100, deadline=None)
@given(
    sizes=st.lists(st.floats(min_value=0.0, max_value=10.0, allow_nan=False), max_size=40),
    max_total_size=st.floats(min_value=0.1, max_value=30.0),
)
def test_property_float_sizes_through_the_function(sizes, max_total_size):
    batches = list(size_aware_batching(range(len(sizes)), sizes, max_total_size))
    assert all(sum(sizes[i] for i in b) <= max_total_size for b in batches)
    assert [i for b in batches for i in b] == [i for i, s in enumerate(sizes) if s <= max_total_size]
