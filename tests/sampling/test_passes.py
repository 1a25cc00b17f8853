import pytest

from dynabatch.sampling.passes import EpochPasses, reduce_across_ranks, resolve_world


class _Epochs(EpochPasses):
    """Epoch ``e`` has ``e + 1`` one-row batches."""

    def __init__(self):
        self.seed, self.num_replicas, self.shard, self._cache = 0, 1, True, None
        self._start_epochs()

    def identity(self):
        return ["epochs"]

    def _current_batches(self, for_pass=False):
        return [[i] for i in range(self.epoch + 1)]


class _Other(_Epochs):
    pass


def test_resolve_world_defaults_and_errors():
    assert resolve_world(None, None) == (1, 0)  # no process group here
    assert resolve_world(3, 2) == (3, 2)
    with pytest.raises(ValueError, match="num_replicas should be a positive integer"):
        resolve_world(0, None)
    with pytest.raises(ValueError, match="rank should be a non-negative integer"):
        resolve_world(2, -1)
    with pytest.raises(ValueError, match=r"rank should be in \[0, num_replicas=2\), but got rank=2"):
        resolve_world(2, 2)


def test_max_len_plans_every_epoch_and_keeps_the_current_one_and_its_resume_point():
    s = _Epochs()
    s.set_epoch(1)
    s.load_state_dict({**s.state_dict(), "batches_done": 1})
    assert s.max_len(4) == 4
    assert s.epoch == 1 and list(s) == [[1]]


def test_a_state_loads_only_into_the_same_class_and_keys():
    state = _Epochs().state_dict()
    with pytest.raises(ValueError, match="state should come from a sampler over the same data and settings"):
        _Other().load_state_dict(state)
    with pytest.raises(ValueError, match=r"missing \['epoch'\]"):
        _Epochs().load_state_dict({k: v for k, v in state.items() if k != "epoch"})


def test_reduce_across_ranks_without_a_process_group_is_the_values_and_refuses_other_ops():
    # over two gloo ranks it is exercised by the multipack (min/max) and trainer (sum) two-process tests
    assert reduce_across_ranks([2, 3.5], "min") == [2.0, 3.5]
    with pytest.raises(ValueError, match=r"op should be one of 'sum', 'min', 'max', but got op='mean'"):
        reduce_across_ranks([1.0], "mean")
