import copy

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

from dynabatch.data.packing import PackedCollator, packed_dataloader
from dynabatch.sampling.multipack import MultipackBatchSampler
from dynabatch.training.hf import BatchSamplerTrainer
from dynabatch.training.packed_loss import count_target_tokens, num_items_in_batch, packed_causal_lm_loss

VOCAB = 97


def _setup(seed=0):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config)
    rng = np.random.default_rng(seed)
    examples = [{"input_ids": rng.integers(1, VOCAB, size=int(n)).tolist()} for n in rng.integers(2, 30, size=13)]
    for e in examples[::3]:  # some sequences train on their second half only
        half = len(e["input_ids"]) // 2
        e["labels"] = [-100] * half + e["input_ids"][half:]
    lengths = np.array([len(e["input_ids"]) for e in examples])
    return model, examples, lengths


def _reference_grads(model, examples):
    """The gradient of the token mean over every target of every sequence, each sequence run alone."""
    model = copy.deepcopy(model)
    total = 0
    losses = []
    for e in examples:
        ids = torch.tensor([e["input_ids"]])
        labels = torch.tensor([e.get("labels", e["input_ids"])])
        logits = model(input_ids=ids).logits
        losses.append(torch.nn.functional.cross_entropy(logits[0, :-1], labels[0, 1:], reduction="sum"))
        total += int(labels[0, 1:].ne(-100).sum())
    (sum(losses) / total).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def _close(grads, reference):
    worst = max((grads[k] - reference[k]).abs().max().item() for k in reference)
    scale = max(reference[k].abs().max().item() for k in reference)
    return worst / scale


def test_count_and_loss_helpers():
    labels = torch.tensor([[-100, 2, 3, -100, 5], [-100, 7, -100, -100, -100]])
    assert count_target_tokens(labels) == 4 and count_target_tokens(labels, shift=False) == 4
    assert num_items_in_batch([{"labels": labels}, {"labels": labels[:1]}]) == 7
    logits = torch.randn(2, 5, 11)
    by_hand = sum(torch.nn.functional.cross_entropy(logits[r, t - 1], labels[r, t], reduction="sum")
                  for r in range(2) for t in range(1, 5) if labels[r, t] != -100)
    assert packed_causal_lm_loss(logits, labels).item() == pytest.approx(by_hand.item() / 4, rel=1e-6)
    assert packed_causal_lm_loss(logits, labels, 8).item() == pytest.approx(by_hand.item() / 8, rel=1e-6)
    with pytest.raises(ValueError, match="num_items_in_batch should be a positive number of target tokens"):
        packed_causal_lm_loss(logits, labels, 0)
    with pytest.raises(TypeError, match="labels should be an integer torch.Tensor"):
        count_target_tokens([[1, 2]])
    with pytest.raises(ValueError, match=r"logits should be a tensor of shape \(rows, tokens, vocab\) matching"):
        packed_causal_lm_loss(logits[:1], labels)


def test_gradient_accumulation_over_packed_micro_batches_is_the_token_mean(one_thread):
    model, examples, lengths = _setup()
    reference = _reference_grads(model, examples)
    sampler = MultipackBatchSampler(list(range(len(examples))), 2, 40, lengths, drop_last=False)
    micro = list(packed_dataloader(examples, sampler, PackedCollator(block_mask="float")))
    assert len(micro) >= 3  # a real accumulation: several micro-batches of different target counts
    items = num_items_in_batch(micro)
    for batch in micro:
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                       attention_mask=batch["attention_mask"]).logits
        packed_causal_lm_loss(logits, batch["labels"], items).backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    assert _close(grads, reference) < 1e-5
    # the mean of per-micro-batch means (what a plain loop does) is measurably different
    model.zero_grad()
    for batch in micro:
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                       attention_mask=batch["attention_mask"]).logits
        (packed_causal_lm_loss(logits, batch["labels"]) / len(micro)).backward()
    assert _close({name: p.grad for name, p in model.named_parameters()}, reference) > 1e-3


def test_hf_trainer_step_with_packed_accumulation_follows_the_token_mean(one_thread, tmp_path):
    model, examples, lengths = _setup(1)
    reference = _reference_grads(model, examples)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    sampler = MultipackBatchSampler(list(range(len(examples))), 2, 40, lengths, drop_last=False)
    steps = len(sampler)  # one optimizer step over every micro-batch of the epoch
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], remove_unused_columns=False,
                             gradient_accumulation_steps=steps, max_steps=1, optim="sgd", learning_rate=1.0,
                             lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0,
                             save_strategy="no", logging_strategy="no", disable_tqdm=True)
    collator = PackedCollator(block_mask="float", return_flash_attn_kwargs=False)
    trainer = BatchSamplerTrainer(model=model, args=args, train_dataset=examples, data_collator=collator,
                                  train_batch_sampler=sampler)
    trainer.train()
    step = {name: before[name] - p.detach() for name, p in trainer.model.named_parameters()}  # lr 1: the gradient
    assert _close(step, reference) < 1e-4


@pytest.mark.slow
def test_packed_finetune_example_runs(tmp_path, warm):  # in a fork of tests/_warm.py's interpreter: no import wait
    import os
    import sys
    from pathlib import Path

    import _warm

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    result = _warm.run(warm, [sys.executable, str(root / "examples" / "packed_finetune.py"), "--n-texts", "60",
                              "--max-len", "64", "--bins", "2"], text=True, env=env, cwd=root, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "60 passages" in result.stdout and "packed micro-batches of 2 x 64 tokens" in result.stdout
    assert "optimizer steps in" in result.stdout
