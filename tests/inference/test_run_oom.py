"""``run`` on real batches of real texts: out-of-memory recovery. Models are real (see conftest.py); nothing of dynabatch is mocked.
"""

import logging

import numpy as np
import pytest
import torch
from runner_helpers import (
    MAX_LEN,
    _cpu_oom,
    _embed_under_a_real_limit,
    _fails_at,
    _lengths,
    _load,
    _oom_over,
)

from dynabatch import BatchOutOfMemoryError, RunResult, run

pytestmark = pytest.mark.usefixtures("one_thread")


# --- out-of-memory recovery --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def same_width(tokenizer, same_width_texts):
    """A loader whose first batches all have one shape, and its results without out-of-memory errors."""
    loader = _load(same_width_texts, tokenizer, max_input_token_length=24)
    return loader, run(_lengths, loader, progress=False)


@pytest.mark.parametrize(
    ("max_rows", "error"), [(1, None), (2, _cpu_oom), (3, None)], ids=["1-cuda-oom", "2-cpu-allocator", "3-cuda-oom"]
)
def test_out_of_memory_batches_are_split_and_later_ones_pre_split(
    same_width, same_width_texts, max_rows, error, caplog
):
    loader, want = same_width
    shapes = [(len(b.indices), b["input_ids"].shape[1]) for b in loader]
    would_fail = sum(rows > max_rows for rows, _ in shapes)
    fn = _oom_over(_lengths, max_rows, error)
    with caplog.at_level(logging.INFO, logger="dynabatch.inference"):
        got = run(fn, loader, memory="off", progress=False)  # the plan's shapes, as they are
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    assert got.failed == []
    report = got.report
    assert report.oom_events == sum(rows > max_rows for rows, _ in fn.calls)  # every failed call counted
    assert report.oom_splits == report.oom_events  # each was split (none was a single row)
    # The plan learns: batches as large as a failed shape are split before they are tried.
    assert shapes.count(shapes[0]) > 10 and report.pre_split_batches >= shapes.count(shapes[0]) - 1
    assert report.oom_events < would_fail
    assert fn.calls.count(shapes[0]) == 1  # only the first batch of that shape was tried whole
    assert [r.pre_split for r in report.records][1 : shapes.count(shapes[0])] == [True] * (shapes.count(shapes[0]) - 1)
    assert report.rows == len(same_width_texts)
    logged = caplog.text
    assert "ran out of memory" in logged and "before trying it" in logged


def test_split_batches_give_the_same_model_outputs(tokenizer, minilm, texts):
    loader = _load(texts[:60], tokenizer)
    with torch.no_grad():
        want = run(lambda b: minilm(**b).last_hidden_state[:, 0], loader, progress=False)
        fn = _oom_over(lambda b: minilm(**b).last_hidden_state[:, 0], 2)
        got = run(fn, loader, progress=False)
    assert got.report.oom_events > 0
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    # Halves are trimmed to their longest row, never wider than the batch they came from.
    assert max(w for _, w in fn.calls) == MAX_LEN and len({w for r, w in fn.calls if r <= 2}) > 3


def test_a_genuine_cpu_out_of_memory_is_recovered(tokenizer, minilm, same_width_texts):
    loader = _load(same_width_texts[:60], tokenizer, max_input_token_length=24)
    limited = _embed_under_a_real_limit(minilm, loader)
    with torch.no_grad():
        got = run(limited, loader, memory="off", progress=False)  # the plan's shapes, as they are
        want = run(lambda b: minilm(**b).last_hidden_state[:, 0], loader, progress=False)
    assert got.report.oom_events >= 1 and got.report.pre_split_batches >= 1 and got.failed == []
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def test_a_single_row_that_fails_raises_with_the_partial_result(tokenizer, texts):
    loader = _load(texts, tokenizer)
    want = run(_lengths, loader, progress=False)
    position = int(loader.batch_sampler.batches[2][1])  # in the third batch
    with pytest.raises(BatchOutOfMemoryError, match=rf"input position {position} ran out of memory") as info:
        run(_fails_at(_lengths, position), loader, progress=False)
    error = info.value
    assert isinstance(error, RuntimeError) and error.position == position
    assert isinstance(error.__cause__, torch.OutOfMemoryError)
    partial = error.partial
    assert isinstance(partial, RunResult) and len(partial) == len(texts) and partial[position] is None
    finished = [p for p, r in enumerate(partial) if r is not None]
    first_two = sorted(int(p) for b in loader.batch_sampler.batches[:2] for p in b)
    assert set(first_two) < set(finished)  # the batches before it, and the rows of its batch that ran
    assert all(torch.equal(partial[p], want[p]) for p in finished)


def test_a_single_row_that_fails_is_skipped(tokenizer, texts, caplog):
    loader = _load(texts, tokenizer)
    want = run(_lengths, loader, progress=False)
    position = int(loader.batch_sampler.batches[1][0])
    with caplog.at_level(logging.WARNING, logger="dynabatch.inference"):
        got = run(_fails_at(_lengths, position), loader, on_oom="skip", progress=False)
    assert got.failed == [position] and got[position] is None
    assert all(torch.equal(got[p], want[p]) for p in range(len(texts)) if p != position)
    assert got.report.failed_rows == 1 and got.report.oom_events == got.report.oom_splits + 1
    assert f"input position {position} ran out of memory on its own" in caplog.text



