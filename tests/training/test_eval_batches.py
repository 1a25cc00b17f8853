"""The Trainer hook's ``evaluate()`` and ``predict()`` on planned batches: equal to the Trainer's fixed batches,
and sized from measured peaks so that no batch exceeds the first batch's.

Random-weight BERT classifiers and a random-weight Marian (``predict_with_generate``) on real KJV text, the
real MiniLM tokenizer; every number compared comes from the HF ``Trainer`` itself or the CPU tracker.
"""

import numpy as np
import pytest
import torch

from dynabatch.data.sources import tokenize_source
from dynabatch.data.training_collate import TrainingCollator
from dynabatch.demo import kjv_passages, vary_lengths
from dynabatch.memory.measure import track_peak_memory
from dynabatch.sampling.constraints import TokenBudget
from dynabatch.sampling.smart import SmartBatchSampler
from dynabatch.training._eval_batches import EvalBatchSampler

pytestmark = pytest.mark.usefixtures("one_thread")

N_ROWS = 48
EVAL_BATCH = 8


@pytest.fixture(scope="module")
def texts():
    return vary_lengths(kjv_passages()[2000:], n=N_ROWS, max_words=60, seed=4)


@pytest.fixture(scope="module")
def labelled(tokenizer, texts):
    labels = np.random.default_rng(0).integers(0, 2, N_ROWS)
    rows = [{"text": t, "label": int(y)} for t, y in zip(texts, labels)]
    return tokenize_source(rows, tokenizer, max_length=64, keep=["label"], progress=False), labels


class _Widths:
    """The collator, recording each batch's rows (and the batches, with ``keep=True``)."""

    def __init__(self, collate, keep=False):
        self.collate, self.rows, self.batches, self.keep = collate, [], [], keep

    def __call__(self, features):
        self.rows.append(len(features))
        batch = self.collate(features)
        if self.keep:
            self.batches.append(batch)
        return batch


def _loaders(trainer):
    """The evaluation DataLoaders the trainer builds, recorded."""
    loaders, build = [], trainer.get_eval_dataloader
    trainer.get_eval_dataloader = lambda dataset=None: loaders.append(build(dataset)) or loaders[-1]
    return loaders


def _classifier(tokenizer, num_labels=2):
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64, num_labels=num_labels)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return BertForSequenceClassification(config).eval()


def _args(out, **extra):
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=str(out), per_device_eval_batch_size=EVAL_BATCH, use_cpu=True, report_to=[],
                             remove_unused_columns=False, log_level="error", disable_tqdm=True, **extra)


def _evaluate(tokenizer, tokens, out, eval_batches):
    from dynabatch.training.hf import BatchSamplerTrainer

    seen = []

    def accuracy(prediction):
        seen.append(prediction.label_ids.copy())
        return {"accuracy": float((prediction.predictions.argmax(-1) == prediction.label_ids).mean())}

    collate = _Widths(TrainingCollator(tokenizer))
    trainer = BatchSamplerTrainer(model=_classifier(tokenizer), args=_args(out), eval_dataset=tokens.dataset,
                                  train_dataset=tokens.dataset, data_collator=collate, compute_metrics=accuracy,
                                  train_batch_sampler=SmartBatchSampler(tokens.lengths, TokenBudget(512)),
                                  eval_batches=eval_batches)
    metrics = trainer.evaluate()
    evaluated = list(collate.rows)
    prediction = trainer.predict(tokens.dataset)
    return metrics, prediction, seen, evaluated


