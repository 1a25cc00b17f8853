"""Gradients of backward passes that ran without DDP's synchronisation, averaged over the ranks once.

A training step whose micro-batches may be split on out-of-memory errors runs
every backward without DDP's synchronisation (a split on one rank would
otherwise hang the others) and averages the accumulated gradients over the
ranks afterwards, as DDP's synchronised backward does: :func:`sync_gradients`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dynabatch.memory.units import MIB
from dynabatch.sampling.ranks import reduce_across_ranks

__all__ = ["average_gradients", "sync_gradients"]


def average_gradients(
    params: Sequence[torch.nn.Parameter], on_some_rank: Sequence[bool], world_size: int,
    bucket_bytes: int = int(25 * MIB),
) -> None:
    """Sets each parameter's gradient to the mean over the ranks of their accumulated gradients (as DDP does).

    ``params`` must be the same list, in the same order, on every rank. A
    parameter with ``on_some_rank`` false (no rank has a gradient for it)
    keeps ``grad=None``; one that has a gradient on some ranks only counts
    zeros for the others. Gradients travel in flat buckets of one dtype and
    at most ``bucket_bytes`` (25 MiB, DDP's bucket size; one ``all_reduce`` each, the same on every rank).
    """
    todo = [p for p, some in zip(params, on_some_rank) if some]
    buckets: list[list[torch.nn.Parameter]] = []
    size = 0
    for p in todo:
        if not buckets or p.dtype != buckets[-1][0].dtype or size + p.numel() * p.element_size() > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += p.numel() * p.element_size()
    for bucket in buckets:
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in bucket])
        torch.distributed.all_reduce(flat)
        flat /= world_size
        for p, part in zip(bucket, flat.split([p.numel() for p in bucket])):
            if p.grad is None:
                p.grad = part.view_as(p).clone()
            else:
                p.grad.copy_(part.view_as(p))


def sync_gradients(params: Sequence[torch.nn.Parameter], world_size: int) -> None:
    """What DDP's synchronised backward does, after backward passes that ran without it: each parameter's
    gradient becomes the mean over the ranks (:func:`average_gradients`); ``params`` the same list on every rank."""
    on_some_rank = reduce_across_ranks([float(p.grad is not None) for p in params])
    average_gradients(params, [n > 0 for n in on_some_rank], world_size)
