"""The whole multi-task run in one call (the multi-task system's ``HeterogeneousTrainingConfig`` and pipeline).

:meth:`DynamicBatchingTrainingPipeline.train` calibrates a
:class:`~dynabatch.compat.multitask.MemoryPredictor` on the real model's training step (a few
probe batches per task, measured), builds the :class:`~dynabatch.compat.multitask.OOMGuardian`,
the :class:`~dynabatch.DynamicBatchingMonitor` and the
:class:`~dynabatch.compat.multitask.DynamicBatchingTrainer`, and trains. The monitor's files go
to ``<output_dir>/training_metrics/``. Calibration fills the guardian's
budget (:meth:`DynamicBatchingTrainingPipeline.calibration_budget`):
``max_memory_mb`` in MB of 10**6 bytes, less the margin.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
from collections import Counter
from collections.abc import Hashable
from typing import Any

import numpy as np
import torch

from dynabatch._validation import bad_type, bad_value
from dynabatch.compat.multitask.monitor import DynamicBatchingMonitor
from dynabatch.compat.multitask.oom_guardian import GradientCheckpointManager, OOMGuardian
from dynabatch.compat.multitask.predictor import MemoryPredictor, task_shares
from dynabatch.compat.multitask.sampler import read_task_metadata
from dynabatch.compat.multitask.trainer import DynamicBatchingTrainer
from dynabatch.memory.device import default_device

__all__ = ["DynamicBatchingTrainingPipeline", "HeterogeneousTrainingConfig"]

logger = logging.getLogger(__name__)


_MIX_TOLERANCE = 0.05  # a share of the data's task mix: what rounding a described mix such as 0.4 / 0.3 / 0.3 needs


def _check_task_mix(task_distribution: Any, tasks: list[Hashable]) -> None:
    """Refuses a ``task_distribution`` that is not the data's own mix, which the batches follow: a given mix the run
    did not train on would be a setting silently ignored."""
    name = "config.task_distribution"
    given = dict(zip(task_distribution, task_shares(name, task_distribution).tolist()))
    counts = Counter(tasks)
    unknown = [task for task in given if task not in counts]
    if unknown:
        raise bad_value(name, f"a dict over the data's tasks (unknown: {unknown})", task_distribution)
    data = {task: counts[task] / len(tasks) for task in [*given, *counts]}  # the given tasks first, as the message
    if max(abs(given.get(task, 0.0) - share) for task, share in data.items()) > _MIX_TOLERANCE:
        mix = {task: round(share, 3) for task, share in data.items()}
        raise bad_value(name, f"the data's own task mix, which the batches follow, within {_MIX_TOLERANCE} of each "
                        f"share ({mix}; resample the dataset to train on another mix, or leave task_distribution=None)",
                        task_distribution)


@dataclasses.dataclass
class HeterogeneousTrainingConfig:
    """Settings of a memory-aware multi-task run; defaults are the multi-task system's where its docs show them.

    ``max_memory_mb`` is in MB of 10**6 bytes (that system's docs call 30000 a
    "30GB" limit). ``task_distribution`` and ``initial_task_loss_weights``
    default to ``None``: the tasks found in the data, each weighing 1.0 (its
    docs' example values are for their tasks T1-T3). ``max_steps=-1`` lets
    ``num_epochs`` decide (its docs show 10000 for long runs). The batches
    follow the data's own task mix: a ``task_distribution`` given describes it,
    and :meth:`DynamicBatchingTrainingPipeline.train` refuses one whose shares are
    more than 0.05 from the data's (resample the dataset to change the mix).
    ``simulate_memory_limit`` (CPU only) makes going over ``max_memory_mb`` a
    real out-of-memory error.
    """

    # memory
    max_memory_mb: float = 30000
    memory_margin_percent: float = 0.10
    enable_gradient_checkpointing: bool = False
    simulate_memory_limit: bool = False
    # batches
    base_batch_size: int = 16
    target_batch_size: int | None = 32
    gradient_accumulation_steps: int = 2
    use_gradient_accumulation: bool = True
    task_diversity_weight: float = 0.5
    sort_window: int | None = None
    batch_size_normalizer: str = "tokens"
    # tasks
    task_distribution: dict[Hashable, float] | None = None
    initial_task_loss_weights: dict[Hashable, float] | None = None
    use_grad_norm_balancing: bool = False
    grad_norm_alpha: float = 1.5
    # training
    num_epochs: int = 3
    learning_rate: float = 5e-5
    warmup_steps: int = 500
    max_steps: int = -1
    seed: int = 42
    logging_steps: int = 10
    save_steps: int | None = None
    output_dir: str = "./dynamic_training_outputs"
    resume_from_checkpoint: str | bool | None = None
    # calibration
    calibration_batch_sizes: tuple[int, ...] | None = None  # default (2, base/4); then rows filling the budget
    calibration_length_quantiles: tuple[float, ...] = (0.5, 1.0)
    extra_training_args: dict[str, Any] = dataclasses.field(default_factory=dict)


class _Probes:
    """Probe batches of real samples: per task, at length quantiles of the task, and padded to the
    dataset's longest length (a mixed batch pads a task's samples that far)."""

    def __init__(self, dataset: Any, tasks: list, lengths: np.ndarray, collator: Any, quantiles) -> None:
        self.dataset, self.collator = dataset, collator
        self.padded = copy.copy(collator)
        self.padded.pad_to_multiple_of = int(lengths.max())  # exactly the longest length wide
        self.groups = []  # (task, sample positions sorted by length, end of the window, padded?)
        for task in dict.fromkeys(tasks):
            mine = np.array([i for i, t in enumerate(tasks) if t == task])
            mine = mine[np.argsort(lengths[mine], kind="stable")]
            ends = sorted({max(round(q * (len(mine) - 1)) + 1, 1) for q in quantiles})
            self.groups += [(task, mine, end, False) for end in ends]
            if lengths[mine].max() < lengths.max():
                self.groups.append((task, mine, len(mine), True))

    def batch(self, group: int, rows: int) -> tuple[Any, Any]:
        task, mine, end, padded = self.groups[group]
        rows = min(rows, len(mine))
        start = max(end - rows, 0)
        picked = [self.dataset[int(i)] for i in mine[start : start + rows]]
        return task, (self.padded if padded else self.collator)(picked)


class DynamicBatchingTrainingPipeline:
    """Calibrate, guard, monitor and train: ``DynamicBatchingTrainingPipeline(config, model, tokenizer).train(...)``.

    Args:
        config: a :class:`HeterogeneousTrainingConfig`.
        model: a transformers model (or any model the HF ``Trainer`` takes) returning logits.
        tokenizer: pads batches (its ``pad_token_id``) and is saved with checkpoints.
    """

    def __init__(self, config: HeterogeneousTrainingConfig, model: torch.nn.Module, tokenizer: Any) -> None:
        if not isinstance(config, HeterogeneousTrainingConfig):
            raise bad_type("config", "a HeterogeneousTrainingConfig", config)
        if not isinstance(model, torch.nn.Module):
            raise bad_type("model", "a torch.nn.Module", model)
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.device = default_device()
        self.predictor = MemoryPredictor(self.device)
        self.guardian: OOMGuardian | None = None
        self.monitor: DynamicBatchingMonitor | None = None
        self.trainer: DynamicBatchingTrainer | None = None

    def _training_args(self, has_eval: bool):
        from transformers import TrainingArguments

        c = self.config
        kwargs: dict[str, Any] = {
            "output_dir": c.output_dir,
            "num_train_epochs": c.num_epochs,
            "learning_rate": c.learning_rate,
            "warmup_steps": c.warmup_steps,
            "max_steps": c.max_steps,
            "per_device_train_batch_size": c.base_batch_size,
            "per_device_eval_batch_size": c.base_batch_size,
            "gradient_accumulation_steps": 1,
            "seed": c.seed,
            "logging_steps": c.logging_steps,
            "save_strategy": "steps" if c.save_steps else "no",
            "eval_strategy": "epoch" if has_eval else "no",
            "use_cpu": self.device.type == "cpu",
            "report_to": [],
            "remove_unused_columns": False,
            "disable_tqdm": True,
        }
        if c.save_steps:
            kwargs["save_steps"] = c.save_steps
        kwargs.update(c.extra_training_args)
        return TrainingArguments(**kwargs)

    def train(self, train_dataset: Any, eval_dataset: Any = None) -> dict[str, Any]:
        """Calibrates on the real training step, then trains; returns what happened.

        Returns:
            ``train_output`` (HF ``TrainOutput``), ``report`` (the monitor's
            training report), ``calibration_accuracy`` (per task),
            ``eval_metrics`` (when an eval dataset was given) and ``metrics_dir``.
        """
        c = self.config
        tasks, lengths = read_task_metadata(train_dataset)
        if c.task_distribution is not None:
            _check_task_mix(c.task_distribution, tasks)
        if c.enable_gradient_checkpointing:
            GradientCheckpointManager.enable_gradient_checkpointing(self.model)
        self.guardian = self._guardian()
        self.monitor = DynamicBatchingMonitor(os.path.join(c.output_dir, "training_metrics"))
        self.trainer = DynamicBatchingTrainer(
            model=self.model,
            args=self._training_args(eval_dataset is not None),
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=self.tokenizer,
            memory_predictor=self.predictor,
            oom_guardian=self.guardian,
            batch_size_normalizer=c.batch_size_normalizer,
            task_loss_weights=c.initial_task_loss_weights,
            use_gradient_accumulation=c.use_gradient_accumulation,
            target_batch_size=c.target_batch_size or c.base_batch_size * c.gradient_accumulation_steps,
            task_diversity_weight=c.task_diversity_weight,
            sort_window=c.sort_window,
            use_grad_norm_balancing=c.use_grad_norm_balancing,
            grad_norm_alpha=c.grad_norm_alpha,
            monitor=self.monitor,
        )
        if not c.resume_from_checkpoint:
            self.calibrate(train_dataset, tasks, lengths)
        train_output = self.trainer.train(resume_from_checkpoint=c.resume_from_checkpoint)
        result = {
            "train_output": train_output,
            "report": self.monitor.generate_report() if self.monitor.batches else None,
            "calibration_accuracy": self.predictor.get_calibration_accuracy(),
            "metrics_dir": self.monitor.output_dir,
        }
        if eval_dataset is not None:
            result["eval_metrics"] = self.trainer.evaluate()
        return result

    def _guardian(self) -> OOMGuardian:
        c = self.config
        return OOMGuardian(self.device, c.memory_margin_percent, max_memory_mb=c.max_memory_mb,
                           predictor=self.predictor, simulate_limit=c.simulate_memory_limit)

    def calibration_budget(self) -> float:
        """The bytes a step may use, which the calibration probes fill: the guardian's budget less its margin."""
        return (self.guardian or self._guardian()).usable_bytes()

    def _predicted(self, task: Hashable, rows: int, length: int) -> float:
        return float(self.predictor.predict_bytes(task, rows, length))

    def calibrate(self, dataset: Any, tasks: list, lengths: np.ndarray) -> int:
        """Measures the real training step on probe batches of every task; returns how many ran."""
        c = self.config
        b = c.base_batch_size
        # Not 1 row: there a row-free phase (allocating the gradients) is the peak, and a batch
        # that small is never what the budget is spent on.
        sizes = c.calibration_batch_sizes or (min(2, b), max(b // 4, 2))
        trainer = self.trainer
        model = trainer.model.to(self.device)
        model.train()

        def step(batch: dict[str, Any]) -> None:
            batch = trainer._prepare_inputs(batch)
            loss, _, _ = trainer._micro_loss(model, batch)
            loss.backward()
            model.zero_grad(set_to_none=True)

        model.zero_grad(set_to_none=True)
        probes = _Probes(dataset, tasks, lengths, trainer.data_collator, c.calibration_length_quantiles)
        usable = self.calibration_budget()
        measured = 0
        for group in range(len(probes.groups)):
            # the given sizes first; then the rows that fill half and 90% of the budget at this
            # length by those first measurements (where the plan spends it)
            todo, done, extended = list(sizes), set(), False
            while todo:
                task, batch = probes.batch(group, todo.pop(0))
                rows, length = batch["input_ids"].shape
                known = task in self.predictor.task_types
                # probing far above the budget teaches nothing the plan uses
                if rows not in done and not (known and self._predicted(task, rows, length) > 1.5 * usable):
                    measured += self.predictor.calibrate(step, [(task, batch)])
                done.add(rows)
                if not todo and not extended and task in self.predictor.task_types:
                    extended = True
                    per_row = self._predicted(task, rows, length) / rows
                    todo = [max(3, min(b, int(f * usable / per_row))) for f in (0.5, 0.9)]
        logger.info("calibrated on %d probe batches: %s", measured, self.predictor.get_calibration_accuracy())
        return measured
