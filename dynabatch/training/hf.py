"""The HF ``Trainer`` hook: train on the batches a dynabatch sampler plans.

The ``Trainer`` builds its own training DataLoader of fixed-size batches.
:class:`BatchSamplerTrainerMixin` overrides ``get_train_dataloader`` (the
method transformers documents for custom loaders) to build it on your batch
sampler instead, then hands it to ``accelerator.prepare`` as the ``Trainer``
does. Mix it into any ``Trainer`` subclass (``Seq2SeqTrainer``, TRL's
trainers, ...) or use :class:`BatchSamplerTrainer`::

    sampler = SmartBatchSampler(tokens.lengths, TokenBudget(4096, 64), seed=args.seed,
                                num_replicas=args.world_size, shard=args.world_size == 1)
    trainer = BatchSamplerTrainer(model=model, args=args, train_dataset=tokens.dataset,
                                  data_collator=TrainingCollator(tokenizer), train_batch_sampler=sampler)
    trainer.train()

``per_device_train_batch_size`` and ``group_by_length`` play no part: the
sampler decides every batch. Packing works the same way: pass a
:class:`~dynabatch.sampling.multipack.MultipackBatchSampler` and a
:class:`~dynabatch.data.packing.PackedCollator` as ``data_collator`` (each bin
of a batch becomes one row)::

    sampler = MultipackBatchSampler(RandomSampler(ds), batch_size=4, batch_max_len=2048, lengths=lengths,
                                    num_replicas=args.world_size, shard=args.world_size == 1)
    trainer = BatchSamplerTrainer(model=model, args=args, train_dataset=ds,
                                  data_collator=PackedCollator(pad_token_id=tok.pad_token_id, block_mask="bool"),
                                  train_batch_sampler=sampler)

What the hook takes care of:

* **Distributed / accelerate.** With several processes, accelerate puts its
  ``BatchSamplerShard`` in front of a custom batch sampler and deals batch
  ``i`` to rank ``i % world_size``. The sampler is therefore built with
  ``num_replicas=world_size, shard=False``: it yields every rank's batches,
  step by step, in a number that is a multiple of the world size, so the
  dealer gives each rank exactly its share (equal counts, every sample once).
  A sampler built otherwise is refused with the fix in the message. The
  dealer sees the sampler without its ``batch_size`` (if it has one), so a
  smaller last batch of a step is dealt like any other (accelerate would
  otherwise hold back or repeat such steps).
* **Steps per epoch.** The ``Trainer`` fixes the steps of every epoch from
  ``len()`` of the first; a sampler whose epochs differ in batch count (smart
  batching windows) is given a floor (:meth:`~dynabatch.sampling.base.PlannedBatchSampler.set_min_batches`)
  equal to the most batches of any epoch to be trained, so no batch is left out.
* **Epochs and resuming.** A callback sets the sampler's epoch at the start of
  every epoch (accelerate does not forward ``set_epoch`` through its wrappers
  on every path); the ``Trainer`` resumes mid-epoch by skipping the batches
  already trained, which replays the same plan since it depends only on the
  seed and the epoch. Each checkpoint holds the sampler's ``state_dict``
  (``dynabatch_sampler.json``) with ``batches_done`` the batches of the epoch
  *trained* (every rank's, when accelerate deals them), not those the loader
  had read ahead; resuming with other data or settings is refused.
* **Gradient accumulation.** An optimizer step's loss is the mean over the
  items of all its micro-batches, whatever their sizes: a loss that is its
  micro-batch's own mean (a classifier's) is weighed by the micro-batch's items
  over the step's (:meth:`~BatchSamplerTrainerMixin._share_of_the_step`), where
  the ``Trainer`` alone would divide such means by the micro-batches, or sum
  them for a model that takes ``num_items_in_batch`` and ignores it.
* **Out of memory** (``split_on_oom=True``, the default). Every micro-batch
  runs through the one out-of-memory guard
  (:func:`~dynabatch.training.step_guard.guarded_step`): one that runs out
  of memory, in the forward or the backward, is run again in halves whose
  gradients add up to the whole micro-batch's (each part's loss is its share
  of the micro-batch's, so the step equals the unsplit one within float
  tolerance), and what the error taught (the
  failed shape, and a lower limit on a micro-batch's padded cells that rises
  again as parts run) splits later micro-batches before they run
  (``trainer.oom_guardian``). The plan, the optimizer steps and the samples of
  each step do not change, so resuming is unaffected. Under DDP every
  backward runs without synchronisation and the gradients are averaged over
  the ranks once per optimizer step (as the multi-task trainer does), so a
  split on one rank neither hangs nor desynchronises the others. Not under
  DeepSpeed or FSDP, whose engines own the backward (the guard is off there,
  logged once). ``split_on_oom=False`` turns it off: an out-of-memory error
  then ends the run, and DDP synchronises as usual.

* **Packed rows without a block mask.** A ``PackedCollator(block_mask=None)``
  leaves it to the model to keep a row's sequences apart (flash-attention's
  ``cu_seq_lens``, or a mask split at the restarting ``position_ids``); at the
  first training step, before any optimizer step, the model is run on one
  tiny packed row twice (:meth:`~dynabatch.data.packing.PackedCollator.check_sequences_apart`)
  and refused if one sequence's logits move with the sequence before it.

* **Evaluation and prediction.** ``evaluate()`` and ``predict()`` run on the
  inference planner's batches (``eval_batches="dynamic"``, the default): the
  ``per_device_eval_batch_size`` longest rows first, each later batch sized
  from the measured peaks of the prediction steps before it so that it stays
  under the first batch's peak (measured mode, as ``dynabatch.run``); predictions,
  labels and ``compute_metrics`` come in dataset order, and ``eval_loss``
  weighs each batch by the items its loss is a mean over (rows, or labelled
  tokens for per-token labels).
  :class:`Seq2SeqBatchSamplerTrainer` does the same for ``Seq2SeqTrainer``
  (``predict_with_generate`` included). One process; ``eval_batches="fixed"``
  keeps the ``Trainer``'s own batches. Under either, a ``PackedCollator``
  collates each example on a row of its own (one prediction per example).

DeepSpeed runs through the same path (the ``Trainer`` prepares the loader with
accelerate), see ``docs/distributed.md``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler
from transformers import Seq2SeqTrainer, Trainer, TrainerCallback
from transformers.trainer_pt_utils import find_batch_size
from transformers.trainer_utils import EvalLoopOutput, EvalPrediction, get_last_checkpoint, unwrap_peft_model

from dynabatch._validation import bad_type, bad_value, check_bool
from dynabatch.data.collate import batch_shape, take_rows
from dynabatch.data.packing import PackedCollator, PackedDataset
from dynabatch.memory.shape import ModelShape
from dynabatch.sampling.base import PlannedBatchSampler
from dynabatch.training._eval_batches import EvalBatchSampler, eval_lengths, in_order
from dynabatch.training.gradients import sync_gradients
from dynabatch.training.loss import count_items, shifts_labels
from dynabatch.training.step_guard import BATCH_WIDE_FIELDS, StepGuard, guarded_step

__all__ = ["SAMPLER_STATE_FILE", "BatchSamplerTrainer", "BatchSamplerTrainerMixin", "Seq2SeqBatchSamplerTrainer"]

_EVAL_BATCHES = ("dynamic", "fixed")

logger = logging.getLogger(__name__)

SAMPLER_STATE_FILE = "dynabatch_sampler.json"
"""The file in each checkpoint folder holding the sampler's ``state_dict``."""


