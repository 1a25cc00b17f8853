"""Task weighting and step normalisation against losses computed by hand."""

import math

import pytest
import torch

from dynabatch.training.loss import (
    check_normalization,
    count_items,
    per_sample_losses,
    shifts_labels,
    weighted_loss_sum,
)


def _hand_token_losses(logits, labels, shift):
    """Per-row lists of -log softmax(target), written out with math.log on plain floats."""
    rows = []
    for r in range(labels.shape[0]):
        mine = []
        for t in range(labels.shape[1] - (1 if shift else 0)):
            target = int(labels[r, t + 1 if shift else t])
            if target == -100:
                continue
            z = [float(v) for v in logits[r, t]]
            mine.append(math.log(sum(math.exp(v) for v in z)) - z[target])
        rows.append(mine)
    return rows


@pytest.mark.parametrize("shift", [False, True])
def test_per_sample_losses_match_hand_computed(shift):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 7, generator=gen)
    labels = torch.tensor([[1, 2, 3, -100, -100], [4, 5, 6, 0, 1], [-100, 3, -100, -100, -100]])
    sums, counts = per_sample_losses(logits, labels, shift=shift)
    hand = _hand_token_losses(logits, labels, shift)
    assert counts.tolist() == [len(r) for r in hand]
    assert sums.tolist() == pytest.approx([sum(r) for r in hand], rel=1e-5)
    assert count_items(labels, shift=shift, normalization="tokens") == sum(len(r) for r in hand)
    assert count_items(labels, shift=shift, normalization="samples") == sum(1 for r in hand if r)


def test_step_loss_is_weighted_mean_over_all_tokens_not_mean_of_micro_batch_means():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 6, 5, generator=gen)
    labels = torch.randint(0, 5, (4, 6), generator=gen)
    labels[0, 2:] = -100  # row 0: 2 tokens; the others 6
    labels[3, 1:] = -100  # row 3: 1 token
    tasks = ["a", "b", "a", "c"]
    weights = {"a": 2.0, "b": 0.5, "c": 1.0}
    hand = _hand_token_losses(logits, labels, shift=False)
    n_tokens = sum(len(r) for r in hand)
    expected = sum(weights[t] * sum(r) for t, r in zip(tasks, hand)) / n_tokens
    # two micro-batches of different sizes, each divided by the whole step's count
    total = 0.0
    for rows in ([0, 1, 2], [3]):
        sums, counts = per_sample_losses(logits[rows], labels[rows], shift=False)
        w = torch.tensor([weights[tasks[i]] for i in rows])
        total += float(weighted_loss_sum(sums, counts, w, "tokens")) / n_tokens
    assert total == pytest.approx(expected, rel=1e-6)
    # the mean of micro-batch means is a different number here: the test can tell them apart
    means = []
    for rows in ([0, 1, 2], [3]):
        r_tokens = sum(len(hand[i]) for i in rows)
        means.append(sum(weights[tasks[i]] * sum(hand[i]) for i in rows) / r_tokens)
    assert abs(sum(means) / 2 - expected) > 1e-3


def test_samples_normalisation_is_weighted_mean_of_per_sample_means():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 4, 5, generator=gen)
    labels = torch.randint(0, 5, (3, 4), generator=gen)
    labels[1, 1:] = -100
    hand = _hand_token_losses(logits, labels, shift=False)
    w = torch.tensor([1.0, 3.0, 0.5])
    sums, counts = per_sample_losses(logits, labels, shift=False)
    got = float(weighted_loss_sum(sums, counts, w, "samples")) / 3
    expected = sum(float(wi) * sum(r) / len(r) for wi, r in zip(w, hand)) / 3
    assert got == pytest.approx(expected, rel=1e-6)


def test_sequence_classification_labels_are_one_item_per_row():
    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0]])
    labels = torch.tensor([0, 0])
    sums, counts = per_sample_losses(logits, labels, shift=True)
    hand = [math.log(math.exp(2) + 1) - 2, math.log(1 + math.e)]
    assert sums.tolist() == pytest.approx(hand, rel=1e-6)
    assert counts.tolist() == [1, 1]


def test_bad_normalizer_is_named():
    with pytest.raises(ValueError, match=r"batch_size_normalizer should be one of \('tokens', 'samples'\), but got "
                       r"batch_size_normalizer='rows'$"):
        check_normalization("rows")


def test_a_normalizer_object_is_a_type_error():
    # the multi-task system's quick reference passes batch_size_normalizer=normalizer, an object
    class Normalizer:
        pass

    with pytest.raises(TypeError, match=r"batch_size_normalizer should be one of \('tokens', 'samples'\), but got "
                       r"batch_size_normalizer=.* of type Normalizer$"):
        check_normalization(Normalizer())


def test_shifts_labels_for_every_causal_lm_and_no_other_model():
    """GPT-2's loss_type is None (the HF Trainer's own rule misses it), yet its loss is the shifted one."""
    from transformers import (BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel, LlamaConfig,
                              LlamaForCausalLM, MarianConfig, MarianMTModel)

    small = {"vocab_size": 64}
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=8, n_layer=1, n_head=2, **small))
    llama = LlamaForCausalLM(LlamaConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                         num_attention_heads=2, **small))
    bert = BertForSequenceClassification(BertConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                                    intermediate_size=16, **small))
    marian = MarianMTModel(MarianConfig(d_model=8, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                                        decoder_attention_heads=2, encoder_ffn_dim=16, decoder_ffn_dim=16,
                                        decoder_start_token_id=0, pad_token_id=0, **small))
    assert gpt2.loss_type is None
    assert [shifts_labels(m) for m in (gpt2, llama, bert, marian)] == [True, True, False, False]
