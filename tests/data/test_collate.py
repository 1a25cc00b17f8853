import copy
import pickle

import numpy as np
import pytest
import torch

from dynabatch.data.collate import Batch, TokenCollator
from dynabatch.data.tokenization import TokenizedTexts, tokenize_texts

MAX_LEN = 48


@pytest.fixture(scope="module")
def texts():
    from dynabatch.demo import kjv_passages, vary_lengths

    return vary_lengths(kjv_passages(), n=120, max_words=80, seed=1) + ["", "And God said", "And God said"]


@pytest.fixture(scope="module")
def tokens(tokenizer, texts):
    return tokenize_texts(texts, tokenizer, MAX_LEN)


def _tokenizer_with_side(tokenizer, side):
    other = copy.deepcopy(tokenizer)
    other.padding_side = side
    return other


POSITIONS = [5, 120, 0, 77, 121, 122, 33, 7]  # includes the empty text and the duplicates


@pytest.mark.parametrize("side", ["right", "left"])
def test_equals_the_tokenizer_padding(tokenizer, texts, tokens, side):
    sided = _tokenizer_with_side(tokenizer, side)
    collate = TokenCollator.from_tokenizer(tokens, sided)
    batch = collate(POSITIONS)
    expected = sided([texts[i] for i in POSITIONS], padding=True, truncation=True, max_length=MAX_LEN, return_tensors="pt")
    assert set(batch) == set(expected) == {"input_ids", "attention_mask", "token_type_ids"}
    for key in expected:
        assert batch[key].dtype == torch.long
        assert torch.equal(batch[key], expected[key]), key


@pytest.mark.parametrize("side", ["right", "left"])
def test_many_batches_equal_the_tokenizer_padding(tokenizer, texts, tokens, side):
    sided = _tokenizer_with_side(tokenizer, side)
    collate = TokenCollator.from_tokenizer(tokens, sided)
    order = np.random.default_rng(0).permutation(len(texts))
    for start in range(0, len(order), 16):
        positions = order[start : start + 16].tolist()
        expected = sided([texts[i] for i in positions], padding=True, truncation=True, max_length=MAX_LEN, return_tensors="pt")
        batch = collate(positions)
        assert torch.equal(batch["input_ids"], expected["input_ids"])
        assert torch.equal(batch["attention_mask"], expected["attention_mask"])


def test_shapes_and_attention_mask(tokens):
    collate = TokenCollator(tokens, pad_token_id=0)
    batch = collate(POSITIONS)
    lengths = tokens.lengths[POSITIONS]
    assert batch["input_ids"].shape == (len(POSITIONS), lengths.max())
    assert batch["attention_mask"].sum(dim=1).tolist() == lengths.tolist()
    assert batch["token_type_ids"].shape == batch["input_ids"].shape


@pytest.mark.parametrize("side", ["right", "left"])
def test_pad_ids_go_on_the_padding_side(tokens, side):
    pad = 99999
    batch = TokenCollator(tokens, pad_token_id=pad, padding_side=side)(POSITIONS)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    assert torch.equal(ids == pad, mask == 0)
    for row, length in zip(ids.tolist(), tokens.lengths[POSITIONS].tolist()):
        width = len(row)
        real = row[:length] if side == "right" else row[width - length :]
        padding = row[length:] if side == "right" else row[: width - length]
        assert pad not in real
        assert padding == [pad] * (width - length)


@pytest.mark.parametrize("side", ["right", "left"])
def test_pad_to_multiple_of(tokens, side):
    batch = TokenCollator(tokens, pad_token_id=0, pad_to_multiple_of=8, padding_side=side)([120, 121])  # 2 and 5 tokens
    assert batch["input_ids"].shape == (2, 8)
    assert batch["attention_mask"].sum(dim=1).tolist() == [2, 5]
    expected_row = [101, 1998, 2643, 2056, 102]
    if side == "right":
        assert batch["input_ids"][1].tolist() == expected_row + [0, 0, 0]
    else:
        assert batch["input_ids"][1].tolist() == [0, 0, 0] + expected_row


def test_pad_values_of_extras(tokens):
    batch = TokenCollator(tokens, pad_token_id=0, pad_values={"token_type_ids": 7})([120, 121])
    assert batch["token_type_ids"].tolist() == [[0, 0, 7, 7, 7], [0, 0, 0, 0, 0]]


