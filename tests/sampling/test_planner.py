import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.tree import DecisionTreeClassifier

from dynabatch.memory.classifier import SpikeClassifier, load_classifier
from dynabatch.memory.features import ModelShape, compute_features
from dynabatch.sampling.estimators import SpikeEstimator, choose_estimator
from dynabatch.sampling.planner import BatchPlanner, PlanSettings, candidate_sizes, plan_batch_sizes, plan_batches


class CountingClassifier(SpikeClassifier):
    """A real classifier that counts how often the planner asks it."""

    def __init__(self, inner: SpikeClassifier) -> None:
        self.calls = self.rows = 0
        super().__init__(inner.estimator, inner.metadata)
        self.calls = self.rows = 0

    def predict_spike_proba(self, features):
        self.calls += 1
        self.rows += len(features)
        return super().predict_spike_proba(features)


@pytest.fixture(scope="module")
def bundled():
    return load_classifier()


@pytest.fixture(scope="module")
def counting(bundled):
    return CountingClassifier(bundled)


@pytest.fixture(scope="module")
def non_monotone():
    # A tree fitted on noise: its spike probability jumps up and down with the batch size.
    rng = np.random.default_rng(0)
    f = compute_features(rng.integers(16, 512, 3000), rng.integers(1, 512, 3000), rng.integers(1, 64, 3000), 0,
                         rng.integers(1, 512, 3000), rng.integers(1, 600, 3000), 0)
    return load_classifier(DecisionTreeClassifier(max_depth=8, random_state=0).fit(f, rng.integers(0, 2, 3000)))


