"""Timing the GPU benchmarks can trust: engines warmed until a repeated call's time is stable, then timed in rounds
that rotate their order, every round kept.

On an H200 a young process ran each decoding step at about 45 ms for its first 15-20 s of GPU work, then at
4-5 ms: whichever engine ran first lost (``../shared/gpu/2026-11-28-h200.md``). So every engine is called again
and again before any is timed, until its last calls agree (:func:`warm_until_stable`, with a cap on the seconds
spent), and the engines then run in ``rounds`` whose order rotates, so each runs early in one round and late in
another (:func:`rotated`); the tables give every round's time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

__all__ = ["add_device_arguments", "check_device_arguments", "rotated", "warm_until_stable"]

WARMUP_CAP = {"cuda": 20.0, "cpu": 2.0}
"""Seconds a warm-up may take by default: 20 on CUDA (a young process's slow first GPU work), 2 on the CPU."""


def add_device_arguments(parser: argparse.ArgumentParser) -> None:
    """``--device``, ``--dtype`` and ``--warmup-cap``: what every timed benchmark on a GPU takes."""
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                        help="the timed runs' dtype; auto: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--warmup-cap", type=float, default=None,
                        help="seconds a warm-up may take at most (default: 20 on cuda, 2 on cpu)")


def check_device_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuses ``--device cuda`` without a CUDA device; resolves ``--dtype auto`` and the default warm-up cap."""
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA device, but torch.cuda.is_available() is False")
    if args.dtype == "auto":
        args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    if args.warmup_cap is None:
        args.warmup_cap = WARMUP_CAP[args.device]


def warm_until_stable(call: Callable[[], Any], *, cap_s: float, tolerance: float = 0.10, min_calls: int = 3,
                      sync: Callable[[], None] = lambda: None, name: str = "") -> list[float]:
    """Calls ``call`` until its last ``min_calls`` times lie within ``tolerance`` of their median, or ``cap_s``
    seconds have passed (one call at least); returns every call's seconds.

    ``sync`` waits for the device's queued work (``torch.cuda.synchronize``) so that a call's time is its own.
    """
    times: list[float] = []
    start = time.perf_counter()
    while True:
        sync()
        begin = time.perf_counter()
        call()
        sync()
        times.append(time.perf_counter() - begin)
        last = times[-min_calls:]
        median = statistics.median(last)
        stable = len(times) >= min_calls and all(abs(t - median) <= tolerance * median for t in last)
        if stable or time.perf_counter() - start >= cap_s:
            break
    spent = time.perf_counter() - start
    print(f"warm-up{f' {name}' if name else ''}: {len(times)} calls in {spent:.1f} s, "
          f"{'stable' if stable else f'not stable within {cap_s:g} s'}: "
          + ", ".join(f"{t:.3f}" for t in times), file=sys.stderr, flush=True)
    return times


def rotated(names: list[str], round_: int) -> list[str]:
    """``names`` in round ``round_``'s order: rotated by one each round, so each runs first once in ``len(names)``.

    Example:
        >>> rotated(["a", "b", "c"], 0), rotated(["a", "b", "c"], 1)
        (['a', 'b', 'c'], ['b', 'c', 'a'])
    """
    shift = round_ % max(1, len(names))
    return names[shift:] + names[:shift]
