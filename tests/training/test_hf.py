import json
import os
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from dynabatch.data.sources import tokenize_source
from dynabatch.data.training_collate import TrainingCollator
from dynabatch.demo import kjv_passages
from dynabatch.sampling.constraints import LengthDifference, TokenBudget
from dynabatch.sampling.smart import SmartBatchSampler

REPO = Path(__file__).resolve().parents[2]
N_ROWS = 64


@pytest.fixture(scope="module")
def tokens(tokenizer):
    rows = [{"text": t, "row": i} for i, t in enumerate(kjv_passages()[:N_ROWS])]
    return tokenize_source(rows, tokenizer, max_length=48, keep=["row"])


class _Recording:
    """The training collator, recording which rows each batch holds (the ``row`` column)."""

    def __init__(self, tokenizer):
        self.collate = TrainingCollator(tokenizer, labels_from="input_ids")
        self.batches = []

    def __call__(self, features):
        self.batches.append(sorted(f["row"] for f in features))
        return self.collate([{"input_ids": f["input_ids"]} for f in features])


def _gpt2(vocab_size):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=vocab_size, n_embd=32, n_layer=2, n_head=2, n_positions=64,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def _trainer(tokenizer, tokens, out, sampler, **args):
    from transformers import TrainingArguments

    from dynabatch.training.hf import BatchSamplerTrainer

    arguments = TrainingArguments(output_dir=str(out), num_train_epochs=2, learning_rate=3e-3, use_cpu=True,
                                  report_to=[], remove_unused_columns=False, logging_steps=1, save_strategy="no",
                                  log_level="error",
                                  seed=0, disable_tqdm=True, **args)
    collate = _Recording(tokenizer)
    trainer = BatchSamplerTrainer(model=_gpt2(len(tokenizer)), args=arguments, train_dataset=tokens.dataset,
                                  data_collator=collate, train_batch_sampler=sampler)
    return trainer, collate


def _sampler(tokens, **kw):
    return SmartBatchSampler(tokens.lengths, TokenBudget(384, 16), window_batches=2, seed=1, **kw)


@pytest.fixture(scope="module")
def full_run(tokenizer, tokens, tmp_path_factory, one_thread):
    """Two epochs with the Trainer, start to end: (trainer, recorded batches, sampler)."""
    sampler = _sampler(tokens)
    counts = [len(sampler.epoch_batches(e)) for e in range(2)]
    trainer, collate = _trainer(tokenizer, tokens, tmp_path_factory.mktemp("full"), sampler)
    trainer.train()
    return trainer, collate.batches, sampler, counts


def test_trainer_trains_every_row_once_per_epoch_and_the_loss_falls(tokens, full_run):
    trainer, batches, sampler, counts = full_run
    assert counts[0] < counts[1]  # the Trainer fixes the steps from epoch 0: the floor keeps epoch 1 whole
    per_epoch = trainer.state.global_step // 2
    assert per_epoch == counts[1]
    epochs = [batches[:per_epoch], batches[per_epoch:]]
    for share in epochs:
        assert sorted(i for b in share for i in b) == list(range(N_ROWS))
    assert epochs[0] != epochs[1]
    for share, epoch in zip(epochs, range(2)):  # the sampler's own plan of that epoch, in order
        assert share == [sorted(tokens.dataset[b.tolist()]["row"]) for b in sampler.epoch_batches(epoch)]
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert all(np.isfinite(losses)) and np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.5


