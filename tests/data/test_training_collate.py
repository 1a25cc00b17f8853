import copy

import numpy as np
import pytest
import torch

from dynabatch.data.sources import tokenize_source
from dynabatch.data.training_collate import TrainingCollator
from dynabatch.demo import kjv_passages
from dynabatch.sampling.constraints import (
    FixedBatchSize,
    LengthDifference,
    MemoryBudget,
    TokenBudget,
)
from dynabatch.sampling.smart import SmartBatchSampler


def test_pads_each_field_with_its_value_on_the_padding_side(tokenizer):
    left = copy.deepcopy(tokenizer)
    left.padding_side = "left"
    features = [
        {"input_ids": [101, 7, 102], "token_type_ids": [0, 0, 0], "labels": [7, 8], "label": 1},
        {"input_ids": [101, 102], "token_type_ids": [0, 0], "labels": [9], "label": 0},
    ]
    classes = TrainingCollator(tokenizer)([{"input_ids": [1], "label": 1}, {"input_ids": [2, 3], "label": 0}])
    assert classes["labels"].tolist() == [1, 0] and classes["labels"].dtype == torch.long
    right = TrainingCollator(tokenizer)(features)
    assert right["input_ids"].tolist() == [[101, 7, 102], [101, 102, 0]]
    assert right["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert right["labels"].tolist() == [[7, 8], [9, -100]]
    assert right["label"].tolist() == [1, 0]  # kept: the features have their own labels
    lefted = TrainingCollator(left, pad_to_multiple_of=4)(features)
    assert lefted["input_ids"].tolist() == [[0, 101, 7, 102], [0, 0, 101, 102]]
    assert lefted["attention_mask"].tolist() == [[0, 1, 1, 1], [0, 0, 1, 1]]
    assert lefted["labels"].tolist() == [[-100, -100, 7, 8], [-100, -100, -100, 9]]
    assert lefted["token_type_ids"].tolist() == [[0, 0, 0, 0], [0, 0, 0, 0]]


def test_causal_labels_mask_only_the_padding_even_when_pad_is_eos():
    collate = TrainingCollator(pad_token_id=2, labels_from="input_ids")
    batch = collate([{"input_ids": np.array([5, 2])}, {"input_ids": torch.tensor([6])}])
    assert batch["input_ids"].tolist() == [[5, 2], [6, 2]]
    assert batch["labels"].tolist() == [[5, 2], [6, -100]]  # the real eos keeps its label


def test_matches_the_tokenizers_own_padding(tokenizer):
    texts = kjv_passages()[:9]
    features = [{"input_ids": ids} for ids in tokenizer(texts)["input_ids"]]
    ours = TrainingCollator(tokenizer, pad_to_multiple_of=8)(features)
    theirs = tokenizer(texts, padding=True, pad_to_multiple_of=8, return_tensors="pt")
    assert torch.equal(ours["input_ids"], theirs["input_ids"])
    assert torch.equal(ours["attention_mask"], theirs["attention_mask"])


def test_a_token_label_sequence_pads_with_the_label_pad_and_float_tensors_keep_their_values():
    # A token-classification "label" becomes "labels": its padding must be ignored by the loss, not class 0
    # (transformers' DataCollatorForTokenClassification pads it with -100 too).
    collate = TrainingCollator(pad_token_id=0)
    batch = collate([{"input_ids": [1, 2, 3], "label": [4, 5, 6]}, {"input_ids": [1], "label": [7]}])
    assert batch["labels"].tolist() == [[4, 5, 6], [7, -100, -100]] and "label" not in batch
    # A float vector per row is stacked as it is, never cut to integer token ids.
    for make in (torch.tensor, np.array):
        batch = collate([{"input_ids": [1, 2], "w": make([0.5, 1.5])}, {"input_ids": [1], "w": make([2.75, 3.25])}])
        assert batch["w"].dtype.is_floating_point and batch["w"].tolist() == [[0.5, 1.5], [2.75, 3.25]]
    with pytest.raises(ValueError, match=r"features\[...\]\['w'\] should be tensors of one shape to stack "
                                         r"\(only integer 1-D sequences are padded, as token ids\), but got .*\(1,\), \(2,\)"):
        collate([{"input_ids": [1], "w": torch.tensor([0.5, 1.5])}, {"input_ids": [1], "w": torch.tensor([2.7])}])


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda c: TrainingCollator(), ValueError, "pad_token_id should be given, or a tokenizer with a pad token"),
        (lambda c: TrainingCollator(pad_token_id="0"), TypeError, "pad_token_id should be an int"),
        (lambda c: TrainingCollator(pad_token_id=0, padding_side="up"), ValueError,
         "padding_side should be 'right' or 'left', but got padding_side='up'"),
        (lambda c: TrainingCollator(pad_token_id=0, pad_to_multiple_of=0), ValueError,
         "pad_to_multiple_of should be a positive integer"),
        (lambda c: c([]), ValueError, r"features should be a non-empty list of dicts"),
        (lambda c: c({"input_ids": [1]}), TypeError, "features should be a list of dicts"),
        (lambda c: c([{"input_ids": [1]}, {"ids": [1]}]), ValueError,
         r"features\[1\].keys\(\) should be the keys of features\[0\] \['input_ids'\]"),
        (lambda c: c([{"input_ids": [1.5]}]), TypeError, "should be a sequence of int token ids"),
        (lambda c: c([{"input_ids": [1], "x": [1]}, {"input_ids": [1], "x": 3}]), ValueError,
         "should be a sequence in every row or in none"),
        (lambda c: TrainingCollator(pad_token_id=0, labels_from="ids")([{"input_ids": [1]}]), ValueError,
         r"labels_from should be a sequence field of the features \['input_ids'\], but got labels_from='ids'"),
    ],
)
def test_bad_input(make, error, match):
    with pytest.raises(error, match=match):
        make(TrainingCollator(pad_token_id=0))