def test_evaluate_and_predict_on_planned_batches_equal_fixed_batches_in_dataset_order(tokenizer, labelled, tmp_path):
    tokens, labels = labelled
    fixed, fixed_prediction, _, fixed_rows = _evaluate(tokenizer, tokens, tmp_path / "fixed", "fixed")
    metrics, prediction, seen, rows = _evaluate(tokenizer, tokens, tmp_path / "dynamic", "dynamic")
    assert fixed_rows == [EVAL_BATCH] * (N_ROWS // EVAL_BATCH)
    assert rows[0] == EVAL_BATCH and len(rows) < len(fixed_rows) and sum(rows) == N_ROWS  # later batches grew
    assert metrics["eval_accuracy"] == fixed["eval_accuracy"]
    assert metrics["eval_loss"] == pytest.approx(fixed["eval_loss"], abs=1e-5)  # each row weighs the same
    assert np.array_equal(seen[0], labels)  # compute_metrics sees the rows in dataset order
    assert np.array_equal(prediction.label_ids, labels) and np.array_equal(fixed_prediction.label_ids, labels)
    assert np.abs(prediction.predictions - fixed_prediction.predictions).max() < 1e-5
    assert prediction.metrics["test_loss"] == pytest.approx(fixed_prediction.metrics["test_loss"], abs=1e-5)


def test_dynamic_evaluation_refuses_what_it_cannot_put_back_in_order(tokenizer, labelled, tmp_path):
    from dynabatch.training.hf import BatchSamplerTrainer

    tokens, _ = labelled
    sampler = SmartBatchSampler(tokens.lengths, TokenBudget(512))
    with pytest.raises(ValueError, match=r"eval_batches should be one of \('dynamic', 'fixed'\), but got "
                       r"eval_batches='sorted'"):
        BatchSamplerTrainer(model=_classifier(tokenizer), args=_args(tmp_path), train_batch_sampler=sampler,
                            eval_batches="sorted")
    trainer = BatchSamplerTrainer(model=_classifier(tokenizer), args=_args(tmp_path, eval_do_concat_batches=False),
                                  eval_dataset=tokens.dataset, data_collator=TrainingCollator(tokenizer),
                                  train_batch_sampler=sampler)
    with pytest.raises(ValueError, match=r"args.eval_do_concat_batches should be True with eval_batches='dynamic'"):
        trainer.evaluate()


def test_eval_loss_of_a_per_token_loss_is_the_mean_over_labelled_tokens_whatever_the_batches(tokenizer, labelled,
                                                                                               tmp_path):
    # A token classifier's loss is a mean over its batch's labelled tokens: weighed by rows, eval_loss would follow
    # which rows share a batch (and so the measured memory); weighed by labelled tokens it is the dataset's mean.
    from transformers import BertConfig, BertForTokenClassification, DataCollatorForTokenClassification

    from dynabatch.training.hf import BatchSamplerTrainer

    tokens, _ = labelled
    dataset = tokens.dataset.map(lambda r: {"labels": [i % 2 if i % 3 else -100 for i in range(len(r["input_ids"]))]})
    dataset = dataset.remove_columns(["label"])
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64, num_labels=2)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = BertForTokenClassification(config).eval()
    trainer = BatchSamplerTrainer(model=model, args=_args(tmp_path), data_collator=DataCollatorForTokenClassification(
        tokenizer), train_batch_sampler=SmartBatchSampler(tokens.lengths, TokenBudget(512)))
    prediction = trainer.predict(dataset)
    labelled_tokens = prediction.label_ids != -100
    log_p = torch.log_softmax(torch.from_numpy(prediction.predictions[labelled_tokens]), -1)
    targets = torch.from_numpy(prediction.label_ids[labelled_tokens]).long()
    mean = float(-log_p[torch.arange(len(targets)), targets].mean())
    assert prediction.metrics["test_loss"] == pytest.approx(mean, abs=1e-5)


def test_eval_loss_of_a_gpt2_is_the_mean_over_its_target_tokens(tokenizer, texts, tmp_path):
    # GPT-2's loss_type is None: the Trainer alone counted its targets unshifted (a row's first label too), so its
    # loss was divided by targets plus rows and weighed by them: 4.2% under the mean here.
    from transformers import GPT2Config, GPT2LMHeadModel

    from dynabatch.training.hf import BatchSamplerTrainer

    tokens = tokenize_source(texts, tokenizer, max_length=64, progress=False)
    collate = TrainingCollator(tokenizer, labels_from="input_ids")
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2,
                                           n_positions=64)).eval()
    summed, targets = 0.0, 0
    with torch.no_grad():
        for row in tokens.dataset:  # each row alone: the shifted cross-entropy over its real tokens
            labels = torch.tensor([row["input_ids"]])
            logits = model(input_ids=labels).logits[0, :-1]
            summed += float(torch.nn.functional.cross_entropy(logits, labels[0, 1:], reduction="sum"))
            targets += labels.shape[1] - 1
    trainer = BatchSamplerTrainer(model=model, args=_args(tmp_path), data_collator=collate,
                                  train_batch_sampler=SmartBatchSampler(tokens.lengths, TokenBudget(512)))
    assert trainer.evaluate(tokens.dataset)["eval_loss"] == pytest.approx(summed / targets, rel=1e-5)