def reference_sizes(lengths, batch_size, max_len, clf, threshold=0.025, start=1.0, end=6.0, steps=50, shape=None,
                    max_tokens=None):
    """The spike rule of dynabatch 0.1.6 with the differences docs/planner.md lists (a safe prefix, candidates capped
    at the texts that remain before they are asked), batch by batch, with every candidate asked, then at most
    ``max_tokens`` padded tokens: what the planner must equal."""
    n = len(lengths)
    prefix = np.concatenate([[0], np.cumsum(lengths)])
    first = min(batch_size, n)
    cands = candidate_sizes(batch_size, start, end, steps)
    out, pos = [first], first
    while pos < n:
        caps = np.unique(np.minimum(cands, n - pos))
        p = clf.predict_spike_proba(compute_features(max_len, lengths[0], first, prefix[first],
                                                     np.full(len(caps), lengths[pos]), caps,
                                                     prefix[pos + caps] - prefix[pos], shape=shape))
        k = 0
        while k < len(caps) and p[k] <= threshold:
            k += 1
        size = int(caps[k - 1]) if k else min(batch_size, n - pos)
        if max_tokens is not None:
            size = min(size, max_tokens // max(int(lengths[pos]), 1))
        out.append(size)
        pos += size
    return out


length_lists = st.integers(1, 1024).flatmap(
    lambda max_len: st.tuples(
        st.just(max_len),
        st.lists(st.integers(0, max_len), min_size=1, max_size=1500),
    )
)


# Device peaks that grow with rows and with width, as measured mode assumes.
concave = st.sampled_from([
    lambda r, w: r * (1e5 + 40 * w),  # mostly per row
    lambda r, w: r * 40 * w,  # all per token
    lambda r, w: r * (3e3 * np.sqrt(w) + 10 * w),  # falls less than linearly with length
    lambda r, w: r * (2e3 + w * w),  # eager attention: quadratic
    lambda r, w: 4096 + r * (500 + 30 * w),  # and a part that does not grow with rows
])


@settings(max_examples=40, deadline=None)
@given(data=length_lists, batch_size=st.integers(1, 96), threshold=st.sampled_from([0.0, 0.01, 0.025, 0.1, 0.5, 1.0]))
def test_plan_equals_the_batch_by_batch_rule(bundled, counting, data, batch_size, threshold):
    max_len, raw = data
    lengths = np.asarray(raw)
    clf = counting
    clf.calls = clf.rows = 0
    batches = plan_batches(lengths, batch_size, max_len, classifier=clf, threshold=threshold)
    sizes = [len(b) for b in batches]

    # every input position exactly once
    assert sorted(np.concatenate(batches).tolist()) == list(range(len(lengths)))
    # the first batch is the batch_size longest texts
    first = batches[0]
    assert len(first) == min(batch_size, len(lengths))
    assert lengths[first].min() >= np.sort(lengths)[::-1][len(first) - 1]
    # batches run longest first
    flat = lengths[np.concatenate(batches)]
    assert (np.diff(flat) <= 0).all()
    # every size is a candidate, the fallback batch_size, or what remained
    cands = set(candidate_sizes(batch_size, 1.0, 6.0, 50).tolist())
    assert all(s in cands or s == batch_size or i == len(sizes) - 1 for i, s in enumerate(sizes))
    # exactly the rule, asked candidate by candidate (monotone choice, no safe island)
    assert sizes == reference_sizes(np.sort(lengths)[::-1], batch_size, max_len, bundled, threshold)
    # never a call per text: at most one per batch after the first, plus the bisection over the candidates
    # that long runs of equal lengths share (a handful of calls for all of them at once)
    assert clf.calls <= max(len(sizes) - 1, 0) + int(np.ceil(np.log2(len(cands)))) + 1


@settings(max_examples=20, deadline=None)
@given(data=length_lists, batch_size=st.integers(1, 64))
def test_a_non_monotone_classifier_still_gets_the_smallest_unsafe_cut(non_monotone, data, batch_size):
    max_len, raw = data
    lengths = np.sort(np.asarray(raw))[::-1]
    assert not non_monotone.monotone_in_rows
    sizes = plan_batch_sizes(lengths, batch_size, max_len, classifier=non_monotone, threshold=0.5)
    assert sizes.tolist() == reference_sizes(lengths, batch_size, max_len, non_monotone, 0.5)


@settings(max_examples=20, deadline=None)
@given(data=length_lists, batch_size=st.integers(1, 64), steps=st.integers(1, 80),
       start=st.floats(1.0, 3.0), span=st.floats(0.0, 6.0))
def test_candidate_ranges_are_honoured(bundled, data, batch_size, steps, start, span):
    max_len, raw = data
    lengths = np.sort(np.asarray(raw))[::-1]
    sizes = plan_batch_sizes(lengths, batch_size, max_len, batch_start_range=start, batch_end_range=start + span,
                             steps=steps)
    assert sizes.sum() == len(lengths)
    cands = candidate_sizes(batch_size, start, start + span, steps)
    assert sizes[1:-1].max(initial=0) <= cands[-1]
    assert sizes.tolist() == reference_sizes(lengths, batch_size, max_len, bundled, 0.025, start, start + span, steps)


def test_planning_is_deterministic():
    rng = np.random.default_rng(5)
    lengths = rng.integers(1, 256, 20_000)
    a = plan_batches(lengths, 16, 256)
    b = plan_batches(lengths.copy(), 16, 256)
    assert [x.tolist() for x in a] == [x.tolist() for x in b]


def test_shorter_texts_get_larger_batches():
    rng = np.random.default_rng(1)
    lengths = np.concatenate([np.full(64, 512), rng.integers(4, 40, 20_000)])
    sizes = plan_batch_sizes(np.sort(lengths)[::-1], 32, 512)
    assert sizes[0] == 32
    assert sizes[1:-1].max() > 32


def test_a_first_batch_without_padding_still_lets_batches_grow():
    # 200 texts cut at the limit, then short ones: the published version never grew here.
    lengths = np.concatenate([np.full(200, 128), np.full(5000, 12)])
    sizes = plan_batch_sizes(lengths, 16, 128)
    assert sizes[-2] > 16


def test_unsafe_everywhere_falls_back_to_batch_size():
    lengths = np.full(100, 64)
    sizes = plan_batch_sizes(lengths, 8, 64, threshold=0.0)
    assert sizes.tolist() == [8] * 12 + [4]


def test_threshold_one_takes_the_largest_candidate():
    sizes = plan_batch_sizes(np.full(1000, 10), 10, 64, threshold=1.0, batch_end_range=6.0)
    assert sizes.tolist()[:3] == [10, 60, 60]


def test_fewer_texts_than_batch_size_is_one_batch():
    assert [b.tolist() for b in plan_batches([3, 9, 5], 8, 16)] == [[1, 2, 0]]


def test_empty_lengths_plan_nothing():
    assert plan_batches([], 8, 16) == []


def test_ties_keep_input_order():
    batches = plan_batches([5, 5, 5, 5], 2, 8)
    assert batches[0].tolist() == [0, 1]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"batch_size": 0}, ValueError, "batch_size should be a positive integer, but got batch_size=0"),
        ({"batch_size": True}, TypeError, "batch_size should be a positive integer, but got batch_size=True"),
        ({"batch_size": 2.0}, TypeError, "batch_size should be a positive integer, but got batch_size=2.0"),
        ({"max_input_token_length": 0}, ValueError, "max_input_token_length should be a positive integer"),
        ({"threshold": 1.5}, ValueError, r"threshold should be a number in \[0, 1\], but got threshold=1.5"),
        ({"threshold": -0.1}, ValueError, r"threshold should be a number in \[0, 1\], but got threshold=-0.1"),
        ({"batch_start_range": 0.5}, ValueError, "batch_start_range should be a finite number >= 1"),
        ({"batch_end_range": 0.9}, ValueError, "batch_end_range should be a finite number >= batch_start_range=1.0"),
        ({"steps": 0}, ValueError, "steps should be a positive integer, but got steps=0"),
        ({"lengths": [1, 99]}, ValueError, r"lengths should be at most max_input_token_length=16 .*lengths=99"),
        ({"lengths": [1, -2]}, ValueError, r"lengths\[1\] should be a non-negative length, but got lengths\[1\]=-2"),
        ({"lengths": [1.5]}, TypeError, "lengths should be a 1-D sequence of integer token lengths"),
        ({"lengths": "abc"}, TypeError, "lengths should be a 1-D sequence of integer token lengths"),
    ],
)
def test_bad_arguments_are_named(kwargs, error, match):
    args = {"lengths": [3, 2, 1], "batch_size": 2, "max_input_token_length": 16, **kwargs}
    with pytest.raises(error, match=match):
        plan_batches(**args)


