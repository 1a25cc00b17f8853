"""GradNorm task balancing (Chen et al., 2018), in closed form.

Each task ``k`` in a step has a mean loss ``L_k``, its first recorded loss
``L_k(0)`` and ``g_k``, the norm of the gradient of ``L_k`` with respect to a
shared parameter ``W`` (the last shared layer). With weights ``w_k``:

* ``G_k = w_k * g_k`` and ``G_mean`` their mean;
* ``r_k = (L_k / L_k(0)) / mean_j(L_j / L_j(0))``, how slowly task ``k`` trains;
* target ``T_k = G_mean * r_k ** alpha`` (treated as a constant);
* GradNorm's loss ``sum_k |G_k - T_k|`` has derivative ``sign(G_k - T_k) * g_k``
  with respect to ``w_k``; one gradient step of size ``lr`` follows, weights
  are kept >= 1e-3 and rescaled to their previous sum.

Example:
    >>> from dynabatch.compat.multitask.gradnorm import gradnorm_update
    >>> new = gradnorm_update({"a": 1.0, "b": 1.0}, losses={"a": 1.0, "b": 1.0},
    ...                       initial_losses={"a": 2.0, "b": 1.0}, grad_norms={"a": 1.0, "b": 3.0},
    ...                       alpha=1.5, lr=0.1)
    >>> {k: round(v, 4) for k, v in new.items()}  # "a" halved its loss, "b" did not: "b" gains weight
    {'a': 0.9167, 'b': 1.0833}
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np
import torch
from torch import nn

from dynabatch._validation import bad_value
from dynabatch.sampling.ranks import process_group, reduce_across_ranks

__all__ = ["GradNormBalancer", "gradnorm_update", "shared_parameter"]


def gradnorm_update(
    weights: dict[Hashable, float],
    losses: dict[Hashable, float],
    initial_losses: dict[Hashable, float],
    grad_norms: dict[Hashable, float],
    *,
    alpha: float,
    lr: float,
) -> dict[Hashable, float]:
    """One GradNorm step on the weights of the tasks in ``losses``; other weights are unchanged."""
    tasks = [t for t in losses if t in grad_norms]
    if len(tasks) < 2:
        return dict(weights)
    w = np.array([weights[t] for t in tasks], dtype=np.float64)
    g = np.array([grad_norms[t] for t in tasks], dtype=np.float64)
    ratio = np.array([losses[t] / max(initial_losses[t], 1e-12) for t in tasks])
    r = ratio / ratio.mean()
    big_g = w * g
    target = big_g.mean() * r**alpha
    new = np.maximum(w - lr * np.sign(big_g - target) * g, 1e-3)
    new *= w.sum() / new.sum()
    out = dict(weights)
    out.update({t: float(v) for t, v in zip(tasks, new)})
    return out


def shared_parameter(model: nn.Module) -> nn.Parameter:
    """The last parameter of the shared trunk: the last one not in the output head.

    Head parameters are those of ``model.get_output_embeddings()`` and of
    modules named ``lm_head``, ``classifier``, ``score``, ``cls`` or ``qa_outputs``.
    """
    head_ids: set[int] = set()
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if out_emb is not None:
        head_ids |= {id(p) for p in out_emb.parameters()}
    heads = ("lm_head", "classifier", "score", "cls", "qa_outputs")
    for name, module in model.named_modules():
        if name.split(".")[-1] in heads:
            head_ids |= {id(p) for p in module.parameters()}
    shared = [p for p in model.parameters() if p.requires_grad and id(p) not in head_ids]
    if not shared:
        raise bad_value("model", "a model with trainable parameters outside its output head", type(model).__name__)
    return shared[-1]


class GradNormBalancer:
    """Accumulates per-task gradient norms over a step and updates the task weights.

    Args:
        parameter: the shared parameter ``W`` whose gradient norms are compared.
        alpha: GradNorm's asymmetry (1.5 in the multi-task system).
        lr: step size of the weight update.
    """

    def __init__(self, parameter: nn.Parameter, alpha: float = 1.5, lr: float = 0.025) -> None:
        self.parameter = parameter
        self.alpha = float(alpha)
        self.lr = float(lr)
        self.initial_losses: dict[Hashable, float] = {}
        self._grads: dict[Hashable, torch.Tensor] = {}
        self._loss: dict[Hashable, float] = {}
        self._count: dict[Hashable, float] = {}

    def accumulate(self, task_sums: dict[Hashable, torch.Tensor], task_counts: dict[Hashable, float]) -> None:
        """Adds the gradient of each task's summed loss in a micro-batch (the graph is kept for backward)."""
        if not self.parameter.requires_grad:
            return
        for task, loss_sum in task_sums.items():
            if not loss_sum.requires_grad:
                continue
            (grad,) = torch.autograd.grad(loss_sum, self.parameter, retain_graph=True, allow_unused=True)
            if grad is None:
                continue
            self._grads[task] = self._grads.get(task, 0) + grad.detach()
            self._loss[task] = self._loss.get(task, 0.0) + float(loss_sum.detach())
            self._count[task] = self._count.get(task, 0.0) + float(task_counts[task])

    def step(self, weights: dict[Hashable, float]) -> dict[Hashable, float]:
        """Updates ``weights`` from the step's accumulated gradients, and starts a new step.

        Under ``torch.distributed`` (more than one process) every task's
        gradient, loss sum and item count are first summed over the ranks, so
        every rank computes the same new weights, those of the step's samples
        on all ranks together. Every rank must call ``step`` once per step.
        """
        self._sum_across_ranks()
        losses = {t: self._loss[t] / max(self._count[t], 1.0) for t in self._loss}
        norms = {t: float(self._grads[t].norm()) / max(self._count[t], 1.0) for t in self._grads}
        for task, loss in losses.items():
            self.initial_losses.setdefault(task, loss)
        new = gradnorm_update(weights, losses, self.initial_losses, norms, alpha=self.alpha, lr=self.lr)
        self._grads.clear()
        self._loss.clear()
        self._count.clear()
        return new

    def _sum_across_ranks(self) -> None:
        """Sums every task's gradient, loss and count over the ranks (tasks a rank did not see count zero)."""
        group = process_group()
        if group is None or group[1] == 1:
            return
        dist = torch.distributed
        seen: list[list[Hashable]] = [[] for _ in range(group[1])]
        dist.all_gather_object(seen, list(self._grads))
        tasks = list(dict.fromkeys(t for rank_tasks in seen for t in rank_tasks))  # rank order: the same everywhere
        if not tasks:
            return
        zero = torch.zeros_like(self.parameter, dtype=torch.float64)
        grads = torch.stack([self._grads[t].to(torch.float64) if t in self._grads else zero for t in tasks])
        dist.all_reduce(grads)
        stats = reduce_across_ranks([self._loss.get(t, 0.0) for t in tasks] + [self._count.get(t, 0.0) for t in tasks])
        dtype = self.parameter.dtype
        self._grads = {t: grads[i].to(dtype) for i, t in enumerate(tasks)}
        self._loss = dict(zip(tasks, stats[: len(tasks)]))
        self._count = dict(zip(tasks, stats[len(tasks) :]))
