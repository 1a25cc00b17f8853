import copy
import math
import os
import re
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from dynabatch import Batch, build_dynamic_batch_dataloader
from dynabatch.memory.features import FEATURE_NAMES

MAX_LEN = 64
BATCH_SIZE = 4


@pytest.fixture(scope="module")
def texts():
    from dynabatch.demo import kjv_passages, vary_lengths

    varied = vary_lengths(kjv_passages(), n=150, max_words=80, seed=2)
    # Duplicates (of a long and of a short text) and empty strings are valid texts.
    return varied + ["", varied[0], "And God said", "", "And God said", varied[0]]


def _lengths(tokenizer, texts, max_len=MAX_LEN, **kwargs):
    return [len(tokenizer(t, truncation=True, max_length=max_len, **kwargs)["input_ids"]) for t in texts]


@pytest.fixture(scope="module")
def lengths(tokenizer, texts):
    return _lengths(tokenizer, texts)


def _load(texts, tokenizer, **kwargs):
    kwargs.setdefault("batch_size", BATCH_SIZE)
    kwargs.setdefault("max_input_token_length", MAX_LEN)
    kwargs.setdefault("num_workers", 0)
    return build_dynamic_batch_dataloader(texts, tokenizer, **kwargs)


@pytest.fixture(scope="module")
def batches(tokenizer, texts):
    return list(_load(texts, tokenizer))


def _all_indices(batches):
    return sorted(i for b in batches for i in b.indices.tolist())


# --- the DataLoader ---------------------------------------------------------------------------------


def test_returns_a_plain_dataloader(tokenizer, texts):
    loader = _load(texts, tokenizer)
    assert type(loader) is DataLoader
    assert loader.num_workers == 0
    assert _load(texts, tokenizer, num_workers=2).num_workers == min(2, len(os.sched_getaffinity(0)))
    assert len(loader) == len(list(loader)) > 1


def test_worker_processes_give_the_same_batches(tokenizer, texts, batches):
    with_workers = list(_load(texts, tokenizer, num_workers=2))
    assert [b.indices.tolist() for b in with_workers] == [b.indices.tolist() for b in batches]
    for got, want in zip(with_workers, batches):
        assert isinstance(got, Batch)
        assert got.texts == want.texts
        assert all(torch.equal(got[k], want[k]) for k in want)


def test_every_text_comes_out_exactly_once(texts, batches):
    assert _all_indices(batches) == list(range(len(texts)))
    assert all(isinstance(b, Batch) and b.indices.dtype == torch.long for b in batches)


def test_fewer_texts_than_batch_size_make_one_batch(tokenizer):
    few = ["In the beginning", "", "And God said, Let there be light"]
    (batch,) = list(_load(few, tokenizer, batch_size=8))
    assert sorted(batch.indices.tolist()) == [0, 1, 2]
    assert batch.indices.tolist() == [2, 0, 1]  # longest first
    assert batch.texts == [few[2], few[0], few[1]]
    assert batch["attention_mask"].sum(dim=1).tolist() == [10, 5, 2]


def test_a_single_text(tokenizer):
    (batch,) = list(_load(["In the beginning"], tokenizer))
    assert batch["input_ids"].tolist() == [[101, 1999, 1996, 2927, 102]]
    assert batch.indices.tolist() == [0]


def test_first_batch_is_the_batch_size_longest_texts(batches, lengths):
    first = batches[0].indices.tolist()
    assert len(first) == BATCH_SIZE
    rest = [lengths[i] for b in batches[1:] for i in b.indices.tolist()]
    assert min(lengths[i] for i in first) >= max(rest)
    assert batches[0]["input_ids"].shape == (BATCH_SIZE, MAX_LEN)  # these texts are truncated to the limit


def test_later_batches_have_at_least_batch_size_rows_but_the_last(batches, texts):
    sizes = [len(b.indices) for b in batches]
    assert all(size >= BATCH_SIZE for size in sizes[:-1])
    assert 1 <= sizes[-1]
    assert max(sizes) > BATCH_SIZE  # batches grow as texts get shorter
    assert max(sizes) <= math.ceil(BATCH_SIZE * 6.0)  # batch_end_range's default
    assert sum(sizes) == len(texts)


def test_batches_run_longest_to_shortest(batches, lengths):
    widths = [b["input_ids"].shape[1] for b in batches]
    assert widths == sorted(widths, reverse=True)


# --- shapes and contents ----------------------------------------------------------------------------


def test_collated_rows_are_the_truncated_tokenization(tokenizer, texts, batches, lengths):
    for batch in batches:
        rows = batch.indices.tolist()
        assert batch["input_ids"].shape[1] == max(lengths[i] for i in rows)
        assert batch["attention_mask"].sum(dim=1).tolist() == [lengths[i] for i in rows]
        for row, i in zip(batch["input_ids"].tolist(), rows):
            expected = tokenizer(texts[i], truncation=True, max_length=MAX_LEN)["input_ids"]
            assert row == expected + [tokenizer.pad_token_id] * (len(row) - len(expected))


def test_the_batch_is_tensors_only_and_knows_its_texts(texts, batches):
    for batch in batches:
        assert sorted(batch) == ["attention_mask", "input_ids", "token_type_ids"]
        assert all(isinstance(value, torch.Tensor) and value.dtype == torch.long for value in batch.values())
        assert batch.texts == [texts[i] for i in batch.indices.tolist()]