# --------------------------------------------------------------------------- a real model trains with each sampler


def _tiny_bert(vocab_size):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=128, num_labels=2,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(config)


def _fitted_memory_model(model, collate, dataset):
    """A MemoryModel fitted on measured peaks of this model's training step at a few shapes."""
    from dynabatch.compat.bionemo import collect_peak_alloc
    from dynabatch.memory.model import MemoryModel

    lengths = np.array([len(r) for r in dataset["input_ids"]])
    shapes = [(rows, length) for rows in (4, 24) for length in (16, 40, 64)]

    def step(shape):
        rows, length = shape
        picks = np.flatnonzero(lengths >= length)[:rows]
        batch = collate([{"input_ids": dataset[int(i)]["input_ids"][:length], "label": 0} for i in picks])
        model(**batch).loss.backward()
        model.zero_grad(set_to_none=True)
        return shape

    done, peaks = collect_peak_alloc(shapes, step, "cpu")
    rows, length = zip(*done)
    return MemoryModel(device="cpu").fit(list(rows), list(length), peaks)


@pytest.fixture(scope="module")
def kjv_tokens(tokenizer):
    texts = kjv_passages()[:160]
    rows = [{"text": t, "label": int("LORD" in t)} for t in texts]
    return tokenize_source(rows, tokenizer, max_length=64, keep=["label"])


@pytest.mark.parametrize("name", ["fixed", "difference", "tokens", "memory"])
def test_a_small_model_fine_tunes_with_each_sampler(tokenizer, kjv_tokens, one_thread, name):
    model = _tiny_bert(len(tokenizer))
    collate = TrainingCollator(tokenizer)
    constraint = {
        "fixed": lambda: FixedBatchSize(16),
        "difference": lambda: LengthDifference(8, 24),
        "tokens": lambda: TokenBudget(600, 32),
        "memory": lambda: MemoryBudget(_fitted_memory_model(model, collate, kjv_tokens.dataset),
                                       reference_batch=(8, 64), memory_margin=0.0),
    }[name]()
    sampler = SmartBatchSampler(kjv_tokens.lengths, constraint, window_batches=4, seed=0)
    loader = torch.utils.data.DataLoader(kjv_tokens.dataset, batch_sampler=sampler, collate_fn=collate)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    def loss_on_all_rows():
        with torch.no_grad():
            batches = [collate([kjv_tokens.dataset[i] for i in range(s, min(s + 60, len(kjv_tokens)))])
                       for s in range(0, len(kjv_tokens), 60)]
            return float(np.mean([float(model(**b).loss) for b in batches]))

    before = loss_on_all_rows()
    losses, rows = [], 0
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for batch in loader:
            loss = model(**batch).loss
            loss.backward()
            assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters()
                       if p is not model.bert.embeddings.token_type_embeddings.weight)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            rows += len(batch["labels"])
    assert all(np.isfinite(losses))
    assert rows == 2 * len(kjv_tokens)
    assert loss_on_all_rows() < before