def test_unsorted_lengths_are_refused_by_plan_batch_sizes():
    with pytest.raises(ValueError, match=r"^sorted_lengths\[1\] should be at most sorted_lengths\[0\]=1 \(sorted longest "
                                         r"first\), but got sorted_lengths\[1\]=5$"):
        plan_batch_sizes(np.array([1, 5]), 1, 8)


@pytest.mark.parametrize("batch_size", [1, 8, 64])
@pytest.mark.parametrize("max_len", [128, 512])
def test_plan_equals_the_rule_on_realistic_lengths(bundled, counting, batch_size, max_len):
    # Long runs of equal sizes are where the planner speculates; check it against the rule there.
    rng = np.random.default_rng(batch_size + max_len)
    # The reference asks the classifier once a batch: 4,000 lengths a row of batch_size keep it to ~1,000 batches
    n = min(4_000 * batch_size, 20_000)
    lengths = np.sort(np.minimum(rng.lognormal(3.3, 0.9, n).astype(int) + 2, max_len))[::-1]
    counting.calls = 0
    sizes = plan_batch_sizes(lengths, batch_size, max_len, classifier=counting)
    assert sizes.tolist() == reference_sizes(lengths, batch_size, max_len, bundled)
    assert counting.calls <= len(sizes) - 1  # at most one classifier call per planned batch


# --- planning with the model's shape -------------------------------------------------------------

shapes = st.builds(ModelShape, vocab_size=st.sampled_from([30522, 50257, 151936, 256206]),
                   hidden_size=st.sampled_from([384, 768, 1024, 4096]), max_new_tokens=st.sampled_from([0, 8, 128]),
                   num_beams=st.sampled_from([1, 4]))


@pytest.fixture(scope="module")
def shaped():
    return load_classifier(shape=True)


@settings(max_examples=25, deadline=None)
@given(data=length_lists, batch_size=st.integers(1, 64), shape=shapes)
def test_a_plan_with_the_model_shape_equals_the_rule(shaped, data, batch_size, shape):
    max_len, raw = data
    lengths = np.asarray(raw)
    batches = plan_batches(lengths, batch_size, max_len, model_shape=shape)
    assert sorted(np.concatenate(batches).tolist()) == list(range(len(lengths)))
    assert len(batches[0]) == min(batch_size, len(lengths))
    assert [len(b) for b in batches] == reference_sizes(np.sort(lengths)[::-1], batch_size, max_len, shaped,
                                                        shape=shape)