def test_rows_of_length_zero():
    store = TokenizedTexts(np.array([5, 6], dtype=np.int32), np.array([0, 0, 2, 2]), {})
    batch = TokenCollator(store, pad_token_id=1, padding_side="left")([0, 1, 2])
    assert batch["input_ids"].tolist() == [[1, 1], [5, 6], [1, 1]]
    assert batch["attention_mask"].tolist() == [[0, 0], [1, 1], [0, 0]]
    empty = TokenCollator(store, pad_token_id=1)([2, 0])
    assert empty["input_ids"].shape == (2, 0)
    assert empty["attention_mask"].shape == (2, 0)


def test_indices_and_texts(tokens, texts):
    batch = TokenCollator(tokens, pad_token_id=0, texts=texts)(POSITIONS)
    assert batch.indices.dtype == torch.long
    assert batch.indices.tolist() == POSITIONS
    assert batch.texts == [texts[i] for i in POSITIONS]
    assert TokenCollator(tokens, pad_token_id=0)(POSITIONS).texts is None


def test_the_texts_key_of_dynabatch_016_points_to_the_attribute(tokens, texts):
    # 0.1.6 documented batch["texts"]; the mapping now holds tensors only (model(**batch)), the texts are batch.texts
    batch = TokenCollator(tokens, pad_token_id=0, texts=texts)(POSITIONS)
    for key in ("texts", "indices"):
        with pytest.raises(KeyError, match=rf"'{key}' is not a key of a dynabatch Batch .* read batch\.{key}"):
            batch[key]
        assert key not in batch and batch.get(key) is None
    with pytest.raises(KeyError, match=r"^'labels'$"):
        batch["labels"]


def test_accepts_tensor_and_array_positions(tokens):
    collate = TokenCollator(tokens, pad_token_id=0)
    expected = collate(POSITIONS)["input_ids"]
    assert torch.equal(collate(torch.tensor(POSITIONS))["input_ids"], expected)
    assert torch.equal(collate(np.array(POSITIONS, dtype=np.int32))["input_ids"], expected)


def test_works_as_a_dataloader_collate_fn(tokens):
    collate = TokenCollator(tokens, pad_token_id=0)
    sampler = [[3, 1], [0, 2, 4]]
    loader = torch.utils.data.DataLoader(range(len(tokens)), batch_sampler=sampler, collate_fn=collate)
    batches = list(loader)
    assert [b.indices.tolist() for b in batches] == sampler
    assert all(isinstance(b, Batch) for b in batches)


def test_batch_is_a_mapping_of_tensors_for_model_calls(tokens):
    batch = TokenCollator(tokens, pad_token_id=0)(POSITIONS)

    def model(**kwargs):
        return sorted(kwargs)

    assert model(**batch) == ["attention_mask", "input_ids", "token_type_ids"]
    assert all(isinstance(v, torch.Tensor) for v in batch.values())


def test_batch_to_keeps_indices_and_texts(tokens, texts):
    batch = TokenCollator(tokens, pad_token_id=0, texts=texts)(POSITIONS)
    moved = batch.to("cpu")
    assert isinstance(moved, Batch) and moved is not batch
    assert moved.indices is batch.indices and moved.texts == batch.texts
    assert torch.equal(moved["input_ids"], batch["input_ids"])
    assert batch.to(torch.device("cpu"), non_blocking=True).texts == batch.texts


def test_batch_pin_memory_delegates_and_keeps_attributes(tokens, texts, monkeypatch):
    batch = TokenCollator(tokens, pad_token_id=0, texts=texts)(POSITIONS)
    pinned_keys = []

    def fake_pin(self, *args, **kwargs):
        pinned_keys.append(tuple(self.shape))
        return self.clone()

    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    pinned = batch.pin_memory()
    assert isinstance(pinned, Batch)
    assert len(pinned_keys) == len(batch)
    assert pinned.indices is batch.indices and pinned.texts == batch.texts
    assert all(torch.equal(pinned[k], batch[k]) for k in batch)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
def test_dataloader_pin_memory_keeps_attributes():
    # The tokenizer that travels with the repository: the GPU machine has no PyPI demo assets.
    from pathlib import Path

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(Path(__file__).resolve().parents[2] / "benchmarks" / "assets" / "kjv-wordpiece")
    texts = ["In the beginning God created the heaven and the earth.", "And God said, Let there be light.", "",
             "And the evening and the morning were the first day."]
    collate = TokenCollator(tokenize_texts(texts, tokenizer, MAX_LEN), pad_token_id=tokenizer.pad_token_id, texts=texts)
    loader = torch.utils.data.DataLoader(range(len(texts)), batch_sampler=[[3, 0, 2]], collate_fn=collate, pin_memory=True)
    (batch,) = list(loader)
    assert batch["input_ids"].is_pinned() and batch["attention_mask"].is_pinned()
    assert batch.indices.tolist() == [3, 0, 2] and batch.texts == [texts[3], texts[0], texts[2]]
    on_gpu = batch.to("cuda", non_blocking=True)  # what run does with a pinned batch
    assert on_gpu["input_ids"].device.type == "cuda" and torch.equal(on_gpu["input_ids"].cpu(), batch["input_ids"])