def test_compute_metrics_sees_each_row_loss_in_dataset_order(tokenizer, labelled, tmp_path):
    # include_for_metrics=["loss"]: one loss per row (its batch's), put back in dataset order with the predictions.
    from dynabatch.training.hf import BatchSamplerTrainer

    tokens, labels = labelled
    dataset = tokens.dataset.add_column("row", list(range(N_ROWS)))
    batches, seen = [], []

    def collate(features):
        batches.append([f["row"] for f in features])
        return TrainingCollator(tokenizer)([{k: v for k, v in f.items() if k != "row"} for f in features])

    def keep(prediction):
        seen.append(prediction)
        return {}

    trainer = BatchSamplerTrainer(model=_classifier(tokenizer), args=_args(tmp_path, include_for_metrics=["loss"]),
                                  data_collator=collate, compute_metrics=keep,
                                  train_batch_sampler=SmartBatchSampler(tokens.lengths, TokenBudget(512)))
    trainer.evaluate(dataset)
    prediction = seen[0]
    log_p = torch.log_softmax(torch.from_numpy(prediction.predictions), -1)
    row_losses = -log_p[torch.arange(N_ROWS), torch.from_numpy(labels).long()]
    assert len(batches) > 1 and np.array_equal(prediction.label_ids, labels)
    for batch in batches:  # each row carries its own batch's mean loss
        assert np.allclose(prediction.losses[batch], float(row_losses[batch].mean()), atol=1e-5)


@pytest.mark.parametrize("eval_batches", ["dynamic", "fixed"])
def test_a_packed_collator_evaluates_each_example_on_a_row_of_its_own(tokenizer, texts, tmp_path, eval_batches):
    # A PackedCollator packs a plain list of examples into one row: each evaluation batch became one row as wide as
    # its examples together, and predict() gave 2 rows for 12 examples (planned batches silently left out of order).
    from transformers import LlamaConfig, LlamaForCausalLM

    from dynabatch.data.packing import PackedCollator
    from dynabatch.training.hf import BatchSamplerTrainer

    tokens = tokenize_source([{"text": t} for t in texts[:12]], tokenizer, max_length=32, progress=False)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).eval()
    trainer = BatchSamplerTrainer(
        model=model, args=_args(tmp_path), eval_batches=eval_batches,
        data_collator=PackedCollator(pad_token_id=tokenizer.pad_token_id, block_mask="float"),
        train_batch_sampler=SmartBatchSampler(tokens.lengths, TokenBudget(512)),
        preprocess_logits_for_metrics=lambda logits, labels: logits[..., :8])
    prediction = trainer.predict(tokens.dataset)
    ids = tokens.dataset["input_ids"]
    assert prediction.predictions.shape[0] == prediction.label_ids.shape[0] == len(ids)
    alone = []
    with torch.no_grad():
        for i, row in enumerate(ids):  # each example in dataset order, its logits and labels as run alone
            out = model(input_ids=torch.tensor([row]), labels=torch.tensor([row]))
            assert np.abs(prediction.predictions[i, :len(row)] - out.logits[0, :, :8].numpy()).max() < 1e-5
            assert prediction.label_ids[i, 1:len(row)].tolist() == row[1:]
            alone.append((float(out.loss), len(row) - 1))
    if eval_batches == "dynamic":  # the mean over the labelled tokens, as training counts its loss
        reference = sum(loss * n for loss, n in alone) / sum(n for _, n in alone)
        assert prediction.metrics["test_loss"] == pytest.approx(reference, abs=1e-5)


def _strip(row, pad):
    """A generated row without the padding of its batch (pad after its tokens) and of the gathering (-100)."""
    row = [int(t) for t in row if t != -100]
    while len(row) > 1 and row[-1] == pad:
        row.pop()
    return row