def test_a_forward_pass_grows_further_than_a_generate_call_with_a_large_vocabulary():
    lengths = np.random.default_rng(0).integers(1, 129, size=5000)
    forward = plan_batches(lengths, 16, 128, model_shape=ModelShape(32000, 1024))
    generate = plan_batches(lengths, 16, 128, model_shape=ModelShape(256206, 1024, max_new_tokens=64, num_beams=4))
    assert len(forward) < len(generate)
    assert max(map(len, forward)) > max(map(len, generate))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"model_shape": (32000, 512)}, TypeError,
         (r"model_shape should be a ModelShape \(ModelShape.from_model\(model, \.\.\.\)\) or None, but got "
          r"model_shape=\(32000, 512\)")),
        ({"model_shape": ModelShape(32000, 512), "classifier": "bundled-13"}, ValueError,
         ("classifier should be fitted on memory_ratio_estimate when model_shape is given, but got "
         "classifier='a classifier of 13 features'")),
        ({"classifier": "bundled-shape"}, ValueError,
         ("model_shape should be a ModelShape for a classifier fitted on memory_ratio_estimate, but got "
         "model_shape=None")),
    ],
)
def test_the_shape_and_the_classifier_must_agree(kwargs, error, match):
    named = {"bundled-13": load_classifier(), "bundled-shape": load_classifier(shape=True)}
    kwargs = {k: named.get(v, v) if isinstance(v, str) else v for k, v in kwargs.items()}
    with pytest.raises(error, match=match):
        plan_batches(np.arange(100) % 60, 8, 64, **kwargs)


# --- runs of equal lengths, and the planner object ---------------------------------------------------------


@pytest.mark.parametrize("which", ["bundled", "non_monotone"])
@pytest.mark.parametrize("batch_size", [1, 16])
def test_long_runs_of_equal_lengths_equal_the_rule_with_few_calls(request, which, batch_size):
    # Few distinct lengths in long runs (the shortcut), with short runs between them (the exact steps).
    clf = request.getfixturevalue(which)
    rng = np.random.default_rng(batch_size)
    values = np.sort(rng.choice(np.arange(1, 129), size=30, replace=False))[::-1]
    long = (200, 3000) if batch_size > 1 else (60, 600)  # the reference asks once a batch: a few thousand batches
    counts = np.where(rng.random(30) < 0.5, rng.integers(1, 40, 30), rng.integers(*long, 30))
    lengths = np.repeat(values, counts)
    counting = CountingClassifier(clf)
    sizes = plan_batch_sizes(lengths, batch_size, 128, classifier=counting, threshold=0.5 if which == "non_monotone"
                             else 0.025)
    assert sizes.tolist() == reference_sizes(lengths, batch_size, 128, clf, 0.5 if which == "non_monotone" else 0.025)
    assert counting.calls < len(sizes) / 4


def test_a_million_lengths_need_few_classifier_rows(counting):
    # What bounds the planning time: rows the trees evaluate (a run over 1M lengths asks for a few thousand).
    lengths = np.random.default_rng(0).choice(np.minimum(np.random.default_rng(1).lognormal(3.5, 0.8, 5000)
                                                         .astype(int) + 2, 256), 1_000_000)
    counting.calls = counting.rows = 0
    batches = plan_batches(lengths, 16, 256, classifier=counting)
    assert sum(map(len, batches)) == 1_000_000
    assert counting.rows < 20_000 and counting.calls < 1_000


@settings(max_examples=40, deadline=None)
@given(data=length_lists, batch_size=st.integers(1, 64), spare=st.floats(1.0, 8.0),
       threshold=st.sampled_from([0.025, 0.5, 1.0]))
def test_a_token_cap_cuts_the_spike_choice_and_nothing_else(bundled, data, batch_size, spare, threshold):
    max_len, raw = data
    lengths = np.sort(np.asarray(raw))[::-1]
    max_tokens = int(min(batch_size, len(lengths)) * max(int(lengths[0]), 1) * spare)
    settings = PlanSettings(batch_size, max_len, threshold, max_tokens=max_tokens)
    sizes = SpikeEstimator(bundled).plan_sizes(lengths, settings)
    assert sizes.tolist() == reference_sizes(lengths, batch_size, max_len, bundled, threshold, max_tokens=max_tokens)
    starts = np.cumsum(sizes) - sizes
    assert (sizes * np.maximum(lengths[starts], 1) <= max_tokens).all()


