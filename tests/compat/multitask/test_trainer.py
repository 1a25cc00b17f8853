"""DynamicBatchingTrainer and the pipeline on a real small model, on CPU, with a measured budget."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from dynabatch.compat.multitask import (
    DynamicBatchingTrainer,
    DynamicBatchingTrainingPipeline,
    HeterogeneousTrainingConfig,
    MultiTaskDataset,
    OOMGuardian,
)
from dynabatch.memory.units import MB
from dynabatch.training.step_sampler import STEP_SEPARATOR

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "multitask_training.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("multitask_training_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def dataset(example, tokenizer):
    return example.build_dataset(tokenizer, n_per_task=16, max_length=32)


def _config(out, budget, **kw):
    base = {"max_memory_mb": budget, "base_batch_size": 8, "target_batch_size": 4, "num_epochs": 3,
            "learning_rate": 3e-3, "warmup_steps": 0, "logging_steps": 5, "output_dir": str(out), "save_steps": 5,
            "calibration_batch_sizes": (2, 4, 8)}
    base.update(kw)
    return HeterogeneousTrainingConfig(**base)


def test_the_pipeline_calibrates_to_the_guardians_budget_in_mb_of_a_million_bytes(example, tokenizer, tmp_path):
    model = example.build_model(tokenizer, hidden=32, max_length=32)
    pipeline = DynamicBatchingTrainingPipeline(_config(tmp_path, 30000), model, tokenizer)  # "30GB" in its docs
    guardian = OOMGuardian(pipeline.device, 0.10, max_memory_mb=30000)
    assert pipeline.calibration_budget() == guardian.usable_bytes() == 30000 * MB * 0.9 == 27 * 10**9


@pytest.mark.parametrize("mix", [{"joke": 0.4, "verse": 0.3, "passage": 0.3}, {"joke": 0.5, "verse": 0.5}])
def test_a_task_distribution_other_than_the_datas_mix_is_refused_before_training(example, tokenizer, dataset, mix,
                                                                                 tmp_path):
    # the batches follow the data's mix (a third each here): another mix given would be a setting silently ignored
    model = example.build_model(tokenizer, hidden=32, max_length=32)
    pipeline = DynamicBatchingTrainingPipeline(_config(tmp_path, 30000, task_distribution=mix), model, tokenizer)
    with pytest.raises(ValueError, match=r"config.task_distribution should be the data's own task mix, which the "
                                         r"batches follow, within 0.05 of each share \(\{'joke': 0.333, 'verse': "
                                         r"0.333, 'passage': 0.333\}; resample the dataset to train on another mix, "
                                         r"or leave task_distribution=None\), but got config.task_distribution="):
        pipeline.train(dataset)
    assert pipeline.trainer is None
    unknown = DynamicBatchingTrainingPipeline(_config(tmp_path, 30000, task_distribution={"T9": 1.0}), model,
                                              tokenizer)
    with pytest.raises(ValueError, match=r"a dict over the data's tasks \(unknown: \['T9'\]\)"):
        unknown.train(dataset)


def test_pipeline_trains_within_a_measured_budget_and_resumes_without_repeating(
    one_thread, example, tokenizer, dataset, tmp_path
):
    model = example.build_model(tokenizer, hidden=32, max_length=32)
    budget = example.measured_budget_mb(model, dataset, rows=4)  # a step on the 4 longest samples, measured
    mix = {"joke": 1.0, "verse": 1.0, "passage": 1.0}  # the data's own: a third each, as fractions of any scale
    pipeline = DynamicBatchingTrainingPipeline(_config(tmp_path, budget, task_distribution=mix), model, tokenizer)
    result = pipeline.train(dataset)
    trainer = pipeline.trainer
    assert pipeline.calibration_budget() == pipeline.guardian.usable_bytes()  # probes fill what the guardian allows

    metrics = Path(result["metrics_dir"])
    steps = json.loads((metrics / "batch_metrics.json").read_text())
    epochs = json.loads((metrics / "epoch_metrics.json").read_text())
    report = json.loads((metrics / "training_report.json").read_text())
    assert len(steps) >= 20 and len(epochs) == 3 and report["num_batches"] == len(steps)
    assert all(s["memory_allocated_mb"] > 0 for s in steps)
    assert max(s["memory_allocated_mb"] for s in steps) <= budget  # every step's measured peak
    assert sum(s["num_micro_batches"] for s in steps) > len(steps)  # steps accumulate micro-batches
    losses = [s["loss"] for s in steps]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3
    for name in ("training_curves.png", "training_curves_memory.png", "task_comparison.png"):
        assert (metrics / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert logged and all(f"loss_{t}" in {k for e in logged for k in e} for t in ("joke", "verse", "passage"))
    for task, acc in result["calibration_accuracy"].items():  # leave-one-out error of each task's fit
        assert acc["num_measurements"] >= 3 and acc["mean_abs_error_pct"] < 10, (task, acc)

    # every sample exactly once per epoch
    per_epoch = len(trainer.trained_indices) // 3
    for e in range(3):
        seen = sorted(i for step in trainer.trained_indices[e * per_epoch:(e + 1) * per_epoch] for i in step)
        assert seen == list(range(len(dataset)))

    # resume from a checkpoint in the middle of the second epoch: the same steps follow, nothing repeats
    step = next(s for s in range(per_epoch + 1, 2 * per_epoch) if s % 5 == 0)
    checkpoint = tmp_path / f"checkpoint-{step}"
    assert (checkpoint / "dynabatch_state.json").is_file()
    fresh = example.build_model(tokenizer, hidden=32, max_length=32)
    resumed = DynamicBatchingTrainingPipeline(
        _config(tmp_path / "resumed", budget, resume_from_checkpoint=str(checkpoint)), fresh, tokenizer
    )
    resumed.train(dataset)
    again = resumed.trainer.trained_indices
    assert again == trainer.trained_indices[step:]
    epoch = trainer.trained_indices[per_epoch:step] + again[: 2 * per_epoch - step]
    assert sorted(i for s in epoch for i in s) == list(range(len(dataset)))


def _step_bundle(trainer, dataset, groups):
    items = []
    for g in groups:
        items += [(i, dataset[i]) for i in g] + [(STEP_SEPARATOR, None)]
    return trainer._collate_step(items[:-1])


def test_training_step_gradient_is_the_weighted_token_mean_over_the_whole_step(
    one_thread, example, tokenizer, dataset, tmp_path
):
    from transformers import TrainingArguments

    model = example.build_model(tokenizer, hidden=32, max_length=32)
    weights = {"joke": 2.0, "verse": 0.5, "passage": 1.0}
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], remove_unused_columns=False)
    trainer = DynamicBatchingTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                                     task_loss_weights=weights, measure_memory=False)
    rows = [0, 1, 20, 40, 41]  # jokes, a verse, passages: different lengths
    model.zero_grad(set_to_none=True)
    loss = trainer.training_step(model, _step_bundle(trainer, dataset, [rows[:2], rows[2:]]))
    got = {n: p.grad.clone() for n, p in model.named_parameters()}

    # by hand: one unpadded forward per sample, token losses summed with the task weight,
    # divided by the number of predicted tokens of the whole step
    model.zero_grad(set_to_none=True)
    total, tokens = 0.0, 0
    for i in rows:
        ids = torch.tensor([dataset[i]["input_ids"]])
        logits = model(input_ids=ids).logits[0, :-1]
        token_losses = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none")
        total = total + weights[dataset[i]["task_type"]] * token_losses.sum()
        tokens += token_losses.numel()
    (total / tokens).backward()
    assert float(loss) == pytest.approx(float((total / tokens).detach()), rel=1e-5)
    worst = max(float((got[n] - p.grad).abs().max()) for n, p in model.named_parameters())
    assert worst < 1e-6


def test_task_loss_weights_must_name_known_tasks(example, tokenizer, dataset, tmp_path):
    from transformers import TrainingArguments

    model = example.build_model(tokenizer, hidden=32, max_length=32)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], remove_unused_columns=False)
    with pytest.raises(ValueError, match=r"task_loss_weights should be a dict over the training data's tasks "
                                         r"\['joke', 'verse', 'passage'\] \(unknown: \['T9'\]\), but got "
                                         r"task_loss_weights=\{'joke': 1.0, 'T9': 2.0\}"):
        DynamicBatchingTrainer(model=model, args=args, train_dataset=dataset,
                               task_loss_weights={"joke": 1.0, "T9": 2.0})
    with pytest.raises(ValueError, match=r"task_loss_weights\['joke'\] should be a finite number >= 0, but got "
                                         r"task_loss_weights\['joke'\]=-1"):
        DynamicBatchingTrainer(model=model, args=args, train_dataset=dataset, task_loss_weights={"joke": -1})
    bad = MultiTaskDataset([{"input_ids": [1, 2], "task_type": "a"}])
    bad.samples[0]["task_type"] = None
    with pytest.raises(ValueError, match=r"dataset.get_sample_metadata\(0\) should be a dict with a 'task_type' key"):
        DynamicBatchingTrainer(model=model, args=args, train_dataset=bad)


def test_without_predictor_with_evaluation_and_gradnorm(one_thread, example, tokenizer, dataset, tmp_path):
    from transformers import TrainingArguments

    model = example.build_model(tokenizer, hidden=32, max_length=32)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=4, logging_steps=2,
                             per_device_train_batch_size=4, gradient_accumulation_steps=2, learning_rate=1e-3,
                             save_strategy="no", disable_tqdm=True)  # remove_unused_columns left on
    trainer = DynamicBatchingTrainer(model=model, args=args, train_dataset=dataset, eval_dataset=dataset,
                                     processing_class=tokenizer, use_grad_norm_balancing=True, grad_norm_lr=0.5,
                                     task_diversity_weight=1.0, measure_memory=False)
    assert trainer.target_batch_size == 8 and trainer.args.gradient_accumulation_steps == 1
    trainer.train()
    assert all(len(step) >= 8 for step in trainer.trained_indices)  # micro-batches of 4 accumulated to 8
    weights = trainer.task_weights
    assert sum(weights.values()) == pytest.approx(3.0) and len(set(weights.values())) > 1
    logged = [e for e in trainer.state.log_history if "loss" in e]
    assert {"weight_joke", "loss_joke"} <= set(logged[-1])
    metrics = trainer.evaluate()
    assert 5 < metrics["eval_loss"] < 15


def test_out_of_memory_inside_training_is_split_and_the_steps_are_unchanged(
    one_thread, example, tokenizer, dataset, tmp_path
):
    from transformers import TrainingArguments

    from dynabatch.compat.multitask import DynamicBatchingMonitor, OOMGuardian

    def run(guardian, out):
        model = example.build_model(tokenizer, hidden=32, max_length=32)
        args = TrainingArguments(output_dir=str(out), use_cpu=True, report_to=[], max_steps=4, learning_rate=1e-3,
                                 per_device_train_batch_size=8, save_strategy="no", disable_tqdm=True)
        monitor = DynamicBatchingMonitor(str(out / "metrics"))
        trainer = DynamicBatchingTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                                         oom_guardian=guardian, monitor=monitor, task_diversity_weight=1.0)
        trainer.train()
        return trainer, monitor

    plain, plain_monitor = run(None, tmp_path / "plain")
    probe = example.build_model(tokenizer, hidden=32, max_length=32)
    limit = 0.6 * example.measured_budget_mb(probe, dataset, rows=8)  # a device too small for 8 long rows
    guardian = OOMGuardian("cpu", max_memory_mb=limit, simulate_limit=True)
    split, split_monitor = run(guardian, tmp_path / "split")
    assert guardian.num_out_of_memory > 0 and sum(b.oom_splits for b in split_monitor.batches) > 0
    assert split.trained_indices == plain.trained_indices
    assert [b.loss for b in split_monitor.batches] == pytest.approx([b.loss for b in plain_monitor.batches], rel=1e-5)
    assert max(b.memory_allocated_mb for b in split_monitor.batches) <= limit


def test_steps_dealt_to_two_ranks_are_whole_steps_every_sample_once():
    # shard=False (accelerate deals the steps): the plan's steps, a multiple of the ranks, none halved
    import numpy as np

    from dynabatch.compat.multitask._trainer_plan import step_sampler

    tasks, lengths = ["a"] * 14 + ["b"] * 13, np.arange(1, 28)
    for max_steps, epochs in ((-1, 3), (5, 1)):
        steps, _ = step_sampler(tasks, lengths, rows=4, target_batch_size=8, task_diversity_weight=0.5, seed=0,
                                world_size=2, max_steps=max_steps, num_train_epochs=epochs)
        for epoch in range(3):
            steps.set_epoch(epoch)
            dealt = [[i for i in step if i != STEP_SEPARATOR] for step in steps]
            assert len(dealt) % 2 == 0 and sorted(i for step in dealt for i in step) == list(range(27))
            assert sum(len(step) < 8 for step in dealt) <= 1  # one short remainder, not every step split in two


def test_every_rank_gets_a_step_with_samples_or_a_clear_error():
    # step separators are not samples: 3 samples never give a rank an empty step
    import numpy as np
    import pytest

    from dynabatch.compat.multitask._trainer_plan import step_sampler
    from dynabatch.training.step_sampler import split_step

    steps, _ = step_sampler(["a"] * 3, np.array([5, 5, 5]), rows=1, target_batch_size=2, task_diversity_weight=0.0,
                            seed=0, world_size=3)
    dealt = [split_step(step) for step in steps]
    assert len(dealt) % 3 == 0 and all(any(micro) for micro in dealt)
    assert sorted(i for step in dealt for micro in step for i in micro) == [0, 1, 2]
    with pytest.raises(ValueError, match=r"num_replicas should be at most 3 for 3 samples in 2 batches"):
        step_sampler(["a"] * 3, np.array([5, 5, 5]), rows=1, target_batch_size=2, task_diversity_weight=0.0,
                     seed=0, world_size=4)
