"""A MemoryModel as bionemo's sizes: fit_memory_model, MemorySizeof, bucket_memory_kwargs."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dynabatch.compat.bionemo import BucketBatchSampler, SizeAwareBatchSampler, collect_peak_alloc, create_buckets
from dynabatch.compat.bionemo.size_aware_memory import MemorySizeof, bucket_memory_kwargs, fit_memory_model
from dynabatch.memory.budget import MemoryBudget
from dynabatch.memory.model import MemoryModel

SHAPES = [(r, n) for r in (1, 4, 16, 64, 256) for n in (1, 8, 16, 32, 64)]


def _peak(rows, length):  # fixed part F(L) = 1000 + 50 L, per-row part S(L) = 200 + 10 L + L^2
    return 1000 + 50 * length + rows * (200 + 10 * length + length**2)


@pytest.fixture(scope="module")
def model():
    return fit_memory_model(SHAPES, [_peak(r, n) for r, n in SHAPES], device="cpu")


def test_fit_memory_model_from_collect_peak_alloc_output():
    weight = torch.randn(32, 32)

    def work(shape):
        rows, length = shape
        x = torch.randn(rows, length, 32) @ weight  # rows * length * 32 floats, then relu's as many
        x.relu().sum()
        return shape

    shapes = [(1, 8), (4, 8), (2, 16), (8, 16), (1, 32), (4, 32)]  # few: collect_peak_alloc runs gc per item
    features, peaks = collect_peak_alloc(shapes, work, "cpu")
    mm = fit_memory_model(features, peaks, device="cpu")
    assert isinstance(mm, MemoryModel) and mm.device == "cpu"
    predicted = mm.predict([r for r, _ in shapes], [n for _, n in shapes])
    assert np.allclose(predicted, peaks, rtol=0.02)


def test_fit_memory_model_accepts_dicts_and_leaves_out_out_of_memory_items(caplog):
    features = [{"rows": r, "padded_length": n} for r, n in SHAPES] + [None]
    mm = fit_memory_model(features, [_peak(r, n) for r, n in SHAPES] + [None])
    assert len(mm.probes_) == len(SHAPES)
    assert "1 of 26 items left out" in caplog.text


def test_fit_memory_model_bad_input():
    with pytest.raises(ValueError, match="alloc_peaks should be one peak per feature"):
        fit_memory_model([(1, 8)], [1, 2])
    with pytest.raises(TypeError, match="features should be a list of"):
        fit_memory_model([3], [100])
    with pytest.raises(ValueError, match="features should be at least one item with a shape and a peak"):
        fit_memory_model([None], [None])


def test_memory_sizeof_is_the_per_row_bytes_and_max_total_size_the_budget_minus_the_fixed_bytes(model):
    sizeof = MemorySizeof(model, [8, 16, 64])
    assert [round(sizeof(i)) for i in range(3)] == [200 + 80 + 64, 200 + 160 + 256, 200 + 640 + 4096]
    assert round(sizeof.max_total_size(50_000)) == 50_000 - (1000 + 50 * 64)
    with pytest.raises(ValueError, match="budget_bytes should be above the fixed bytes of the longest batch"):
        sizeof.max_total_size(4000)
    with pytest.raises(ValueError, match="index should be an element index in"):
        sizeof(3)
    fixed = MemorySizeof(model, [8, 16], padded_length=64, pad_to_multiple_of=None)
    assert round(fixed(0)) == round(fixed(1)) == 200 + 640 + 4096
    assert round(MemorySizeof(model, [9], pad_to_multiple_of=8)(0)) == 200 + 160 + 256
    with pytest.raises(ValueError, match="padded_length should be >= the longest length"):
        MemorySizeof(model, [8, 70], padded_length=64)
    with pytest.raises(TypeError, match="memory_model should be a fitted MemoryModel"):
        MemorySizeof(object(), [8])


def test_size_aware_batch_sampler_with_fixed_padding_stays_under_the_budget(model):
    lengths = [5, 30, 64, 12, 40, 64, 1, 33]
    sizeof = MemorySizeof(model, lengths, padded_length=64)
    budget = 30_000
    batches = list(SizeAwareBatchSampler(range(len(lengths)), sizeof, sizeof.max_total_size(budget)))
    assert [i for b in batches for i in b] == list(range(len(lengths)))
    assert all(_peak(len(b), 64) <= budget for b in batches)
    assert all(_peak(len(b) + 1, 64) > budget for b in batches[:-1])  # full batches


def test_memory_sizeof_keeps_batches_beyond_the_measured_rows_within_the_budget():
    # measured up to 4 rows: the model predicts more than F + r * S for many more rows (it extrapolates
    # conservatively), so the sizes must not let the sum of per-row bytes admit more rows than the budget allows
    shapes = [(r, n) for r in (1, 2, 4) for n in (8, 16, 32, 64)]
    mm = fit_memory_model(shapes, [_peak(r, n) for r, n in shapes], device="cpu")
    budget = 200_000
    quiet = MemoryBudget(mm, budget, memory_margin=0.0)  # predicts without the model's extrapolation warning
    allowed = int(quiet.rows_allowed(64))
    sizeof = MemorySizeof(mm, [64] * 100, padded_length=64)
    batches = list(SizeAwareBatchSampler(range(100), sizeof, sizeof.max_total_size(budget)))
    assert [i for b in batches for i in b] == list(range(100))
    assert max(len(b) for b in batches) == allowed  # full batches of what the budget allows, not more
    assert all(quiet.predict_at(len(b), 64) <= budget for b in batches)


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(min_value=1, max_value=64), min_size=1, max_size=60),
    budget=st.integers(min_value=10_000, max_value=80_000),
    seed=st.integers(min_value=0, max_value=1000),
)
def test_property_bucketed_batches_are_within_the_budget_at_their_padded_length(model, lengths, budget, seed):
    sizes = torch.tensor(lengths)
    buckets = create_buckets(sizes, max_width=8, min_bucket_count=4)
    kwargs = bucket_memory_kwargs(model, sizes, buckets.bucket_boundaries, budget)
    sampler = BucketBatchSampler(sizes, buckets.bucket_boundaries, SizeAwareBatchSampler,
                                 base_batch_sampler_individual_kwargs=kwargs,
                                 generator=torch.Generator().manual_seed(seed))
    batches = list(sampler)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        padded = max(lengths[i] for i in b)
        assert _peak(len(b), padded) <= budget * (1 + 1e-6)  # the fit is exact to rounding here
        bucket_longest = max(v for v in lengths if any(
            lo <= v < hi and lo <= padded < hi for lo, hi in zip(buckets.bucket_boundaries.tolist(),
                                                                 buckets.bucket_boundaries.tolist()[1:])))
        assert len(b) <= int(model.max_rows(bucket_longest, budget * (1 + 1e-9)))  # float sums: ties either way


def test_bucket_memory_kwargs_refuses_a_budget_below_one_row(model):
    sizes = torch.tensor([8, 60])
    with pytest.raises(ValueError, match="budget_bytes should be enough for one row of length 60"):
        bucket_memory_kwargs(model, sizes, torch.tensor([0, 32, 64]), 5000)
    kwargs = bucket_memory_kwargs(model, torch.tensor([8, 9]), torch.tensor([0, 32, 64]), 5000)
    assert kwargs["max_total_size"][1] == 5000  # the empty bucket gets valid placeholder arguments
    assert kwargs["sizeof"][1](0) == 0.0


def test_a_small_model_trains_with_size_aware_batch_sampler_under_a_measured_budget(one_thread):
    from torch.utils.data import DataLoader, RandomSampler

    from dynabatch import track_peak_memory

    torch.manual_seed(0)
    vocab, width, padded = 500, 32, 24
    model = torch.nn.Sequential(torch.nn.Embedding(vocab, width), torch.nn.Linear(width, width), torch.nn.GELU(),
                                torch.nn.Linear(width, vocab))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(ids):
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), ids[:, 1:].reshape(-1), ignore_index=0)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    step(torch.randint(1, vocab, (2, padded)))  # warm-up
    shapes = [(r, padded) for r in (8, 16, 32)] + [(r, 12) for r in (16, 32)]
    features, peaks = collect_peak_alloc(
        shapes, lambda shape: (step(torch.randint(1, vocab, shape)), shape)[1], "cpu")
    mm = fit_memory_model(features, peaks, device="cpu", model=model)

    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(4, padded + 1, (120,), generator=generator).tolist()
    texts = [torch.randint(1, vocab, (n,), generator=generator) for n in lengths]
    budget = float(mm.predict(20, padded)) + 1  # a byte over 20 rows: float sums of 20 sizes reach it exactly
    sizeof = MemorySizeof(mm, lengths, padded_length=padded)  # every batch padded to `padded` tokens
    sampler = SizeAwareBatchSampler(RandomSampler(texts, generator=generator), sizeof, sizeof.max_total_size(budget))

    def collate(rows):
        out = torch.zeros(len(rows), padded, dtype=torch.long)
        for i, row in enumerate(rows):
            out[i, : len(row)] = row
        return out

    seen, losses = [], []
    for ids in DataLoader(texts, batch_sampler=sampler, collate_fn=collate):
        with track_peak_memory("cpu") as mem:
            losses.append(step(ids))
        assert mem.peak_bytes <= budget * (1 + mm.loo_error_ + 0.02)
        seen.append(len(ids))
    assert sum(seen) == 120 and max(seen) == 20  # every text once; full batches of the budget's rows
    assert len(losses) == 6 and np.isfinite(losses).all()  # random tokens: the loss need not fall


def test_a_shape_that_ran_out_of_memory_caps_both_sizeofs_at_the_rows_the_budget_allows(model):
    budget = MemoryBudget(model, 10**9, memory_margin=0.0)  # bytes alone would allow hundreds of rows
    budget.observe_out_of_memory(8, 64)
    cap = int(budget.rows_allowed(64))
    assert cap == 7
    lengths = [64] * 20
    sizeof = MemorySizeof(budget, lengths)
    batches = list(SizeAwareBatchSampler(range(20), sizeof, sizeof.max_total_size()))
    assert [len(b) for b in batches] == [7, 7, 6]  # the cap, not one row fewer
    kwargs = bucket_memory_kwargs(budget, lengths, [1, 65])
    bucketed = list(BucketBatchSampler(torch.tensor(lengths), torch.tensor([1, 65]), SizeAwareBatchSampler,
                                       base_batch_sampler_individual_kwargs=kwargs, shuffle=False))
    assert sorted(len(b) for b in bucketed) == [6, 7, 7]
