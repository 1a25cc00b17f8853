import json
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from dynabatch.sampling.constraints import AllOf, FixedBatchSize, LengthDifference, TokenBudget
from dynabatch.sampling.smart import SmartBatchSampler, as_lengths, plan_constrained

REPO = Path(__file__).resolve().parents[2]
LENGTHS = np.random.default_rng(0).integers(1, 120, size=500)


def _indices(batches):
    return sorted(i for b in batches for i in b)


def test_every_epoch_covers_every_row_once_with_new_batches():
    sampler = SmartBatchSampler(LENGTHS, TokenBudget(1024, 32), window_batches=4, seed=3)
    epochs = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        batches = list(sampler)
        assert len(batches) == len(sampler)
        assert _indices(batches) == list(range(len(LENGTHS)))
        epochs.append(batches)
    assert epochs[0] != epochs[1] != epochs[2]
    again = SmartBatchSampler(LENGTHS, TokenBudget(1024, 32), window_batches=4, seed=3)
    again.set_epoch(1)
    assert list(again) == epochs[1]  # deterministic for (seed, epoch)


def test_windows_pad_less_than_random_batches_and_one_window_least():
    def padding(batches):
        return sum(len(b) * LENGTHS[b].max() - LENGTHS[b].sum() for b in batches)

    rng = np.random.default_rng(0)
    random_batches = np.array_split(rng.permutation(len(LENGTHS)), len(LENGTHS) // 16)
    windowed = plan_constrained(LENGTHS, FixedBatchSize(16), window_batches=4)
    sorted_all = plan_constrained(LENGTHS, FixedBatchSize(16), window_batches=None)
    assert padding(sorted_all) < padding(windowed) < padding(random_batches) / 3


def test_resume_mid_epoch_with_the_same_data_and_refusal_with_other_data():
    sampler = SmartBatchSampler(LENGTHS, LengthDifference(4, 16), seed=1)
    sampler.set_epoch(2)
    it = iter(sampler)
    head = [next(it) for _ in range(5)]
    state = json.loads(json.dumps(sampler.state_dict()))  # saved in a checkpoint as JSON
    resumed = SmartBatchSampler(LENGTHS, LengthDifference(4, 16), seed=1)
    resumed.load_state_dict(state)
    assert _indices(head + list(resumed)) == list(range(len(LENGTHS)))
    with pytest.raises(ValueError, match="state should come from a sampler over the same data"):
        SmartBatchSampler(LENGTHS[:-1], LengthDifference(4, 16), seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="state should come from a sampler over the same data"):
        SmartBatchSampler(LENGTHS, LengthDifference(5, 16), seed=1).load_state_dict(state)


def test_it_has_no_batch_size_for_accelerate_to_read():
    # A DataLoader takes it as batch_sampler (tests/sampling/test_contract.py); accelerate would treat its
    # batches as fixed-size and drop short ones if it had a batch_size.
    assert not hasattr(SmartBatchSampler(LENGTHS, TokenBudget(512), seed=0), "batch_size")


def test_lengths_as_mapping_2d_and_errors():
    array, names = as_lengths(np.array([[1, 2], [3, 4]]))
    assert array.shape == (2, 2) and names == ("lengths[:, 0]", "lengths[:, 1]")
    with pytest.raises(TypeError, match=r"lengths should be a 1-D or 2-D \(one column per key field\) sequence of integer token lengths"):
        as_lengths([1.5, 2.0])
    with pytest.raises(ValueError, match=r"lengths\[1\] should be a non-negative length, but got lengths\[1\]=-1"):
        as_lengths([3, -1])
    with pytest.raises(ValueError, match="lengths should be fields of one length each"):
        as_lengths({"a": [1, 2], "b": [1]})
    with pytest.raises(TypeError, match="lengths should be a 1-D or 2-D"):
        as_lengths(5)
    # ragged key fields: numpy's own "inhomogeneous shape" error named no argument
    with pytest.raises(ValueError, match=r"^lengths should be a 1-D or 2-D \(one column per key field\) sequence of "
                                         r"integer token lengths, every row with as many fields, but got "
                                         r"lengths=\[\[1, 2\], \[3\]\]$"):
        SmartBatchSampler([[1, 2], [3]], FixedBatchSize(2))
    with pytest.raises(ValueError, match="window_batches should be a positive integer"):
        SmartBatchSampler([1, 2], FixedBatchSize(2), window_batches=0)
    assert plan_constrained([], FixedBatchSize(2)) == []
    assert len(SmartBatchSampler([], FixedBatchSize(2))) == 0


def test_plans_a_million_lengths_quickly():
    lengths = np.random.default_rng(0).integers(1, 512, size=1_000_000)
    start = time.process_time()
    batches = plan_constrained(lengths, TokenBudget(8192, 256), window_batches=100)
    assert time.process_time() - start < 3.0  # ~0.4 s idle; loose for a busy CI machine
    assert sum(len(b) for b in batches) == 1_000_000


# --------------------------------------------------------------------------- two gloo processes

_WORKER = textwrap.dedent(
    """
    import json, os, sys

    import numpy as np
    import torch
    import torch.distributed as dist

    from dynabatch.memory.model import MemoryModel
    from dynabatch.sampling.constraints import FixedBatchSize, LengthDifference, MemoryBudget, TokenBudget
    from dynabatch.sampling.smart import SmartBatchSampler

    rank, out = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", rank=rank, world_size=2)
    memory = MemoryModel(device="cpu")
    for rows, length in [(4, 8), (4, 32), (16, 8), (8, 64), (32, 16), (2, 64)]:
        memory.observe(rows, length, 1000 + rows * (200 + 10 * length))
    constraints = {
        "fixed": FixedBatchSize(7),
        "difference": LengthDifference(3, 16),
        "tokens": TokenBudget(700, 32),
        "memory": MemoryBudget(memory, 30000, memory_margin=0.1),
    }
    lengths = np.random.default_rng(1).integers(1, 64, size=301)
    report = {}
    for name, constraint in constraints.items():
        sampler = SmartBatchSampler(lengths, constraint, window_batches=3, seed=5)  # world from the process group
        epochs, lens = [], []
        for epoch in range(2):
            sampler.set_epoch(epoch)
            lens.append(len(sampler))
            seen = []
            for batch in sampler:
                seen.append(batch)
                dist.all_reduce(torch.ones(1))  # a collective every step: hangs if the counts differ
            epochs.append(seen)
        # resume epoch 1 after 3 batches in a fresh sampler, as after a restart
        sampler.set_epoch(1)
        it = iter(sampler)
        head = [next(it) for _ in range(3)]
        state = sampler.state_dict()
        fresh = SmartBatchSampler(lengths, constraint, window_batches=3, seed=5)
        fresh.load_state_dict(state)
        tail = list(fresh)
        report[name] = {"epochs": epochs, "resumed": head + tail, "len": lens,
                        "world": [sampler.num_replicas, sampler.rank]}
    dist.barrier()
    dist.destroy_process_group()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    """
)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, run_two_ranks):
    return run_two_ranks(_WORKER, tmp_path_factory.mktemp("gloo_smart"))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fixed", "difference", "tokens", "memory"])