def test_tokenizer_kwargs_apply_to_planning_and_collating(tokenizer, texts):
    # A limit no text reaches, so that dropping the special tokens shrinks every row by exactly 2; without them an
    # empty text holds no token (a bad input), so they are left out.
    texts = [t for t in texts if t]
    limit = 256
    with_special = _lengths(tokenizer, texts, limit)
    assert max(with_special) < limit
    batches = list(_load(texts, tokenizer, max_input_token_length=limit, add_special_tokens=False))
    assert _all_indices(batches) == list(range(len(texts)))
    for batch in batches:
        rows = batch.indices.tolist()
        shrunk = [with_special[i] - 2 for i in rows]
        assert batch["attention_mask"].sum(dim=1).tolist() == shrunk
        assert batch["input_ids"].shape[1] == max(shrunk)
        ids = batch["input_ids"][batch["attention_mask"].bool()]
        assert not ({tokenizer.cls_token_id, tokenizer.sep_token_id} & set(ids.tolist()))


def test_tokenizer_kwargs_can_drop_token_type_ids(tokenizer, texts):
    batch = next(iter(_load(texts[:20], tokenizer, return_token_type_ids=False)))
    assert sorted(batch) == ["attention_mask", "input_ids"]


@pytest.mark.parametrize("multiple", [8, 5])
def test_pad_to_multiple_of(tokenizer, texts, lengths, multiple):
    batches = list(_load(texts, tokenizer, pad_to_multiple_of=multiple))
    assert _all_indices(batches) == list(range(len(texts)))
    for batch in batches:
        rows = batch.indices.tolist()
        width = batch["input_ids"].shape[1]
        assert width % multiple == 0
        assert width - multiple < max(lengths[i] for i in rows) <= width
        assert batch["attention_mask"].sum(dim=1).tolist() == [lengths[i] for i in rows]


def test_left_padding_follows_the_tokenizer(tokenizer, texts, lengths):
    left = copy.deepcopy(tokenizer)
    left.padding_side = "left"
    for batch in list(_load(texts, left))[:5]:
        expected = left(batch.texts, padding=True, truncation=True, max_length=MAX_LEN, return_tensors="pt")
        assert all(torch.equal(batch[k], expected[k]) for k in expected)


# --- input containers -------------------------------------------------------------------------------


def test_pandas_series_input_uses_positions_not_labels(tokenizer, texts, batches):
    import pandas as pd

    series = pd.Series(texts, index=range(1000, 1000 + len(texts)))
    got = list(_load(series, tokenizer))
    assert [b.indices.tolist() for b in got] == [b.indices.tolist() for b in batches]
    for batch in got:
        assert batch.texts == [series.iloc[i] for i in batch.indices.tolist()]


def test_tuple_and_numpy_input(tokenizer, texts, batches):
    for container in (tuple(texts), np.array(texts)):
        got = list(_load(container, tokenizer))
        assert [b.indices.tolist() for b in got] == [b.indices.tolist() for b in batches]
        assert all(type(t) is str for b in got for t in b.texts)


# --- shuffle and the classifier ---------------------------------------------------------------------


def test_shuffle_keeps_the_first_batch_first_and_is_seeded(tokenizer, texts, batches):
    planned = [b.indices.tolist() for b in batches]
    shuffled = [b.indices.tolist() for b in _load(texts, tokenizer, shuffle=True, seed=3)]
    assert shuffled[0] == planned[0]
    assert sorted(shuffled) == sorted(planned)
    assert shuffled != planned
    again = [b.indices.tolist() for b in _load(texts, tokenizer, shuffle=True, seed=3)]
    assert again == shuffled


def test_resuming_mid_epoch_through_the_dataloader(tokenizer, texts):
    loader = _load(texts, tokenizer, shuffle=True, seed=5)
    loader.batch_sampler.set_epoch(2)
    it = iter(loader)
    seen = [next(it).indices.tolist() for _ in range(3)]
    state = loader.batch_sampler.state_dict()
    assert state["batches_done"] == 3  # num_workers=0: nothing is fetched ahead
    rest = [b.indices.tolist() for b in it]

    again = _load(texts, tokenizer, shuffle=True, seed=5)
    again.batch_sampler.load_state_dict(state)
    assert [b.indices.tolist() for b in again] == rest
    assert sorted(seen + rest) == sorted(b.indices.tolist() for b in again)  # then a full epoch


def test_a_saved_position_is_refused_for_other_texts(tokenizer, texts):
    state = _load(texts, tokenizer).batch_sampler.state_dict()
    other = _load(texts[:-1], tokenizer)
    with pytest.raises(ValueError, match=r"^state should come from a sampler over the same plan .*: the texts, tokenizer or planning arguments differ$"):
        other.batch_sampler.load_state_dict(state)


class _Constant:
    """An estimator whose spike probability is always ``p``."""

    def __init__(self, p):
        self.p = p

    def predict_proba(self, X):
        n = len(X)
        return np.column_stack([np.full(n, 1 - self.p), np.full(n, self.p)])


