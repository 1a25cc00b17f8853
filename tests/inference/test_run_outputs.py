"""``run`` on real batches of real texts: cutting batches (take_rows, split_rows). Models are real (see conftest.py); nothing of dynabatch is mocked.
"""


import pytest
import torch
from runner_helpers import (
    MAX_LEN,
)

from dynabatch.data.collate import TokenCollator, take_rows
from dynabatch.data.collate import split_rows as split_batch
from dynabatch.data.tokenization import tokenize_texts

pytestmark = pytest.mark.usefixtures("one_thread")


# --- cutting batches ---------------------------------------------------------------------------------


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("multiple", [None, 8])
def test_split_parts_equal_collating_each_part(tokenizer, texts, side, multiple):
    tokenized = tokenize_texts(texts[:40], tokenizer, MAX_LEN)
    collate = TokenCollator(tokenized, pad_token_id=0, padding_side=side, pad_to_multiple_of=multiple, texts=texts[:40])
    positions = [7, 3, 30, 12, 5, 39, 0]
    batch = collate(positions)
    for got, want in zip(
        split_batch(batch, [3, 4], padding_side=side, pad_to_multiple_of=multiple),
        (collate(positions[:3]), collate(positions[3:])),
    ):
        assert sorted(got) == sorted(want) and got.texts == want.texts
        assert torch.equal(got.indices, want.indices)
        assert all(torch.equal(got[k], want[k]) for k in want), side
    # The padding side is inferred from the mask when not given.
    first, _ = split_batch(batch, [3, 4], pad_to_multiple_of=multiple)
    assert torch.equal(first["input_ids"], collate(positions[:3])["input_ids"])
    picked = take_rows(batch, [4, 1], padding_side=side, pad_to_multiple_of=multiple)
    assert torch.equal(picked["input_ids"], collate([5, 3])["input_ids"])
