"""``run`` on real batches of real texts: row extraction (split_rows, take_rows, halves). Models are real (see conftest.py); nothing of dynabatch is mocked.
"""


import pytest
import torch
from runner_helpers import (
    MAX_LEN,
)

from dynabatch import Batch
from dynabatch.data.collate import TokenCollator, halves, take_rows
from dynabatch.data.tokenization import tokenize_texts
from dynabatch.inference.outputs import split_rows

pytestmark = pytest.mark.usefixtures("one_thread")


# --- row extraction --------------------------------------------------------------------------------------


def _batch(ids, mask, indices=None):
    ids, mask = torch.tensor(ids), torch.tensor(mask)
    return Batch(
        {"input_ids": ids, "attention_mask": mask},
        indices=torch.tensor(indices if indices is not None else range(len(ids))),
    )


def test_split_rows_strips_the_echoed_left_padding_and_trailing_pads_only():
    batch = _batch([[0, 0, 5, 6], [7, 0, 8, 9]], [[0, 0, 1, 1], [1, 1, 1, 1]])  # row 1: an inner pad id
    generated = torch.tensor([[0, 0, 5, 6, 3, 0, 0], [7, 0, 8, 9, 0, 4, 0]])
    rows = split_rows(generated, batch, pad_token_id=0)
    assert [r.tolist() for r in rows] == [[5, 6, 3], [7, 0, 8, 9, 0, 4]]
    # Not an echo of the prompt (an encoder-decoder output): a leading pad id is the decoder start token.
    rows = split_rows(torch.tensor([[0, 3, 4, 0], [0, 5, 0, 0]]), batch, pad_token_id=0)
    assert [r.tolist() for r in rows] == [[0, 3, 4], [0, 5]]
    # Without a pad id, and for float tensors, rows are kept whole.
    assert [r.tolist() for r in split_rows(generated, batch)] == generated.tolist()
    floats = torch.zeros(2, 3)
    assert [r.shape for r in split_rows(floats, batch, pad_token_id=0)] == [(3,), (3,)]


def test_split_rows_of_each_output_kind():
    batch = _batch([[1, 2], [3, 0], [4, 0]], [[1, 1], [1, 0], [1, 0]], indices=[5, 0, 2])
    hidden = torch.arange(3 * 2 * 4, dtype=torch.float32).reshape(3, 2, 4)
    assert split_rows(None, batch) == [None, None, None]
    assert split_rows(["a", "b", "c"], batch) == ["a", "b", "c"]
    # A tuple of batched tensors of another length than the rows (return_dict=False): one tuple per row.
    pairs = split_rows((hidden, hidden[:, 0]), batch)
    assert len(pairs) == 3 and torch.equal(pairs[1][0], hidden[1]) and torch.equal(pairs[1][1], hidden[1, 0])
    output = {"logits": hidden, "loss": torch.tensor(1.5), "hidden_states": (hidden, hidden + 1), "cache": object()}
    rows = split_rows(output, batch)
    assert [sorted(r) for r in rows] == [["hidden_states", "logits"]] * 3  # no per-row loss or cache
    assert torch.equal(rows[2]["hidden_states"][1], hidden[2] + 1)
    # Rows are detached, on the CPU, and do not keep the whole batch output alive.
    big = torch.randn(3, 1000, requires_grad=True) * 2
    (row, *_) = split_rows(big[:, :2], batch)
    assert not row.requires_grad and row.untyped_storage().nbytes() <= 3 * 2 * 4
    with pytest.raises(ValueError, match=r"fn\(batch\)\.shape should be a batch dimension first \(3 rows"):
        split_rows(torch.zeros(2, 5), batch)
    with pytest.raises(ValueError, match=r"len\(fn\(batch\)\) should be 3 \(one item per batch row\)"):
        split_rows(["a", "b"], batch)
    with pytest.raises(TypeError, match=r"fn\(batch\) should be a tensor with a batch dimension.* of type str"):
        split_rows("abc", batch)


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("multiple", [None, 8])
def test_halves_equal_collating_each_half(tokenizer, texts, side, multiple):
    tokenized = tokenize_texts(texts[:40], tokenizer, MAX_LEN)
    collate = TokenCollator(tokenized, pad_token_id=0, padding_side=side, pad_to_multiple_of=multiple, texts=texts[:40])
    positions = [7, 3, 30, 12, 5, 39, 0]
    batch = collate(positions)
    for got, want in zip(
        halves(batch, padding_side=side, pad_to_multiple_of=multiple), (collate(positions[:3]), collate(positions[3:]))
    ):
        assert sorted(got) == sorted(want) and got.texts == want.texts
        assert torch.equal(got.indices, want.indices)
        assert all(torch.equal(got[k], want[k]) for k in want), side
    # The padding side is inferred from the mask when not given.
    first, _ = halves(batch, pad_to_multiple_of=multiple)
    assert torch.equal(first["input_ids"], collate(positions[:3])["input_ids"])
    picked = take_rows(batch, [4, 1], padding_side=side, pad_to_multiple_of=multiple)
    assert torch.equal(picked["input_ids"], collate([5, 3])["input_ids"])
