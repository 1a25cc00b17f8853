"""The row rule (``dynabatch.inference.outputs``): what ``fn(batch)`` returns, as one item per row.

The first tests run real models through ``run`` in batches of 2 and of 8: a row's result must never depend
on its batch. The rest pin each line of the rule's table in ``docs/inference.md``.
"""

import logging

import numpy as np
import pytest
import torch
from runner_helpers import MAX_LEN, _load

from dynabatch import Batch, PerRow, run
from dynabatch.data.collate import TokenCollator
from dynabatch.data.tokenization import tokenize_texts
from dynabatch.inference.outputs import RowSplitter, split_rows

pytestmark = pytest.mark.usefixtures("one_thread")


def _pairs(texts, tokenizer, rows=2):
    """A plain iterable of batches of exactly ``rows`` rows (the shape an out-of-memory split leaves)."""
    collate = TokenCollator.from_tokenizer(tokenize_texts(texts, tokenizer, MAX_LEN), tokenizer)
    return [collate(list(range(i, min(i + rows, len(texts))))) for i in range(0, len(texts), rows)]


def _alone(model, tokenizer, text):
    return model(**tokenizer(text, truncation=True, max_length=MAX_LEN, return_tensors="pt"))


@pytest.fixture(scope="module")
def tagger(tokenizer):
    """A random-weight BERT token classifier whose most frequent label, 0, equals the pad id."""
    from transformers import BertConfig, BertForTokenClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64, num_labels=3)
    model = BertForTokenClassification(config).eval()
    with torch.no_grad():
        model.classifier.bias.copy_(torch.tensor([0.5, 0.0, 0.0]))  # label 0 ("O") most, not all, of the time
    return model


def test_a_tuple_of_batch_first_tensors_is_one_field_per_element_in_batches_of_two(tokenizer, minilm, texts):
    with torch.no_grad():
        result = run(lambda b: (minilm(**b).last_hidden_state[:, 0], b["attention_mask"].sum(1)),
                     _pairs(texts[:12], tokenizer), progress=False)
        for p, text in enumerate(texts[:12]):
            vector, length = result[p]
            alone = _alone(minilm, tokenizer, text)
            assert vector.shape == (384,) and int(length) == alone.last_hidden_state.shape[1]
            torch.testing.assert_close(vector, alone.last_hidden_state[0, 0], atol=1e-4, rtol=0)


def test_integer_tags_equal_to_the_pad_id_are_kept(tokenizer, tagger, texts):
    with torch.no_grad():
        result = run(lambda b: tagger(**b).logits.argmax(-1), _load(texts[:24], tokenizer, batch_size=8),
                     token_outputs="per_token", progress=False)  # (rows, width) tags: declared per token
        zeros = 0
        for p, text in enumerate(texts[:24]):
            want = _alone(tagger, tokenizer, text).logits.argmax(-1)[0]
            assert torch.equal(result[p], want)  # every token's tag, trailing label-0 tags included
            zeros += int((want == 0).sum())
    assert zeros > 24  # the case that matters: many tags equal the pad id


@pytest.mark.parametrize("rows", [2, 8])
def test_hidden_states_are_cut_to_each_rows_tokens_whatever_the_batch(tokenizer, minilm, texts, rows):
    with torch.no_grad():
        result = run(lambda b: minilm(**b).last_hidden_state, _pairs(texts[:16], tokenizer, rows), progress=False)
        for p, text in enumerate(texts[:16]):
            alone = _alone(minilm, tokenizer, text).last_hidden_state[0]
            assert result[p].shape == alone.shape
            torch.testing.assert_close(result[p], alone, atol=1e-4, rtol=0)


def test_left_padded_per_token_rows_and_model_outputs(tokenizer, minilm, texts):
    collate = TokenCollator(tokenize_texts(texts[:8], tokenizer, MAX_LEN), pad_token_id=0, padding_side="left")
    with torch.no_grad():
        result = run(lambda b: minilm(**b, output_hidden_states=True), [collate(range(4)), collate(range(4, 8))],
                     progress=False)
        for p, text in enumerate(texts[:8]):
            n = len(tokenizer(text, truncation=True, max_length=MAX_LEN)["input_ids"])
            row = result[p]
            assert row["last_hidden_state"].shape == (n, 384) and row["pooler_output"].shape == (384,)
            assert [h.shape for h in row["hidden_states"]] == [(n, 384)] * 7