class _FollowEpochs(TrainerCallback):
    """Sets the sampler's epoch at the start of every epoch; saves its state with each checkpoint."""

    def __init__(self, sampler: PlannedBatchSampler) -> None:
        self.sampler = sampler

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # state.epoch is the epoch and the share of it done (e.g. 1.5 when resuming mid-epoch 1).
        self.sampler.set_epoch(math.floor((state.epoch or 0.0) + 1e-9))

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if os.path.isdir(folder) and args.process_index == 0:
            with open(os.path.join(folder, SAMPLER_STATE_FILE), "w") as f:
                json.dump({**self.sampler.state_dict(), "batches_done": self.trained(state)}, f)

    def trained(self, state: Any) -> int:
        """The batches of the sampler's epoch trained so far (every rank's): the loader reads ahead of training.

        The ``Trainer`` counts ``state.epoch`` as the epoch plus the share of its
        batches (per rank) trained.
        """
        sampler = self.sampler
        dealt = _dealt_to(sampler)
        per_rank = len(sampler) // dealt
        share = min(max((state.epoch or 0.0) - sampler.epoch, 0.0), 1.0)
        return min(round(share * per_rank) * dealt, len(sampler))


class _AnySize(Sampler):
    """The sampler as accelerate's dealer must see it: batches of any size.

    accelerate's ``BatchSamplerShard`` reads a batch sampler's ``batch_size``
    and then yields a step only when its last batch has that many items, so the
    batches of a sampler that has one (``MultipackBatchSampler``: bins;
    ``MemoryAwareBatchSampler``: a most rows) would be withheld or repeated
    whenever a batch is smaller. This view has no ``batch_size``; iteration,
    ``len`` and ``set_epoch`` are the sampler's own.
    """

    def __init__(self, sampler: PlannedBatchSampler) -> None:
        self.sampler = sampler

    def __iter__(self) -> Iterator[Any]:
        return iter(self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)