def test_two_ranks_see_every_sample_once_per_epoch_in_equal_counts(two_ranks, name):
    ranks = [r[name] for r in two_ranks]
    assert [r["world"] for r in ranks] == [[2, 0], [2, 1]]
    for epoch in range(2):
        shares = [r["epochs"][epoch] for r in ranks]
        assert len(shares[0]) == len(shares[1]) == ranks[0]["len"][epoch] == ranks[1]["len"][epoch]
        assert _indices(shares[0] + shares[1]) == list(range(301))
    assert ranks[0]["epochs"][0] != ranks[0]["epochs"][1]
    for r in ranks:  # resumed mid-epoch: the same batches, nothing lost or repeated
        assert r["resumed"] == r["epochs"][1]


def test_max_len_is_per_rank_when_a_wrapper_deals_the_batches():
    # shard=False under 2 processes: the sampler yields both ranks' batches, a rank gets half of them;
    # asking for all of them per rank would halve every batch (twice the steps, half the rows each).
    lengths = np.random.default_rng(0).integers(8, 300, 203)
    dealt = SmartBatchSampler(lengths, TokenBudget(300, 16), seed=2, num_replicas=2, rank=0, shard=False)
    own = SmartBatchSampler(lengths, TokenBudget(300, 16), seed=2, num_replicas=2, rank=0)

    def lengths_by_epoch(sampler):
        counts = []
        for epoch in range(3):
            sampler.set_epoch(epoch)
            counts.append(len(sampler))
        return counts

    per_rank = dealt.max_len(3)
    assert per_rank == max(lengths_by_epoch(own))
    planned = lengths_by_epoch(dealt)
    dealt.set_min_batches(per_rank)
    assert lengths_by_epoch(dealt) == planned  # nothing split further


class _Rule:
    """A constraint written to the documented protocol only (fits, row_cap): no key(), a default repr."""

    def __init__(self, limit):
        self.limit = limit

    def fits(self, rows, longest, shortest):
        return rows * longest[:, 0] <= self.limit

    def row_cap(self, lengths):
        return max(1, self.limit // max(1, int(lengths.min())))


def test_a_users_constraint_resumes_in_another_sampler_with_the_same_settings():
    first = SmartBatchSampler(LENGTHS, _Rule(512), seed=0)
    it = iter(first)
    next(it)
    state = first.state_dict()
    again = SmartBatchSampler(LENGTHS, _Rule(512), seed=0)  # a new object, as after a restart
    again.load_state_dict(state)
    assert list(again) == list(it)
    with pytest.raises(ValueError, match="state should come from a sampler over the same data and settings"):
        SmartBatchSampler(LENGTHS, _Rule(256), seed=0).load_state_dict(state)


def test_the_fingerprint_is_the_same_in_another_process():
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = ("import numpy as np\nfrom dynabatch.sampling.smart import SmartBatchSampler\n"
            "from dynabatch.sampling.constraints import AllOf, TokenBudget, LengthDifference\n"
            "print(SmartBatchSampler(np.arange(1, 200) % 37, AllOf(TokenBudget(300), LengthDifference(4, 16)),"
            " seed=2).fingerprint)")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    here = SmartBatchSampler(np.arange(1, 200) % 37, AllOf(TokenBudget(300), LengthDifference(4, 16)), seed=2)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == here.fingerprint
