"""create_buckets, Buckets and BucketBatchSampler: bionemo's API, its edge cases and errors."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import BatchSampler, DataLoader

from dynabatch.compat.bionemo import BucketBatchSampler, Buckets, SizeAwareBatchSampler, create_buckets
from dynabatch.compat.bionemo._bucket_draw import draw_bucket, mcg_powers


def _bbs(sizes, boundaries, batch_sizes=(2, 3, 5), **kwargs):
    kwargs.setdefault("base_batch_sampler_shared_kwargs", {"drop_last": False})
    kwargs.setdefault("base_batch_sampler_individual_kwargs", {"batch_size": list(batch_sizes)})
    return BucketBatchSampler(sizes, boundaries, BatchSampler, **kwargs)


# ---------------------------------------------------------------- create_buckets


def test_create_buckets_returns_a_named_tuple():
    buckets = create_buckets(torch.tensor([0, 5, 7, 1, 6]), max_width=5, min_bucket_count=3)
    assert isinstance(buckets, Buckets) and isinstance(buckets, tuple)
    boundaries, counts = buckets
    assert boundaries.tolist() == [0, 5, 8] and counts.tolist() == [2, 3]  # 0, 1 | 5, 6, 7
    assert buckets.bucket_boundaries is boundaries and buckets.bucket_sizes is counts


def test_create_buckets_single_value_and_int32_sizes():
    assert create_buckets(torch.tensor([4, 4, 4], dtype=torch.int32), 3, 1).bucket_boundaries.tolist() == [4, 5]
    assert create_buckets(torch.tensor([4]), 1, 10).bucket_sizes.tolist() == [1]


@pytest.mark.parametrize(
    "sizes, message",
    [
        (torch.tensor([], dtype=torch.int64), "sizes should be a non-empty 1D tensor of integers"),
        (torch.tensor([]), r"sizes should be a 1D tensor of integers, but got sizes.dtype=torch.float32"),
        (torch.tensor([1.0, 2.0]), "sizes.dtype=torch.float32"),
        (torch.tensor([True, False]), "sizes.dtype=torch.bool"),
        (torch.tensor([[1, 2]]), r"sizes with shape \(1, 2\)"),
        ([1, 2, 3], r"sizes should be a 1D tensor of integers, but got sizes=\[1, 2, 3\] of type list"),
    ],
)
def test_create_buckets_refuses_empty_or_non_integer_sizes(sizes, message):
    with pytest.raises(ValueError, match=message):
        create_buckets(sizes, 5, 2)


@pytest.mark.parametrize("name", ["max_width", "min_bucket_count"])
@pytest.mark.parametrize("value", [0, -3, 2.5, True, None])
def test_create_buckets_refuses_non_positive_integers(name, value):
    kwargs = {"max_width": 5, "min_bucket_count": 2, name: value}
    with pytest.raises(ValueError, match=f"{name} should be a positive integer, but got {name}="):
        create_buckets(torch.arange(10), **kwargs)


@settings(max_examples=200, deadline=None)
@given(
    values=st.lists(st.integers(min_value=-50, max_value=300), min_size=1, max_size=80),
    max_width=st.integers(min_value=1, max_value=40),
    min_bucket_count=st.integers(min_value=1, max_value=30),
)
def test_property_create_buckets(values, max_width, min_bucket_count):
    sizes = torch.tensor(values)
    boundaries, counts = create_buckets(sizes, max_width, min_bucket_count)
    bounds = boundaries.tolist()
    widths = [b - a for a, b in zip(bounds, bounds[1:])]
    assert len(counts) == len(bounds) - 1
    assert bounds[0] == min(values) and bounds[-1] == max(values) + 1
    assert all(0 < w <= max_width for w in widths)
    # the counts are the histogram of the sizes over the buckets
    assert counts.tolist() == [sum(a <= v < b for v in values) for a, b in zip(bounds, bounds[1:])]
    # a bucket is short of min_bucket_count only when it reached max_width (or it is the last one)
    assert all(c >= min_bucket_count or w == max_width for c, w in zip(counts.tolist()[:-1], widths[:-1]))


# ---------------------------------------------------------------- BucketBatchSampler: construction


def test_boundaries_are_sorted_and_empty_buckets_kept():
    sizes = torch.tensor([1, 2, 12, 13, 3, 11])
    sampler = _bbs(sizes, torch.tensor([10, 5, 0, 16]), batch_sizes=(2, 4, 2), shuffle=False)
    assert sampler.bucket_boundaries.tolist() == [0, 5, 10, 16]
    assert sampler.num_buckets == 3 and sampler.bucket_sizes.tolist() == [3, 0, 3]
    assert list(sampler) == [[0, 1], [4], [2, 3], [5]]
    assert len(sampler) == 4


def test_elements_outside_the_ranges_are_skipped_with_a_warning(caplog):
    sizes = torch.tensor([-1, 0, 1, 5, 9, 10])
    with pytest.warns(UserWarning, match="2 elements are outside the buckets provided and will be skipped"):
        sampler = _bbs(sizes, torch.tensor([0, 5, 10]), batch_sizes=(8, 8), shuffle=False)
    with caplog.at_level("WARNING", logger="dynabatch.compat.bionemo.bucket"):
        assert list(sampler) == [[1, 2], [3, 4]]
        assert list(sampler) == [[1, 2], [3, 4]]
    said = [r.getMessage() for r in caplog.records if r.name == "dynabatch.compat.bionemo.bucket"]
    assert said == ["2 of 6 elements are outside the bucket ranges and skipped this epoch"] * 2  # once per epoch


def test_no_element_inside_the_ranges_is_a_runtime_error():
    with pytest.raises(RuntimeError, match=r"no element of sizes is inside the bucket ranges.*bucket_boundaries=\[30, 40\]"):
        _bbs(torch.arange(25), torch.tensor([30, 40]), batch_sizes=(2,))
    with pytest.raises(RuntimeError, match="no element of sizes is inside"):
        _bbs(torch.tensor([], dtype=torch.int64), torch.tensor([0, 1]), batch_sizes=(2,))


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("sizes", list(range(5)), r"sizes should be a 1D tensor of real numbers, but got sizes=\[0, 1, 2, 3, 4\] of type list"),
        ("sizes", torch.arange(6).reshape(2, 3), r"sizes with shape \(2, 3\)"),
        ("sizes", torch.tensor([True, False]), "sizes.dtype=torch.bool"),
        ("sizes", torch.tensor([1j, 2j]), "sizes.dtype=torch.complex64"),
        ("bucket_boundaries", [0, 2, 5], "bucket_boundaries should be a 1D tensor of real numbers, but got bucket_boundaries="),
        ("bucket_boundaries", torch.tensor([[0, 2, 5]]), r"bucket_boundaries with shape \(1, 3\)"),
        ("bucket_boundaries", torch.tensor([3]), "bucket_boundaries should have at least 2 values"),
        ("bucket_boundaries", torch.tensor([0, 2, 2, 5]), "bucket_boundaries should not contain duplicate values"),
        ("bucket_boundaries", torch.tensor([0.0, float("nan"), 5.0]), "bucket_boundaries should not contain NaN"),
        ("base_batch_sampler_shared_kwargs", [("drop_last", False)], "base_batch_sampler_shared_kwargs should be a keyword argument dictionary"),
        ("base_batch_sampler_shared_kwargs", {1: False}, r"with keys \[1\]"),
        ("base_batch_sampler_individual_kwargs", [("batch_size", [2, 3])], "base_batch_sampler_individual_kwargs should be a keyword argument dictionary"),
        ("base_batch_sampler_individual_kwargs", {"batch_size": [2, 3, 5]}, r"base_batch_sampler_individual_kwargs\['batch_size'\] should have 2 values \(len\(bucket_boundaries\) - 1\), but got 3"),
        ("base_batch_sampler_individual_kwargs", {"batch_size": 2}, r"base_batch_sampler_individual_kwargs\['batch_size'\] should be an iterable of 2 values"),
        ("base_batch_sampler_class", DataLoader, "base_batch_sampler_class should be a batch sampler class inherited from torch.utils.data.Sampler"),
        ("shuffle", 1, "shuffle should be a bool, but got shuffle=1"),
        ("generator", 0, "generator should be a torch.Generator or None, but got generator=0"),
    ],
)
def test_bad_arguments_raise_value_error_naming_argument_and_value(name, value, message):
    kwargs = {
        "sizes": torch.arange(10),
        "bucket_boundaries": torch.tensor([0, 5, 10]),
        "base_batch_sampler_class": BatchSampler,
        "base_batch_sampler_shared_kwargs": {"drop_last": False},
        "base_batch_sampler_individual_kwargs": {"batch_size": [2, 3]},
        name: value,
    }
    with pytest.raises(ValueError, match=message):
        BucketBatchSampler(**kwargs)


def test_wrong_types_are_also_type_errors():
    with pytest.raises(TypeError):
        _bbs([1, 2], torch.tensor([0, 5]), batch_sizes=(2,))
    with pytest.raises(TypeError):
        create_buckets([1, 2], 2, 2)


def test_default_kwargs_are_empty_dicts_and_base_class_errors_propagate():
    sampler = BucketBatchSampler(torch.arange(4), torch.tensor([0, 4]), SizeAwareBatchSampler,
                                 {"sizeof": [1, 1, 1, 1], "max_total_size": 2}, shuffle=False)
    assert sampler.base_batch_sampler_individual_kwargs == [{}]
    assert list(sampler) == [[0, 1], [2, 3]]
    with pytest.raises(TypeError):  # BatchSampler needs batch_size and drop_last
        BucketBatchSampler(torch.arange(4), torch.tensor([0, 4]), BatchSampler)


# ---------------------------------------------------------------- BucketBatchSampler: iteration


def test_len_counts_batches_only_when_the_base_sampler_has_len():
    sizes = torch.arange(25)
    boundaries = torch.tensor([0, 6, 15, 25])
    for drop_last in (False, True):
        sampler = _bbs(sizes, boundaries, batch_sizes=(4, 4, 4), base_batch_sampler_shared_kwargs={"drop_last": drop_last},
                       shuffle=True, generator=torch.Generator().manual_seed(1))
        assert len(sampler) == len(list(sampler)) == (2 + 3 + 3 if not drop_last else 1 + 2 + 2)
    sampler = BucketBatchSampler(sizes, boundaries, SizeAwareBatchSampler, {"sizeof": lambda i: 1, "max_total_size": 4})
    with pytest.raises(TypeError):
        len(sampler)


def test_drop_last_drops_only_incomplete_batches_and_iteration_ends():
    sampler = _bbs(torch.arange(25), torch.tensor([0, 6, 15, 25]), batch_sizes=(4, 4, 4),
                   base_batch_sampler_shared_kwargs={"drop_last": True}, generator=torch.Generator().manual_seed(0))
    batches = list(sampler)
    assert [len(b) for b in batches] == [4] * 5
    assert len({i for b in batches for i in b}) == 20


def test_shuffle_is_reproducible_from_the_generator_seed_and_changes_every_epoch():
    sizes = torch.randint(0, 100, (200,), generator=torch.Generator().manual_seed(3))
    boundaries = torch.tensor([0, 20, 50, 100])

    def run(seed):
        sampler = _bbs(sizes, boundaries, batch_sizes=(8, 6, 4), generator=torch.Generator().manual_seed(seed))
        return list(sampler), list(sampler)

    a, b = run(7), run(7)
    assert a == b
    assert a[0] != a[1]
    assert run(8)[0] != a[0]


def test_without_a_generator_the_seed_comes_from_torch_global_rng():
    sizes = torch.arange(50)
    torch.manual_seed(11)
    first = list(_bbs(sizes, torch.tensor([0, 25, 50]), batch_sizes=(3, 3)))
    torch.manual_seed(11)
    assert list(_bbs(sizes, torch.tensor([0, 25, 50]), batch_sizes=(3, 3))) == first


def test_float_sizes_and_boundaries_and_a_data_loader():
    sizes = torch.tensor([0.5, 1.5, 0.7, 2.5, 1.2])
    data = [f"x{i}" for i in range(5)]
    sampler = BucketBatchSampler(sizes, torch.tensor([0, 1, 2, 3]), BatchSampler, {"drop_last": False},
                                 {"batch_size": [5, 5, 5]}, shuffle=False)
    loader = DataLoader(data, batch_sampler=sampler, collate_fn=list)
    assert list(loader) == [["x0", "x2"], ["x1", "x4"], ["x3"]]


def test_bucket_draw_follows_the_weights():
    generator = torch.Generator().manual_seed(0)
    powers = mcg_powers(3)
    remaining = np.array([1, 0, 3])
    draws = [draw_bucket(remaining, 4, generator, powers) for _ in range(3000)]  # > 624: crosses twists
    assert draws.count(1) == 0
    assert abs(draws.count(2) / 3000 - 0.75) < 0.03


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(st.integers(min_value=0, max_value=60), min_size=1, max_size=80),
    cuts=st.lists(st.integers(min_value=-5, max_value=70), min_size=2, max_size=6, unique=True),
    batch_size=st.integers(min_value=1, max_value=7),
    shuffle=st.booleans(),
    seed=st.integers(min_value=0, max_value=2**31),
)
def test_property_batches_are_homogeneous_and_every_index_in_range_appears_once(values, cuts, batch_size, shuffle, seed):
    sizes = torch.tensor(values)
    boundaries = torch.tensor(cuts)
    bounds = sorted(cuts)
    inside = [i for i, v in enumerate(values) if bounds[0] <= v < bounds[-1]]
    if not inside:
        with pytest.raises(RuntimeError):
            _bbs(sizes, boundaries, batch_sizes=[batch_size] * (len(cuts) - 1))
        return
    with pytest.warns(UserWarning) if len(inside) < len(values) else _no_warning():
        sampler = _bbs(sizes, boundaries, batch_sizes=[batch_size] * (len(cuts) - 1), shuffle=shuffle,
                       generator=torch.Generator().manual_seed(seed))

    def bucket_of(i):
        return max(k for k, b in enumerate(bounds[:-1]) if values[i] >= b)

    for _ in range(2):
        batches = list(sampler)
        assert sorted(i for b in batches for i in b) == inside
        assert all(1 <= len(b) <= batch_size for b in batches)
        assert all(len({bucket_of(i) for i in b}) == 1 for b in batches)
        assert len(batches) == len(sampler)


class _no_warning:
    def __enter__(self):
        import warnings

        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("error")

    def __exit__(self, *exc):
        return self._catch.__exit__(*exc)


# ---------------------------------------------------------------- state_dict / load_state_dict (dynabatch extra)


def _resume_sampler(seed=5, base=BatchSampler):
    sizes = torch.randint(0, 60, (120,), generator=torch.Generator().manual_seed(2))
    if base is BatchSampler:
        return _bbs(sizes, torch.tensor([0, 10, 30, 60]), batch_sizes=(7, 5, 3),
                    generator=torch.Generator().manual_seed(seed))
    return BucketBatchSampler(sizes, torch.tensor([0, 10, 30, 60]), SizeAwareBatchSampler,
                              {"sizeof": sizes.tolist(), "max_total_size": 100},
                              generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("base", [BatchSampler, SizeAwareBatchSampler])
@pytest.mark.parametrize("stop_after", [0, 1, 9])
def test_resume_mid_epoch_loses_and_repeats_nothing(base, stop_after):
    reference = _resume_sampler(base=base)
    epochs = [list(reference), list(reference)]

    sampler = _resume_sampler(base=base)
    first = list(sampler)
    assert first == epochs[0]
    it = iter(sampler)
    seen = [next(it) for _ in range(stop_after)]
    state = sampler.state_dict()
    assert state["batches_yielded"] == stop_after

    restored = _resume_sampler(seed=99, base=base)  # another seed: the state must override it
    restored.load_state_dict(state)
    rest = list(restored)
    assert seen + rest == epochs[1]
    assert list(restored) == list(reference)  # and the epoch after follows as without the interruption


def test_state_dict_right_after_load_state_dict_keeps_the_position():
    """A checkpoint saved after resuming, before iterating, still resumes after the batches already yielded."""
    reference = _resume_sampler()
    epochs = [list(reference), list(reference)]
    sampler = _resume_sampler()
    list(sampler)
    it = iter(sampler)
    seen = [next(it) for _ in range(4)]
    resumed = _resume_sampler(seed=99)
    resumed.load_state_dict(sampler.state_dict())
    state = resumed.state_dict()  # saved again before the resumed epoch starts
    assert state["batches_yielded"] == 4
    again = _resume_sampler(seed=98)
    again.load_state_dict(state)
    assert seen + list(again) == epochs[1]


@settings(max_examples=25, deadline=None)
@given(
    values=st.lists(st.integers(min_value=0, max_value=30), min_size=1, max_size=60),
    batch_sizes=st.lists(st.integers(min_value=1, max_value=6), min_size=3, max_size=3),
    drop_last=st.booleans(),
    shuffle=st.booleans(),
    epoch=st.integers(min_value=0, max_value=3),
    data=st.data(),
)
def test_property_resume_anywhere_and_save_again_gives_exactly_the_rest(values, batch_sizes, drop_last, shuffle,
                                                                         epoch, data):
    def make(seed):
        sampler = _bbs(torch.tensor(values), torch.tensor([0, 8, 20, 31]), batch_sizes=batch_sizes, shuffle=shuffle,
                       base_batch_sampler_shared_kwargs={"drop_last": drop_last},
                       generator=torch.Generator().manual_seed(seed))
        sampler.set_epoch(epoch)
        return sampler

    full = list(make(1))
    assert len(full) == len(make(1))
    stop = data.draw(st.integers(min_value=0, max_value=len(full)))
    sampler = make(1)
    it = iter(sampler)
    seen = [next(it) for _ in range(stop)]
    resumed = make(2)
    resumed.load_state_dict(sampler.state_dict())
    again = make(3)
    again.load_state_dict(resumed.state_dict())  # saved again before the resumed epoch starts
    assert seen + list(again) == full


def test_state_dict_between_epochs_starts_the_next_epoch():
    reference = _resume_sampler()
    epochs = [list(reference), list(reference)]
    sampler = _resume_sampler()
    list(sampler)
    state = sampler.state_dict()
    assert state["batches_yielded"] == 0
    restored = _resume_sampler(seed=3)
    restored.load_state_dict(state)
    assert list(restored) == epochs[1]


def test_load_state_dict_refuses_a_state_of_other_elements():
    state = _resume_sampler().state_dict()
    other = _bbs(torch.arange(25), torch.tensor([0, 6, 15, 25]))
    with pytest.raises(ValueError, match="state_dict should be a state_dict\\(\\) of a BucketBatchSampler over the same"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="batches_yielded'\\] should be a non-negative int"):
        _resume_sampler().load_state_dict({**state, "batches_yielded": -1})
    epoch = len(_resume_sampler())
    with pytest.raises(ValueError, match=rf"batches_yielded'\] should be at most {epoch} \(the batches of an epoch\), "
                                         rf"but got {epoch + 1}"):
        _resume_sampler().load_state_dict({**state, "batches_yielded": epoch + 1})  # not an empty epoch
    with pytest.raises(TypeError, match=r"state_dict should be a dict from BucketBatchSampler.state_dict\(\), but got "
                                        r"state_dict=\[\] of type list"):
        _resume_sampler().load_state_dict([])


def test_set_epoch_makes_an_epoch_depend_only_on_the_seed_and_the_epoch():
    fresh = [list(_resume_sampler(seed=5))]
    a, b = _resume_sampler(seed=5), _resume_sampler(seed=5)
    list(a), list(a), list(a)  # a has iterated three epochs, b none
    a.set_epoch(0)
    b.set_epoch(0)
    assert list(a) == list(b) == fresh[0]  # set_epoch(0) is a fresh sampler's first epoch
    a.set_epoch(4)
    list(b)
    b.set_epoch(4)
    epoch4 = list(a)
    assert epoch4 == list(b) and epoch4 != fresh[0]
    assert sorted(i for batch in epoch4 for i in batch) == list(range(120))
    with pytest.raises(ValueError, match="epoch should be a non-negative int, but got epoch=-1"):
        a.set_epoch(-1)
    unshuffled = _bbs(torch.arange(25), torch.tensor([0, 6, 15, 25]), shuffle=False)
    unshuffled.set_epoch(2)
    assert list(unshuffled)[0] == [0, 1]
