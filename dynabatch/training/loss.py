"""Per-sample losses and the task-weighted loss of an optimizer step.

A step of variable-size micro-batches must be normalised by the whole step,
not micro-batch by micro-batch. With ``w(i)`` the weight of sample ``i``'s
task and ``l(i, j)`` the loss of its ``j``-th labelled token:

* ``"tokens"``: ``L = sum_i w(i) * sum_j l(i, j) / N_tokens``, where
  ``N_tokens`` counts the labelled tokens of the whole step;
* ``"samples"``: ``L = sum_i w(i) * mean_j l(i, j) / N_samples``.

With every weight 1, ``"tokens"`` is the plain mean over all the step's
tokens (what HF's ``num_items_in_batch`` gives) and ``"samples"`` the mean of
per-sample means. Each micro-batch contributes its own part of the sum
divided by the step's count, so the parts add up to the step's loss, however
the step was cut.

Example:
    >>> import torch
    >>> from dynabatch.training.loss import per_sample_losses, weighted_loss_sum
    >>> logits = torch.zeros(2, 3, 4)  # uniform over 4 classes: every token costs log(4)
    >>> labels = torch.tensor([[1, 2, -100], [3, -100, -100]])
    >>> sums, counts = per_sample_losses(logits, labels, shift=False)
    >>> counts.tolist(), [round(v / 1.3862944, 4) for v in sums.tolist()]
    ([2, 1], [2.0, 1.0])
    >>> round(float(weighted_loss_sum(sums, counts, torch.tensor([1.0, 3.0]), "tokens")) / 3 / 1.3862944, 4)
    1.6667
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dynabatch._validation import check_choice

__all__ = ["NORMALIZATIONS", "count_items", "per_sample_losses", "shifts_labels", "weighted_loss_sum"]

NORMALIZATIONS = ("tokens", "samples")


def check_normalization(value: object) -> str:
    """Returns ``value`` if it is one of :data:`NORMALIZATIONS`: a ``TypeError`` for a non-str (such as a normalizer
    object, which the multi-task system's docs pass), a ``ValueError`` for another string."""
    check_choice("batch_size_normalizer", value, NORMALIZATIONS)
    return value  # type: ignore[return-value]


def shifts_labels(model: torch.nn.Module) -> bool:
    """Whether ``model``'s loss shifts its labels by one (a causal LM's next-token loss), so a row's first label is
    never a target.

    True for a decoder-only class among transformers' causal LMs, and for a model whose ``loss_type`` is
    ``ForCausalLM`` (the rule the HF ``Trainer`` itself reads). The ``Trainer``'s rule alone misses causal LMs whose
    class name does not end in ``ForCausalLM`` (``GPT2LMHeadModel``: its ``loss_type`` is ``None``, though its loss is
    the shifted one), and counting their unshifted labels adds a row's first token to every row: a step's loss
    divided by its targets plus its rows, a bias that varies with the rows each planned step holds.
    """
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return False  # its decoder reads right-shifted decoder_input_ids: every label is a target
    causal_class = type(model).__name__ in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
    return causal_class or LOSS_MAPPING.get(getattr(model, "loss_type", None)) is ForCausalLMLoss


def _labels_for_loss(labels: torch.Tensor, shift: bool) -> torch.Tensor:
    return labels[:, 1:] if shift and labels.dim() > 1 else labels


def per_sample_losses(
    logits: torch.Tensor, labels: torch.Tensor, *, shift: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed loss and labelled-item count of each row.

    * ``labels`` of shape (rows, T): token cross-entropy (``-100`` ignored),
      labels shifted left by one when ``shift`` (causal language models);
    * ``labels`` of shape (rows,): one item per row; cross-entropy over
      ``logits`` (rows, classes), or squared error when ``logits`` has one column.

    Returns:
        ``(sums, counts)``, each of shape (rows,); ``sums`` float32 with gradient.
    """
    if labels.dim() == 1:
        if logits.dim() == 2 and logits.shape[-1] == 1 and labels.is_floating_point():
            losses = (logits[:, 0].float() - labels.float()) ** 2
        else:
            losses = F.cross_entropy(logits.float(), labels, reduction="none")
        return losses, torch.ones_like(losses, dtype=torch.long)
    if shift:
        logits = logits[:, :-1]
    target = _labels_for_loss(labels, shift)
    flat = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1), ignore_index=-100, reduction="none"
    )
    mask = target != -100
    sums = (flat.view(target.shape) * mask).sum(dim=1)
    return sums, mask.sum(dim=1)


def count_items(labels: torch.Tensor, *, shift: bool, normalization: str) -> int:
    """Items a batch adds to its step's normaliser: labelled tokens, or rows with a label."""
    if labels.dim() == 1:
        return int(labels.shape[0])
    target = _labels_for_loss(labels, shift)
    mask = target != -100
    if normalization == "tokens":
        return int(mask.sum())
    return int(mask.any(dim=1).sum())


def weighted_loss_sum(
    sums: torch.Tensor, counts: torch.Tensor, weights: torch.Tensor, normalization: str
) -> torch.Tensor:
    """This micro-batch's share of the step loss, before dividing by the step's item count."""
    weights = weights.to(sums.device, sums.dtype)
    if normalization == "tokens":
        return (weights * sums).sum()
    means = sums / counts.clamp(min=1).to(sums.dtype)
    return (weights * means * (counts > 0)).sum()
