"""ChunkedPlanner: chunk after chunk, each position exactly once, cursors carried across chunks."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dynabatch.sampling.chunked_planner import ChunkedPlanner
from dynabatch.sampling.planner import PlanSettings


def _chunks(lengths: np.ndarray, cuts: list[int]):
    order = np.argsort(-lengths, kind="stable")
    bounds = [0, *cuts, len(lengths)]
    return [(order[a:b], lengths[order[a:b]]) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def _all(planner):
    out = []
    while (batch := planner.next_batch()) is not None:
        out.append(batch.tolist())
    return out


def _planner(chunks, batch_size=4, max_length=64):
    it = iter(chunks)
    return ChunkedPlanner(lambda block=True: next(it, None), PlanSettings(batch_size, max_length))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 64), min_size=1, max_size=300), st.data())
def test_every_position_once_and_no_batch_spans_two_chunks(lengths, data):
    lengths = np.asarray(lengths)
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(lengths) - 1)), max_size=5)))
    chunks = _chunks(lengths, [c for c in cuts if c < len(lengths)])
    planner = _planner(chunks)
    seen, home = [], {int(p): i for i, (positions, _) in enumerate(chunks) for p in positions}
    rows = 0
    while (batch := planner.next_batch()) is not None:
        assert len({home[int(p)] for p in batch}) == 1
        assert np.all(np.diff(lengths[batch]) <= 0)  # longest first within a batch
        planner.observe(len(batch), int(lengths[batch].max()), 1000.0 * len(batch))
        seen.extend(batch.tolist())
        rows += 1
    assert sorted(seen) == list(range(len(lengths)))
    assert sorted(np.concatenate(planner.batches()).tolist()) == list(range(len(lengths)))


def test_the_cursor_carries_the_first_batchs_budget_across_chunks():
    lengths = np.array([60] * 8 + [10] * 64)
    planner = _planner(_chunks(lengths, [8]))
    assert len(planner.next_batch()) == 4
    planner.observe(4, 60, 4 * 6000.0)  # the first batch: the budget, 24,000
    assert len(planner.next_batch()) == 4  # the first chunk's last rows
    second = planner.next_batch()  # the second chunk's first batch, sized by the first chunk's peaks
    assert len(second) == 4 and lengths[second].max() == 10
    planner.observe(4, 10, 4 * 1000.0)
    assert planner.feedback.budget == 24_000.0
    assert len(planner.next_batch()) == 8  # grown under the same budget (max_growth 2x)


def test_peek_never_waits_for_a_chunk_and_restart_replays():
    lengths = np.arange(1, 41)
    chunks = _chunks(lengths, [10])
    given_out = iter(chunks)
    ready = {"n": 1}

    def next_chunk(block=True):
        if not block and ready["n"] <= 0:
            return "not yet"
        ready["n"] -= 1
        return next(given_out, None)

    planner = ChunkedPlanner(next_chunk, PlanSettings(4, 64))
    assert sum(len(b) for b in planner.peek(100)) == 10  # only the chunk already in
    whole = _all(planner)
    planner.restart()
    assert _all(planner) == whole
    assert planner.first_rows() == 4