def test_a_classifier_that_always_spikes_keeps_batch_size(tokenizer, texts):
    sizes = [len(b.indices) for b in _load(texts, tokenizer, classifier=_Constant(0.9))]
    assert sizes == [BATCH_SIZE] * (len(texts) // BATCH_SIZE) + ([len(texts) % BATCH_SIZE] if len(texts) % BATCH_SIZE else [])


def test_a_classifier_that_never_spikes_takes_the_largest_candidate(tokenizer, texts):
    batches = list(_load(texts, tokenizer, classifier=_Constant(0.0), batch_end_range=3.0))
    sizes = [len(b.indices) for b in batches]
    assert sizes[0] == BATCH_SIZE
    assert all(size == 3 * BATCH_SIZE for size in sizes[1:-1])
    assert 1 <= sizes[-1] <= 3 * BATCH_SIZE
    assert _all_indices(batches) == list(range(len(texts)))


def test_threshold_decides_what_is_safe(tokenizer, texts):
    # p=0.5: unsafe under the default threshold, safe under threshold=0.5.
    unsafe = [len(b.indices) for b in _load(texts, tokenizer, classifier=_Constant(0.5))]
    safe = [len(b.indices) for b in _load(texts, tokenizer, classifier=_Constant(0.5), threshold=0.5)]
    assert max(unsafe[:-1]) == BATCH_SIZE
    assert max(safe) == 6 * BATCH_SIZE


def test_a_classifier_fitted_on_the_feature_names(tokenizer, texts):
    import pandas as pd
    from sklearn.linear_model import LogisticRegression

    X = pd.DataFrame(np.random.default_rng(0).uniform(1, 100, size=(40, len(FEATURE_NAMES))), columns=list(FEATURE_NAMES))
    clf = LogisticRegression().fit(X, np.arange(40) % 2)
    batches = list(_load(texts, tokenizer, classifier=clf))
    assert len(batches[0].indices) == BATCH_SIZE
    assert _all_indices(batches) == list(range(len(texts)))


# --- errors -----------------------------------------------------------------------------------------


def test_empty_texts(tokenizer):
    with pytest.raises(ValueError, match=r"^texts should be a non-empty sequence of str, but got texts=\[\]$"):
        _load([], tokenizer)
    with pytest.raises(ValueError, match=r"^texts should be a non-empty sequence of str, but got texts=\(\)$"):
        _load((), tokenizer)


@pytest.mark.parametrize("stream", [None, True, False])
def test_a_generator_read_once_already_is_refused_naming_texts_and_why(tokenizer, stream):
    # A second loader built from the generator the first one read: the error named source (read_texts' argument, not
    # this function's) and said nothing of a generator yielding its texts once (found probing a generator of texts
    # read twice)
    texts = (text for text in ["In the beginning", "And God said"])
    assert sum(len(b.indices) for b in _load(texts, tokenizer, stream=stream)) == 2
    with pytest.raises(ValueError, match=r"^texts should hold at least one text, but got an iterable that yielded "
                                         r"none \(an iterator or generator yields its texts once: .*make a new one"):
        _load(texts, tokenizer, stream=stream)


def test_texts_of_the_wrong_type(tokenizer):
    with pytest.raises(TypeError, match=r"^texts should be a list of str \(or a tuple, pandas Series, numpy array or other non-str sequence of str\), but got texts='In the beginning' of type str$"):
        _load("In the beginning", tokenizer)
    with pytest.raises(TypeError, match=r"^texts should be a list of str .*, but got texts=42 of type int$"):
        _load(42, tokenizer)


def test_a_generator_of_texts_is_read_once_and_streamed(tokenizer, texts):
    loader = _load((t for t in texts), tokenizer)
    assert loader.plan.stream is not None
    assert _all_indices(list(loader)) == list(range(len(texts)))


def test_a_non_str_item_is_named_by_position(tokenizer):
    with pytest.raises(TypeError, match=r"^texts\[2\] should be a str, but got texts\[2\]=3 of type int; 1 of 4 texts "
                       r"are not str \(positions 2\): clean them, or pass on_bad_input='skip' to skip "
                       r"them"):
        _load(["a", "b", 3, "d"], tokenizer)
    with pytest.raises(TypeError, match=r"^texts\[1\] should be a str, but got texts\[1\]=None of type NoneType; 1 of 2"):
        _load(["a", None], tokenizer)


def test_bad_inputs_skipped_are_planned_into_no_batch(tokenizer, texts, caplog):
    dirty = list(texts[:30])
    for p in (0, 7, 29):
        dirty[p] = None
    loader = _load(dirty, tokenizer, on_bad_input="skip")
    assert loader.plan.skipped.tolist() == [0, 7, 29]
    assert sorted(int(i) for b in loader for i in b.indices) == sorted(set(range(30)) - {0, 7, 29})
    assert "skipping 3 of 30 texts that are not str (positions 0, 7, 29)" in caplog.text
    with pytest.raises(ValueError, match=r"^on_bad_input should be 'raise' or 'skip', but got on_bad_input='drop'$"):
        _load(dirty, tokenizer, on_bad_input="drop")
    with pytest.raises(TypeError, match=r"^on_bad_input should be 'raise' or 'skip', but got on_bad_input=None"):
        _load(dirty, tokenizer, on_bad_input=None)


@pytest.mark.parametrize("n, stream", [(2, False), (2, True), (600, True)])  # 600: past the stream's first chunk
def test_with_skip_and_every_text_bad_the_plan_has_no_batch_and_every_position_skipped(tokenizer, caplog, n, stream):
    # the loader refused: "texts should hold at least one str", where skip promises every input listed failed
    loader = _load([None, 3] * (n // 2), tokenizer, on_bad_input="skip", stream=stream)
    assert loader.plan.skipped.tolist() == list(range(n)) and list(loader) == []
    assert f"skipping {n} of {n} texts that are not str (positions 0, 1" in caplog.text


@pytest.mark.parametrize("stream", [False, True, None])  # None: streamed above STREAM_ABOVE (set to 3 here)
def test_a_text_of_no_token_is_a_bad_input_by_on_bad_input(tokenizer, caplog, monkeypatch, stream):
    # planned into a batch of width 0: a mean pooling stored NaN and the run reported success
    from dynabatch import run
    from dynabatch.inference import loader as loader_module

    monkeypatch.setattr(loader_module, "STREAM_ABOVE", 3)
    texts = ["", "hello world", None, "   ", "a b c d"]
    with pytest.raises(ValueError, match=r"^texts\[0\] should be at least one token \(a row of no token is padding "
                                         r"alone.*but got texts\[0\]='', of no token; 2 of .* hold no token "
                                         r"\(positions 0, 3\): keep the tokenizer's special tokens"):
        run(len, _load(["x" if t is None else t for t in texts], tokenizer, add_special_tokens=False, stream=stream), progress=False)
    loader = _load(texts, tokenizer, add_special_tokens=False, stream=stream, on_bad_input="skip")
    assert (loader.plan.stream is not None) == (stream is not False)

    def mean(batch):
        mask = batch["attention_mask"].float()
        return mask.sum(1, keepdim=True) / mask.sum(1, keepdim=True)

    got = run(mean, loader, progress=False)
    assert got.failed == [0, 2, 3] and got.report.skipped_inputs == 3
    assert got[1].tolist() == got[4].tolist() == [1.0]
    assert got.failures[0] == got.failures[3] == "bad input: no token once tokenized (the loader skipped it, " \
                                                 "on_bad_input='skip')"
    assert "not a str" in got.failures[2] and "that hold no token (positions 0, 3)" in caplog.text
    # pre-tokenized rows of no token follow the same rule
    with pytest.raises(ValueError, match=r"^texts\[1\] should be at least one token .* texts\[1\]=\[\], of no token"):
        _load([[101, 102], [], [7]], tokenizer)
    got = run(mean, _load([[101, 102], [], [7]], tokenizer, on_bad_input="skip"), progress=False)
    assert got.failed == [1] and "no token" in got.failures[1]


def test_texts_name_is_what_errors_call_the_texts(tokenizer):
    # a function building the loader from its own argument (generate's prompts) names that argument
    with pytest.raises(ValueError, match=r"^prompts\[1\] should be at least one token .* 1 of 2 prompts hold no token "
                                         r"\(positions 1\): .* fill the empty prompts, or pass on_bad_input='skip'"):
        _load(["hello", ""], tokenizer, add_special_tokens=False, texts_name="prompts")
    with pytest.raises(TypeError, match=r"^texts_name should be a str, the name of an argument \(such as 'prompts'\), "
                                        r"but got texts_name=3 of type int$"):
        _load(["hello"], tokenizer, texts_name=3)
    with pytest.raises(ValueError, match=r"^texts_name should be the name of an argument \(such as 'prompts'\), but "
                                         r"got texts_name='my prompts'$"):
        _load(["hello"], tokenizer, texts_name="my prompts")


def test_ids_are_one_per_text_and_carried_by_the_plan(tokenizer, texts):
    loader = _load(texts[:5], tokenizer, ids=[10, 11, 12, 13, 14])
    assert loader.plan.ids.to_pylist() == [10, 11, 12, 13, 14]
    assert _load(texts[:5], tokenizer).plan.ids is None
    with pytest.raises(ValueError, match=r"^len\(ids\) should be len\(texts\)=5, one id per text, but got len\(ids\)=4$"):
        _load(texts[:5], tokenizer, ids=[1, 2, 3, 4])
    with pytest.raises(ValueError, match=r"ids should be unique"):
        _load(texts[:2], tokenizer, ids=["a", "a"])


@pytest.mark.parametrize(
    ("value", "error", "got"),
    [
        (0, ValueError, r"batch_size=0"),
        (-1, ValueError, r"batch_size=-1"),
        (2.5, TypeError, r"batch_size=2\.5 of type float"),
        (True, TypeError, r"batch_size=True of type bool"),
    ],
)
def test_bad_batch_size(tokenizer, texts, value, error, got):
    with pytest.raises(error, match=rf"^batch_size should be a positive integer, but got {got}$"):
        _load(texts[:10], tokenizer, batch_size=value)


def test_bad_max_input_token_length(tokenizer, texts):
    with pytest.raises(ValueError, match=r"^max_input_token_length should be a positive integer, but got max_input_token_length=0$"):
        _load(texts[:10], tokenizer, max_input_token_length=0)


@pytest.mark.parametrize("value", [-0.1, 1.5])
def test_bad_threshold(tokenizer, texts, value):
    with pytest.raises(ValueError, match=rf"^threshold should be a number in \[0, 1\], but got threshold={re.escape(repr(value))}$"):
        _load(texts[:10], tokenizer, threshold=value)


def test_bad_ranges_and_steps(tokenizer, texts):
    with pytest.raises(ValueError, match=r"^batch_start_range should be a finite number >= 1 \(the first batch is the smallest\), but got batch_start_range=0\.5$"):
        _load(texts[:10], tokenizer, batch_start_range=0.5)
    with pytest.raises(ValueError, match=r"^batch_end_range should be a finite number >= batch_start_range=2\.0, but got batch_end_range=1\.5$"):
        _load(texts[:10], tokenizer, batch_start_range=2.0, batch_end_range=1.5)
    with pytest.raises(ValueError, match=r"^steps should be a positive integer, but got steps=0$"):
        _load(texts[:10], tokenizer, steps=0)


@pytest.mark.parametrize("value", [float("inf"), 1e30])
def test_a_non_finite_or_huge_batch_end_range_is_refused(tokenizer, texts, value):
    with pytest.raises(ValueError, match=r"^batch_end_range should be (a finite number|at most)"):
        _load(texts[:10], tokenizer, batch_end_range=value)


def test_a_max_tokens_the_first_batch_cannot_keep_is_refused_with_the_numbers(tokenizer, texts):
    with pytest.raises(TypeError, match=r"^max_tokens should be a positive integer, but got max_tokens=1\.5 of type"):
        _load(texts[:10], tokenizer, max_tokens=1.5)
    longest = max(len(tokenizer(t, truncation=True, max_length=MAX_LEN)["input_ids"]) for t in texts[:10])
    first = 4 * longest
    with pytest.raises(ValueError, match=rf"^max_tokens should be at least 4 x {longest} = {first} padded tokens \(the "
                                         rf"first batch, the batch_size=4 longest texts {longest} tokens wide\); pass a "
                                         rf"larger max_tokens, .*, but got max_tokens={first - 1}$"):
        _load(texts[:10], tokenizer, max_tokens=first - 1)
    loader = _load(texts[:10], tokenizer, max_tokens=first)  # exactly the first batch
    assert loader.plan.planner.settings.max_tokens == first


def test_planning_arguments_are_checked_before_any_tokenizing(texts):
    def tokenizer(*args, **kwargs):
        raise AssertionError("tokenized before the arguments were checked")

    tokenizer.pad_token_id = 0
    with pytest.raises(ValueError, match=r"^batch_size should be a positive integer, but got batch_size=0$"):
        build_dynamic_batch_dataloader(texts[:10], tokenizer, batch_size=0, max_input_token_length=16)


def test_a_missing_classifier_file(tokenizer, texts, tmp_path):
    missing = str(tmp_path / "nope.pkl")
    with pytest.raises(ValueError, match=rf"^classifier should be the path of an existing classifier file, but got classifier={re.escape(repr(missing))}$"):
        _load(texts[:10], tokenizer, classifier=missing)


class _RefusingCall:
    """Mixed into a copy of the tokenizer: its own call (which the loader then goes through) raises."""

    def __call__(self, text, *args, **kwargs):
        raise RuntimeError("this tokenizer refuses")


@pytest.mark.parametrize("fault", ["classifier", "tokenizer"])
def test_what_loads_beside_the_tokenizer_raises_its_own_error_and_leaves_no_thread(tokenizer, texts, fault):
    import threading

    from dynabatch.memory.classifier import load_classifier

    if fault == "classifier":  # a shape-aware classifier without a model shape: refused as it loads
        args, match = (tokenizer,), r"^model_shape should be a ModelShape for a classifier fitted on memory_ratio"
        kwargs = {"classifier": load_classifier(shape=True)}
    else:  # the tokenizer fails while the classifier loads beside it
        refusing = copy.deepcopy(tokenizer)
        refusing.__class__ = type("Refusing", (_RefusingCall, type(tokenizer)), {})
        args, match, kwargs = (refusing,), r"^this tokenizer refuses$", {}
    with pytest.raises(ValueError if fault == "classifier" else RuntimeError, match=match):
        _load(texts, *args, progress=False, **kwargs)
    assert not [t for t in threading.enumerate() if t.name == "dynabatch-plan-prepare"]


def test_bad_num_workers_and_shuffle(tokenizer, texts):
    with pytest.raises(ValueError, match=r"^num_workers should be a non-negative integer, but got num_workers=-1$"):
        _load(texts[:10], tokenizer, num_workers=-1)
    with pytest.raises(TypeError, match=r"^num_workers should be a non-negative integer, but got num_workers=1\.0 of type float$"):
        _load(texts[:10], tokenizer, num_workers=1.0)
    with pytest.raises(TypeError, match=r"^shuffle should be a bool, but got shuffle='yes' of type str$"):
        _load(texts[:10], tokenizer, shuffle="yes")
    with pytest.raises(TypeError, match=r"^progress should be a bool, but got progress='no' of type str$"):
        _load(texts[:10], tokenizer, progress="no")  # was taken as truthy: the bar showed, as run refused it


def test_tokenize_cores_is_its_own_argument(tokenizer, texts):
    with pytest.raises(ValueError, match=r"^tokenize_cores should be a positive integer, but got tokenize_cores=0$"):
        _load(texts[:10], tokenizer, tokenize_cores=0)

    def rows(loader):
        return {int(i): ids[mask.bool()].tolist() for b in loader
                for i, ids, mask in zip(b.indices, b["input_ids"], b["attention_mask"])}

    one = rows(_load(texts[:40], tokenizer, tokenize_cores=1))
    assert one == rows(_load(texts[:40], tokenizer)) == rows(_load(texts[:40], tokenizer, stream=True, tokenize_cores=1))


def test_tokenizer_without_pad_token(tokenizer, texts):
    no_pad = copy.deepcopy(tokenizer)
    no_pad.pad_token = None
    assert no_pad.pad_token_id is None
    with pytest.raises(ValueError, match=r"^tokenizer should have a pad token \(set one, e\.g\. tokenizer\.pad_token = tokenizer\.eos_token\), but got tokenizer\.pad_token_id=None$"):
        _load(texts[:10], no_pad)
    # The fix the message suggests works.
    no_pad.pad_token = no_pad.sep_token
    assert _all_indices(list(_load(texts[:10], no_pad))) == list(range(10))


@pytest.mark.parametrize(
    ("key", "value", "reason"),
    [
        ("max_length", 10, "dynabatch sets it from max_input_token_length"),
        ("padding", True, "dynabatch pads each batch itself"),
        ("truncation", False, "dynabatch always truncates to max_input_token_length"),
        ("return_tensors", "pt", "dynabatch builds the tensors of each batch itself"),
    ],
)
def test_forbidden_tokenizer_kwargs(tokenizer, texts, key, value, reason):
    pattern = rf"^tokenizer_kwargs should not set '{key}' \({reason}\), but got tokenizer_kwargs={re.escape(repr({key: value}))}$"
    with pytest.raises(ValueError, match=pattern):
        _load(texts[:10], tokenizer, **{key: value})


def test_a_classifier_fitted_on_other_feature_names(tokenizer, texts):
    import pandas as pd
    from sklearn.linear_model import LogisticRegression

    columns = [f"x{i}" for i in range(len(FEATURE_NAMES))]
    X = pd.DataFrame(np.random.default_rng(0).normal(size=(20, len(columns))), columns=columns)
    clf = LogisticRegression().fit(X, np.arange(20) % 2)
    expected = re.escape(f"classifier should be fitted on the features {list(FEATURE_NAMES)} (and optionally "
                         f"'memory_ratio_estimate'), but got classifier={columns}")
    with pytest.raises(ValueError, match=rf"^{expected}$"):
        _load(texts[:10], tokenizer, classifier=clf)


def test_a_classifier_of_the_wrong_type(tokenizer, texts):
    with pytest.raises(TypeError, match=r"^classifier should be a path or a fitted estimator with predict_proba, but got classifier=42 of type int$"):
        _load(texts[:10], tokenizer, classifier=42)


def test_a_hugging_face_datasets_column_is_accepted(tokenizer, texts):
    datasets = pytest.importorskip("datasets")
    column = datasets.Dataset.from_dict({"text": texts[:40]})["text"]
    loader = _load(column, tokenizer)
    seen = sorted(i for batch in loader for i in batch.indices.tolist())
    assert seen == list(range(40))
    for batch in loader:
        assert batch.texts == [texts[i] for i in batch.indices.tolist()]


def test_the_model_shape_plans_with_the_shape_aware_classifier(tokenizer):
    from dynabatch import ModelShape
    from dynabatch.demo import kjv_passages

    texts = kjv_passages()[:3000]
    forward = build_dynamic_batch_dataloader(texts, tokenizer, 8, 128, num_workers=0,
                                             model_shape=ModelShape(30522, 384))
    beams = build_dynamic_batch_dataloader(texts, tokenizer, 8, 128, num_workers=0,
                                           model_shape=ModelShape(256206, 1024, max_new_tokens=64, num_beams=4))
    for loader in (forward, beams):
        assert sorted(i for b in loader.batch_sampler for i in b) == list(range(len(texts)))
    # a per-row part that length does not shrink (logits of 4 beams over 256k tokens) means smaller batches
    assert len(beams) > len(forward)


def test_a_model_instead_of_its_shape_is_refused_before_tokenizing(tokenizer):
    with pytest.raises(TypeError, match=r"model_shape should be a ModelShape \(ModelShape.from_model\(model, "
                                        r"\.\.\.\)\) or None, but got model_shape='t5-small'"):
        build_dynamic_batch_dataloader(["a"], tokenizer, 1, 8, model_shape="t5-small")


# --- the plan it carries; a memory model; the model itself ---------------------------------------------


def test_the_loader_carries_its_plan(tokenizer, texts):
    from dynabatch.inference.loader import LoaderPlan, plan_of

    loader = _load(texts, tokenizer)
    assert isinstance(loader.plan, LoaderPlan) and plan_of(loader) is loader.plan
    assert loader.plan.sampler is loader.batch_sampler and loader.plan.collator is loader.collate_fn
    assert [b.tolist() for b in loader.plan.planner.batches()] == [list(b) for b in loader.batch_sampler]
    assert plan_of(list(loader)) is None


def test_the_model_gives_its_shape(tokenizer, texts):
    from transformers import BertConfig

    from dynabatch import ModelShape

    config = BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=2)
    by_model = _load(texts, tokenizer, model=config)
    by_shape = _load(texts, tokenizer, model_shape=ModelShape.from_model(config))
    assert by_model.plan.planner.settings.model_shape == ModelShape(30522, 64)
    assert [list(b) for b in by_model.batch_sampler] == [list(b) for b in by_shape.batch_sampler]
    with pytest.raises(ValueError, match=r"^model should be None when model_shape is given"):
        _load(texts, tokenizer, model=config, model_shape=ModelShape(30522, 64))
    with pytest.raises(TypeError, match=r"^model should be a transformers model or config"):
        _load(texts, tokenizer, model="bert")


def _memory_model(peak):
    from dynabatch.memory.model import MemoryModel

    shapes = [(4, 64), (4, 16), (16, 8), (8, 32), (2, 64), (32, 4), (16, 64), (256, 4), (128, 16)]
    return MemoryModel().fit(*zip(*shapes), [peak(r, n) for r, n in shapes])


def test_a_memory_model_plans_to_its_budget(tokenizer, texts):
    from dynabatch.sampling.estimators import plan_batches_to_budget

    def peak(rows, length):
        return 10_000 + rows * (300 + 20 * length)

    mm = _memory_model(peak)
    relative = _load(texts, tokenizer, memory_model=mm)
    want = plan_batches_to_budget(relative.plan.planner.lengths, mm, batch_size=BATCH_SIZE)
    assert [list(b) for b in relative.batch_sampler] == [b.tolist() for b in want]
    budget = peak(BATCH_SIZE, max(relative.plan.planner.lengths))
    for batch in relative:
        rows, width = batch["input_ids"].shape
        assert peak(rows, width) <= budget
    absolute = _load(texts, tokenizer, memory_model=mm, max_memory=50_000, memory_margin=0.0, granularity=2)
    for batch in absolute:
        assert peak(*batch["input_ids"].shape) <= 50_000
    assert sorted(i for b in absolute.batch_sampler for i in b) == list(range(len(texts)))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"max_memory": "150%"}, ValueError,
         r"^max_memory should be a percentage in \(0%, 100%\] of the device's free memory, but got max_memory='150%'$"),
        ({"max_memory": "90%"}, ValueError, (r"^max_memory should be bytes or a size such as '20GB' on cpu \(no "
                                             r"device memory is known there: a percentage is a share of a device's "
                                             r"free memory\), but got max_memory='90%'$")),
        ({"memory_model": "mm", "max_memory": "12XB"}, ValueError, r"^max_memory should be .*'12XB'$"),
        ({"memory_model": "mm", "max_memory": -1}, ValueError, r"^max_memory should be .*max_memory=-1$"),
        ({"memory_model": "mm", "memory_margin": 1.0}, ValueError,
         r"^memory_margin should be a number in \[0, 1\), but got memory_margin=1\.0$"),
        ({"memory_model": "mm", "granularity": 0}, ValueError,
         r"^granularity should be a positive integer, but got granularity=0$"),
        ({"memory_model": {"coef": 1}}, TypeError, r"^memory_model should be a MemoryModel"),
    ],
)
def test_bad_memory_options_are_named(tokenizer, kwargs, error, match):
    if kwargs.get("memory_model") == "mm":
        kwargs["memory_model"] = _memory_model(lambda r, n: 100 + r * n)
    with pytest.raises(error, match=match):
        build_dynamic_batch_dataloader(["a", "b"], tokenizer, 1, 8, **kwargs)