def _memory_model():
    """A memory model fitted to peaks of 4096 + rows x (500 + 30 x width) bytes."""
    from dynabatch.memory.model import MemoryModel

    shapes = [(r, w) for r in (1, 8, 32) for w in (8, 64, 320)]
    return MemoryModel().fit(*zip(*shapes), [4096 + r * (500 + 30 * w) for r, w in shapes])


@pytest.mark.filterwarnings("ignore:MemoryModel extrapolates")
@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 300), min_size=1, max_size=400), batch_size=st.integers(1, 16),
       spare=st.floats(1.0, 6.0), multiple=st.sampled_from([None, 8]), device=concave, model=st.booleans())
def test_no_batch_exceeds_max_tokens_up_front_or_in_measured_mode(lengths, batch_size, spare, multiple, device, model):
    lengths = np.asarray(lengths)
    width = -(-int(lengths.max()) // (multiple or 1)) * (multiple or 1)
    max_tokens = int(min(batch_size, len(lengths)) * width * spare)
    estimator = choose_estimator(memory_model=_memory_model()) if model else None  # the classifier or a model
    planner = BatchPlanner(lengths, PlanSettings(batch_size, 300, pad_to_multiple_of=multiple, max_tokens=max_tokens),
                           estimator)

    def tokens(batch):
        longest = int(lengths[batch].max())
        return len(batch) * -(-longest // (multiple or 1)) * (multiple or 1)

    plan = planner.batches()
    assert max(tokens(b) for b in plan) <= max_tokens
    assert sorted(np.concatenate(plan).tolist()) == list(range(len(lengths)))
    seen = []
    while (batch := planner.next_batch()) is not None:  # measured mode: re-sized batches keep the cap too
        assert tokens(batch) <= max_tokens
        planner.observe(len(batch), tokens(batch) // len(batch), device(len(batch), tokens(batch) // len(batch)))
        seen.extend(batch.tolist())
    assert sorted(seen) == list(range(len(lengths)))


def test_a_token_cap_below_the_first_batch_is_refused_with_what_to_do():
    lengths = np.array([100, 90, 10, 10])
    with pytest.raises(ValueError, match=r"^max_tokens should be at least 2 x 104 = 208 padded tokens \(the first "
                                         r"batch, the batch_size=2 longest texts 104 tokens wide\); pass a larger "
                                         r"max_tokens, a smaller batch_size or a smaller max_input_token_length, but "
                                         r"got max_tokens=200$"):
        BatchPlanner(lengths, PlanSettings(2, 128, pad_to_multiple_of=8, max_tokens=200))
    BatchPlanner(lengths, PlanSettings(2, 128, pad_to_multiple_of=8, max_tokens=208))  # exactly the first batch
    # fewer texts than batch_size: the first batch is every text, never said to be "the batch_size=4 longest texts"
    with pytest.raises(ValueError, match=r"^max_tokens should be at least 4 x 104 = 416 padded tokens \(the first "
                                         r"batch, all 4 texts \(fewer than batch_size=16\), the longest 104 tokens "
                                         r"wide\); pass a larger max_tokens"):
        BatchPlanner(lengths, PlanSettings(16, 128, pad_to_multiple_of=8, max_tokens=200))


def test_plan_settings_are_validated_once_and_frozen():
    settings = PlanSettings(batch_size=np.int64(8), max_input_token_length=64, batch_end_range=2)
    assert settings.batch_size == 8 and type(settings.batch_size) is int and settings.batch_end_range == 2.0
    assert settings.candidates.tolist() == candidate_sizes(8, 1.0, 2.0, 50).tolist()
    with pytest.raises(Exception):  # frozen
        settings.batch_size = 4
    with pytest.raises(ValueError, match=r"^batch_size should be a positive integer, but got batch_size=0$"):
        PlanSettings(batch_size=0, max_input_token_length=64)
    with pytest.raises(TypeError, match=r"^settings should be a PlanSettings, but got settings=\{\} of type dict$"):
        BatchPlanner([1, 2], {})
    with pytest.raises(ValueError, match=r"^max_growth should be a finite number >= 1 \(a batch may keep the rows of the "
                                         r"one before\), but got max_growth=0.5$"):
        PlanSettings(batch_size=8, max_input_token_length=64, max_growth=0.5)
    with pytest.raises(ValueError, match=r"^max_tokens should be a positive integer, but got max_tokens=0$"):
        PlanSettings(batch_size=8, max_input_token_length=64, max_tokens=0)
    with pytest.raises(TypeError, match=r"^max_tokens should be a positive integer, but got max_tokens=1.5 of type"):
        PlanSettings(batch_size=8, max_input_token_length=64, max_tokens=1.5)


class FixedPlan:
    """An estimator with a given plan and, like the classifier, no model of bytes: measured mode sizes by the bound."""

    target, relative, granularity = 0.9, True, None

    def __init__(self, sizes):
        self.sizes = np.asarray(sizes, dtype=np.int64)

    def plan_sizes(self, sorted_lengths, settings):
        return self.sizes

    def rows_for_peak(self, longest, first_peak):
        return None

    def restart(self):
        pass

    def observe(self, rows, padded_length, peak_bytes):
        pass

    def observe_out_of_memory(self, rows, padded_length):
        pass


def drive(lengths, plan, device_bytes, **settings):
    """Measured mode over ``lengths`` with ``plan`` as the prior, on a device that peaks at ``device_bytes(rows, width)``."""
    lengths = np.asarray(lengths)
    planner = BatchPlanner(lengths, PlanSettings(int(plan[0]), max(1, int(lengths.max())), **settings), FixedPlan(plan))
    sizes, peaks, seen = [], [], []
    while (batch := planner.next_batch()) is not None:
        width = int(lengths[batch].max())
        peak = device_bytes(len(batch), width)
        planner.observe(len(batch), width, peak)
        sizes.append(len(batch))
        peaks.append(peak)
        seen.extend(batch.tolist())
    assert sorted(seen) == list(range(len(lengths)))  # every position exactly once
    return np.asarray(sizes), np.asarray(peaks, dtype=float)


def test_nothing_measured_follows_the_plan_and_then_the_floor_holds():
    planner = BatchPlanner([9, 5, 5, 1, 1, 1], PlanSettings(1, 9), FixedPlan([1, 2, 3]))
    assert [planner.next_size(0), planner.next_size(1), planner.next_size(3), planner.next_size(4)] == [1, 2, 3, 2]
    planner.observe(1, 9, 1000)  # the first batch: every later row may cost as much as its rows did
    assert (planner.feedback.budget, planner.feedback.row_bytes_) == (1000, 1000)
    assert planner.next_size(1) == 1  # the floor (the first batch's rows), not the plan's 2


def test_the_planner_serves_the_plan_and_then_batches_sized_by_measured_peaks():
    lengths = np.random.default_rng(0).integers(1, 65, size=600)
    planner = BatchPlanner(lengths, PlanSettings(batch_size=8, max_input_token_length=64))
    plan = planner.batches()
    assert [b.tolist() for b in plan] == [b.tolist() for b in plan_batches(lengths, 8, 64)]
    sizes, peaks = [], []
    while (batch := planner.next_batch()) is not None:  # peaks proportional to rows x longest row
        peak = 100.0 * len(batch) * int(lengths[batch].max())
        planner.observe(len(batch), int(lengths[batch].max()), peak)
        sizes.append(len(batch))
        peaks.append(peak)
    assert sum(sizes) == 600 and max(peaks) == peaks[0] and min(sizes[:-1]) >= 8
    assert max(sizes) > 2 * 8 and all(b <= 2 * a for a, b in itertools.pairwise(sizes))  # growth at most 2x a step
    planner.restart()
    assert planner.next_batch().tolist() == plan[0].tolist()


def test_a_timid_plan_grows_where_memory_is_left():
    lengths = np.sort(np.random.default_rng(0).integers(1, 129, 3000))[::-1]
    plan = [8] * (3000 // 8)
    sizes, peaks = drive(lengths, plan, lambda r, w: r * (100 + 40 * w))
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

    _, peaks = drive(lengths, plan, device)
    if per_row:
        assert max(device(s, w) for s, w in zip(plan, [128, 64, 32, 16], strict=True)) > 1.5 * device(16, 128)
    assert (peaks[1:] <= peaks[0]).all()  # measured mode never does


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 512), min_size=1, max_size=600),
    batch_size=st.integers(1, 32),
    device=concave,
    max_growth=st.floats(1, 4),
)
def test_every_text_once_and_nothing_above_the_first_batch(lengths, batch_size, device, max_growth):
    n = len(lengths)
    plan = [batch_size] * (n // batch_size) + ([n % batch_size] if n % batch_size else [])
    sizes, peaks = drive(lengths, plan, device, max_growth=max_growth)
    assert sizes.min() >= 1
    assert all(b <= max_growth * a + 1e-9 for a, b in itertools.pairwise(sizes))
    # memory that grows with rows and with length: the bound holds for every batch after the first,
    # under the 0.9 target unless the batch is at the floor (the first batch's rows)
    assert (peaks[1:] <= peaks[0] * (1 + 1e-9)).all()
    assert (sizes[1:][peaks[1:] > 0.9 * peaks[0] * (1 + 1e-9)] <= min(batch_size, n)).all()


@pytest.mark.filterwarnings("ignore:MemoryModel extrapolates")
def test_a_memory_model_behind_the_planner_is_refined_online():
    from dynabatch.memory.model import MemoryModel
    from dynabatch.sampling.estimators import plan_batch_sizes_to_budget

    def true_peak(rows, length):
        return 1000 + rows * (50 + 4 * length)

    shapes = [(8, 64), (8, 16), (32, 8), (16, 32), (4, 64), (64, 4)]
    mm = MemoryModel().fit(*zip(*shapes), [true_peak(r, n) for r, n in shapes])
    lengths = np.random.default_rng(1).integers(1, 65, size=2000)
    planner = BatchPlanner(lengths, PlanSettings(batch_size=8, max_input_token_length=64),  # refitted in place:
                           choose_estimator(memory_model=mm, memory_margin=0.1, refit_memory_model=True))  # asked
    sizes = planner.sizes()
    assert sizes.tolist() == plan_batch_sizes_to_budget(np.sort(lengths)[::-1], mm, batch_size=8).tolist()
    budget = true_peak(8, 64)
    probes = len(mm.probes_)
    while (batch := planner.next_batch()) is not None:
        width = int(lengths[batch].max())
        assert true_peak(len(batch), width) <= budget  # the model is exact here: never over the first batch's peak
        planner.observe(len(batch), width, true_peak(len(batch), width))
    assert len(mm.probes_) > probes  # every measured batch refined it
    planner.observe_out_of_memory(500, 64)
    assert mm.probes_[-1]["out_of_memory"] and int(mm.max_rows(64, 10**12)) < 500


def test_memory_options_are_checked():
    assert choose_estimator(max_memory=10**9).budget_on("cpu") == 10**9  # the run's budget: the classifier plans
    with pytest.raises(ValueError, match=r"^max_memory should be a number of bytes > 0.*but got max_memory='12XB'$"):
        choose_estimator(max_memory="12XB")  # refused up front, with or without a memory model
    with pytest.raises(ValueError, match=r"^granularity should be None without a memory_model"):
        choose_estimator(granularity=8)
    with pytest.raises(ValueError, match=r"^memory_margin should be a number in \[0, 1\), but got memory_margin=1$"):
        choose_estimator(memory_margin=1)
    with pytest.raises(TypeError, match=r"^memory_model should be a MemoryModel"):
        choose_estimator(memory_model="mm.json")
    from dynabatch.memory.model import MemoryModel

    mm = MemoryModel().fit([1, 2, 4], [4, 8, 2], [10, 40, 20])
    with pytest.raises(ValueError, match=r"^max_memory should be .*, but got max_memory='12XB'$"):
        choose_estimator(memory_model=mm, max_memory="12XB")
    with pytest.raises(ValueError, match=r"^max_memory should be .*, but got max_memory=0$"):
        choose_estimator(memory_model=mm, max_memory=0)
    with pytest.raises(ValueError, match=r"^classifier should be None when a memory_model is given"):
        choose_estimator(load_classifier(), mm)
    assert choose_estimator(memory_model=mm, max_memory="1KiB").max_memory == 1024


# --- an absolute budget (max_memory): set on the lane's feedback when a run starts ---------------------------------


def _exact_model(true_peak):
    from dynabatch.memory.model import MemoryModel

    shapes = [(1, 1), (8, 64), (8, 16), (32, 8), (16, 32), (4, 512), (64, 4), (2, 256), (128, 1)]
    return MemoryModel().fit(*zip(*shapes), [true_peak(r, n) for r, n in shapes])


@pytest.mark.filterwarnings("ignore:MemoryModel extrapolates")
@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 512), min_size=1, max_size=800), budget_kb=st.integers(600, 20_000),
       max_growth=st.floats(1, 3))