def _dealt_to(sampler: Any) -> int:
    """How many ranks share what the sampler yields (its ``len``): ``num_replicas`` when accelerate deals it (``shard=False``)."""
    return 1 if sampler.shard else sampler.num_replicas


class BatchSamplerTrainerMixin:
    """Mix into a ``transformers.Trainer`` subclass to train on ``train_batch_sampler``'s batches.

    Args:
        train_batch_sampler: a :class:`~dynabatch.sampling.base.PlannedBatchSampler`
            over ``train_dataset`` (e.g. :class:`~dynabatch.sampling.smart.SmartBatchSampler`);
            with several processes built with ``num_replicas=args.world_size, shard=False``.
        split_on_oom: run every training micro-batch through the out-of-memory
            guard (the default; see the module): a micro-batch that runs out of
            memory is run in parts whose gradients add up to its own, and later
            micro-batches are split before they run once errors show they do
            not fit. ``False``: an out-of-memory error ends the run.
        eval_batches: ``"dynamic"`` (the default): ``evaluate()`` and ``predict()``
            run on the inference planner's batches (the ``per_device_eval_batch_size``
            longest rows first, later batches grown as rows get shorter while the
            measured peaks stay under the first batch's, see
            :mod:`dynabatch.training._eval_batches`), with predictions, labels and
            ``compute_metrics`` in dataset order and ``eval_loss`` the mean of the batches'
            losses weighted by their items (rows, or labelled tokens for per-token labels); one process. ``"fixed"``: the ``Trainer``'s own batches.
        *args, **kwargs: the ``Trainer``'s own.
    """

    def __init__(self, *args: Any, train_batch_sampler: PlannedBatchSampler, split_on_oom: bool = True,
                 eval_batches: str = "dynamic", **kwargs: Any) -> None:
        if not isinstance(train_batch_sampler, PlannedBatchSampler):
            raise bad_type("train_batch_sampler", "a dynabatch PlannedBatchSampler (e.g. SmartBatchSampler)",
                           train_batch_sampler)
        check_bool("split_on_oom", split_on_oom)
        if eval_batches not in _EVAL_BATCHES:
            raise bad_value("eval_batches", f"one of {_EVAL_BATCHES}", eval_batches)
        super().__init__(*args, **kwargs)
        # The Trainer counts a step's targets (num_items_in_batch) on shifted labels only for the causal LMs its
        # loss_type names: a GPT-2's step would be divided by its targets plus its rows, a bias that varies with the
        # rows each planned step holds.
        self._loss_shifts_labels = bool(getattr(self, "_loss_shifts_labels", False)) or shifts_labels(
            unwrap_peft_model(self.model))
        self.train_batch_sampler = train_batch_sampler
        self.split_on_oom = split_on_oom
        self.oom_guardian = StepGuard()
        """What the out-of-memory errors of training taught (``num_out_of_memory``, the sizes that ran)."""
        self._loss_share = 1.0  # the factor on a micro-batch's (or a part's) loss: its share of the step
        self._window_items: int | None = None  # the items of the optimizer step's micro-batches (get_batch_samples)
        self._divides_by_count: bool | None = None  # whether the model's loss follows num_items_in_batch
        self._packing_checked = False  # whether the first training step checked a packed collator against the model
        self.eval_batches = eval_batches
        self._eval_sampler: EvalBatchSampler | None = None  # the planned batches being evaluated
        self._eval_losses: list[tuple[float, int, int]] = []  # (loss, items it is a mean over, rows) of each batch
        self.add_callback(_FollowEpochs(train_batch_sampler))

    def _check_sampler_world(self) -> None:
        sampler, world = self.train_batch_sampler, self.args.world_size
        if world > 1 and (sampler.shard or sampler.num_replicas != world):
            raise bad_value(
                "train_batch_sampler",
                f"built with num_replicas={world}, shard=False under {world} processes (accelerate deals the "
                "batches to the ranks)",
                f"a sampler with num_replicas={sampler.num_replicas}, shard={sampler.shard}",
            )
        if world == 1 and sampler.num_replicas != 1:
            raise bad_value("train_batch_sampler", "built with num_replicas=1 in a single process",
                            f"a sampler with num_replicas={sampler.num_replicas}")

    def _check_packed_mask(self) -> None:
        """Refuses a packed collation the model would read wrong (the loss silently that of one row).

        The collator's block mask is causal and its labels are for next-token prediction: a model whose every
        attention layer is bidirectional (``is_causal=False``: BERT-style encoders) would read the rows wrong.
        Eager attention adds the 4D mask to its scores: a ``bool`` mask adds 1 or 0 instead of masking, so
        every sequence of a packed row attends to the others and the loss is silently that of one long
        sequence (sdpa reads a bool mask as allowed / not allowed).
        """
        collator = self.data_collator
        if not isinstance(collator, PackedCollator):
            return
        causal = {m.is_causal for m in self.model.modules() if isinstance(getattr(m, "is_causal", None), bool)}
        if causal == {False}:  # a bidirectional encoder: the causal block mask and shifted labels would be wrong
            raise bad_value("model", "a causal LM when the data_collator is a PackedCollator (its rows are for causal "
                            "attention and next-token labels; every attention layer of this model is bidirectional)",
                            type(self.model).__name__)
        attention = getattr(getattr(self.model, "config", None), "_attn_implementation", None)
        if collator.block_mask == "bool" and attention == "eager":
            raise bad_value("data_collator.block_mask", "'float' for a model with eager attention (eager adds a "
                            "bool mask to its scores as 0 and 1, so the sequences of a packed row would attend to "
                            "each other; 'bool' is for sdpa)", collator.block_mask)

    def _check_packed_attention(self) -> None:
        """At the first training step, refuses a model that would let a packed row's sequences attend to each other.

        Without a block mask only the model can keep them apart (:meth:`PackedCollator.check_sequences_apart`
        runs it on a tiny packed row to see whether it does). It runs here, before any optimizer step, on the
        model as training runs it: prepared (on its device, its forward under accelerate's autocast) and with the
        ``use_cache`` the ``Trainer`` set in its config.
        """
        if self._packing_checked:
            return
        if isinstance(self.data_collator, PackedCollator):
            self.data_collator.check_sequences_apart(self.model)
        self._packing_checked = True

    def _check_packed_width(self) -> None:
        """Refuses a collator that would not cut what a truncating packing sampler counts as cut.

        ``MultipackBatchSampler(oversized="truncate")`` plans a longer sequence as ``batch_max_len``
        tokens; a ``PackedCollator`` without that ``max_length`` would pack it whole, in rows wider than planned.
        """
        collator, sampler = self.data_collator, self.train_batch_sampler
        if not isinstance(collator, PackedCollator) or getattr(sampler, "oversized", None) != "truncate":
            return
        if collator.max_length is None or collator.max_length > sampler.batch_max_len:
            raise bad_value("data_collator.max_length", f"at most batch_max_len={sampler.batch_max_len} (the "
                            "sampler's oversized='truncate' plans a longer sequence as cut to it: pass "
                            f"PackedCollator(max_length={sampler.batch_max_len}))", collator.max_length)

    def _epochs_to_plan(self) -> int:
        args, sampler = self.args, self.train_batch_sampler
        if args.max_steps and args.max_steps > 0:
            per_epoch = max(1, len(sampler) // _dealt_to(sampler))
            steps_per_epoch = max(1, per_epoch // args.gradient_accumulation_steps)
            return max(1, math.ceil(args.max_steps / steps_per_epoch)) + 1
        return max(1, math.ceil(args.num_train_epochs))

    def get_train_dataloader(self) -> DataLoader:
        """The training DataLoader on ``train_batch_sampler``, prepared by accelerate."""
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        self._check_sampler_world()
        self._check_packed_mask()
        self._check_packed_width()
        sampler = self.train_batch_sampler
        sampler.set_min_batches(0)
        sampler.set_min_batches(sampler.max_len(self._epochs_to_plan()))
        dataset, collator = self.train_dataset, self.data_collator
        try:
            import datasets
        except ImportError:  # pragma: no cover - datasets is optional
            datasets = None
        bins = getattr(sampler, "yields_bins", False)  # a packing sampler: its batches are lists of bins
        if datasets is not None and isinstance(dataset, datasets.Dataset):
            dataset = self._remove_unused_columns(dataset, description="training")
        elif not bins:
            collator = self._get_collator_with_removed_columns(collator, description="training")
        if bins:
            dataset = PackedDataset(dataset)
        params: dict[str, Any] = {
            "batch_sampler": _AnySize(sampler),
            "collate_fn": collator,
            "num_workers": self.args.dataloader_num_workers,
            "pin_memory": self.args.dataloader_pin_memory,
            "persistent_workers": self.args.dataloader_persistent_workers and self.args.dataloader_num_workers > 0,
        }
        if self.args.dataloader_num_workers > 0 and self.args.dataloader_prefetch_factor is not None:
            params["prefetch_factor"] = self.args.dataloader_prefetch_factor
        return self.accelerator.prepare(DataLoader(dataset, **params))

    # ----------------------------------------------------------------- the out-of-memory guard

    def _guarding(self) -> bool:
        if not self.split_on_oom:
            return False
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            if not getattr(self, "_guard_off_logged", False):
                self._guard_off_logged = True
                logger.warning("split_on_oom is off under DeepSpeed and FSDP (their engines own the backward)")
            return False
        return True

    def _loss_spans_the_step(self, model: Any, batch: Any, num_items_in_batch: Any) -> bool:
        """Whether ``compute_loss`` is a sum over the whole optimizer step's items, not a mean over the micro-batch.

        ``loss_is_scaled_for_ga`` when set, and a ``compute_loss_func`` (it is
        given the step's count), answer as the ``Trainer`` reads them. A model
        given ``num_items_in_batch`` may still ignore it (many heads compute
        their own mean): that is seen once, from one row's loss at two counts.
        """
        if self.loss_is_scaled_for_ga is not None:
            return bool(self.loss_is_scaled_for_ga)
        if self.compute_loss_func is not None:
            return True
        if num_items_in_batch is None or not self.model_accepts_loss_kwargs:
            return False
        if self._divides_by_count is None:
            self._divides_by_count = self._loss_follows_the_count(model, batch)
        return self._divides_by_count

    def _loss_follows_the_count(self, model: Any, batch: Any) -> bool:
        """Whether the model's loss of one row halves when ``num_items_in_batch`` doubles (no gradient, eval mode).

        A packed batch with flash-attention's batch-wide fields cannot be cut into rows: it is run whole.
        """
        row = batch
        if not any(key in batch for key in BATCH_WIDE_FIELDS):
            rows = [take_rows(batch, [i], trim=False) for i in range(batch_shape(batch)[0])]
            row = max(rows, key=self._items)  # a row with targets
        training = model.training
        model.eval()
        try:
            with torch.no_grad():
                one, two = (float(self.compute_loss(model, self._prepare_inputs(dict(row)),
                                                    num_items_in_batch=torch.tensor(count)))
                            for count in (1.0, 2.0))
        finally:
            model.train(training)
        follows = one == 0.0 or abs(one - 2 * two) <= 1e-3 * abs(one)
        logger.info("the model's loss %s num_items_in_batch: micro-batches and their parts carry %s",
                    "divides by" if follows else "ignores",
                    "their own losses" if follows else "their items' share of the step's")
        return follows

    def _items(self, batch: Any) -> int:
        """What a micro-batch's mean loss is over: its labelled targets (shifted for a causal LM), else its rows."""
        shifted = "shift_labels" in batch
        labels = batch["shift_labels"] if shifted else batch.get("labels")
        if not isinstance(labels, torch.Tensor):
            return batch_shape(batch)[0]
        return count_items(labels, shift=not shifted and bool(getattr(self, "_loss_shifts_labels", False)),
                           normalization="tokens")

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> tuple[list, Any]:
        """The ``Trainer``'s micro-batches of one optimizer step; their items are counted for
        :meth:`_share_of_the_step`."""
        batch_samples, num_items_in_batch = super().get_batch_samples(epoch_iterator, num_batches, device)
        self._window_items = sum(max(self._items(batch), 1) for batch in batch_samples) or None
        return batch_samples, num_items_in_batch

    def _trainer_divides_by_accumulation(self, num_items_in_batch: Any) -> bool:
        """Whether the ``Trainer``'s own step divides the loss by its micro-batches (its rule,
        ``loss_is_scaled_for_ga``)."""
        if self.loss_is_scaled_for_ga is not None:
            return not self.loss_is_scaled_for_ga
        scaled = ((self.model_accepts_loss_kwargs and num_items_in_batch is not None)
                  or self.compute_loss_func is not None)
        return not scaled

    def _share_of_the_step(self, model: Any, inputs: Any, part: Any, num_items_in_batch: Any) -> float:
        """The factor on the loss of ``part`` (a micro-batch, or a part of one split on out of memory) that makes the
        optimizer step's gradient the mean over the items of all its micro-batches.

        A loss divided by ``num_items_in_batch`` (a causal or masked LM's) needs none. A loss that is its
        micro-batch's own mean (a classifier's, most encoder-decoders') would weigh the items of a small micro-batch
        more than those of a large one, and planned micro-batches differ in size: each carries its items over the
        step's (those :meth:`get_batch_samples` counted, times the micro-batches the ``Trainer`` divides by; or
        ``num_items_in_batch``, all ranks' with ``average_tokens_across_devices``, where the ``Trainer`` takes the loss
        for one divided by it and does not divide). Outside the ``Trainer``'s loop (no step counted) a part carries
        its share of its micro-batch.
        """
        window = getattr(self, "_window_items", None)
        if (part is inputs and (window is None or window == max(self._items(inputs), 1))
                and self.args.world_size == 1):
            return 1.0  # the step's only micro-batch, whole: whatever the loss, it is the step's mean
        if self._loss_spans_the_step(model, inputs, num_items_in_batch):
            return 1.0
        items = self._items(part)
        if window is None:
            return items / max(self._items(inputs), 1)
        if self._trainer_divides_by_accumulation(num_items_in_batch):
            return items * self.current_gradient_accumulation_steps / window
        return items / max(float(num_items_in_batch), 1.0)

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        """The ``Trainer``'s step, through the out-of-memory guard (``split_on_oom``, see the module).

        A part of a split micro-batch runs the ``Trainer``'s own step. Where the
        loss is a sum over the whole optimizer step's items divided by
        ``num_items_in_batch`` (causal and masked LMs given it) the losses
        add up as they are; where it is a mean over the micro-batch (a
        classifier's, most encoder-decoders'), each micro-batch's or part's loss is
        scaled by its share of the step's items (:meth:`_share_of_the_step`).
        """
        self._check_packed_attention()

        def step(part: Any) -> torch.Tensor:
            self._loss_share = self._share_of_the_step(model, inputs, part, num_items_in_batch)
            try:
                return super(BatchSamplerTrainerMixin, self).training_step(model, part, num_items_in_batch)
            finally:
                self._loss_share = 1.0

        if not self._guarding():
            return step(inputs)
        ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel) and self.args.world_size > 1
        synced = ddp and model.require_backward_grad_sync  # the optimizer step's last micro-batch
        params = [p for p in model.parameters() if p.requires_grad]
        with self.accelerator.no_sync(model) if ddp else contextlib.nullcontext():
            result = guarded_step(step, inputs, params, guardian=self.oom_guardian)
        if synced:
            sync_gradients(params, self.args.world_size)
        return torch.stack([loss.reshape(()) for loss in result.outputs]).sum()

    def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None,
                     **kwargs: Any) -> Any:
        """The ``Trainer``'s loss; in training, times its share of the step (:meth:`_share_of_the_step`)."""
        out = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                   num_items_in_batch=num_items_in_batch, **kwargs)
        share = self._loss_share
        if share == 1.0:
            return out
        return (out[0] * share, *out[1:]) if return_outputs else out * share

    # ----------------------------------------------------------------- evaluation and prediction

    def get_eval_dataloader(self, eval_dataset: Any = None) -> DataLoader:
        """The evaluation DataLoader on planned batches (``eval_batches="dynamic"``), else the ``Trainer``'s."""
        dataset = self.eval_dataset[eval_dataset] if isinstance(eval_dataset, str) else eval_dataset
        dataset = self.eval_dataset if dataset is None else dataset
        with self._collating_one_per_row():
            planned = None if dataset is None else self._planned_loader(dataset, "Evaluation")
            return planned if planned is not None else super().get_eval_dataloader(eval_dataset)

    def get_test_dataloader(self, test_dataset: Any) -> DataLoader:
        """The prediction DataLoader on planned batches (``eval_batches="dynamic"``), else the ``Trainer``'s."""
        with self._collating_one_per_row():
            planned = self._planned_loader(test_dataset, "test")
            return planned if planned is not None else super().get_test_dataloader(test_dataset)

    @contextlib.contextmanager
    def _collating_one_per_row(self) -> Iterator[None]:
        """Evaluation and prediction loaders built here collate a ``PackedCollator``'s examples one per row.

        An evaluation batch is a plain list of examples, which the collator would pack into one row: one
        prediction for the whole batch (``predict()`` and ``compute_metrics`` would see rows that are not the
        dataset's, and planned batches could not be put back in order), in a row as wide as all its examples
        (neither the planner's rows nor the training's ``batch_max_len``). The ``Trainer`` builds its loaders
        from ``self.data_collator``, so it is :meth:`~dynabatch.data.packing.PackedCollator.one_per_row` while
        they are built. A collation the training would refuse for this model is refused here too
        (:meth:`_check_packed_mask`): one sequence per row, it is as wrong.
        """
        collator = self.data_collator
        if isinstance(collator, PackedCollator):
            self._check_packed_mask()
            self.data_collator = collator.one_per_row
        try:
            yield
        finally:
            self.data_collator = collator

    def _eval_shape(self) -> ModelShape | None:
        """What the planner may know of the model and the call (``generate``'s new tokens when predicting with it)."""
        gen = getattr(self, "_gen_kwargs", None) or {}
        generating = getattr(self.args, "predict_with_generate", False)
        new_tokens = (gen.get("max_new_tokens") or gen.get("max_length") or 0) if generating else 0
        try:
            return ModelShape.from_model(self.model, max_new_tokens=int(new_tokens),
                                         num_beams=int(gen.get("num_beams") or 1) if generating else 1)
        except TypeError:  # not a transformers model: the planner's plain features
            return None

    def _planned_loader(self, dataset: Any, description: str) -> DataLoader | None:
        """A DataLoader on the inference planner's batches, prepared by accelerate; ``None`` for the Trainer's own."""
        if self.eval_batches == "fixed" or isinstance(dataset, IterableDataset):
            return None
        if self.args.world_size > 1:
            raise bad_value("eval_batches", f"'fixed' under {self.args.world_size} processes (dynamic evaluation "
                            "batches put predictions back in dataset order in one process)", self.eval_batches)
        if not self.args.eval_do_concat_batches:
            raise bad_value("args.eval_do_concat_batches", "True with eval_batches='dynamic' (predictions are put "
                            "back in dataset order across batches)", False)
        collator = self.data_collator
        try:
            import datasets
        except ImportError:  # pragma: no cover - datasets is optional
            datasets = None
        if datasets is not None and isinstance(dataset, datasets.Dataset):
            dataset = self._remove_unused_columns(dataset, description=description)
        else:
            collator = self._get_collator_with_removed_columns(collator, description=description)
        field = getattr(self.model, "main_input_name", "input_ids")
        lengths = eval_lengths(dataset, field)
        if lengths is None:
            logger.info("%s rows have no %r to plan batches by: the Trainer's own batches", description, field)
            return None
        sampler = EvalBatchSampler(lengths, self.args.per_device_eval_batch_size, self._eval_shape(), self.args.device)
        if sampler.device is None:
            logger.info("%s batches follow the plan: the memory of %s cannot be measured", description,
                        self.args.device)
        loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=collator,
                            num_workers=self.args.dataloader_num_workers, pin_memory=self.args.dataloader_pin_memory)
        prepared = self.accelerator.prepare(loader)
        prepared.dynabatch_sampler = sampler
        return prepared

    def prediction_step(self, model: Any, inputs: Any, prediction_loss_only: bool, ignore_keys: Any = None,
                        **kwargs: Any) -> Any:
        """The ``Trainer``'s step; on planned batches measured (its peak sizes the batches after it) and its loss kept
        with the items it is a mean over (for ``eval_loss``)."""
        sampler = self._eval_sampler
        if sampler is None:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys, **kwargs)
        rows = int(find_batch_size(inputs) or 1)
        with sampler.measuring(rows, int(inputs[getattr(self.model, "main_input_name", "input_ids")].shape[-1])):
            loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only,
                                                           ignore_keys=ignore_keys, **kwargs)
        if loss is not None:  # weighed by what the loss is a mean over, so that eval_loss is not the batches'
            self._eval_losses.append((float(loss.detach().float().mean()), self._items(inputs), rows))
        return loss, logits, labels

    def evaluation_loop(self, dataloader: DataLoader, description: str, prediction_loss_only: bool | None = None,
                        ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval") -> EvalLoopOutput:
        """The ``Trainer``'s loop; on planned batches, predictions, labels and metrics in dataset order."""
        sampler = getattr(dataloader, "dynabatch_sampler", None)
        if sampler is None:
            return super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys,
                                           metric_key_prefix)

        def inverse() -> np.ndarray:  # dataset order from the order the batches came in (known once they have)
            return np.argsort(sampler.order(), kind="stable")

        def row_losses() -> np.ndarray:  # each row's batch loss, as the rows came
            # The Trainer repeats each batch's loss eval_batch_size times, not the batch's rows: on planned batches
            # its losses would not be one per row (fewer or more than the dataset's), so they are built here.
            return np.repeat(np.asarray([loss for loss, _, _ in self._eval_losses], dtype=np.float32),
                             [rows for _, _, rows in self._eval_losses])

        compute = self.compute_metrics
        if compute is not None and not self.args.batch_eval_metrics:  # per-batch metrics see batches as they come
            self.compute_metrics = lambda p: compute(EvalPrediction(
                in_order(p.predictions, inverse()), in_order(p.label_ids, inverse()), in_order(p.inputs, inverse()),
                None if p.losses is None else in_order(row_losses(), inverse())))
        self._eval_sampler, self._eval_losses = sampler, []
        try:
            output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys,
                                             metric_key_prefix)
        finally:
            self.compute_metrics = compute
            losses, self._eval_losses, self._eval_sampler = self._eval_losses, [], None
        logger.debug("%s: %d of its batches measured", description, sampler.measured_calls)
        metrics = dict(output.metrics or {})
        losses = [(loss, items) for loss, items, _ in losses
                  if np.isfinite(loss) or not self.args.logging_nan_inf_filter]
        # Each batch weighs by the items its loss is a mean over (its rows for a per-row label, its labelled tokens
        # for per-token labels): the mean over the dataset's items, whatever the batches (which follow measured
        # memory). The Trainer weighs every batch as eval_batch_size rows, so its eval_loss of a per-token loss
        # depends on which rows share a batch.
        if losses and sum(items for _, items in losses) > 0:
            metrics[f"{metric_key_prefix}_loss"] = (sum(loss * items for loss, items in losses)
                                                    / sum(items for _, items in losses))
        return EvalLoopOutput(predictions=in_order(output.predictions, inverse()),
                              label_ids=in_order(output.label_ids, inverse()), metrics=metrics,
                              num_samples=output.num_samples)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; a checkpoint whose sampler state belongs to other data or settings is refused."""
        folder = resume_from_checkpoint
        if folder is True:
            folder = get_last_checkpoint(self.args.output_dir)
        if isinstance(folder, str):
            path = os.path.join(folder, SAMPLER_STATE_FILE)
            if os.path.isfile(path):
                with open(path) as f:
                    state = json.load(f)
                fingerprint = self.train_batch_sampler.fingerprint
                if state.get("fingerprint") != fingerprint:
                    raise ValueError(
                        f"resume_from_checkpoint should hold a sampler state for the same data and settings "
                        f"(fingerprint {fingerprint!r}), but got {path} with "
                        f"fingerprint={state.get('fingerprint')!r}: the dataset, lengths or constraint differ"
                    )
                for key in ("seed", "shuffle", "num_replicas"):
                    if key in state and state[key] != getattr(self.train_batch_sampler, key):
                        raise bad_value(f"train_batch_sampler.{key}", f"{state[key]!r} as in {path}",
                                        getattr(self.train_batch_sampler, key))
        return super().train(resume_from_checkpoint, *args, **kwargs)


class BatchSamplerTrainer(BatchSamplerTrainerMixin, Trainer):
    """``transformers.Trainer`` training on a dynabatch batch sampler (see :class:`BatchSamplerTrainerMixin`)."""


class Seq2SeqBatchSamplerTrainer(BatchSamplerTrainerMixin, Seq2SeqTrainer):
    """``transformers.Seq2SeqTrainer`` on dynabatch batches (``predict_with_generate`` included); see the mixin."""