# --- the errors a new user hits (issue 15) ------------------------------------------------------------


def test_a_missing_tokenizer_or_a_model_name_is_not_a_tokenizer(texts):
    with pytest.raises(TypeError, match=r"^tokenizer should be a tokenizer object \(e\.g\. AutoTokenizer\.from_pretrained\(\.\.\.\)\), but got tokenizer=None of type NoneType$"):
        build_dynamic_batch_dataloader(texts[:10], None, batch_size=4, max_input_token_length=MAX_LEN)
    with pytest.raises(TypeError, match=r"^tokenizer should be a tokenizer object, not a model name: load it first with AutoTokenizer\.from_pretrained\('bert-base-uncased'\); but got tokenizer='bert-base-uncased' of type str$"):
        build_dynamic_batch_dataloader(texts[:10], "bert-base-uncased", batch_size=4, max_input_token_length=MAX_LEN)


@pytest.mark.parametrize("value", [1, 2])
def test_a_limit_with_no_room_after_the_special_tokens(tokenizer, texts, value):
    with pytest.raises(ValueError, match=rf"^max_input_token_length should be at least 3 \(the tokenizer adds 2 special tokens to every text\), but got max_input_token_length={value}$"):
        _load(texts[:10], tokenizer, max_input_token_length=value)
    # Without special tokens a single token per text is a valid (if odd) limit.
    loader = _load(texts[:10], tokenizer, max_input_token_length=1, add_special_tokens=False)
    assert {b["input_ids"].shape[1] for b in loader} == {1}


