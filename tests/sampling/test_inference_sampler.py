import random

import numpy as np
import pytest
import torch

from dynabatch.sampling.inference_sampler import DynamicBatchSampler


def _plan(num_batches=50, seed=0):
    """A plan of ``num_batches`` batches of varied sizes covering range(n) exactly once."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 6, size=num_batches)
    order = rng.permutation(int(sizes.sum()))
    return [chunk.tolist() for chunk in np.split(order, np.cumsum(sizes)[:-1])]


PLAN = _plan()


def test_len_is_the_number_of_batches():
    assert len(DynamicBatchSampler(PLAN)) == 50
    assert len(DynamicBatchSampler(PLAN, shuffle=True, seed=3)) == 50
    assert len(DynamicBatchSampler([[0, 1, 2]])) == 1


def test_unshuffled_yields_the_plan_in_order_as_lists_of_int():
    plan = [np.array([4, 2]), (0,), [1, 3]]
    out = list(DynamicBatchSampler(plan))
    assert out == [[4, 2], [0], [1, 3]]
    assert all(type(b) is list and all(type(i) is int for i in b) for b in out)
    assert list(DynamicBatchSampler(PLAN)) == PLAN
    # Every epoch of an unshuffled sampler is the plan again.
    sampler = DynamicBatchSampler(PLAN)
    sampler.set_epoch(5)
    assert list(sampler) == PLAN


def _is_permutation_of_plan(order):
    return sorted(map(tuple, order)) == sorted(map(tuple, PLAN))


def test_shuffle_keeps_batch_0_first_and_permutes_the_batches():
    order = list(DynamicBatchSampler(PLAN, shuffle=True, seed=0))
    assert order[0] == PLAN[0]
    assert _is_permutation_of_plan(order)
    assert order != PLAN
    assert all(type(i) is int for b in order for i in b)


def test_shuffle_is_reproducible_for_the_same_seed_and_epoch():
    a = DynamicBatchSampler(PLAN, shuffle=True, seed=7)
    b = DynamicBatchSampler(PLAN, shuffle=True, seed=7)
    a.set_epoch(3)
    b.set_epoch(3)
    assert list(a) == list(b)
    assert list(a) == list(b)  # iterating again gives the same epoch order


def test_shuffle_differs_between_epochs_and_seeds():
    sampler = DynamicBatchSampler(PLAN, shuffle=True, seed=7)
    epoch0 = list(sampler)
    sampler.set_epoch(1)
    epoch1 = list(sampler)
    assert epoch0 != epoch1
    assert epoch1[0] == epoch0[0] == PLAN[0]
    assert _is_permutation_of_plan(epoch1)
    other_seed = list(DynamicBatchSampler(PLAN, shuffle=True, seed=8))
    assert other_seed != epoch0
    assert _is_permutation_of_plan(other_seed)


def test_global_random_state_is_untouched():
    random.seed(123)
    np.random.seed(123)
    torch.manual_seed(123)
    py_state, np_state, torch_state = random.getstate(), np.random.get_state(), torch.get_rng_state()

    sampler = DynamicBatchSampler(PLAN, shuffle=True, seed=1)
    list(sampler)
    sampler.set_epoch(2)
    it = iter(sampler)
    next(it)
    state = sampler.state_dict()
    DynamicBatchSampler(PLAN, shuffle=True, seed=1).load_state_dict(state)

    assert random.getstate() == py_state
    np_after = np.random.get_state()
    assert np_after[0] == np_state[0] and np.array_equal(np_after[1], np_state[1]) and np_after[2:] == np_state[2:]
    assert torch.equal(torch.get_rng_state(), torch_state)


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("k", [0, 1, 17, 50])
def test_state_dict_resumes_mid_epoch(shuffle, k):
    original = DynamicBatchSampler(PLAN, shuffle=shuffle, seed=11)
    original.set_epoch(4)
    it = iter(original)
    taken = [next(it) for _ in range(k)]
    state = original.state_dict()
    assert state["batches_done"] == k and state["epoch"] == 4
    remainder = list(it)

    resumed = DynamicBatchSampler([list(b) for b in PLAN], shuffle=shuffle, seed=11)
    resumed.load_state_dict(state)
    assert resumed.epoch == 4
    assert list(resumed) == remainder
    assert taken + remainder == list(original)  # the whole epoch, again
    # Only the resumed epoch is shortened: the next iteration is a full epoch.
    assert len(list(resumed)) == len(PLAN)


def test_moving_to_another_epoch_drops_the_resume_point():
    original = DynamicBatchSampler(PLAN, shuffle=True, seed=3)
    it = iter(original)
    for _ in range(len(PLAN)):
        next(it)
    resumed = DynamicBatchSampler(PLAN, shuffle=True, seed=3)
    resumed.load_state_dict(original.state_dict())  # saved at the very end of epoch 0
    resumed.set_epoch(0)  # the same epoch: still resuming, nothing left
    resumed.set_epoch(1)
    fresh = DynamicBatchSampler(PLAN, shuffle=True, seed=3)
    fresh.set_epoch(1)
    assert list(resumed) == list(fresh)
    assert len(list(fresh)) == len(PLAN)


def test_state_dict_of_the_resumed_sampler_counts_from_the_resume_point():
    original = DynamicBatchSampler(PLAN, shuffle=True, seed=2)
    it = iter(original)
    for _ in range(10):
        next(it)
    resumed = DynamicBatchSampler(PLAN, shuffle=True, seed=2)
    resumed.load_state_dict(original.state_dict())
    it2 = iter(resumed)
    for _ in range(5):
        next(it2)
    assert resumed.state_dict()["batches_done"] == 15
    again = DynamicBatchSampler(PLAN, shuffle=True, seed=2)
    again.load_state_dict(resumed.state_dict())
    assert list(again) == list(it2) == list(it)[5:]


def test_state_survives_a_round_trip_through_torch_save(tmp_path):
    original = DynamicBatchSampler(PLAN, shuffle=True, seed=5)
    it = iter(original)
    next(it)
    next(it)
    torch.save(original.state_dict(), tmp_path / "sampler.pt")
    resumed = DynamicBatchSampler(PLAN, shuffle=True, seed=5)
    resumed.load_state_dict(torch.load(tmp_path / "sampler.pt"))
    assert list(resumed) == list(it)


# --- load_state_dict refusals -----------------------------------------------------------------------


def _state(plan=PLAN, **kwargs):
    sampler = DynamicBatchSampler(plan, **kwargs)
    it = iter(sampler)
    next(it)
    return sampler.state_dict()


def test_load_state_dict_refuses_another_plan():
    other = _plan(seed=1)
    sampler = DynamicBatchSampler(PLAN)
    with pytest.raises(ValueError, match=rf"^state should come from a sampler over the same plan \(fingerprint '{sampler.fingerprint}'\), but got state\['fingerprint'\]='[0-9a-f]{{16}}': the texts, tokenizer or planning arguments differ$"):
        sampler.load_state_dict(_state(other))
    # Same positions, other split into batches: still another plan.
    regrouped = [PLAN[0] + PLAN[1]] + PLAN[2:]
    with pytest.raises(ValueError, match=r"^state should come from a sampler over the same plan"):
        sampler.load_state_dict(_state(regrouped))
    # Same batches in another order: another plan too (batch 0 is the hardest).
    with pytest.raises(ValueError, match=r"^state should come from a sampler over the same plan"):
        sampler.load_state_dict(_state(PLAN[::-1]))


def test_load_state_dict_refuses_other_shuffle_or_seed():
    sampler = DynamicBatchSampler(PLAN, shuffle=True, seed=3)
    with pytest.raises(ValueError, match=r"^state\['shuffle'\] should be True as in this sampler, but got state\['shuffle'\]=False$"):
        sampler.load_state_dict(_state(shuffle=False, seed=3))
    with pytest.raises(ValueError, match=r"^state\['seed'\] should be 3 as in this sampler, but got state\['seed'\]=4$"):
        sampler.load_state_dict(_state(shuffle=True, seed=4))
    # A refused state leaves the sampler as it was: a full epoch from the start.
    assert list(sampler) == list(DynamicBatchSampler(PLAN, shuffle=True, seed=3))


def test_load_state_dict_refuses_a_non_dict_or_a_partial_dict():
    sampler = DynamicBatchSampler(PLAN)
    with pytest.raises(TypeError, match=r"^state should be a dict from DynamicBatchSampler\.state_dict\(\), but got state=\[1, 2\] of type list$"):
        sampler.load_state_dict([1, 2])
    with pytest.raises(TypeError, match=r"^state should be a dict from DynamicBatchSampler\.state_dict\(\), but got state=None of type NoneType$"):
        sampler.load_state_dict(None)
    state = sampler.state_dict()
    del state["seed"]
    with pytest.raises(ValueError, match=r"^state should be a dict with the keys of state_dict\(\) \(missing \['seed'\]\), but got state="):
        sampler.load_state_dict(state)


def test_load_state_dict_refuses_bad_positions():
    sampler = DynamicBatchSampler(PLAN)
    state = sampler.state_dict()
    state["batches_done"] = 51
    with pytest.raises(ValueError, match=r"^state\['batches_done'\] should be at most 50 \(the batches of epoch 0\), but got state\['batches_done'\]=51$"):
        sampler.load_state_dict(state)
    state["batches_done"] = -1
    with pytest.raises(ValueError, match=r"^state\['batches_done'\] should be a non-negative integer, but got state\['batches_done'\]=-1$"):
        sampler.load_state_dict(state)
    state["batches_done"] = 0
    state["epoch"] = "1"
    with pytest.raises(TypeError, match=r"^state\['epoch'\] should be a non-negative integer, but got state\['epoch'\]='1' of type str$"):
        sampler.load_state_dict(state)


# --- bad arguments ----------------------------------------------------------------------------------


def test_bad_shuffle():
    with pytest.raises(TypeError, match=r"^shuffle should be a bool, but got shuffle='yes' of type str$"):
        DynamicBatchSampler(PLAN, shuffle="yes")
    with pytest.raises(TypeError, match=r"^shuffle should be a bool, but got shuffle=1 of type int$"):
        DynamicBatchSampler(PLAN, shuffle=1)


def test_bad_seed():
    with pytest.raises(ValueError, match=r"^seed should be a non-negative integer, but got seed=-1$"):
        DynamicBatchSampler(PLAN, seed=-1)
    with pytest.raises(TypeError, match=r"^seed should be a non-negative integer, but got seed=1\.5 of type float$"):
        DynamicBatchSampler(PLAN, seed=1.5)
    with pytest.raises(TypeError, match=r"^seed should be a non-negative integer, but got seed=True of type bool$"):
        DynamicBatchSampler(PLAN, seed=True)
    assert DynamicBatchSampler(PLAN, seed=np.int64(3)).seed == 3


def test_bad_epoch():
    sampler = DynamicBatchSampler(PLAN, shuffle=True)
    with pytest.raises(ValueError, match=r"^epoch should be a non-negative integer, but got epoch=-1$"):
        sampler.set_epoch(-1)
    with pytest.raises(TypeError, match=r"^epoch should be a non-negative integer, but got epoch=1\.0 of type float$"):
        sampler.set_epoch(1.0)
    assert sampler.epoch == 0


def test_bad_batches():
    with pytest.raises(TypeError, match=r"^batches should be a sequence of sequences of input positions, but got batches='abc' of type str$"):
        DynamicBatchSampler("abc")
    with pytest.raises(TypeError, match=r"^batches should be a sequence of sequences of input positions, but got batches=<generator"):
        DynamicBatchSampler(b for b in PLAN)


# --- with a DataLoader ------------------------------------------------------------------------------


@pytest.mark.parametrize("shuffle", [False, True])
def test_works_as_the_batch_sampler_of_a_dataloader(shuffle):
    n = sum(len(b) for b in PLAN)
    sampler = DynamicBatchSampler(PLAN, shuffle=shuffle, seed=9)
    loader = torch.utils.data.DataLoader(range(100, 100 + n), batch_sampler=sampler)
    assert len(loader) == 50
    got = [batch.tolist() for batch in loader]  # default collate: one tensor of the dataset items per batch
    assert got == [[100 + i for i in b] for b in sampler]
    assert got[0] == [100 + i for i in PLAN[0]]
    sampler.set_epoch(1)
    again = [batch.tolist() for batch in loader]
    assert (again != got) == shuffle


def test_a_state_taken_right_after_moving_to_a_new_epoch_resumes_that_epoch_whole():
    sampler = DynamicBatchSampler([[4, 2], [0], [1, 3]], shuffle=True, seed=0)
    list(sampler)  # epoch 0, done
    sampler.set_epoch(1)
    state = sampler.state_dict()
    assert state["epoch"] == 1 and state["batches_done"] == 0
    resumed = DynamicBatchSampler([[4, 2], [0], [1, 3]], shuffle=True, seed=0)
    resumed.load_state_dict(state)
    assert list(resumed) == list(sampler)  # the whole of epoch 1, not nothing
    assert sorted(i for b in list(resumed) for i in b) == [0, 1, 2, 3, 4]
