"""The contract every dynabatch batch sampler keeps, tested once over all of them.

Parametrized over the inference loader's sampler (DynamicBatchSampler), the smart sampler
(SmartBatchSampler), the multi-task system's MemoryAwareBatchSampler, StepBatchSampler (optimizer steps), axolotl's
multipack sampler (MultipackBatchSampler, with ``drop_last=False`` so that it keeps every sample) and the
smallest subclass of the base (PlannedBatchSampler's own example):

* every index exactly once per epoch, over all ranks together;
* the same number of batches on every rank (``num_replicas`` 2 and 3);
* ``state_dict`` taken mid-epoch and loaded into a fresh sampler in a fresh process continues exactly as
  the uninterrupted run does (one subprocess for every sampler: this file run as a script);
* a DataLoader with ``num_workers=2`` yields the sampler's batches, in order.

Run as a script, this file reads pickled ``(name, lengths, epoch, state)`` tuples from the path given as
its argument, loads each state into a freshly built sampler and pickles what each yields to the path
given second.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, Dataset

from dynabatch.compat.multitask.predictor import MemoryPredictor
from dynabatch.compat.multitask.sampler import MemoryAwareBatchSampler
from dynabatch.sampling.base import PlannedBatchSampler
from dynabatch.sampling.constraints import TokenBudget
from dynabatch.sampling.inference_sampler import DynamicBatchSampler
from dynabatch.sampling.multipack import MultipackBatchSampler
from dynabatch.sampling.planner import plan_batches
from dynabatch.sampling.smart import SmartBatchSampler
from dynabatch.training.step_sampler import STEP_SEPARATOR, StepBatchSampler

SEED = 3


class Pairs(PlannedBatchSampler):
    """The base's smallest subclass: consecutive pairs of indices."""

    def __init__(self, n, **kwargs):
        super().__init__(**kwargs)
        self.n = n

    def plan(self, epoch):
        return [np.arange(i, min(i + 2, self.n)) for i in range(0, self.n, 2)]

    def identity(self):
        return ("pairs", self.n)


def _predictor():
    """Measured peaks (MB) of two tasks, linear in rows x length: every sample of up to 64 tokens fits 40 MB."""
    predictor = MemoryPredictor("cpu")
    for task, per_token in (("a", 1 / 16), ("b", 1 / 8)):
        for rows in (1, 2, 4):
            for length in (8, 64):
                predictor.record_actual_memory(task, 1 + rows * length * per_token, batch_size=rows,
                                               seq_length=length)
    return predictor


PREDICTOR = _predictor()


def _smart(lengths, world, rank):
    return SmartBatchSampler(lengths, TokenBudget(max_tokens=4 * 64), window_batches=4, seed=SEED,
                             num_replicas=world, rank=rank)


BUILDERS = {
    "inference": lambda lengths, world, rank: DynamicBatchSampler(
        plan_batches(lengths, 4, 64), shuffle=True, seed=SEED, num_replicas=world, rank=rank),
    "smart": _smart,
    "multi-task": lambda lengths, world, rank: MemoryAwareBatchSampler(
        None, 6, 40, predictor=PREDICTOR, task_types=["a", "b"] * (len(lengths) // 2) + ["a"] * (len(lengths) % 2),
        lengths=lengths, seed=SEED, num_replicas=world, rank=rank),
    "step": lambda lengths, world, rank: StepBatchSampler(_smart(lengths, world, rank), target_batch_size=8),
    "multipack": lambda lengths, world, rank: MultipackBatchSampler(
        list(range(len(lengths))), batch_size=2, batch_max_len=64, lengths=np.asarray(lengths), drop_last=False,
        seed=SEED, num_replicas=world, rank=rank),
    "base": lambda lengths, world, rank: Pairs(len(lengths), seed=SEED, num_replicas=world, rank=rank),
}


def build(name, lengths, world=1, rank=0, epoch=0):
    sampler = BUILDERS[name](np.asarray(lengths, dtype=np.int64), world, rank)
    sampler.set_epoch(epoch)
    return sampler


def indices(batch):
    """A yielded batch's dataset indices: a multipack batch's bins joined, a step's separators left out."""
    if batch and isinstance(batch[0], list):
        return [i for group in batch for i in group]
    return [i for i in batch if i != STEP_SEPARATOR]


def _resume_in_this_process(cases, out_path):
    results = []
    for name, lengths, epoch, state in cases:
        sampler = build(name, lengths, epoch=epoch)
        sampler.load_state_dict(state)
        results.append(list(sampler))
    with open(out_path, "wb") as f:
        pickle.dump(results, f)


if __name__ == "__main__":
    with open(sys.argv[1], "rb") as f:
        _resume_in_this_process(pickle.load(f), sys.argv[2])


NAMES = list(BUILDERS)
lengths_st = st.lists(st.integers(1, 64), min_size=3, max_size=90)


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=25, deadline=None)
@given(lengths=lengths_st, world=st.integers(1, 3), epoch=st.integers(0, 2))
def test_every_index_once_per_epoch_and_equal_batch_counts_on_every_rank(name, lengths, world, epoch):
    per_rank = [list(build(name, lengths, world, rank, epoch)) for rank in range(world)]
    counts = {len(batches) for batches in per_rank}
    assert len(counts) == 1  # every rank steps as often: collectives never wait for a rank that left
    assert counts == {len(build(name, lengths, world, 0, epoch))}
    seen = sorted(i for batches in per_rank for b in batches for i in indices(b))
    assert seen == list(range(len(lengths)))  # every index exactly once over the ranks, none dropped


@pytest.fixture(scope="module")
def lengths():
    return np.random.default_rng(0).integers(1, 65, size=120)


@pytest.mark.slow
def test_resume_from_a_state_in_a_fresh_process_equals_the_uninterrupted_run(lengths, tmp_path):
    cases, expected = [], []
    for name in NAMES:
        sampler = build(name, lengths, epoch=1)
        uninterrupted = list(sampler)
        assert len(uninterrupted) >= 3, name
        interrupted = build(name, lengths, epoch=1)
        it = iter(interrupted)
        done = [next(it) for _ in range(len(uninterrupted) // 2)]
        assert done == uninterrupted[: len(done)]
        cases.append((name, lengths, 1, interrupted.state_dict()))
        expected.append(uninterrupted[len(done) :])
    states, out = tmp_path / "states.pkl", tmp_path / "resumed.pkl"
    states.write_bytes(pickle.dumps(cases))
    root = str(Path(__file__).resolve().parents[2])  # this checkout's dynabatch, as the tests import it
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, __file__, str(states), str(out)], capture_output=True, text=True, env=env,
                          check=False, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    resumed = pickle.loads(out.read_bytes())
    for name, want, got in zip(NAMES, expected, resumed):
        assert got == want, name


class _Echo(Dataset):
    """Item ``i`` is ``i`` (a list of indices for a multipack bin): the loader's batches are the sampler's."""

    def __len__(self):
        return 10**9

    def __getitem__(self, i):
        return i


@pytest.mark.parametrize("name", NAMES)
def test_a_dataloader_with_two_workers_yields_the_samplers_batches(name, lengths):
    want = list(build(name, lengths, epoch=1))
    loader = DataLoader(_Echo(), batch_sampler=build(name, lengths, epoch=1), num_workers=2, collate_fn=list)
    got = [[i.tolist() if isinstance(i, torch.Tensor) else i for i in batch] for batch in loader]
    assert got == want