def test_a_limit_above_the_model_max_length_warns(tokenizer, texts):
    assert tokenizer.model_max_length == 512
    with pytest.warns(UserWarning, match=r"^max_input_token_length=100000 is above the tokenizer's model_max_length=512: .* pass max_input_token_length<=512$"):
        _load(texts[:10], tokenizer, max_input_token_length=100000)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _load(texts[:10], tokenizer, max_input_token_length=512)


def test_a_misspelt_keyword_is_named_not_swallowed(tokenizer, texts):
    with pytest.raises(TypeError, match=r"^build_dynamic_batch_dataloader\(\) got an unexpected keyword argument 'batchsize' \(did you mean 'batch_size'\?\): extra keywords go to the tokenizer, and BertTokenizer does not take it; but got batchsize=8$"):
        build_dynamic_batch_dataloader(texts[:10], tokenizer, batchsize=8, max_input_token_length=MAX_LEN, batch_size=4)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'add_special_token' \(did you mean 'add_special_tokens'\?\)"):
        _load(texts[:10], tokenizer, add_special_token=False)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'frobnicate': extra keywords"):
        _load(texts[:10], tokenizer, frobnicate=1)


def test_a_tokenizer_setting_passed_as_a_keyword_says_to_set_it_on_the_tokenizer(tokenizer, texts):
    # The tokenizer's call drops truncation_side silently; the hint named 'truncation', a keyword dynabatch refuses
    with pytest.raises(TypeError, match=r"^build_dynamic_batch_dataloader\(\) got an unexpected keyword argument "
                                        r"'truncation_side' \(set it on the tokenizer instead: "
                                        r"tokenizer.truncation_side = 'left'\): extra keywords go to the tokenizer"):
        _load(texts[:10], tokenizer, truncation_side="left")
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'truncate': extra keywords"):  # no hint
        _load(texts[:10], tokenizer, truncate=True)


