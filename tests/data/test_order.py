import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dynabatch.data.order import restore_order


def _shuffled_batches(n, sizes, seed=0):
    order = np.random.default_rng(seed).permutation(n)
    bounds = np.cumsum([0, *sizes])
    assert bounds[-1] == n
    return [order[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def test_tensor_batches_of_different_widths_come_back_in_input_order():
    batches = _shuffled_batches(10, [3, 4, 3])
    # Like generate: row p holds p, batches of different widths.
    outputs = [torch.tensor(b).unsqueeze(1).repeat(1, width) for b, width in zip(batches, (2, 5, 1))]
    indices = [torch.from_numpy(b) for b in batches]
    rows = restore_order(outputs, indices)
    assert len(rows) == 10
    assert all(isinstance(r, torch.Tensor) for r in rows)
    assert [int(r[0]) for r in rows] == list(range(10))
    assert {r.shape[0] for r in rows} == {1, 2, 5}


def test_list_batches_with_duplicate_texts():
    texts = ["a", "b", "a", "c", "a", "b"]
    batches = _shuffled_batches(len(texts), [4, 2], seed=3)
    outputs = [[f"{texts[p]}#{p}" for p in b] for b in batches]
    indices = [b.tolist() for b in batches]
    assert restore_order(outputs, indices) == [f"{t}#{p}" for p, t in enumerate(texts)]


def test_numpy_batches_and_tuple_outputs():
    outputs = [np.array([[1.0, 1.5], [0.0, 0.5]]), (("two",),)]
    indices = [np.array([1, 0]), torch.tensor([2])]
    rows = restore_order(outputs, indices)
    assert [r.tolist() for r in rows[:2]] == [[0.0, 0.5], [1.0, 1.5]]
    assert rows[2] == ("two",)


def test_items_are_returned_as_they_are():
    item = {"label": "x"}
    assert restore_order([[item]], [[0]])[0] is item


def test_the_batch_indices_of_a_collator_round_trip():
    from dynabatch.data.collate import TokenCollator
    from dynabatch.data.tokenization import TokenizedTexts

    store = TokenizedTexts(np.arange(6, dtype=np.int32), np.array([0, 1, 3, 3, 6]), {})
    collate = TokenCollator(store, pad_token_id=0)
    batches = [collate([3, 0]), collate([2, 1])]
    rows = restore_order([b["attention_mask"].sum(dim=1) for b in batches], [b.indices for b in batches])
    assert [int(r) for r in rows] == store.lengths.tolist()


def test_nothing_in_nothing_out():
    assert restore_order([], []) == []


@given(st.data())
def test_any_partition_into_batches_round_trips(data):
    n = data.draw(st.integers(1, 60))
    permutation = data.draw(st.permutations(range(n)))
    cuts = sorted(data.draw(st.sets(st.integers(1, n - 1), max_size=n - 1)) if n > 1 else set())
    bounds = [0, *cuts, n]
    batches = [list(permutation[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    kind = data.draw(st.sampled_from(["list", "tensor", "numpy"]))
    if kind == "list":
        outputs = [[p * 10 for p in b] for b in batches]
        indices = batches
    elif kind == "tensor":
        outputs = [torch.tensor(b) * 10 for b in batches]
        indices = [torch.tensor(b) for b in batches]
    else:
        outputs = [np.array(b) * 10 for b in batches]
        indices = [np.array(b) for b in batches]
    assert [int(r) for r in restore_order(outputs, indices)] == [p * 10 for p in range(n)]


# --- errors -----------------------------------------------------------------------------------------


def test_outputs_and_indices_of_different_lengths():
    with pytest.raises(ValueError, match=r"^len\(indices\) should be len\(outputs\)=2, one entry per batch, but got len\(indices\)=1$"):
        restore_order([[1], [2]], [[0]])


def test_a_batch_with_the_wrong_row_count_is_named():
    outputs = [torch.zeros(2, 3), torch.zeros(3, 3)]
    with pytest.raises(ValueError, match=r"^len\(outputs\[1\]\) should be len\(indices\[1\]\)=2, one row per position, but got len\(outputs\[1\]\)=3$"):
        restore_order(outputs, [[0, 1], [2, 3]])


def test_a_duplicated_position_is_named():
    with pytest.raises(ValueError, match=r"^indices\.count\(1\) should be 1 \(every position in range\(4\) exactly once, one per row\); it is at indices\[0\]\[1\] and indices\[1\]\[0\], but got indices\.count\(1\)=2$"):
        restore_order([[0, 0], [0, 0]], [[0, 1], [1, 3]])


def test_a_missing_position_is_named():
    # The batch holding positions 2 and 3 was dropped.
    with pytest.raises(ValueError, match=r"^indices\.count\(2\) should be 1 \(every position in range\(4\) exactly once, one per row\), but got indices\.count\(2\)=0$"):
        restore_order([["a", "b"], ["e", "f"]], [[0, 1], [4, 5]])


def test_a_negative_position_is_named():
    with pytest.raises(ValueError, match=r"^indices\[1\]\[0\] should be a position in range\(3\), but got indices\[1\]\[0\]=-1$"):
        restore_order([[0, 0], [0]], [[0, 1], [-1]])


def test_wrong_types():
    with pytest.raises(TypeError, match=r"outputs should be a list with one entry per batch, but got outputs=.* of type Tensor"):
        restore_order(torch.zeros(2), [[0, 1]])
    with pytest.raises(TypeError, match=r"indices should be a list with one entry per batch, but got indices=7 of type int"):
        restore_order([[1]], 7)
    with pytest.raises(TypeError, match=r"outputs\[0\] should be a torch\.Tensor, numpy array, list or tuple with one item per row, but got outputs\[0\]='ab' of type str"):
        restore_order(["ab"], [[0, 1]])
    with pytest.raises(TypeError, match=r"indices\[0\] should be a 1-D torch tensor, numpy array or list of int positions, but got indices\[0\]=\[0\.0\] of type list"):
        restore_order([[1]], [[0.0]])


def test_outputs_without_a_batch_dimension():
    with pytest.raises(ValueError, match=r"outputs\[0\] should be a torch\.Tensor, .* \(a batch dimension first\), but got outputs\[0\]=tensor\(3\.\)"):
        restore_order([torch.tensor(3.0)], [[0]])
    with pytest.raises(ValueError, match=r"indices\[0\] should be a 1-D torch tensor, numpy array or list of int positions, but got indices\[0\]=tensor\(0\)"):
        restore_order([[1]], [torch.tensor(0)])