def test_an_out_of_memory_error_a_wrapper_raised_from_splits_the_batch(tokenizer, texts):
    # It was fn's error: the run raised it (on_error="raise"), or set aside rows that fit alone, counting no split.
    loader = _load(texts, tokenizer)
    want = run(_lengths, loader, progress=False)
    over = _oom_over(_lengths, 2)
    got = run(lambda b: _call_wrapping(over, b), loader, memory="off", progress=False)
    assert got.failed == [] and all(torch.equal(a, b) for a, b in zip(got, want))
    assert got.report.oom_splits == got.report.oom_events > 0 and got.report.error_rows == 0
    position = int(loader.batch_sampler.batches[1][0])
    fails = _fails_at(_lengths, position)
    wrapped = run(lambda b: _call_wrapping(fails, b), loader, on_oom="skip", progress=False)
    assert wrapped.failed == [position] and wrapped.report.failed_rows == 1
    assert wrapped.failures[position].startswith("out of memory alone: RuntimeError: the model's forward failed")


def _call_wrapping(fn, batch):
    """``fn(batch)`` as a model wrapper calls it: its own error raised from an out-of-memory one."""
    try:
        return fn(batch)
    except torch.OutOfMemoryError as error:
        raise RuntimeError("the model's forward failed") from error


# --- learning from out-of-memory errors --------------------------------------------------------------------


@pytest.fixture(scope="module")
def row_limited(tokenizer, marian):
    """A real encoder forward on texts of many lengths, on a device where any call over 24 rows runs out of
    memory whatever its width (per-row memory the measured peaks do not show, as a large vocabulary's logits),
    and the results of the same loader without errors."""
    from dynabatch.demo import kjv_passages, vary_lengths

    texts = vary_lengths(kjv_passages(), n=400, max_words=120, seed=3)
    loader = _load(texts, tokenizer, batch_size=16, max_input_token_length=128, return_token_type_ids=False)
    encoder = marian.get_encoder()

    def encode(batch):
        return encoder(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state[:, 0]

    with torch.no_grad():
        want = run(encode, loader, progress=False)
    return loader, encode, want


def _over_24_rows(fn):
    return _oom_over(fn, 24, lambda: torch.OutOfMemoryError("CUDA out of memory (over 24 rows)"))


def test_after_out_of_memory_errors_measured_mode_plans_under_the_lower_limit(row_limited):
    loader, encode, want = row_limited
    fn = _over_24_rows(encode)
    with torch.no_grad():
        got = run(fn, loader, progress=False)  # measured mode: batches grow as the measured peaks fall
    assert got.failed == [] and len(got) == len(want)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    rows = [r.rows for r in got.report.records]
    failed = [i for i, r in enumerate(got.report.records) if r.oom_events]
    assert got.report.oom_events <= 5  # without learning: 14 errors in 9 batches, each grown 2x past the last
    assert max(rows[: failed[0]]) <= 24 < rows[failed[0]]  # the first batch over the real limit failed ...
    assert max(rows[failed[-1] + 1 :]) == 24  # ... and the batches after the last error grew to the most that fit



def test_a_row_too_large_alone_teaches_no_limit(tokenizer, texts):
    # Its batch's errors and its own were taken as the device's limit: every later batch ran one row at a time.
    loader = _load(texts, tokenizer)
    want = run(_lengths, loader, progress=False)  # measured mode
    position = int(loader.batch_sampler.batches[1][0])
    got = run(_fails_at(_lengths, position), loader, on_oom="skip", progress=False)
    assert got.failed == [position] and got.report.failed_rows == 1
    assert all(torch.equal(got[p], want[p]) for p in range(len(texts)) if p != position)
    sizes, plain = [r.rows for r in got.report.records], [r.rows for r in want.report.records]
    assert sizes == plain, (sizes, plain)
    # Rows too wide for the device, where nothing as wide ran: the width may be what fails, so later rows as
    # wide run alone at once, not in halves first.
    wide = _oom_over(_lengths, 0)
    got = run(lambda b: wide(b) if b["input_ids"].shape[1] >= 40 else _lengths(b), loader, on_oom="skip",
              progress=False)
    assert got.report.failed_rows == len(got.failed) > 10
    assert got.report.oom_events <= 1.5 * got.report.failed_rows, (got.report.oom_events, got.report.failed_rows)


def test_after_out_of_memory_errors_guarded_mode_caps_rows_under_the_lower_limit(row_limited):
    loader, encode, want = row_limited
    order, collate = loader.plan.planner.order, loader.plan.collator
    sizes = [16] + [40] * 9  # a plain iterable: a first batch of the longest texts, then large batches
    starts = np.cumsum([0, *sizes, len(order) - sum(sizes)])
    batches = [collate(order[a:b]) for a, b in zip(starts[:-1], starts[1:])]
    fn = _over_24_rows(encode)
    with torch.no_grad():
        got = run(fn, batches, progress=False)  # guarded mode: batches are split, never re-planned
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert got.report.oom_events <= 5 and got.report.pre_split_batches >= 5
    last = max(i for i, (rows, _) in enumerate(fn.calls) if rows > 24)
    assert max(rows for rows, _ in fn.calls[last + 1 :]) <= 24 and min(rows for rows, _ in fn.calls[last + 1 :]) >= 10
    assert len(fn.calls) <= 2 * len(batches) + 2 * got.report.oom_events  # two calls a batch, and the failed ones