def test_an_absolute_budget_fills_every_batch_from_the_first(lengths, budget_kb, max_growth):
    def true_peak(rows, length):  # generate-like: a per-row part that short texts do not shrink, and a quadratic one
        return 1000 + rows * (500 + 20 * length + 0.05 * length**2)

    lengths = np.asarray(lengths)
    budget = budget_kb * 1000.0
    estimator = choose_estimator(memory_model=_exact_model(true_peak), max_memory=budget, memory_margin=0.1)
    planner = BatchPlanner(lengths, PlanSettings(batch_size=4, max_input_token_length=512, max_growth=max_growth),
                           estimator)
    assert planner.budget_on("cpu") == budget
    planner.feedback.set_budget(planner.budget_on("cpu"))
    seen, sizes = [], []
    while (batch := planner.next_batch()) is not None:
        rows, width = len(batch), int(lengths[batch].max())
        assert true_peak(rows, width) <= 0.9 * budget * (1 + 1e-9)  # under the budget less its margin
        rest = lengths[np.setdiff1d(np.arange(len(lengths)), [*seen, *batch.tolist()])]
        if len(rest):  # as large as the budget allows: one more row (the next longest) would not fit
            assert true_peak(rows + 1, width) > 0.9 * budget * (1 - 1e-6)
        planner.observe(rows, width, true_peak(rows, width))
        seen.extend(batch.tolist())
        sizes.append(rows)
    assert seen == np.argsort(-lengths, kind="stable").tolist()  # every text once, longest first
    # no step cap: a model of bytes sizes each batch, however much more it holds than the one before
    assert sizes == planner.sizes().tolist()