def test_resuming_mid_epoch_replays_the_rest_of_the_plan(tokenizer, tokens, tmp_path, full_run):
    from transformers import TrainerCallback

    full, full_batches = full_run[:2]
    stop_at = full.state.global_step // 2 + 3  # in the second epoch

    class Stop(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == stop_at:
                control.should_save = control.should_training_stop = True

    first, first_rows = _trainer(tokenizer, tokens, tmp_path / "run", _sampler(tokens))
    first.add_callback(Stop())
    first.train()
    with open(tmp_path / "run" / f"checkpoint-{stop_at}" / "dynabatch_sampler.json") as f:
        state = json.load(f)
    # the state counts the batches trained: the loader had read one more ahead
    assert (state["epoch"], state["batches_done"]) == (1, stop_at - full.state.global_step // 2)
    assert len(first_rows.batches) == stop_at + 1
    second, second_rows = _trainer(tokenizer, tokens, tmp_path / "run", _sampler(tokens))
    second.train(resume_from_checkpoint=True)
    # the stopped run collated one batch ahead of the step it stopped at; it was not trained
    assert first_rows.batches[:stop_at] + second_rows.batches == full_batches  # nothing lost or repeated

    other = SmartBatchSampler(tokens.lengths, LengthDifference(3, 12), seed=0)
    third, _ = _trainer(tokenizer, tokens, tmp_path / "run", other)
    with pytest.raises(ValueError, match="resume_from_checkpoint should hold a sampler state for the same data"):
        third.train(resume_from_checkpoint=True)


@pytest.mark.parametrize("accumulation", [1, 3])
def test_an_accumulated_step_of_a_gpt2_has_the_gradient_of_its_rows_in_one_batch(tokenizer, tokens, tmp_path,
                                                                                one_thread, accumulation):
    """The step's loss is the mean over its target tokens, as one batch of its rows gives it: a GPT-2's
    ``loss_type`` is None, so the Trainer alone counted its unshifted labels (targets plus rows: 3.6% off here)."""
    import copy

    from transformers import TrainerCallback

    class Gradients(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})

    grads = []
    sampler = SmartBatchSampler(tokens.lengths, TokenBudget(300, 16), window_batches=2, seed=1)
    trainer, collate = _trainer(tokenizer, tokens, tmp_path, sampler, max_steps=1, optim="sgd", max_grad_norm=0,
                                gradient_accumulation_steps=accumulation)
    reference = copy.deepcopy(trainer.model)
    trainer.add_callback(Gradients())
    trainer.train()
    step = collate.batches[:accumulation]
    assert len({len(b) for b in step}) == accumulation  # micro-batches of different rows
    one_batch = collate.collate([{"input_ids": tokens.dataset[r]["input_ids"]} for b in step for r in b])
    reference.zero_grad()
    reference(**one_batch).loss.backward()  # the mean over the rows' target tokens
    for name, param in reference.named_parameters():
        assert torch.allclose(grads[0][name], param.grad, rtol=1e-4, atol=1e-7), name


def _bert_classifier(vocab_size):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=1,
                                                    num_attention_heads=2, intermediate_size=64, num_labels=2,
                                                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def _classifier_step(tokenizer, out, accumulation, n_rows, **sharding):
    """One optimizer step of a random-weight BERT classifier under the hook (SGD, no clipping), on planned batches
    of KJV passages labelled i % 2: (the rows of its micro-batches, the gradients at the optimizer step, the data)."""
    from transformers import TrainerCallback, TrainingArguments

    from dynabatch.training.hf import BatchSamplerTrainer

    rows = [{"text": t, "label": i % 2, "row": i} for i, t in enumerate(kjv_passages()[:n_rows])]
    labelled = tokenize_source(rows, tokenizer, max_length=40, keep=["label", "row"], progress=False)
    collate, batches, grads = TrainingCollator(tokenizer), [], []

    def recording(features):
        batches.append([f["row"] for f in features])
        return collate([{k: v for k, v in f.items() if k != "row"} for f in features])

    class Gradients(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})

    args = TrainingArguments(str(out), max_steps=1, use_cpu=True, report_to=[], remove_unused_columns=False,
                             save_strategy="no", log_level="error", seed=0, disable_tqdm=True, optim="sgd",
                             max_grad_norm=0, gradient_accumulation_steps=accumulation,
                             ddp_backend="gloo" if sharding else None)
    sampler = SmartBatchSampler(labelled.lengths, TokenBudget(300, 16), window_batches=2, seed=1, **sharding)
    BatchSamplerTrainer(model=_bert_classifier(len(tokenizer)), args=args, train_dataset=labelled.dataset,
                        data_collator=recording, train_batch_sampler=sampler, callbacks=[Gradients()]).train()
    return batches[:accumulation], grads[0], labelled