def _batch(ids, mask, padding=None):
    return Batch({"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask)},
                 indices=torch.arange(len(ids)))


RIGHT = _batch([[5, 6, 7], [8, 0, 0]], [[1, 1, 1], [1, 0, 0]])
LEFT = _batch([[0, 0, 5, 6], [7, 0, 8, 9]], [[0, 0, 1, 1], [1, 1, 1, 1]])  # row 1: an inner pad id


def test_generated_ids_lose_the_batchs_padding_only():
    echoed = torch.tensor([[0, 0, 5, 6, 3, 0, 0], [7, 0, 8, 9, 0, 4, 0]])
    assert [r.tolist() for r in split_rows(echoed, LEFT, pad_token_id=0)] == [[5, 6, 3], [7, 0, 8, 9, 0, 4]]
    # Not an echo (an encoder-decoder's replies, or top-k ids): nothing is certain, so rows stay whole, unless
    # declared generated; then a leading pad id is its start token and stays.
    decoded = torch.tensor([[0, 3, 4, 0, 0], [0, 5, 0, 0, 0]])
    assert [r.tolist() for r in split_rows(decoded, LEFT, pad_token_id=0)] == decoded.tolist()
    declared = split_rows(decoded, LEFT, pad_token_id=0, token_outputs="generated")
    assert [r.tolist() for r in declared] == [[0, 3, 4], [0, 5]]
    # Without a pad id generated rows stay whole; "whole" keeps every tensor as the batch padded it.
    assert [r.tolist() for r in split_rows(echoed, LEFT)] == echoed.tolist()
    tags = torch.tensor([[4, 0, 0, 2], [1, 0, 3, 0]])
    assert [r.tolist() for r in split_rows(tags, LEFT, pad_token_id=0, token_outputs="whole")] == tags.tolist()


def test_token_outputs_declares_the_reading_of_2d_tensors_as_wide_as_the_batch():
    as_wide = torch.tensor([[0, 3, 4], [0, 5, 0]])
    with pytest.raises(ValueError, match=r"fn\(batch\) should say how its rows are read, but got a 2-D tensor of "
                                         r"shape \(2, 3\) whose dimension 1 equals the batch's width 3: .*"
                                         r"token_outputs='per_token'.*token_outputs='whole'.*token_outputs='generated'"):
        split_rows(as_wide, RIGHT, pad_token_id=0)
    per_token = split_rows(as_wide, RIGHT, pad_token_id=0, token_outputs="per_token")
    assert [r.tolist() for r in per_token] == [[0, 3, 4], [0]]
    generated = split_rows(as_wide, RIGHT, pad_token_id=0, token_outputs="generated")
    assert [r.tolist() for r in generated] == [[0, 3, 4], [0, 5]]
    echo = torch.tensor([[5, 6, 7, 1], [8, 0, 0, 2]])  # starts with input_ids, but read per token as asked
    assert [r.tolist() for r in split_rows(echo, RIGHT, pad_token_id=0, token_outputs="per_token")] == echo.tolist()
    with pytest.raises(ValueError, match=r"token_outputs should be one of \('auto', 'per_token', 'generated', "
                                         r"'whole'\), but got token_outputs='tokens'"):
        split_rows(as_wide, RIGHT, token_outputs="tokens")
    with pytest.raises(TypeError, match=r"token_outputs should be one of .* but got token_outputs=None"):
        run(lambda b: None, [RIGHT], token_outputs=None, progress=False)


def test_a_pooled_vector_as_wide_as_the_first_batch_is_refused_not_cut():
    pooled = torch.randn(2, 3)  # a 3-d embedding, the batch 3 tokens wide: never cut by the attention mask
    with pytest.raises(ValueError, match=r"should say how its rows are read.*token_outputs='whole' to keep each row "
                                         r"whole \(a pooled vector\)$"):
        RowSplitter(pad_token_id=0).split(pooled, RIGHT)
    kept = RowSplitter(pad_token_id=0, token_outputs="whole").split(pooled, RIGHT)
    assert [r.tolist() for r in kept] == pooled.tolist()
    other_width = RowSplitter(pad_token_id=0)  # first read at another width: a vector per row, for the whole run
    other_width.split(torch.randn(2, 3), LEFT)
    assert [r.shape for r in other_width.split(pooled, RIGHT)] == [(3,), (3,)]


def test_a_fields_reading_is_kept_for_the_run_and_a_contradiction_is_refused():
    rows = RowSplitter(pad_token_id=0, token_outputs="per_token")
    assert [r.shape for r in rows.split(torch.randn(2, 3), RIGHT)] == [(3, ), (1,)]
    with pytest.raises(ValueError, match=r"fn\(batch\)\.shape\[1\] should be the batch's width 4, as at its first "
                                         r"batch \(width 3, where it was read as per-token .* token_outputs="):
        rows.split(torch.randn(2, 3), LEFT)
    generated = RowSplitter(pad_token_id=0)
    generated.split(torch.tensor([[5, 6, 7, 9, 0], [8, 0, 0, 9, 9]]), RIGHT)  # an echo: generated ids
    kept = generated.split(torch.tensor([[1, 2, 0], [3, 0, 0]]), RIGHT)  # as wide as the batch now: still generated
    assert [r.tolist() for r in kept] == [[1, 2], [3]]


def test_containers_give_each_row_its_own_slices():
    hidden = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4)
    logits = torch.randn(2, 5)
    tuple_rows = split_rows((logits, hidden, None), RIGHT)
    assert isinstance(tuple_rows[1], tuple) and torch.equal(tuple_rows[1][0], logits[1])
    assert torch.equal(tuple_rows[1][1], hidden[1, :1]) and tuple_rows[1][2] is None
    list_rows = split_rows([logits, hidden, logits], RIGHT)  # 3 fields for 2 rows: one field per element
    assert isinstance(list_rows[0], list) and len(list_rows[0]) == 3
    dict_rows = split_rows({"logits": logits, "loss": torch.tensor(1.5), "hidden_states": (hidden, hidden),
                            "cache": object(), "texts": ["a", "b"]}, RIGHT)
    assert sorted(dict_rows[0]) == ["hidden_states", "logits", "texts"] and dict_rows[1]["texts"] == "b"
    assert dict_rows[0]["hidden_states"][1].shape == (3, 4)
    numpy_rows = split_rows(np.arange(6).reshape(2, 3), RIGHT, token_outputs="per_token")
    assert [r.tolist() for r in numpy_rows] == [[0, 1, 2], [3]]


