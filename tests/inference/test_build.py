"""The build stage: batches collated from the plan, a plain iterable's rows taken, input hashes, stored rows of a plain
iterable checked as their batch is built, and batches built ahead in a background thread."""

import threading

import numpy as np
import pytest
import torch
from runner_helpers import _load

from dynabatch.data.input_hashes import token_store_hashes
from dynabatch.inference.build import Builder
from dynabatch.inference.loop import Prefetcher
from dynabatch.inference.scheduler import Scheduler
from dynabatch.inference.source import Item, Source

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_plans_batch_is_collated_with_each_rows_input_hash(tokenizer, texts):
    loader = _load(texts, tokenizer)
    builder = Builder(loader.plan, loader, pad_token_id=None, pinned=False, hashes=True)
    positions = loader.batch_sampler.batches[2]
    built = builder.build(Item(2, positions))
    assert built.batch.indices.tolist() == positions.tolist()
    whole = token_store_hashes(loader.plan.collator.tokenized)
    assert built.hashes.tolist() == whole[positions].tolist()
    assert built.hashes_at(positions[::-1]).tolist() == whole[positions[::-1]].tolist()
    assert builder.pad_token_id == tokenizer.pad_token_id and builder.padding.side == "right"


def test_a_plain_batchs_stored_rows_come_with_their_hashes_to_check_and_only_the_others_kept(tokenizer, texts):
    batch = next(iter(_load(texts, tokenizer)))
    builder = Builder(None, [batch], pad_token_id=None, pinned=False, hashes=True)
    positions = batch.indices.numpy()
    item = Item(0, positions[1:], batch, np.arange(1, len(positions)), stored=positions[:1])
    built = builder.build(item)
    assert built.batch.indices.tolist() == positions[1:].tolist()
    from dynabatch.data.input_hashes import batch_input_hashes

    checked = [(p.tolist(), h.tolist()) for p, h in [built.stored]]
    assert checked == [([int(positions[0])], [int(batch_input_hashes(batch)[0])])]


def test_a_split_is_trimmed_as_collating_its_rows_would(tokenizer, texts):
    loader = _load(texts, tokenizer)
    builder = Builder(loader.plan, loader, pad_token_id=None, pinned=False, hashes=False)
    positions = loader.batch_sampler.batches[0]
    parts = builder.padding.split(builder.build(Item(0, positions)).batch, [1, len(positions) - 1])
    for part in parts:
        collated = loader.plan.collator(part.indices.numpy())
        assert torch.equal(part["input_ids"], collated["input_ids"])


def test_batches_are_built_ahead_in_the_background_and_a_stale_one_is_built_again(tokenizer, texts):
    loader = _load(texts, tokenizer)
    threads = []
    collate = loader.plan.collator

    class Recorded:
        def __getattr__(self, name):
            return getattr(collate, name)

        def __call__(self, positions):
            threads.append(threading.current_thread().name)
            return collate(positions)

    loader.plan.collator = Recorded()
    try:
        scheduler = Scheduler(Source(loader, loader.plan), memory="off", sparse=False)
        builder = Builder(loader.plan, loader, pad_token_id=None, pinned=False, hashes=False)
        lane = scheduler.lane()
        prefetcher = Prefetcher(scheduler, builder, lane, depth=2)
        try:
            seen = []
            while (item := prefetcher.next_item()) is not None:
                seen.append(prefetcher.build(item).batch.indices.tolist())
        finally:
            prefetcher.close()
    finally:
        loader.plan.collator = collate
    assert seen == [b.tolist() for b in loader.batch_sampler.batches]
    assert threads[0] == "MainThread" and set(threads[1:]) == {"dynabatch-prefetch"}
    assert prefetcher.rebuilt == 0
    assert not any(t.name == "dynabatch-prefetch" for t in threading.enumerate())
