"""From a memory limit to batches that train within it: :func:`training_budget`.

The limit (``"20GB"``, or ``"80%"`` of an accelerator) is everything the
training holds on the device at its peak:

* the **weights** and buffers of the model, and the **optimizer state**
  (AdamW's two moments per weight): *resident*, counted from their tensors
  once the optimizer has taken a first step;
* the **gradients**, the **activations** of the forward and backward, and the
  optimizer step's temporaries: the *step*, measured on real training steps
  (forward, backward, ``optimizer.step()``, ``zero_grad(set_to_none=True)``
  as the HF ``Trainer`` does), by the CUDA allocator's statistics or the CPU
  storage tracker.

A percentage is of what the device has free once the optimizer state exists,
plus what the model and its optimizer hold there: ``"80%"`` leaves a fifth of
the memory this training could use to the rest (the CUDA context, other
processes' growth). The step's share, ``limit - resident``, is the budget of a
:class:`~dynabatch.memory.budget.MemoryBudget` over a memory model of the step:
every planned batch is predicted at or under ``(1 - memory_margin)`` of it.

The memory model comes from one of two searches (``method=``):

* ``"calibrate"`` (any device): :func:`~dynabatch.memory.calibrate.calibrate`
  on the training step, with its budget probes aimed at the step's share of
  the limit (on the CPU, a probe above it runs out of memory as on a device of
  that size);
* ``"probe"`` (CUDA, XPU; the CPU simulates): :func:`~dynabatch.memory.limit_probe.probe_limit`,
  the most rows at each length found by running steps under the limit on the
  device itself, as NeMo's OOMptimizer does: slower, but it sees what no
  measurement of allocated bytes does (the allocator's cache and fragmentation).

The model comes back as it was: its weights and training mode are restored,
the optimizer used for the search is dropped, and the random number
generators' states are kept (dropout draws nothing from them).

Example:
    >>> import torch
    >>> from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel
    >>> from dynabatch.demo import minilm_path
    >>> tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2, n_positions=64))
    >>> budget = training_budget(model, tokenizer, "60MB", max_length=64, max_probes=12, progress=False)
    >>> resident = budget.memory_model.metadata["resident_bytes"]  # weights, buffers, optimizer state
    >>> sum(resident.values()) + budget.max_memory == 60e6  # what a step may use is the rest of the limit
    True
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch

from dynabatch._validation import bad_type, bad_value, check_positive_int
from dynabatch.data.collate import Batch
from dynabatch.memory.budget import MemoryBudget, check_memory_margin
from dynabatch.memory.calibrate import calibrate
from dynabatch.memory.device import free_bytes, free_memory
from dynabatch.memory.limit_probe import probe_limit
from dynabatch.memory.measure import check_measurable_device
from dynabatch.memory.units import GB, parse_memory

__all__ = ["METHODS", "resident_bytes", "training_budget"]

logger = logging.getLogger(__name__)

METHODS = ("calibrate", "probe")
"""How :func:`training_budget` measures the step: a designed calibration, or a search at the limit."""


def training_budget(
    model: torch.nn.Module,
    tokenizer: Any,
    limit: str | float,
    *,
    max_length: int,
    optimizer: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer] | None = None,
    loss: Callable[[torch.nn.Module, Batch], torch.Tensor] | None = None,
    texts: Any = None,
    method: str = "calibrate",
    batch_size: int = 4,
    memory_margin: float = 0.10,
    max_probes: int = 24,
    pad_to_multiple_of: int | None = None,
    seed: int = 0,
    progress: bool = True,
) -> MemoryBudget:
    """The :class:`~dynabatch.memory.budget.MemoryBudget` of training ``model`` within ``limit`` (see the module).

    Pass it to a sampler as its constraint: ``SmartBatchSampler(tokens.lengths, budget)``.

    Args:
        model: the model, already on the device it trains on.
        tokenizer: the tokenizer the training batches are collated with.
        limit: everything the training may hold on the device: bytes, a size
            (``"20GB"``: 10**9 bytes a GB, ``"20GiB"``: 2**30), or ``"80%"``
            of an accelerator (of its free memory plus what the model and its
            optimizer hold there).
        max_length: the longest training row (the truncation of ``tokenize_source``).
        optimizer: builds the optimizer from the parameters, as training will
            (default ``torch.optim.AdamW``: the HF ``Trainer``'s, whose state is
            two moments per weight).
        loss: ``loss(model, batch)`` of one collated batch; default the model's
            own loss with ``labels`` the ``input_ids``, padding ignored (a causal
            or masked language model).
        texts: training texts to draw the probe tokens from (default: the
            tokenizer's vocabulary).
        method: ``"calibrate"`` or ``"probe"`` (see the module).
        batch_size: rows of the calibration's base probes: any size that
            surely fits (the budget probes grow from it to the limit).
        memory_margin: the budget's margin: batches are planned to
            ``(1 - memory_margin) * (limit - resident)``.
        max_probes: the most calibration probes.
        pad_to_multiple_of: the collator's rounding of widths.
        seed: seeds the probe tokens.
        progress: show a progress bar.

    Returns:
        The budget; its ``memory_model.metadata`` holds ``limit_bytes``,
        ``resident_bytes`` (``weights``, ``buffers``, ``optimizer_state``) and
        ``step_bytes`` (the step's share).

    Raises:
        TypeError, ValueError: a bad argument, or a limit at or under what the
            model and its optimizer state hold.
    """
    if not isinstance(model, torch.nn.Module):
        raise bad_type("model", "a torch.nn.Module", model)
    if method not in METHODS:
        raise bad_value("method", f"one of {METHODS}", method)
    for name, value in (("optimizer", optimizer), ("loss", loss)):
        if value is not None and not callable(value):
            raise bad_type(name, "a callable or None", value)
    max_length = check_positive_int("max_length", max_length)
    batch_size = check_positive_int("batch_size", batch_size)
    memory_margin = check_memory_margin(memory_margin)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise bad_value("model", "a model with trainable parameters", type(model).__name__)
    device = check_measurable_device("model", params[0].device, "a model on a device whose memory can be measured")
    saved = {name: value.detach().to("cpu", copy=True) for name, value in model.state_dict().items()}
    training = model.training
    opt = (optimizer or torch.optim.AdamW)(params)
    step = _training_step(model, opt, loss or _language_model_loss)
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            step(_warm_up_batch(tokenizer, device))  # the optimizer state exists from here on
            resident = resident_bytes(model, opt, device)
            held = sum(resident.values())
            limit_bytes = parse_memory(limit, "limit", device=device, of=None if device.type == "cpu"
                                       else free_bytes(device) + held)
            if not limit_bytes > held:
                raise bad_value("limit", f"above what the model and its optimizer state hold ({held / GB:.3f} GB: "
                                f"weights {resident['weights'] / GB:.3f}, buffers {resident['buffers'] / GB:.3f}, "
                                f"optimizer state {resident['optimizer_state'] / GB:.3f})", limit)
            step_bytes = limit_bytes - held
            drop = functools.partial(opt.zero_grad, set_to_none=True)  # a step that failed leaves gradients
            if method == "calibrate":
                mm = calibrate(step, tokenizer, batch_size=batch_size, max_input_token_length=max_length, texts=texts,
                               device=device, model=model, memory_margin=memory_margin, budget_bytes=step_bytes,
                               max_probes=max_probes, cleanup=drop, pad_to_multiple_of=pad_to_multiple_of,
                               limit_bytes=int(step_bytes) if device.type == "cpu" else None, seed=seed,
                               progress=progress)
            else:
                mm = probe_limit(step, tokenizer, limit_bytes=limit_bytes, resident_bytes=held,
                                 max_input_token_length=max_length, device=device, model=model, texts=texts,
                                 cleanup=drop, seed=seed, progress=progress)
    finally:
        opt.zero_grad(set_to_none=True)
        del opt, step
        model.load_state_dict(saved)
        model.train(training)
        free_memory()
    mm.metadata.update(limit_bytes=float(limit_bytes), resident_bytes=resident, step_bytes=float(step_bytes),
                       method=method)
    logger.info("training within %.3f GB: weights %.3f, buffers %.3f, optimizer state %.3f; a step may use %.3f GB "
                "(%.3f with the %.0f%% margin)", limit_bytes / GB, resident["weights"] / GB, resident["buffers"] / GB,
                resident["optimizer_state"] / GB, step_bytes / GB, step_bytes * (1 - memory_margin) / GB,
                100 * memory_margin)
    return MemoryBudget(mm, step_bytes, memory_margin=memory_margin, pad_to_multiple_of=pad_to_multiple_of)


def _language_model_loss(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """The model's own loss, ``labels`` the ``input_ids`` with the padding ignored."""
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    return model(**batch, labels=labels).loss


def _training_step(model: torch.nn.Module, opt: torch.optim.Optimizer,
                   loss: Callable[[torch.nn.Module, Batch], torch.Tensor]) -> Callable[[Batch], None]:
    def step(batch: Batch) -> None:
        model.train()
        loss(model, batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _warm_up_batch(tokenizer: Any, device: torch.device) -> dict[str, torch.Tensor]:
    """Two short rows: one step on them makes the optimizer allocate its state."""
    return {key: value.to(device) for key, value in tokenizer(["one two three four"] * 2, return_tensors="pt").items()}


def resident_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                   device: Any = None) -> dict[str, int]:
    """What a training holds on ``device`` between steps: the bytes of the model's ``weights`` and ``buffers``
    and the ``optimizer_state``, each storage counted once (default device: the model's first parameter's).

    Example:
        >>> layer = torch.nn.Linear(256, 256)
        >>> opt = torch.optim.AdamW(layer.parameters())
        >>> resident_bytes(layer, opt)  # no state before the first step
        {'weights': 263168, 'buffers': 0, 'optimizer_state': 0}
        >>> layer(torch.ones(2, 256)).sum().backward(); opt.step()
        >>> resident_bytes(layer, opt)["optimizer_state"]  # two moments per weight (and a step count each)
        526344
    """
    device = torch.device(device) if device is not None else next(model.parameters()).device
    seen: set[int] = set()

    def held(tensors: Iterable[Any]) -> int:
        total = 0
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor) and tensor.device.type == device.type:
                storage = tensor.untyped_storage()
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
        return total

    return {"weights": held(model.parameters()), "buffers": held(model.buffers()),
            "optimizer_state": held(value for state in (optimizer.state.values() if optimizer is not None else ())
                                    for value in state.values())}