def test_one_item_per_row_and_what_is_refused():
    assert split_rows(None, RIGHT) == [None, None]
    assert split_rows(["a", "b"], RIGHT) == ["a", "b"]
    per_row = [{"vector": torch.zeros(2), "ids": torch.tensor([1, 2, 3])}, {"vector": torch.ones(2), "ids": None}]
    assert [r["vector"].tolist() for r in split_rows(per_row, RIGHT)] == [[0, 0], [1, 1]]  # dicts: one per row
    replies = [torch.tensor([1, 2]), torch.tensor([3])]  # the first has as many items as the batch has rows
    assert [r.tolist() for r in split_rows(replies, RIGHT)] == [[1, 2], [3]]  # not all batch-first: one per row
    square = [torch.zeros(2, 4), torch.ones(2, 4)]
    with pytest.raises(ValueError, match=r"fn\(batch\) should say how it splits into rows, but got a list of 2 "
                                         r"tensors for a batch of 2 rows.*dynabatch\.PerRow\(items\)"):
        split_rows(square, RIGHT)
    assert [r.tolist() for r in split_rows(PerRow(square), RIGHT)] == [t.tolist() for t in square]
    with pytest.raises(ValueError, match=r"len\(fn\(batch\)\) should be 2 \(a PerRow holds one item per batch row\)"):
        split_rows(PerRow(["a"]), RIGHT)
    with pytest.raises(ValueError, match=r"fn\(batch\)\.shape should be a batch dimension first \(2 rows.*, but "
                       r"got fn\(batch\)\.shape=\(3, 5\): return one row per batch row .*dynabatch\.PerRow"):
        split_rows(torch.zeros(3, 5), RIGHT)
    with pytest.raises(ValueError, match=r"shape=\(3, 2, 4\): its dimension 1 has 2; move it first \(e\.g\. "
                       r"fn\(batch\)\.transpose\(0, 1\)\)$"):  # a sequence-first model's (W, n, H)
        split_rows(torch.zeros(3, 2, 4), RIGHT)
    with pytest.raises(ValueError, match=r"len\(fn\(batch\)\) should be 2 \(one item per batch row\)"):
        split_rows(["a", "b", "c"], RIGHT)
    with pytest.raises(ValueError, match=r"fn\(batch\)\[1\] should be a tensor with a batch dimension first"):
        split_rows((torch.zeros(2), torch.tensor(1.0), torch.zeros(2)), RIGHT)
    with pytest.raises(TypeError, match=r"fn\(batch\) should be a tensor with a batch dimension.* of type str"):
        split_rows("abc", RIGHT)


def test_rows_are_detached_compact_cpu_tensors():
    big = torch.randn(2, 1000, requires_grad=True) * 2
    row, _ = split_rows(big[:, :2], RIGHT)
    assert not row.requires_grad and row.untyped_storage().nbytes() <= 2 * 2 * 4


def test_per_token_rows_need_an_attention_mask():
    no_mask = Batch({"input_ids": torch.tensor([[5, 6, 7], [8, 0, 0]])}, indices=torch.arange(2))
    with pytest.raises(ValueError, match=r"but got a batch without an attention_mask to cut it by.*'whole'"):
        split_rows(torch.zeros(2, 3, 4), no_mask)
    assert len(split_rows(torch.zeros(2, 3, 4), no_mask, token_outputs="whole")) == 2


def test_right_padded_generation_warns_once(caplog):
    rows = RowSplitter(pad_token_id=0, padding_side="right")
    echo = torch.tensor([[5, 6, 7, 9], [8, 0, 0, 9]])
    with caplog.at_level(logging.WARNING, logger="dynabatch.inference.outputs"):
        rows.split(echo, RIGHT)
        rows.split(echo, RIGHT)
    warnings = [r for r in caplog.records if "right-padded prompts" in r.getMessage()]
    assert len(warnings) == 1 and "padding_side = 'left'" in warnings[0].getMessage()