def _gradient_of_one_batch(tokenizer, labelled, rows):
    reference = _bert_classifier(len(tokenizer))
    one_batch = TrainingCollator(tokenizer)([{k: v for k, v in labelled.dataset[r].items() if k != "row"}
                                             for r in rows])
    reference(**one_batch).loss.backward()  # the mean over the rows
    return {name: param.grad for name, param in reference.named_parameters()}


@pytest.mark.parametrize("accumulation", [2, 3])
def test_an_accumulated_step_of_a_classifier_has_the_gradient_of_its_rows_in_one_batch(tokenizer, tmp_path, one_thread,
                                                                                     accumulation):
    """A classifier's loss is its micro-batch's mean, and it ignores num_items_in_batch: the Trainer summed the
    micro-batches' means (the step's gradient 3.4x off at 2 micro-batches of 9 and 2 rows, 11.8x at 3); each
    micro-batch now carries its rows' share of the step."""
    step, grads, labelled = _classifier_step(tokenizer, tmp_path, accumulation, 40)
    assert len({len(b) for b in step}) == accumulation  # micro-batches of different rows
    for name, grad in _gradient_of_one_batch(tokenizer, labelled, [r for b in step for r in b]).items():
        assert torch.allclose(grads[name], grad, rtol=1e-4, atol=1e-7), name


_CLASSIFIER_WORKER = textwrap.dedent(
    """
    import importlib.util, json, os, sys

    from transformers import AutoTokenizer

    from dynabatch.demo import minilm_path

    rank, out = int(sys.argv[1]), sys.argv[2]
    spec = importlib.util.spec_from_file_location("hf_tests", os.path.join("tests", "training", "test_hf.py"))
    tests = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tests)
    step, grads, _ = tests._classifier_step(AutoTokenizer.from_pretrained(minilm_path()), out, 2, 41,
                                            num_replicas=2, shard=False)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"step": step, "grads": {n: g.tolist() for n, g in grads.items() if n.startswith("classifier")}}, f)
    """
)


@pytest.mark.slow
def test_an_accumulated_classifier_step_on_two_ranks_has_the_gradient_of_all_their_rows_in_one_batch(
        tokenizer, tmp_path, run_two_ranks, one_thread):
    """Each rank's micro-batches carry their rows' share of all ranks' (average_tokens_across_devices): DDP's
    mean is the mean over every row of the step, as one process would compute it on their union."""
    reports = run_two_ranks(_CLASSIFIER_WORKER, tmp_path, timeout=300)
    assert reports[0]["grads"] == reports[1]["grads"]
    rows = [r for report in reports for batch in report["step"] for r in batch]
    assert len(rows) == len(set(rows)) and len({len(b) for report in reports for b in report["step"]}) > 1
    labelled = tokenize_source([{"text": t, "label": i % 2, "row": i} for i, t in enumerate(kjv_passages()[:41])],
                               tokenizer, max_length=40, keep=["label", "row"], progress=False)
    for name, grad in _gradient_of_one_batch(tokenizer, labelled, rows).items():
        if name.startswith("classifier"):
            assert torch.allclose(torch.tensor(reports[0]["grads"][name]), grad, rtol=1e-4, atol=1e-7), name


def test_refuses_a_sampler_sharded_for_another_world(tokenizer, tokens, tmp_path):
    trainer, _ = _trainer(tokenizer, tokens, tmp_path, _sampler(tokens, num_replicas=2, rank=0))
    with pytest.raises(ValueError, match="train_batch_sampler should be built with num_replicas=1 in a single"):
        trainer.get_train_dataloader()
    from dynabatch.training.hf import BatchSamplerTrainer

    with pytest.raises(TypeError, match="train_batch_sampler should be a dynabatch PlannedBatchSampler"):
        BatchSamplerTrainer(model=_gpt2(10), train_batch_sampler=[[0, 1]])


# --------------------------------------------------------------------------- accelerate on two CPU processes

