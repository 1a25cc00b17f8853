"""The multi-task system's ``OOMGuardian`` and ``GradientCheckpointManager``, on dynabatch's step guard.

:class:`OOMGuardian` is the core's :class:`~dynabatch.training.step_guard.StepGuard`
(what out-of-memory errors taught, which :func:`~dynabatch.training.step_guard.guarded_step`
splits by) with the multi-task system's budget calls: a budget for a step's peak
memory (``max_memory_mb``, else what the device has free), its margin, a
preflight check and safe batch sizes from a :class:`~dynabatch.compat.multitask.MemoryPredictor`.
:class:`~dynabatch.memory.budget.MemoryBudget` gives the guardian's budget and
safe batch sizes.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import nn

from dynabatch._validation import bad_type, bad_value, check_positive_number
from dynabatch.compat.multitask.predictor import last_measured_predictor
from dynabatch.memory.budget import MemoryBudget, check_memory_margin
from dynabatch.memory.device import backend_of, free_bytes, free_memory
from dynabatch.memory.units import GB, MB
from dynabatch.training.step_guard import StepGuard

__all__ = ["GradientCheckpointManager", "OOMGuardian"]

logger = logging.getLogger(__name__)


class OOMGuardian(StepGuard):
    """Keeps training steps inside the device's memory.

    Args:
        device: the training device.
        memory_margin_percent: fraction of the budget kept free, in [0, 1)
            (a fraction, despite the name: 0.10 keeps 10% free).
        max_memory_mb: the budget for a step's peak memory in MB (10**6
            bytes, as the multi-task system's docs count: 30000 is "30GB"); by
            default what the device has free (:func:`~dynabatch.memory.device.free_bytes`).
        predictor: a calibrated :class:`~dynabatch.compat.multitask.MemoryPredictor` for
            :meth:`estimate_safe_batch_size`; by default the one that last
            recorded a measurement in the process (the multi-task system's call passes none).
        simulate_limit: CPU only: run guarded steps under the CPU tracker's
            ``limit_bytes`` = ``max_memory_mb``, so going over it raises a real
            out-of-memory error, as on a device of that size.
    """

    def __init__(
        self,
        device: str | torch.device = "cuda:0",
        memory_margin_percent: float = 0.10,
        *,
        max_memory_mb: float | None = None,
        predictor: Any = None,
        simulate_limit: bool = False,
    ) -> None:
        if not isinstance(device, (str, torch.device)):
            raise bad_type("device", "a str or torch.device", device)
        self.device = torch.device(device)
        self.memory_margin_percent = check_memory_margin(memory_margin_percent, "memory_margin_percent")
        self.max_memory_mb = None if max_memory_mb is None else check_positive_number("max_memory_mb", max_memory_mb)
        self.predictor = predictor
        if simulate_limit and (self.device.type != "cpu" or self.max_memory_mb is None):
            raise bad_value("simulate_limit", "False unless device is the CPU and max_memory_mb is set", simulate_limit)
        self.simulate_limit = bool(simulate_limit)
        super().__init__(limit_bytes=int(self.max_memory_mb * MB) if simulate_limit else None)

    # -- budget --------------------------------------------------------------
    def budget_bytes(self) -> float:
        """The memory a step may use: ``max_memory_mb``, else what the device has free now."""
        if self.max_memory_mb is not None:
            return self.max_memory_mb * MB
        if not backend_of(self.device).available():
            raise bad_value("device", "an available device, or max_memory_mb= to check against", self.device)
        return float(free_bytes(self.device))

    def budget(self, task_type: Hashable | None = None, model: Any = None) -> MemoryBudget:
        """The :class:`~dynabatch.memory.budget.MemoryBudget` of a step now: :meth:`budget_bytes`, the margin,
        and the shapes of ``task_type`` that ran out of memory; ``model`` predicts its bytes (optional)."""
        return MemoryBudget(model, self.budget_bytes(), memory_margin=self.memory_margin_percent,
                            failed_shapes=self.failed_shapes(task_type))

    def usable_bytes(self) -> float:
        """The budget minus the safety margin."""
        return self.budget().budget_bytes

    def preflight_check(self, predicted_memory_gb: float) -> bool:
        """True if a step predicted to need ``predicted_memory_gb`` fits the budget minus the margin."""
        predicted = check_positive_number("predicted_memory_gb", predicted_memory_gb) if predicted_memory_gb else 0.0
        usable = self.usable_bytes()
        fits = predicted * GB <= usable
        if not fits:
            logger.warning("preflight: %.3f GB predicted, %.3f GB usable", predicted, usable / GB)
        return fits

    def emergency_cleanup(self) -> None:
        """Frees what can be freed: garbage collection and CUDA's cached blocks."""
        free_memory()

    def estimate_safe_batch_size(self, task_type: Hashable, seq_length: float | None = None) -> int:
        """Most rows of ``task_type`` predicted to fit the budget minus the margin (0 if none fits).

        Uses the predictor (at the task's typical length unless ``seq_length``
        is given) through :meth:`budget`, so a shape that ran out of memory caps it.
        Without a predictor: the most rows :meth:`remembered_batch_size` allows
        at ``seq_length`` (default: the widest batch of the task that failed).
        """
        predictor = self.predictor if self.predictor is not None else last_measured_predictor()
        if predictor is None:
            widest = max((width for _, width in self.failed_shapes(task_type)), default=1)
            remembered = self.remembered_batch_size([task_type], math.ceil(seq_length or widest))
            if remembered is None:
                raise bad_value(
                    "predictor",
                    "a calibrated MemoryPredictor (OOMGuardian(predictor=...); none has recorded a measurement "
                    "in this process)",
                    None,
                )
            return remembered
        length = predictor.typical_length(task_type) if seq_length is None else float(seq_length)
        return int(self.budget(task_type, _TaskBytes(predictor, task_type)).rows_allowed(math.ceil(length)))


class _TaskBytes:
    """One task of a predictor as the memory model of a budget: ``predict(rows, padded_length)`` in bytes."""

    def __init__(self, predictor: Any, task_type: Hashable) -> None:
        self.predictor, self.task_type = predictor, task_type

    def predict(self, rows: Any, padded_length: Any) -> Any:
        return self.predictor.predict_bytes(self.task_type, rows, padded_length)


class GradientCheckpointManager:
    """Turns activation (gradient) checkpointing on and off for HF and plain torch models."""

    @staticmethod
    def enable_gradient_checkpointing(model: nn.Module) -> bool:
        """Recomputes activations in the backward instead of keeping them; True if enabled.

        HF models use their own switch (and stop caching keys and values). A
        plain torch model gets each block of its largest ``ModuleList`` or
        ``Sequential`` wrapped in ``torch.utils.checkpoint``.
        """
        if not isinstance(model, nn.Module):
            raise bad_type("model", "a torch.nn.Module", model)
        if getattr(model, "supports_gradient_checkpointing", False):
            kwargs = {"use_reentrant": False}
            if hasattr(model, "activation_checkpointing_enable"):
                model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
            if getattr(getattr(model, "config", None), "use_cache", False):
                model.config.use_cache = False
            return True
        blocks = _largest_block_list(model)
        if blocks is None:
            logger.warning("%s has no ModuleList or Sequential of blocks to checkpoint", type(model).__name__)
            return False
        for block in blocks:
            if not hasattr(block, "_dynabatch_forward"):
                block._dynabatch_forward = block.forward
                block.forward = _checkpointed(block._dynabatch_forward)
        return True

    @staticmethod
    def disable_gradient_checkpointing(model: nn.Module) -> None:
        """Undoes :meth:`enable_gradient_checkpointing`."""
        if getattr(model, "supports_gradient_checkpointing", False):
            if hasattr(model, "activation_checkpointing_disable"):
                model.activation_checkpointing_disable()
            else:
                model.gradient_checkpointing_disable()
            return
        for module in model.modules():
            if hasattr(module, "_dynabatch_forward"):
                module.forward = module._dynabatch_forward
                del module._dynabatch_forward

    @staticmethod
    def is_enabled(model: nn.Module) -> bool:
        """Whether checkpointing is on (either kind)."""
        if any(hasattr(m, "_dynabatch_forward") for m in model.modules()):
            return True
        return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


def _largest_block_list(model: nn.Module) -> nn.Module | None:
    lists = [m for m in model.modules() if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) > 1]
    return max(lists, key=len) if lists else None


def _checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    from torch.utils.checkpoint import checkpoint

    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run