def test_a_dataframe_is_named_by_type_and_shape_not_printed(tokenizer, texts):
    pandas = pytest.importorskip("pandas")
    frame = pandas.DataFrame({"text": texts, "n": range(len(texts))})
    with pytest.raises(TypeError, match=r"pick one column \(e\.g\. frame\['text'\]\), but got texts=<DataFrame of shape \(156, 2\), columns \['text', 'n'\]>$") as error:
        _load(frame, tokenizer)
    assert texts[0] not in str(error.value)
    assert len(_load(frame["text"], tokenizer)) > 1  # the fix the message suggests works


def test_the_default_num_workers_does_not_trigger_the_worker_count_warning(tokenizer, texts, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)  # a 2-core machine
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = build_dynamic_batch_dataloader(texts[:40], tokenizer, batch_size=4, max_input_token_length=MAX_LEN)
        loader.check_worker_number_rationality()  # what torch runs when iteration starts
    assert loader.num_workers == 2
    assert not [w for w in caught if "worker" in str(w.message)]
    assert _load(texts[:10], tokenizer, num_workers=0).num_workers == 0  # 0 stays 0


def test_the_builder_shows_progress_by_default_like_run(tokenizer, texts, capsys):
    _load(texts[:10], tokenizer)
    assert "tokenizing" in capsys.readouterr().err
    _load(texts[:10], tokenizer, progress=False)
    assert capsys.readouterr().err == ""