_WORKER = textwrap.dedent(
    """
    import json, os, sys

    import numpy as np
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from dynabatch.sampling.constraints import TokenBudget
    from dynabatch.sampling.smart import SmartBatchSampler

    out = sys.argv[2]
    accelerator = Accelerator(cpu=True)
    rank, world = accelerator.process_index, accelerator.num_processes
    lengths = np.random.default_rng(0).integers(1, 64, size=203)
    dealt = SmartBatchSampler(lengths, TokenBudget(300, 16), seed=2, num_replicas=world, shard=False)
    loader = accelerator.prepare(DataLoader(list(range(203)), batch_sampler=dealt, collate_fn=list))
    report = {"world": [rank, world], "epochs": [], "own": []}
    for epoch in range(2):
        loader.set_epoch(epoch)
        dealt.set_epoch(epoch)  # accelerate does not forward set_epoch to a wrapped batch sampler
        report["epochs"].append([batch for batch in loader])
        own = SmartBatchSampler(lengths, TokenBudget(300, 16), seed=2, num_replicas=world, rank=rank)
        own.set_epoch(epoch)
        report["own"].append(list(own))
    accelerator.wait_for_everyone()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    """
)


@pytest.mark.slow
def test_accelerate_on_two_processes_deals_each_rank_its_shard(tmp_path, run_two_ranks):
    reports = run_two_ranks(_WORKER, tmp_path)
    assert [r["world"] for r in reports] == [[0, 2], [1, 2]]
    for epoch in range(2):
        shares = [r["epochs"][epoch] for r in reports]
        assert len(shares[0]) == len(shares[1])
        assert sorted(i for share in shares for b in share for i in b) == list(range(203))
        for r in reports:  # what accelerate deals is exactly the rank's own shard
            assert r["epochs"][epoch] == r["own"][epoch]


# --------------------------------------------------------------------------- packing under the Trainer hook


class _RecordingPacked:
    """The packed collator, recording which rows each packed batch holds (the ``row`` column)."""

    def __init__(self, tokenizer):
        from dynabatch.data.packing import PackedCollator

        self.collate = PackedCollator(pad_token_id=tokenizer.pad_token_id, block_mask="float",
                                      return_flash_attn_kwargs=False)
        self.batches = []

    def __call__(self, bins):
        self.batches.append(sorted(f["row"] for b in bins for f in b))
        return self.collate([[{"input_ids": f["input_ids"]} for f in b] for b in bins])


def _packing_trainer(tokenizer, tokens, out, **args):
    from torch.utils.data import RandomSampler
    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

    from dynabatch.sampling.multipack import MultipackBatchSampler
    from dynabatch.training.hf import BatchSamplerTrainer

    sampler = MultipackBatchSampler(RandomSampler(range(N_ROWS)), batch_size=2, batch_max_len=96,
                                    lengths=tokens.lengths["input_ids"], drop_last=False, seed=3)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=96)
    config._attn_implementation = "sdpa"
    arguments = TrainingArguments(output_dir=str(out), num_train_epochs=2, learning_rate=3e-3, use_cpu=True,
                                  report_to=[], remove_unused_columns=False, logging_steps=1, save_strategy="no",
                                  log_level="error", seed=0, disable_tqdm=True, **args)
    collate = _RecordingPacked(tokenizer)
    trainer = BatchSamplerTrainer(model=LlamaForCausalLM(config), args=arguments, train_dataset=tokens.dataset,
                                  data_collator=collate, train_batch_sampler=sampler)
    return trainer, collate, sampler


