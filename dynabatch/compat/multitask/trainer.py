"""``DynamicBatchingTrainer``: HF ``Trainer`` with memory-aware multi-task steps (the multi-task system's trainer).

Each item of the training dataloader is one optimizer step: micro-batches
planned under the memory budget by :class:`~dynabatch.compat.multitask.MemoryAwareBatchSampler`,
grouped until they hold ``target_batch_size`` samples. ``training_step`` runs
them one by one through :func:`~dynabatch.training.step_guard.guarded_step`
(an out-of-memory error splits a micro-batch and the gradient stays that of
the whole step), with the loss of :mod:`dynabatch.training.loss`: task-weighted
and normalised by the whole step's token (or sample) count. HF's own loop then
clips, steps the optimizer, logs, evaluates and checkpoints as usual, with
``gradient_accumulation_steps=1`` (the accumulation happens inside the step).

Under several processes, with ``args.average_tokens_across_devices`` (HF's
default), a micro-batch's loss is ``total * W / N``, ``N`` the step's item
count summed over the ``W`` ranks, so DDP's mean over the ranks gives the
mean over ALL the step's target tokens, what one process would compute on
their union (without it: each rank's own mean, averaged). Under DDP every
backward runs under ``no_sync`` and the accumulated gradients are averaged
over the ranks once per step, so an out-of-memory split on one rank (more
backward passes there) neither hangs nor desynchronises the ranks. (Other
wrappers, such as FSDP, keep the last micro-batch synchronised: a split in
it is not covered.) The step loss HF logs and the monitor's losses are those
over all ranks' tokens, the same on every rank.

Logged per logging step: ``loss``, ``loss_<task>`` (unweighted mean per task)
and, with GradNorm, ``weight_<task>``. A checkpoint also holds
``dynabatch_state.json`` (the predictor the plan was made from, the task
weights), so a resumed run replays the same plan and HF's skipping of the
steps already done repeats no sample.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Hashable
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from dynabatch._validation import bad_type, check_positive_int
from dynabatch.compat.multitask._trainer_plan import (
    STATE_FILE,  # noqa: F401 (re-exported: the checkpoint file's name, importable from here as before)
    IndexedDataset,
    check_task_weights,
    collate_step,
    read_state,
    reduce_step,
    step_sampler,
    write_state,
)
from dynabatch.compat.multitask.collate import METADATA_KEYS, HeterogeneousCollator
from dynabatch.compat.multitask.gradnorm import GradNormBalancer, shared_parameter
from dynabatch.compat.multitask.monitor import BatchMetrics, DynamicBatchingMonitor
from dynabatch.compat.multitask.oom_guardian import OOMGuardian
from dynabatch.compat.multitask.predictor import MB, MemoryPredictor
from dynabatch.compat.multitask.sampler import MemoryAwareBatchSampler, read_task_metadata
from dynabatch.sampling.ranks import reduce_across_ranks
from dynabatch.training.loss import (
    check_normalization,
    count_items,
    per_sample_losses,
    shifts_labels,
    weighted_loss_sum,
)
from dynabatch.training.step_guard import guarded_step

__all__ = ["DynamicBatchingTrainer"]

logger = logging.getLogger(__name__)


class _MonitorCallback(TrainerCallback):
    def __init__(self, trainer: DynamicBatchingTrainer) -> None:
        self.trainer = trainer

    def on_epoch_begin(self, args, state, control, **kwargs):
        self.trainer._epoch_samples = self.trainer._epoch_steps = 0
        if self.trainer.monitor is not None:
            self.trainer.monitor.start_epoch()

    def on_epoch_end(self, args, state, control, **kwargs):
        t = self.trainer
        if t.monitor is not None:
            t.monitor.end_epoch(total_samples=t._epoch_samples, total_batches=t._epoch_steps)

    def on_train_end(self, args, state, control, **kwargs):
        if self.trainer.monitor is not None and self.trainer.monitor.batches:
            self.trainer.monitor.generate_report()
            self.trainer.monitor.plot_task_comparison()


class DynamicBatchingTrainer(Trainer):
    """HF ``Trainer`` whose steps are memory-planned, OOM-guarded, task-weighted micro-batches.

    Args:
        *args, **kwargs: those of ``transformers.Trainer``. The default data
            collator is a :class:`~dynabatch.compat.multitask.HeterogeneousCollator` of the
            ``processing_class`` (tokenizer).
        memory_predictor: a calibrated :class:`~dynabatch.compat.multitask.MemoryPredictor`; it
            plans the micro-batches and learns from every measured step.
            Without one, micro-batches are ``per_device_train_batch_size`` rows.
        oom_guardian: an :class:`~dynabatch.compat.multitask.OOMGuardian`: its ``max_memory_mb``
            and margin are the plan's budget, it remembers sizes that ran after
            an out-of-memory error (and simulates a device limit on the CPU).
        batch_size_normalizer: ``"tokens"`` (default) or ``"samples"``: what a
            step's loss is the mean over (see :mod:`dynabatch.training.loss`).
        task_loss_weights: weight of each task's loss (tasks not named weigh 1).
        use_gradient_accumulation: accumulate micro-batches until ``target_batch_size``
            samples per optimizer step; otherwise every micro-batch is a step.
        target_batch_size: samples per optimizer step; default
            ``per_device_train_batch_size * gradient_accumulation_steps``.
        max_memory_mb: the budget, when no guardian gives one.
        task_diversity_weight: the sampler's task mix (0 single-task ... 1 global mix).
        use_grad_norm_balancing, grad_norm_alpha, grad_norm_lr: GradNorm on the task weights.
        monitor: a :class:`~dynabatch.DynamicBatchingMonitor` fed one record per step.
        measure_memory: measure every micro-batch's peak (CUDA statistics or the CPU tracker).
        size_field: the metadata field holding a sample's size (default: its length).
        sort_window: the sampler's length sorting window (see
            :class:`~dynabatch.compat.multitask.MemoryAwareBatchSampler`).

    Raises:
        ValueError: ``task_loss_weights`` names a task absent from the training
            data, or a weight is negative; a bad ``batch_size_normalizer``.
    """

    def __init__(
        self,
        *args: Any,
        memory_predictor: MemoryPredictor | None = None,
        oom_guardian: OOMGuardian | None = None,
        batch_size_normalizer: str | None = "tokens",
        task_loss_weights: dict[Hashable, float] | None = None,
        use_gradient_accumulation: bool = True,
        target_batch_size: int | None = None,
        max_memory_mb: float | None = None,
        task_diversity_weight: float = 0.5,
        use_grad_norm_balancing: bool = False,
        grad_norm_alpha: float = 1.5,
        grad_norm_lr: float = 0.025,
        monitor: DynamicBatchingMonitor | None = None,
        measure_memory: bool = True,
        size_field: str | None = None,
        sort_window: int | None = None,
        **kwargs: Any,
    ) -> None:
        given_collator = kwargs.get("data_collator", args[2] if len(args) > 2 else None)
        super().__init__(*args, **kwargs)
        if given_collator is None:
            pad = getattr(self.processing_class, "pad_token_id", None)
            if pad is None:
                pad = getattr(getattr(self.model, "config", None), "pad_token_id", None) or 0
            self.data_collator = HeterogeneousCollator(self.processing_class, pad_token_id=pad)
        if memory_predictor is not None and not isinstance(memory_predictor, MemoryPredictor):
            raise bad_type("memory_predictor", "a MemoryPredictor or None", memory_predictor)
        if oom_guardian is not None and not isinstance(oom_guardian, OOMGuardian):
            raise bad_type("oom_guardian", "an OOMGuardian or None", oom_guardian)
        if monitor is not None and not isinstance(monitor, DynamicBatchingMonitor):
            raise bad_type("monitor", "a DynamicBatchingMonitor or None", monitor)
        self.memory_predictor = memory_predictor
        self.oom_guardian = oom_guardian
        self.normalization = check_normalization("tokens" if batch_size_normalizer is None else batch_size_normalizer)
        self.use_gradient_accumulation = bool(use_gradient_accumulation)
        gas = self.args.gradient_accumulation_steps
        if target_batch_size is None:
            target_batch_size = self.args.per_device_train_batch_size * gas
        self.target_batch_size = check_positive_int("target_batch_size", target_batch_size)
        if gas != 1:
            logger.info("accumulating to target_batch_size=%d inside each step; gradient_accumulation_steps -> 1", target_batch_size)
            self.args.gradient_accumulation_steps = 1
        self.max_memory_mb = max_memory_mb
        if max_memory_mb is None and oom_guardian is not None:
            self.max_memory_mb = oom_guardian.max_memory_mb
        self.task_diversity_weight = task_diversity_weight
        self.size_field = size_field
        self.sort_window = sort_window
        self.monitor = monitor
        self.measure_memory = bool(measure_memory)
        self._train_tasks: list[Hashable] | None = None
        if self.train_dataset is not None:
            tasks, lengths = read_task_metadata(self.train_dataset, size_field)
            self._train_tasks, self._train_lengths = tasks, lengths
        self.task_weights = check_task_weights(task_loss_weights, self._train_tasks)
        self._balancer = None
        if use_grad_norm_balancing:
            self._balancer = GradNormBalancer(shared_parameter(self.model), alpha=grad_norm_alpha, lr=grad_norm_lr)
        self._shifts: bool | None = None
        self._plan_predictor_state: dict[str, Any] | None = None
        self._resume_dir: str | None = None
        self._sampler: MemoryAwareBatchSampler | None = None
        self._epoch_samples = self._epoch_steps = 0
        self._log_task: dict[Hashable, list[float]] = {}
        self.trained_indices: list[list[int]] = []
        self.add_callback(_MonitorCallback(self))

    # -- data ----------------------------------------------------------------
    def _set_signature_columns_if_needed(self) -> None:
        super()._set_signature_columns_if_needed()
        self._signature_columns = list(dict.fromkeys([*self._signature_columns, *METADATA_KEYS]))

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any):
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
        self._resume_dir = resume_from_checkpoint or None
        saved = read_state(self._resume_dir, self.memory_predictor, self.task_weights)
        if saved is not None:
            self._plan_predictor_state = saved.get("plan_predictor")
        return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)

    def get_train_dataloader(self) -> DataLoader:
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        plan_predictor = None
        if self.memory_predictor is not None and self.max_memory_mb is not None:
            plan_predictor = self.memory_predictor
            if self._plan_predictor_state is not None:  # resuming: plan exactly as the saved run did
                plan_predictor = MemoryPredictor(self.memory_predictor.device)
                plan_predictor.load_state_dict(self._plan_predictor_state)
            else:
                self._plan_predictor_state = self.memory_predictor.state_dict()
        elif self.memory_predictor is not None:
            logger.warning("memory_predictor given without max_memory_mb (nor an oom_guardian with one): "
                           "micro-batches of per_device_train_batch_size rows, not planned by memory")
        steps, self._sampler = step_sampler(
            self._train_tasks, self._train_lengths, rows=self.args.per_device_train_batch_size,
            target_batch_size=self.target_batch_size if self.use_gradient_accumulation else None,
            task_diversity_weight=self.task_diversity_weight, seed=self.args.seed,
            world_size=self.accelerator.num_processes, rank=self.accelerator.process_index,
            max_steps=self.args.max_steps, num_train_epochs=self.args.num_train_epochs,
            predictor=plan_predictor, max_memory_mb=self.max_memory_mb,
            memory_margin=self.oom_guardian.memory_margin_percent if self.oom_guardian is not None else 0.10,
            sort_window=self.sort_window,
        )
        loader = DataLoader(
            IndexedDataset(self.train_dataset),
            batch_sampler=steps,
            collate_fn=self._collate_step,
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory,
        )
        return self.accelerator.prepare(loader)

    def _collate_step(self, items: list[tuple[int, Any]]) -> dict[str, Any]:
        return collate_step(self.data_collator, items)

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        if "micro_batches" in inputs:
            return sum(super(DynamicBatchingTrainer, self).floating_point_ops(mb) for mb in inputs["micro_batches"])
        return super().floating_point_ops(inputs)

    # -- loss ----------------------------------------------------------------
    def _shift(self) -> bool:
        """Causal LM labels are shifted (what HF's own loss does for these models)."""
        if self._shifts is None:
            model = self.accelerator.unwrap_model(self.model)
            self._shifts = bool(getattr(self, "_loss_shifts_labels", False) or shifts_labels(model))
        return self._shifts

    def _micro_loss(self, model: torch.nn.Module, batch: dict[str, Any]):
        """Weighted loss sum, per-task (sum tensor, item count), per-sample losses, rows' items."""
        tasks = batch.get("task_type") or [None] * int(batch["labels"].shape[0])
        inputs = {k: v for k, v in batch.items() if k not in METADATA_KEYS and k != "labels"}
        outputs = model(**inputs)
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
        sums, counts = per_sample_losses(logits, batch["labels"], shift=self._shift())
        weights = torch.tensor([self.task_weights.get(t, 1.0) for t in tasks], dtype=torch.float32)
        total = weighted_loss_sum(sums, counts, weights, self.normalization)
        per_task: dict[Hashable, tuple[torch.Tensor, float]] = {}
        for task in dict.fromkeys(tasks):
            rows = torch.tensor([t == task for t in tasks], device=sums.device)
            ones = torch.ones_like(weights)
            part = weighted_loss_sum(sums[rows], counts[rows], ones[rows.cpu()], self.normalization)
            items = float(counts[rows].sum()) if self.normalization == "tokens" else float((counts[rows] > 0).sum())
            per_task[task] = (part, items)
        return total, per_task, outputs

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Task-weighted loss of one (evaluation) batch, normalised by its own items."""
        if "labels" not in inputs:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        batch = dict(inputs)
        total, _, outputs = self._micro_loss(model, batch)
        items = count_items(batch["labels"], shift=self._shift(), normalization=self.normalization)
        loss = total / max(items, 1)
        return (loss, outputs) if return_outputs else loss

    # -- the step ------------------------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        micro_batches = [self._prepare_inputs(mb) for mb in inputs["micro_batches"]]
        total_items = sum(
            count_items(mb["labels"], shift=self._shift(), normalization=self.normalization) for mb in micro_batches
        )
        total_items = max(total_items, 1)
        world = self.accelerator.num_processes
        scale, items = 1, total_items  # loss = total * scale / items: the step's mean over `items`
        if world > 1 and getattr(self.args, "average_tokens_across_devices", True):
            scale, items = world, max(reduce_across_ranks([total_items])[0], 1.0)
        ddp = world > 1 and isinstance(model, torch.nn.parallel.DistributedDataParallel)
        params = [p for p in model.parameters() if p.requires_grad]
        step_loss = 0.0
        task_sum: dict[Hashable, float] = {}
        task_items: dict[Hashable, float] = {}
        peaks, splits, predicted = [], 0, []
        fresh = all(p.grad is None for p in params)

        def step(batch: dict[str, Any]):
            with self.compute_loss_context_manager():
                total, per_task, _ = self._micro_loss(model, batch)
            if self._balancer is not None:
                self._balancer.accumulate({t: s for t, (s, _) in per_task.items()}, {t: n for t, (_, n) in per_task.items()})
            loss = total / items if scale == 1 else total * scale / items
            if loss.requires_grad:
                self.accelerator.backward(loss)
            return float(loss.detach()), {t: (float(s.detach()), n) for t, (s, n) in per_task.items()}

        device = self.args.device if self.measure_memory and self.args.device.type in ("cpu", "cuda") else None
        for i, (mb, idx) in enumerate(zip(micro_batches, inputs["sample_indices"])):
            tasks = mb.get("task_type") or []
            last = i == len(micro_batches) - 1
            ctx = self.accelerator.no_sync(model) if ddp or not last else contextlib.nullcontext()
            with ctx:
                result = guarded_step(step, mb, params, guardian=self.oom_guardian, task_types=tasks, measure_on=device)
            for loss, per_task in result.outputs:
                step_loss += loss
                for task, (s, n) in per_task.items():
                    task_sum[task] = task_sum.get(task, 0.0) + s
                    task_items[task] = task_items.get(task, 0.0) + n
            splits += result.splits
            peaks.extend(p for p in result.peaks if p is not None)
            if self._sampler is not None:
                predicted.append(self._sampler.predicted_mb(idx))
            rows, length = mb["input_ids"].shape if "input_ids" in mb else (len(idx), 0)
            if (
                self.memory_predictor is not None and fresh and i == 0 and result.splits == 0
                and result.peaks[0] is not None and len(set(tasks)) == 1
            ):
                self.memory_predictor.record_actual_memory(tasks[0], result.peaks[0] / MB, int(rows), int(length))
        if self._balancer is not None:
            self.task_weights = self._balancer.step(self.task_weights)
        if world > 1:
            every_task = [*(self._train_tasks or []), None]  # the same list on every rank
            step_loss, per_task_loss = reduce_step(step_loss, task_sum, task_items, every_task, params if ddp else None,
                                                   world)
        else:
            per_task_loss = {t: task_sum[t] / max(task_items[t], 1.0) for t in task_sum}
        for task, loss in per_task_loss.items():
            self._log_task.setdefault(task, []).append(loss)
        flat = [i for group in inputs["sample_indices"] for i in group]
        self.trained_indices.append(flat)
        self._epoch_samples += len(flat)
        self._epoch_steps += 1
        if self.monitor is not None:
            self.monitor.record_batch(BatchMetrics(
                batch_idx=len(self.monitor.batches), timestamp=time.time(),
                task_types=[t for mb in micro_batches for t in (mb.get("task_type") or [])],
                batch_size=len(flat), loss=step_loss, per_task_loss=per_task_loss,
                memory_allocated_mb=max(peaks) / MB if peaks else 0.0,
                predicted_memory_mb=max(predicted) if predicted else None,
                num_micro_batches=len(micro_batches), oom_splits=splits, num_tokens=int(total_items),
                padded_length=max(int(mb["input_ids"].shape[1]) for mb in micro_batches if "input_ids" in mb),
                learning_rate=self._get_learning_rate() if self.lr_scheduler is not None else None,
                task_weights=dict(self.task_weights), epoch=int(self.state.epoch or 0),
            ))
        return torch.tensor(step_loss, device=self.args.device)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:
            for task, losses in self._log_task.items():
                logs[f"loss_{task}"] = float(np.mean(losses))
            if self._balancer is not None:
                logs.update({f"weight_{t}": w for t, w in self.task_weights.items()})
            self._log_task = {}
        super().log(logs, start_time)

    # -- checkpoints ---------------------------------------------------------
    def _save_checkpoint(self, model, trial) -> None:
        super()._save_checkpoint(model, trial)
        folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if self.args.should_save and os.path.isdir(folder):
            write_state(folder, self._plan_predictor_state, self.memory_predictor, self.task_weights)