def test_without_a_model_of_bytes_the_plan_runs_first_and_measured_peaks_grow_batches_to_the_budget():
    lengths = np.repeat([64, 32, 8], [8, 64, 2000])
    planner = BatchPlanner(lengths, PlanSettings(batch_size=8, max_input_token_length=64),
                           choose_estimator(max_memory=200_000))
    planner.feedback.set_budget(planner.budget_on("cpu"))
    sizes, peaks = [], []
    while (batch := planner.next_batch()) is not None:
        width = int(lengths[batch].max())
        peaks.append(len(batch) * 100.0 * width)
        planner.observe(len(batch), width, peaks[-1])
        sizes.append(len(batch))
    assert sizes[0] == 8 and peaks[0] == 51_200  # the classifier's first batch: far under the budget
    assert max(peaks) <= 0.9 * 200_000 and max(peaks) > 0.5 * 200_000  # grown to the budget, not the first peak
    assert all(b <= 2 * a for a, b in itertools.pairwise(sizes))  # extrapolated from measured peaks: 2x a step


def test_a_run_budget_smaller_than_one_row_is_refused_when_the_run_starts():
    lengths = np.array([64, 8, 8])
    estimator = choose_estimator(memory_model=_exact_model(lambda r, n: 1000 + r * 100 * n), max_memory=10**6)
    planner = BatchPlanner(lengths, PlanSettings(batch_size=2, max_input_token_length=64), estimator)
    estimator.max_memory_given = 5_000  # as if the device had that much free when the run started
    with pytest.raises(ValueError, match=r"^max_memory should be at least one row of the longest text \(7,400 bytes "
                                         r"predicted for 1 x 64 tokens, planned to 0\.9 of the budget\); here 5,000 "
                                         r"bytes"):
        planner.budget_on("cpu")


class RowsTimesLongest:
    """A spike classifier monotone in rows: the probability rises with rows x longest row relative to the first
    batch (batch_size_diff x token_size_diff), steeply around 1."""

    classes_ = np.array([0, 1])

    def predict_proba(self, features):
        load = features[:, 6] * features[:, 3]  # batch_size_diff x token_size_diff
        p = 1 / (1 + np.exp(-12 * (load - 1)))
        return np.stack([1 - p, p], axis=1)


def test_a_tail_candidate_is_asked_at_the_rows_that_remain_not_at_its_full_size():
    # 61 texts of 100 tokens, batch_size=30, 31 left: 0.1.6 asked about its candidate of 34 rows (unsafe), took 30
    # and left 1 (30, 30, 1); capped at the 31 that remain the candidate is safe (p = 0.598 <= 0.6)
    sizes = [len(b) for b in plan_batches(np.full(61, 100), batch_size=30, max_input_token_length=128,
                                          threshold=0.6, classifier=RowsTimesLongest())]
    assert sizes == [30, 31]
