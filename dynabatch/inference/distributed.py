"""What passes between ranks under ``torch.distributed``: batches checked alike, results gathered to rank 0, chunks
claimed, a results store's job token, and lockstep rounds (who runs which batch: :mod:`dynabatch.sampling.ranks`)."""

from __future__ import annotations

import itertools
import logging
import os
import pickle
import socket
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from dynabatch._digest import fingerprint
from dynabatch._validation import bad_type, bad_value, brief_error, check_non_negative_int, first_few
from dynabatch.data.order import as_positions
from dynabatch.inference.outputs import to_cpu
from dynabatch.sampling.chunked_planner import ChunkedPlanner
from dynabatch.sampling.ranks import reduce_across_ranks, resolve_world

__all__ = ["CLAIM_CHUNK", "Lockstep", "RankFailedError", "check_same_batches", "chunk_claims", "claimed_planner",
           "gather_results", "job_token", "share_outcome", "world"]

logger = logging.getLogger(__name__)

_CLAIM_COUNTERS = itertools.count()  # one counter per run(ranks='claim') call, the same on every rank

CLAIM_CHUNK = 2048
"""Texts per chunk ranks claim of a loader planned up front (a streaming loader's chunks are its own)."""


class RankFailedError(RuntimeError):
    """Another rank's run raised (``rank``: the first such rank; ``causes``: each failed rank's error, in brief): raised
    on every rank that did not fail itself, so that none waits for ever in a collective the failed rank never joins."""

    def __init__(self, message: str, *, rank: int = -1, causes: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.rank, self.causes = rank, dict(causes or {})


def _round(pending: float, error: BaseException | None) -> float:
    """Collective: the most ``pending`` work of any rank, after every rank learnt whether one failed (``error``: this
    rank's; then the failed ranks' errors are sent to every rank, and each raises: a failed rank its own error, the
    others :class:`RankFailedError`). Lockstep rounds and :func:`share_outcome` send the same two values, so a rank
    that fails between two rounds meets the others at their next one, wherever they are."""
    rank, size = world()
    most, failed = reduce_across_ranks([float(pending), float(rank + 1 if error is not None else 0)], "max")
    if not failed:
        return most
    causes: list = [None] * size
    torch.distributed.all_gather_object(causes, None if error is None else brief_error(error))
    if error is not None:
        raise error
    failed_ranks = {r: cause for r, cause in enumerate(causes) if cause is not None}
    first = min(failed_ranks)
    raise RankFailedError(
        f"run should end on every rank together, but rank {first} of {size} raised {failed_ranks[first]}"
        + (f" (ranks {sorted(failed_ranks)} failed)" if len(failed_ranks) > 1 else "")
        + f"; rank {rank} stopped too (with output_path, the rows stored so far are kept and a rerun runs only the "
        "rows missing). See that rank's log for the traceback", rank=first, causes=failed_ranks)


def share_outcome(error: BaseException | None) -> None:
    """Collective, once per run on every rank of ``ranks="lockstep"`` or ``"claim"``, after its last batch or as it
    fails: raises ``error`` on this rank, or :class:`RankFailedError` here when another rank failed; returns when no
    rank did. ``error`` a :class:`RankFailedError` (this rank learnt of another's failure in a round): raised as it
    is, the failure was shared already."""
    if isinstance(error, RankFailedError):
        raise error
    if world()[1] > 1:
        _round(0, error)
    if error is not None:
        raise error


def world() -> tuple[int, int]:
    """``(rank, world_size)`` of the default process group; ``(0, 1)`` without one.

    Example:
        >>> from dynabatch.inference.distributed import world
        >>> world()  # no process group in a plain process
        (0, 1)
    """
    return resolve_world(None, None)


def _check_cover(shares: list[np.ndarray], n: int, *, complete: bool = True) -> None:
    """Raises ValueError unless the ranks' positions are ``range(n)`` (``complete=False``: in it), each once."""
    flat = np.concatenate(shares)
    ranks = np.repeat(np.arange(len(shares)), [len(p) for p in shares])  # each position's rank, in rank order
    where = " across ranks" if len(shares) > 1 else ""
    outside = np.flatnonzero((flat < 0) | (flat >= n))
    if outside.size:
        names = [f"{flat[i]} (rank {ranks[i]})" for i in outside[:6]]  # first_few shows 5, then "..."
        raise ValueError(f"positions should be in range(n_inputs={n}), but got {outside.size} outside it "
                         f"(first few: {first_few(names)})")
    counts = np.bincount(flat, minlength=n)
    repeated = np.flatnonzero(counts > 1)
    if repeated.size:
        names = [f"{p} (ranks {ranks[flat == p].tolist()})" for p in repeated[:6].tolist()]
        raise ValueError(f"positions should each be computed exactly once{where}, but got {repeated.size} "
                         f"computed more than once (first few: {first_few(names)})")
    missing = np.flatnonzero(counts == 0)
    if complete and missing.size:
        raise ValueError(f"positions should cover range(n_inputs={n}){where}, but got {missing.size} missing "
                         f"(first few: {first_few(missing)})")


def _check_local(positions: Any, results: Any, n_inputs: Any) -> tuple[np.ndarray, int]:
    n = check_non_negative_int("n_inputs", n_inputs)
    pos = as_positions("positions", positions, "a 1-D list, numpy array or tensor of int input positions",
                       shape_in_message=True)
    if not isinstance(results, (list, tuple)):
        raise bad_type("results", "a list with one result per position", results)
    if len(results) != len(pos):
        raise bad_value("len(results)", f"len(positions)={len(pos)}, one result per position", len(results))
    return pos, n


def _prepare(positions: Any, results: Any, n_inputs: Any) -> tuple[tuple, bytes | None, Exception | None]:
    """``(payload for every rank, pickled results, local error)``, never raising: the payload is ``(positions,
    n_inputs, None)``, or ``(None, None, (error class, message))`` for a local problem every rank then raises."""
    try:
        pos, n = _check_local(positions, results, n_inputs)
    except Exception as exc:  # noqa: BLE001 (sent to every rank and raised there)
        kind = next((k for k in (TypeError, ValueError) if isinstance(exc, k)), RuntimeError)
        message = str(exc) if kind is not RuntimeError else f"{type(exc).__name__}: {exc}"
        return (None, None, (kind, message)), None, exc
    try:
        blob = pickle.dumps([to_cpu(value) for value in results], protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # noqa: BLE001 (sent to every rank and raised there)
        message = f"results should be picklable to send to rank 0, but got {type(exc).__name__}: {exc}"
        return (None, None, (TypeError, message)), None, exc
    return (pos, n, None), blob, None


def gather_results(positions: list[int], results: list, n_inputs: int, *, cover: bool = True) -> list | None:
    """Collective: brings every rank's results (one per input position it computed; picklable, tensors moved to the
    CPU) to rank 0 in input order; ``None`` on the other ranks. The positions go to every rank first, so that all
    raise the same error together rather than some hanging. ``cover=False``: positions left out get ``None``.

    Raises:
        TypeError: a bad argument, or results that cannot be pickled, on some rank (named; every rank raises).
        ValueError: ``results`` and ``positions`` of different lengths, ``n_inputs`` that differs between ranks, or
            positions over all ranks not ``range(n_inputs)`` (``cover=False``: in it) each once (first few named).

    Example:
        >>> from dynabatch.inference.distributed import gather_results
        >>> gather_results([2, 0, 1], ["c", "a", "b"], 3)  # one process: just reorders
        ['a', 'b', 'c']
    """
    rank, size = world()
    if size == 1:
        pos, n = _check_local(positions, results, n_inputs)
        shares, parts = [pos], [results]
    else:
        payload, blob, local_error = _prepare(positions, results, n_inputs)
        everyone: list = [None] * size
        torch.distributed.all_gather_object(everyone, payload)
        for r, (_, _, error) in enumerate(everyone):
            if error is not None:
                kind, message = error
                raise kind(f"{message} (on rank {r} of {size})") from (local_error if r == rank else None)
        shares, ns = [pos for pos, _, _ in everyone], [n for _, n, _ in everyone]
        other = next((r for r, got in enumerate(ns) if got != ns[0]), None)
        if other is not None:
            raise ValueError(f"n_inputs should be the same on every rank, but got n_inputs={ns[other]} on rank "
                             f"{other} and n_inputs={ns[0]} on rank 0")
        n = ns[0]
    _check_cover(shares, n, complete=cover)
    if size > 1:
        gathered: list | None = [None] * size if rank == 0 else None
        torch.distributed.gather_object(blob, gathered, dst=0)
        if rank != 0:
            return None
        parts = map(pickle.loads, gathered)
        logger.debug("gathered %d results from %d ranks", n, size)
    out: list = [None] * n
    for pos, part in zip(shares, parts):
        for p, value in zip(pos.tolist(), part):
            out[p] = value
    return out


def job_token() -> str | None:
    """One token naming this job, so that its ranks take a results store's job lock as one job; ``None`` in one
    process (the store names this process). Under ``torchrun`` its rendezvous (``MASTER_ADDR:MASTER_PORT`` and run
    id), readable before the process group starts; else a collective: rank 0's token, sent to every rank.

    Example:
        >>> from dynabatch.inference.distributed import job_token
        >>> job_token() is None  # no process group here
        True
    """
    if "MASTER_ADDR" in os.environ and "TORCHELASTIC_RUN_ID" in os.environ:
        return (f"torchrun {os.environ['MASTER_ADDR']}:{os.environ.get('MASTER_PORT')} "
                f"{os.environ['TORCHELASTIC_RUN_ID']}")
    rank, size = world()
    if size == 1:
        return None
    token = [f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex}" if rank == 0 else None]
    torch.distributed.broadcast_object_list(token, src=0)
    return token[0]


def check_same_batches(ranks: str, batches: Sequence[np.ndarray], inputs: Any = None, *, store: bool = False) -> None:
    """Collective: raises the same ``ValueError`` on every rank unless all ranks share the work the same way (``ranks``:
    ``"lockstep"`` or ``"claim"``; ``store``: whether the rows go to a results store, else rank 0 gathers them; ranks
    that differ would wait for ever in collectives the others never make) and hold the same batches (a digest of
    their positions) of the same inputs (a digest of ``inputs``: what identifies them, such as every input's token
    hash): :func:`dynabatch.run` shares them among the ranks itself, and a rank's rows computed from other texts (or
    by another tokenizer) would be mixed in with the others' unseen."""
    _, size = world()
    if size == 1:
        return
    everyone: list = [None] * size
    digest = fingerprint([np.asarray(b, dtype=np.int64) for b in batches])
    torch.distributed.all_gather_object(everyone, (len(batches), digest, fingerprint(inputs), ranks, store))

    def differs(fact: slice | int) -> int | None:  # the first rank whose ``fact`` (of the gathered) is not rank 0's
        return next((r for r, mine in enumerate(everyone) if mine[fact] != everyone[0][fact]), None)

    other = differs(3)
    if other is not None:
        raise ValueError(f"ranks should be the same on every rank, but got ranks={everyone[other][3]!r} on rank "
                         f"{other} and ranks={everyone[0][3]!r} on rank 0; pass every rank the same ranks")
    other = differs(4)
    if other is not None:
        given = {True: "given", False: "None"}
        raise ValueError(
            "output_path should be given on every rank or on none (with it every rank writes into the store, without "
            f"it rank 0 gathers every rank's rows), but got output_path {given[everyone[other][4]]} on rank {other} "
            f"and {given[everyone[0][4]]} on rank 0; pass every rank the same output_path")
    other = differs(slice(2))
    if other is not None:
        raise ValueError(
            "loader should yield the same batches on every rank (run shares them among the ranks itself), but "
            f"got {everyone[other][0]} batches on rank {other} and {everyone[0][0]} on rank 0 that differ; pass "
            "every rank the whole loader, not its own share"
        )
    other = differs(2)
    if other is not None:
        raise ValueError(
            "loader should hold the same inputs on every rank (each rank runs its share of them, and rank 0 gets "
            f"every rank's rows), but got inputs on rank {other} that differ from rank 0's (other texts, or tokens "
            "of another tokenizer) in the same batches; build every rank's loader from the same texts with the same "
            "tokenizer and settings"
        )


def chunk_claims(n_chunks: int) -> Iterator[int]:
    """Collective in spirit (every rank calls it once per run): the chunk numbers this rank claims, in order, from one
    atomic counter in ``torch.distributed``'s own store, so that each chunk goes to whichever rank asks first."""
    from torch.distributed.distributed_c10d import _get_default_store  # the group's store (a TCPStore under torchrun)

    store = torch.distributed.PrefixStore(f"dynabatch/claims/{next(_CLAIM_COUNTERS)}/", _get_default_store())
    while (k := int(store.add("next", 1)) - 1) < n_chunks:
        yield k


def claimed_planner(plan: Any, inputs: Any, *, store: bool) -> tuple[ChunkedPlanner, Any]:
    """This rank's planner under ``run(ranks="claim")``: the chunks it claims, planned (a streaming loader's also
    tokenized) as they come; with the stream's feed to close, or ``None``. ``inputs``: what identifies the plan's
    inputs, and ``store`` whether rows go to a results store, checked alike on every rank
    (:func:`check_same_batches`)."""
    planner, stream = plan.planner, plan.stream
    check_same_batches("claim", [stream.order if stream is not None else planner.order], inputs, store=store)
    if stream is not None:
        feed = stream.feed(chunk_claims(stream.n_chunks), ahead=1)
        return ChunkedPlanner(feed.next, planner.settings, planner.estimator), feed
    starts = range(0, len(planner.order), CLAIM_CHUNK)
    spans = (slice(starts[k], starts[k] + CLAIM_CHUNK) for k in chunk_claims(len(starts)))
    chunks = ((planner.order[span], planner.sorted_lengths[span]) for span in spans)
    return ChunkedPlanner(lambda block=True: next(chunks, None), planner.settings, planner.estimator), None


class Lockstep:
    """Drives one rank's executor in rounds, so that ranks running ``fn`` with collectives inside stay matched: each
    round every rank makes exactly one call that completes, its item's next piece or, when it has none left while
    another rank has (one collective says so), a stand-in call on one row (its result dropped): the first row that
    ran, or before any did the first row planned (``stand_in(item)`` where every row of the step is stored). A rank
    that raises joins the others' next round through :func:`share_outcome`, so that every rank raises."""

    def __init__(self, stand_in: Any) -> None:
        self._stand_in_for = stand_in
        self._stand_in = None  # one row: the call this rank makes in a round it has no work for
        self._ran = False  # whether that row ran already (else it is the first row planned)

    def run(self, executor: Any, item: Any, built: Any) -> None:
        """Runs ``item`` (``built``: its tensors, ``None`` when every row of it is stored) on ``executor``, started on
        it, in rounds with the other ranks."""
        if self._stand_in is None:
            self._stand_in = self._stand_in_for(item) if built is None else built.padding.take(built.batch, [0])
        while _round(executor.pending, None) > 0:  # collective: whether any rank has work, or failed (then raises)
            piece = None
            while piece is None and executor.pending:
                piece = executor.step()
            if piece is None:  # the round still owes the other ranks a call
                error = executor.call(self._stand_in)
                if error is not None:
                    logger.warning("a stand-in call (one row, to keep the ranks in step) ran out of memory: %s",
                                   brief_error(error))
            elif not self._ran:  # a row that ran: what a stand-in call repeats
                self._ran, self._stand_in = True, built.padding.take(piece, [0])