@pytest.mark.slow
def test_packing_under_the_trainer_hook_trains_every_row_once_per_epoch_and_resumes(tokenizer, tokens, tmp_path,
                                                                                   one_thread):
    from transformers import TrainerCallback

    full, full_rows, sampler = _packing_trainer(tokenizer, tokens, tmp_path / "full")
    full.train()
    per_epoch = full.state.global_step // 2
    epochs = [full_rows.batches[:per_epoch], full_rows.batches[per_epoch:]]
    for share in epochs:  # every packed row of the epoch trained once, nothing lost
        assert sorted(i for b in share for i in b) == list(range(N_ROWS))
    assert epochs[0] != epochs[1]  # a new packing and order each epoch (set_epoch reached the sampler)
    losses = [h["loss"] for h in full.state.log_history if "loss" in h]
    assert all(np.isfinite(losses)) and np.mean(losses[-3:]) < np.mean(losses[:3])

    stop_at = per_epoch + 2  # mid-way through the second epoch

    class Stop(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == stop_at:
                control.should_save = control.should_training_stop = True

    first, first_rows, _ = _packing_trainer(tokenizer, tokens, tmp_path / "run")
    first.add_callback(Stop())
    first.train()
    assert os.path.isfile(tmp_path / "run" / f"checkpoint-{stop_at}" / "dynabatch_sampler.json")
    second, second_rows, _ = _packing_trainer(tokenizer, tokens, tmp_path / "run")
    second.train(resume_from_checkpoint=True)
    # the resumed run trains exactly the rest of the plan: no row repeated, none skipped
    assert first_rows.batches[:stop_at] + second_rows.batches == full_rows.batches


def test_accelerate_deals_every_sample_once_whatever_the_batch_sizes():
    # accelerate's dealer holds back a step whose last batch is smaller than the sampler's batch_size (a
    # packing sampler's batches have up to batch_size bins): the hook shows it the sampler without one.
    from accelerate.data_loader import BatchSamplerShard

    from dynabatch.sampling.multipack import MultipackBatchSampler
    from dynabatch.training.hf import _AnySize

    lengths = np.random.default_rng(0).integers(5, 40, 203)
    for drop_last in (False, True):
        sampler = MultipackBatchSampler(list(range(203)), 4, 64, lengths, drop_last=drop_last, num_replicas=2,
                                        shard=False)
        for epoch in range(3):
            sampler.set_epoch(epoch)
            dealt = [i for r in range(2) for batch in BatchSamplerShard(_AnySize(sampler), 2, r)
                     for b in batch for i in b]
            assert len(dealt) == len(set(dealt)) == 203 - sampler.num_samples_dropped


def test_refuses_a_bool_block_mask_for_a_model_with_eager_attention(tokenizer, tokens, tmp_path):
    # Eager attention adds the 4D mask to its scores: a bool mask adds 0/1 and masks nothing, so a packed row's
    # sequences attend to each other (a random-weight GPT-2's logits moved by 0.1) and the loss is silently wrong.
    from torch.utils.data import RandomSampler
    from transformers import TrainingArguments

    from dynabatch.data.packing import PackedCollator
    from dynabatch.sampling.multipack import MultipackBatchSampler
    from dynabatch.training.hf import BatchSamplerTrainer

    sampler = MultipackBatchSampler(RandomSampler(range(N_ROWS)), batch_size=2, batch_max_len=96,
                                    lengths=tokens.lengths["input_ids"], drop_last=False)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], remove_unused_columns=False,
                             save_strategy="no", disable_tqdm=True)
    for attention, block_mask in (("eager", "bool"), ("eager", "float"), ("sdpa", "bool")):
        model = _gpt2(len(tokenizer))
        model.set_attn_implementation(attention)
        trainer = BatchSamplerTrainer(model=model, args=args, train_dataset=tokens.dataset, train_batch_sampler=sampler,
                                      data_collator=PackedCollator(block_mask=block_mask))
        # Evaluation too (one sequence per row, eager reads the bool mask as none: a Llama's eval logits moved by 0.4)
        if (attention, block_mask) == ("eager", "bool"):
            for refused in (trainer.get_train_dataloader, lambda: trainer.evaluate(tokens.dataset.select(range(4)))):
                with pytest.raises(ValueError, match=r"^data_collator.block_mask should be 'float' for a model with "
                                                     r"eager attention .*but got data_collator.block_mask='bool'$"):
                    refused()
        else:
            assert len(trainer.get_train_dataloader()) == len(sampler)
    # A bidirectional encoder under the causal block mask: its packed logits moved by 3e-3 from its sequences alone
    from transformers import BertConfig, BertForMaskedLM

    encoder = BertForMaskedLM(BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, intermediate_size=64))
    trainer = BatchSamplerTrainer(model=encoder, args=args, train_dataset=tokens.dataset, train_batch_sampler=sampler,
                                  data_collator=PackedCollator(block_mask="float"))
    for refused in (trainer.get_train_dataloader, lambda: trainer.predict(tokens.dataset.select(range(4)))):
        with pytest.raises(ValueError, match=r"^model should be a causal LM when the data_collator is a PackedCollator "
                                             r".*bidirectional\), but got model='BertForMaskedLM'$"):
            refused()