def test_batch_copies_and_pickles_with_attributes(tokens, texts):
    batch = TokenCollator(tokens, pad_token_id=0, texts=texts)(POSITIONS)
    for other in (copy.copy(batch), pickle.loads(pickle.dumps(batch))):
        assert isinstance(other, Batch)
        assert other.indices.tolist() == POSITIONS and other.texts == batch.texts
        assert torch.equal(other["input_ids"], batch["input_ids"])


def test_collator_pickles(tokens, texts):
    collate = TokenCollator(tokens, pad_token_id=0, padding_side="left", pad_to_multiple_of=4, texts=texts)
    again = pickle.loads(pickle.dumps(collate))
    a, b = collate(POSITIONS), again(POSITIONS)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert b.texts == a.texts
    assert "padding_side='left'" in repr(again)


# --- errors -----------------------------------------------------------------------------------------


def test_tokenizer_without_pad_token(tokens, tokenizer):
    no_pad = copy.deepcopy(tokenizer)
    no_pad.pad_token = None
    assert no_pad.pad_token_id is None
    with pytest.raises(ValueError, match=r"^tokenizer should have a pad token \(set one, e\.g\. tokenizer\.pad_token = tokenizer\.eos_token\), but got tokenizer\.pad_token_id=None$"):
        TokenCollator.from_tokenizer(tokens, no_pad)


def test_bad_padding_side(tokens):
    with pytest.raises(ValueError, match=r"padding_side should be 'right' or 'left', but got padding_side='middle'"):
        TokenCollator(tokens, pad_token_id=0, padding_side="middle")
    with pytest.raises(ValueError, match=r"padding_side should be 'right' or 'left', but got padding_side=None"):
        TokenCollator(tokens, pad_token_id=0, padding_side=None)


def test_bad_pad_to_multiple_of(tokens):
    with pytest.raises(ValueError, match=r"pad_to_multiple_of should be a positive integer, but got pad_to_multiple_of=0"):
        TokenCollator(tokens, pad_token_id=0, pad_to_multiple_of=0)


def test_bad_tokenized():
    with pytest.raises(TypeError, match=r"tokenized should be a TokenizedTexts \(from tokenize_texts\), but got tokenized=\[1, 2\] of type list"):
        TokenCollator([1, 2], pad_token_id=0)


def test_bad_pad_token_id(tokens):
    with pytest.raises(TypeError, match=r"pad_token_id should be an int, but got pad_token_id='0' of type str"):
        TokenCollator(tokens, pad_token_id="0")


def test_bad_pad_values(tokens):
    with pytest.raises(ValueError, match=r"pad_values should be a dict over the extras of tokenized \['token_type_ids'\], but got pad_values=\{'position_ids': 0\}"):
        TokenCollator(tokens, pad_token_id=0, pad_values={"position_ids": 0})
    with pytest.raises(TypeError, match=r"pad_values\['token_type_ids'\] should be an int, but got pad_values\['token_type_ids'\]=0\.5 of type float"):
        TokenCollator(tokens, pad_token_id=0, pad_values={"token_type_ids": 0.5})


def test_texts_of_another_length(tokens, texts):
    with pytest.raises(ValueError, match=rf"len\(texts\) should be len\(tokenized\)={len(texts)}, but got len\(texts\)=2"):
        TokenCollator(tokens, pad_token_id=0, texts=texts[:2])


def test_bad_positions(tokens):
    collate = TokenCollator(tokens, pad_token_id=0)
    n = len(tokens)
    with pytest.raises(ValueError, match=rf"positions\[1\] should be an input position in range\({n}\), but got positions\[1\]={n}"):
        collate([0, n])
    with pytest.raises(ValueError, match=rf"positions\[0\] should be an input position in range\({n}\), but got positions\[0\]=-1"):
        collate([-1, 0])
    with pytest.raises(ValueError, match=r"positions should be a non-empty sequence of input positions, but got positions=\[\]"):
        collate([])
    with pytest.raises(TypeError, match=r"positions should be a sequence of int, but got positions=\[0\.5\] of type list"):
        collate([0.5])
