"""The scheduler: stored rows taken out, items sized by the one out-of-memory policy, lanes, rank shares."""

import numpy as np
import pytest
from runner_helpers import _load

from dynabatch.inference.execute import Outcome
from dynabatch.inference.scheduler import Scheduler
from dynabatch.inference.source import Source
from dynabatch.memory.oom import equal_parts

pytestmark = pytest.mark.usefixtures("one_thread")


def _scheduler(loader, memory="off", stored=None):
    return Scheduler(Source(loader, loader.plan), memory=memory, sparse=False, stored=stored)


def test_stored_rows_are_taken_out_before_a_batch_is_built_or_peeked(tokenizer, texts):
    loader = _load(texts, tokenizer)
    planned = loader.batch_sampler.batches
    stored = np.zeros(len(texts), dtype=bool)
    stored[planned[0]] = True  # the whole first batch
    stored[planned[1][:2]] = True  # two rows of the second
    source = Source(loader, loader.plan)
    scheduler = Scheduler(source, memory="off", sparse=False, stored=stored)
    lane = scheduler.lane()
    assert [p.tolist() for p in scheduler.peek(lane, 3)] == [planned[1][2:].tolist(), planned[2].tolist()]
    first = scheduler.next(lane)
    assert first.positions.size == 0 and first.stored.tolist() == planned[0].tolist()  # nothing left to run
    second = scheduler.next(lane)
    assert second.positions.tolist() == planned[1][2:].tolist() and not second.whole
    assert second.stored.tolist() == planned[1][:2].tolist()
    rest = [scheduler.next(lane) for _ in planned[2:]]
    assert all(item.whole and not item.stored.size for item in rest) and scheduler.next(lane) is None
    assert source.total_inputs == len(texts)


def test_a_plain_iterables_stored_rows_are_kept_with_its_batch_for_the_build_stage(tokenizer, texts):
    batches = list(_load(texts[:20], tokenizer))
    stored = np.zeros(20, dtype=bool)
    stored[batches[0].indices[:1].numpy()] = True
    scheduler = Scheduler(Source(batches, None), memory="off", sparse=False, stored=stored)
    item = scheduler.next(scheduler.lane())
    assert item.batch is batches[0] and item.rows.tolist() == list(range(1, len(batches[0].indices)))
    assert item.stored.tolist() == batches[0].indices[:1].tolist()
    assert scheduler.peek(scheduler.lane(), 2) == []  # its batches come built: nothing to build ahead


def test_a_shape_that_ran_out_of_memory_splits_every_shape_as_large_before_it_runs(tokenizer, texts):
    scheduler = _scheduler(_load(texts, tokenizer))
    lane, other = scheduler.lane(), scheduler.lane()
    item = scheduler.next(lane)
    assert item.sizing.split(8, 48) is None
    scheduler.update(lane, Outcome(item, out_of_memory=[(8, 40)]))
    sizing = scheduler.next(lane).sizing  # the next item is sized by what the last one taught
    split = sizing.split(9, 48)
    assert split.sizes == [4, 5] and split.reason == "as large as 8 x 40 which ran out of memory"
    assert sizing.split(9, 32) is None  # narrower: not dominated
    assert scheduler.next(other).sizing.split(9, 48) is None  # another device's lane learned nothing
    assert item.sizing.split(9, 48, [(8, 40)]).sizes == [4, 5]  # a shape that failed while the item ran counts too


def test_guarded_mode_caps_calls_by_the_first_batch_then_by_the_lanes_measured_peaks(tokenizer, texts):
    loader = _load(texts, tokenizer)
    scheduler = _scheduler(loader, memory="guarded")
    lane = scheduler.lane()
    first = loader.plan.planner.first_rows()
    item = scheduler.next(lane)
    assert item.sizing.split(first + 4, 48).sizes == equal_parts(first + 4, first)
    scheduler.update(lane, Outcome(item, measured=[(4, 48, 4000)]))  # 1000 bytes a row at width 48: the budget is 4000
    assert lane.feedback.budget == 4000
    sizing = scheduler.next(lane).sizing
    assert sizing.split(10, 24).sizes == [4, 3, 3]  # 4 rows at width 48 bound 4 at width 24
    assert sizing.measure(4, 48)


def test_guarded_mode_runs_rows_alone_where_calls_as_wide_peaked_above_an_absolute_budget(tokenizer, texts):
    # No memory model: the plan's first batch is the classifier's, and here it peaks at twice max_memory. Its peak
    # bounds no rows under the budget; the calls after it were run whole above it (max_rows' 0 read as "no bound").
    loader = _load(texts, tokenizer, max_memory="50KB")
    scheduler = _scheduler(loader, memory="guarded")
    lane = scheduler.lane("cpu")  # the absolute budget is read on the lane's device
    assert lane.feedback.budget == 50_000
    item = scheduler.next(lane)
    scheduler.update(lane, Outcome(item, measured=[(4, 48, 98_304)]))
    sizing = scheduler.next(lane).sizing
    split = sizing.split(4, 48)
    assert split.sizes == [1, 1, 1, 1] and "peaked above the budget of 50,000 bytes: rows alone" in split.reason
    assert sizing.split(4, 64) is None  # wider than every measured call: nothing bounds it
    scheduler.update(lane, Outcome(item, measured=[(1, 48, 20_000)]))  # a row alone fits: the peaks bound 2 rows
    assert scheduler.next(lane).sizing.split(4, 48).sizes == [2, 2]


def test_rows_a_failed_device_left_are_put_back_and_run_first(tokenizer, texts):
    loader = _load(texts, tokenizer)
    scheduler = _scheduler(loader)
    lane = scheduler.lane()
    first = scheduler.next(lane)
    rest = first.keep(np.arange(2))
    scheduler.update(lane, Outcome(first, unfinished=rest))
    again = scheduler.next(lane)
    assert again.positions.tolist() == rest.positions.tolist() and not again.whole


def test_lockstep_shares_deal_every_batch_to_one_rank(tokenizer, texts):
    loader = _load(texts, tokenizer)
    shares = []
    for rank in (0, 1):
        source = Source(loader, loader.plan)
        source.share("lockstep", rank, 2)
        scheduler = Scheduler(source, memory="off", sparse=False)
        lane = scheduler.lane()
        items = iter(lambda s=scheduler, lane=lane: s.next(lane), None)
        shares.append([p for item in items for p in item.positions.tolist()])
    assert sorted(shares[0] + shares[1]) == list(range(len(texts)))
    assert abs(len(shares[0]) - len(shares[1])) < len(texts) // 2


@pytest.mark.parametrize("n, batch_size, ranks, largest, needed", [(1, 4, 2, 1, 2), (3, 1, 2, 1, 4), (3, 1, 4, 3, 4)])
def test_lockstep_refuses_a_plan_too_small_for_the_ranks_naming_ranks(tokenizer, texts, n, batch_size, ranks, largest,
                                                                      needed):
    # 1 input for 2 ranks, or 3 one-input batches for 2 or 4: no equal share of batches of at least one input each.
    loader = _load(texts[:n], tokenizer, batch_size=batch_size)
    with pytest.raises(ValueError, match=(
            rf"^ranks should be 'claim' \(an fn without collectives\), or 'lockstep' on at most {largest} "
            rf"process(es)?, for {n} inputs? in {n} batch(es)?: 'lockstep' gives each of the {ranks} ranks the same "
            rf"number of batches \({needed} in all\), each of at least one input, and batches are only split, never "
            r"merged or padded, but got ranks='lockstep'$")):
        Source(loader, loader.plan).share("lockstep", 0, ranks)