def test_seq2seq_predict_with_generate_on_planned_batches_equals_fixed_batches(tokenizer, marian, texts,
                                                                                   tmp_path):
    from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments

    from dynabatch.training.hf import Seq2SeqBatchSamplerTrainer

    rows = [{"source": t, "target": " ".join(t.split()[:4])} for t in texts]
    tokens = tokenize_source(rows, tokenizer, fields={"input_ids": "source", "labels": "target"}, max_length=48,
                             progress=False)
    model = marian
    settings = {"output_dir": str(tmp_path), "per_device_eval_batch_size": EVAL_BATCH, "use_cpu": True,
                "report_to": [], "remove_unused_columns": False, "log_level": "error", "disable_tqdm": True,
                "predict_with_generate": True, "generation_max_length": 10}
    collate = TrainingCollator(tokenizer)
    fixed = Seq2SeqTrainer(model=model, args=Seq2SeqTrainingArguments(**settings), data_collator=collate)
    want = fixed.predict(tokens.dataset)
    dynamic = Seq2SeqBatchSamplerTrainer(model=model, args=Seq2SeqTrainingArguments(**settings), data_collator=collate,
                                         train_batch_sampler=SmartBatchSampler(tokens.lengths, TokenBudget(512)))
    got = dynamic.predict(tokens.dataset)
    assert got.predictions.shape[0] == N_ROWS
    generated = [_strip(r, 0) for r in got.predictions]
    assert generated == [_strip(r, 0) for r in want.predictions]
    assert len({tuple(r) for r in generated}) > N_ROWS // 2  # replies depend on the input: the order matters
    assert [_strip(r, 0) for r in got.label_ids] == [_strip(r, 0) for r in want.label_ids]


# --- batches sized from measured peaks ----------------------------------------------------------------------


def test_evaluation_batches_stay_under_the_first_batch_measured_peak_and_few_steps_are_measured(tokenizer, tmp_path):
    # 20,000 labels (an extreme multi-label classifier): every row's logits and their loss dwarf its hidden states,
    # so a row costs about the same whatever its length. The plan alone grows batches as rows get shorter, well
    # past the first batch's peak; measured, no batch exceeds it, and only a few prediction steps are measured.
    from dynabatch.training.hf import BatchSamplerTrainer

    rows = [{"text": t, "label": i % 20000} for i, t in enumerate(kjv_passages()[2000:2160])]
    tokens = tokenize_source(rows, tokenizer, max_length=64, keep=["label"], progress=False)
    collate = _Widths(TrainingCollator(tokenizer), keep=True)
    trainer = BatchSamplerTrainer(model=_classifier(tokenizer, num_labels=20000), args=_args(tmp_path),
                                  data_collator=collate, train_batch_sampler=SmartBatchSampler(tokens.lengths,
                                                                                              TokenBudget(512)))
    loaders = _loaders(trainer)
    trainer.evaluate(tokens.dataset)
    sampler = loaders[0].dynabatch_sampler

    def peak(batch):  # the prediction step as the Trainer runs it, measured on the CPU tracker
        with track_peak_memory("cpu") as memory:
            trainer.prediction_step(trainer.model, batch, prediction_loss_only=False)
        return memory.peak_bytes

    peaks = [peak(batch) for batch in collate.batches]
    assert sum(collate.rows) == len(rows) and collate.rows[0] == EVAL_BATCH
    assert max(peaks) <= peaks[0]
    plain = [peak(TrainingCollator(tokenizer)([tokens.dataset[int(i)] for i in b])) for b in sampler.planner.batches()]
    assert max(plain) > 1.5 * plain[0]  # what the plan alone would have run
    assert 1 <= sampler.measured_calls <= len(collate.rows) // 4  # the CPU tracker's cost on a few steps only


def test_eval_sampler_follows_the_plan_unmeasured_and_caps_batches_asked_for_before_the_first_peak():
    lengths = np.random.default_rng(0).integers(1, 64, 400)
    plan = [b.tolist() for b in EvalBatchSampler(lengths, 8).planner.batches()]
    assert max(len(b) for b in plan) > 8
    assert [b.tolist() for b in EvalBatchSampler(lengths, 8, device="meta")] == plan  # nothing to measure on
    sampler = EvalBatchSampler(lengths, 8, device="cpu")
    ahead = iter(sampler)
    first, second, third = next(ahead), next(ahead), next(ahead)  # a loader prefetching three batches
    assert len(first) == len(second) == len(third) == 8  # no more rows than the first until its peak is known

    def step(batch):  # a prediction step holding a (rows, width, 256) activation
        width = int(lengths[batch].max())
        with sampler.measuring(rows=len(batch), width=width):
            torch.ones(len(batch), width, 256).sum()

    handed = [first, second, third]
    for batch in handed[:3]:
        step(batch)
    for batch in ahead:
        handed.append(batch)
        step(batch)
    assert max(len(b) for b in handed) > 8  # measured: later batches grow as rows get shorter
    assert 1 <= sampler.measured_calls < len(handed) // 2  # sparse on the CPU
    assert sorted(sampler.order().tolist()) == list(range(400))