# --- pre-tokenized texts, and the model's positions ---------------------------------------------------


def test_pre_tokenized_texts_give_the_batches_of_their_texts(tokenizer, texts):
    ids = tokenizer(texts, truncation=True, max_length=MAX_LEN, return_token_type_ids=False)["input_ids"]
    from_ids = list(_load(ids, tokenizer))
    from_texts = list(_load(texts, tokenizer, return_token_type_ids=False))
    assert len(from_ids) == len(from_texts)
    for a, b in zip(from_ids, from_texts):
        assert a.indices.tolist() == b.indices.tolist() and a.texts is None
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["attention_mask"], b["attention_mask"])
    with pytest.raises(ValueError, match=r"tokenizer_kwargs should be empty for pre-tokenized texts"):
        _load(ids, tokenizer, add_special_tokens=False)


def test_pre_tokenized_rows_in_a_pandas_series_or_with_missing_rows_follow_on_bad_input(tokenizer, texts):
    # A Series (or object array) of id rows was read as texts ("texts[0] should be a str"), and with
    # on_bad_input="skip" a missing row (None, pandas' NaN) still raised a TypeError: the option was ignored
    import pandas as pd

    from dynabatch import run

    ids = tokenizer(texts[:12], truncation=True, max_length=MAX_LEN)["input_ids"]
    rows = np.empty(len(ids), dtype=object)
    rows[:] = ids
    want = [len(row) for row in ids]
    for given in (pd.Series(ids, index=range(100, 112)), rows):
        got = run(lambda b: b["attention_mask"].sum(1), _load(given, tokenizer), progress=False)
        assert [int(n) for n in got] == want and got.failed == []
    dirty = pd.Series([None, *ids[1:5], float("nan"), *ids[6:]])  # the first row missing too
    with pytest.raises(TypeError, match=r"^texts\[0\] should be a row of int token ids, like the other rows, but got "
                                        r"texts\[0\]=None of type NoneType; 2 of 12 rows are not rows of token ids "
                                        r"\(positions 0, 5\): clean them, or pass "
                                        r"on_bad_input='skip'"):
        _load(dirty, tokenizer)
    got = run(lambda b: b["attention_mask"].sum(1), _load(dirty, tokenizer, on_bad_input="skip"), progress=False)
    assert got.failed == [0, 5] and got[0] is None and [int(got[i]) for i in range(1, 5)] == want[1:5]
    assert got.failures[5] == "bad input: not a row of token ids (the loader skipped it, on_bad_input='skip')"


def test_a_limit_above_the_model_positions_is_refused_when_the_loader_is_built(llama_tokenizer, texts):
    from transformers import BertConfig, GPT2Config

    tok = copy.deepcopy(llama_tokenizer)
    tok.pad_token = tok.eos_token
    assert tok.model_max_length > 10**20  # the tokenizer reports no limit: the model's config still holds
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and the check is an error, not a warning
        with pytest.raises(ValueError, match=r"max_input_token_length should be at most 32 \(the model's "
                           r"config.n_positions=32 positions\), but got max_input_token_length=64"):
            _load(texts, tok, model=GPT2Config(n_positions=32, n_embd=32, n_layer=1, n_head=2))
    config = BertConfig(max_position_embeddings=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2)
    assert len(_load(texts, tok, model=config).dataset) == len(texts)  # 64 fits 64 positions