@pytest.mark.parametrize("family", ["opt", "llama"])
def test_a_model_that_lets_packed_sequences_attend_to_each_other_is_refused_before_the_first_optimizer_step(
        tokenizer, tokens, tmp_path, family):
    # Without a block mask OPT reads a packed row as one sequence (its packed logits move with the sequence before);
    # Llama splits the row at its restarting position_ids when no cache is built, which the Trainer's use_cache=False
    # (its default, set in the model's config) gives: trained on, though its config says use_cache=True.
    from torch.utils.data import RandomSampler
    from transformers import LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM, TrainingArguments

    from dynabatch.data.packing import PackedCollator
    from dynabatch.sampling.multipack import MultipackBatchSampler
    from dynabatch.training.hf import BatchSamplerTrainer

    torch.manual_seed(0)
    if family == "opt":
        model = OPTForCausalLM(OPTConfig(vocab_size=len(tokenizer), hidden_size=32, ffn_dim=64, num_hidden_layers=1,
                                         num_attention_heads=2, word_embed_proj_dim=32, max_position_embeddings=96))
    else:
        model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    assert model.config.use_cache
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sampler = MultipackBatchSampler(RandomSampler(range(N_ROWS)), batch_size=2, batch_max_len=96,
                                    lengths=tokens.lengths["input_ids"], drop_last=False)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], remove_unused_columns=False,
                             save_strategy="no", disable_tqdm=True, max_steps=1, learning_rate=1e-2)
    trainer = BatchSamplerTrainer(model=model, args=args, train_dataset=tokens.dataset, train_batch_sampler=sampler,
                                  data_collator=PackedCollator(pad_token_id=tokenizer.pad_token_id))
    if family == "llama":
        trainer.train()
        assert trainer.state.global_step == 1 and not torch.equal(model.model.norm.weight, before["model.norm.weight"])
        return
    with pytest.raises(ValueError, match=r"^block_mask should be 'float' .*for OPTForCausalLM: without a block mask "
                                         r"the sequences packed into one row would attend to each other .*or do not "
                                         r"pack, but got block_mask=None$"):
        trainer.train()
    assert trainer.state.global_step == 0
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # no optimizer step ran


def test_refuses_a_collator_that_would_not_cut_what_a_truncating_packer_plans_cut(tokens, tmp_path):
    # oversized="truncate" plans a 48-token row as 16 tokens: packed whole, rows would be 3x wider than planned
    from transformers import TrainingArguments

    from dynabatch.data.packing import PackedCollator
    from dynabatch.sampling.multipack import MultipackBatchSampler
    from dynabatch.training.hf import BatchSamplerTrainer

    sampler = MultipackBatchSampler(list(range(N_ROWS)), batch_size=2, batch_max_len=16,
                                    lengths=tokens.lengths["input_ids"], drop_last=False, oversized="truncate")
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], remove_unused_columns=False,
                             save_strategy="no", disable_tqdm=True)
    for max_length in (None, 17, 16):
        trainer = BatchSamplerTrainer(model=_gpt2(200), args=args, train_dataset=tokens.dataset,
                                      train_batch_sampler=sampler,
                                      data_collator=PackedCollator(block_mask="float", max_length=max_length))
        if max_length == 16:
            batch = next(iter(trainer.get_train_dataloader()))
            assert batch["input_ids"].shape[1] <= 16
        else:
            with pytest.raises(ValueError, match=r"^data_collator.max_length should be at most batch_max_len=16 .*"
                                                 rf"PackedCollator\(max_length=16\)\), but got .*={max_length}$"):
                trainer.get_train_dataloader()
