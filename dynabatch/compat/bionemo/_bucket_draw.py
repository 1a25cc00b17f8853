"""How bionemo's BucketBatchSampler picked a bucket, draw for draw.

bionemo draws the bucket of each batch with ``torch.multinomial(weights, 1, generator)``, which is
``argmax(weights / q)`` for exponential variates ``q``. The torch it documented its outputs with drew
``q`` on the CPU through MKL: one 32-bit word ``w`` of the generator's Mersenne Twister seeds an
MCG31m1 stream (``x_0 = w mod (2**31 - 1)``, or 1 if that is 0; ``x_k = a**k x_0 mod (2**31 - 1)``)
and ``q_k = -ln(x_k / (2**31 - 1))``. Later torch builds draw ``q`` differently, so the same seed gives
other batches there; drawing ``q`` as that torch did keeps bionemo's documented outputs, and it is the
same exponential race, so every bucket is still picked with probability proportional to its weight.
"""

from __future__ import annotations

import struct
from typing import List, Optional

import numpy as np
import torch

__all__ = ["draw_bucket", "mcg_powers"]

_MCG31_MODULUS = 2**31 - 1
_MCG31_MULTIPLIER = 1132489760


def mcg_powers(n: int) -> np.ndarray:
    """``a**k mod m`` for ``k < n``, the MCG31m1 multipliers of a stream's first ``n`` values."""
    powers = np.empty(max(n, 1), dtype=np.uint64)
    power = 1
    for k in range(len(powers)):
        powers[k] = power
        power = power * _MCG31_MULTIPLIER % _MCG31_MODULUS
    return powers


_TWISTER: List[np.random.RandomState] = []  # one reusable RandomState, for the twist every 624 words


def _temper(y: int) -> int:
    y ^= y >> 11
    y ^= (y << 7) & 0x9D2C5680
    y ^= (y << 15) & 0xEFC60000
    return y ^ (y >> 18)


def _next_word(generator: torch.Generator) -> int:
    """Consumes and returns the generator's next 32-bit Mersenne Twister output.

    torch's CPU generator state is ``seed (u64), left (i32), seeded (i32), next (u64), state[624] (u64 each)``;
    the next output is ``state[next]`` tempered, unless ``left == 1``, when the state is regenerated first.
    """
    state = generator.get_state().numpy()
    left, next_index = struct.unpack_from("<i4xQ", state, 8)
    if left > 1:
        (raw,) = struct.unpack_from("<I", state, 24 + 8 * next_index)
        word = _temper(raw)
    else:
        if not _TWISTER:
            _TWISTER.append(np.random.RandomState(0))
        key = np.frombuffer(state, dtype=np.uint64, count=624, offset=24).astype(np.uint32)
        _TWISTER[0].set_state(("MT19937", key, 624))
        word = int(_TWISTER[0].randint(0, 2**32, dtype=np.uint64))
    consumed = int(torch.empty(1, dtype=torch.int32).random_(generator=generator))  # the same word, mod 2**31
    if consumed != word % 2**31:
        raise RuntimeError("unexpected torch.Generator state layout: cannot draw buckets as bionemo does")
    return word


def draw_bucket(remaining: np.ndarray, total: int, generator: Optional[torch.Generator], powers: np.ndarray) -> int:
    """A bucket drawn with probability ``remaining[k] / total``, as bionemo's torch drew it.

    The arithmetic is torch's, in numpy: ``float32(remaining) / float32(total)`` divided by the
    exponential variates cast to float32, and the first largest quotient.
    """
    weights = remaining.astype(np.float32) / np.float32(total)
    if generator is None or generator.device.type != "cpu":
        return int(torch.multinomial(torch.from_numpy(weights), 1, generator=generator))
    start = _next_word(generator) % _MCG31_MODULUS or 1
    stream = (np.uint64(start) * powers[: len(weights)]) % np.uint64(_MCG31_MODULUS)
    exponential = (-np.log(stream / _MCG31_MODULUS)).astype(np.float32)
    return int(np.argmax(weights / exponential))
