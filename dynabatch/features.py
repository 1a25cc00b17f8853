"""The spike classifier's features: one candidate batch compared with the first batch.

:func:`compute_features` is the only place features are computed: the planner
calls it for every candidate batch, ``train_classifier/train_classifier.py``
calls it on the profiled batches, so both see exactly the same numbers.

Suffix ``_x`` is the first (hardest) batch, ``_y`` the candidate batch. Sizes
are counted in tokens of a right- or left-padded rectangle: ``token_size`` is
the longest row, ``total_tokens`` the real tokens, ``paddings`` the pad cells
(``batch_size * token_size - total_tokens``).

Every ratio is finite for every batch the planner can meet: token ratios divide
by at least 1, and the padding ratio is smoothed, ``(paddings_y + 1) /
(paddings_x + 1)``, so a first batch without padding (every text cut at the
token limit) no longer makes the ratio infinite; it stays ordered by the
candidate's padding.

Example:
    >>> from dynabatch.features import FEATURE_NAMES, compute_features
    >>> f = compute_features(max_input_length=128, token_size_x=128, batch_size_x=4, total_tokens_x=512,
    ...                      token_size_y=[64, 32], batch_size_y=[8, 16], total_tokens_y=[500, 400])
    >>> f.shape
    (2, 13)
    >>> dict(zip(FEATURE_NAMES, f[0].tolist()))["total_paddings_diff"]  # (8*64-500+1) / (0+1)
    13.0
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

from dynabatch._validation import bad_value

__all__ = ["FEATURE_NAMES", "compute_features"]

FEATURE_NAMES: tuple[str, ...] = (
    "max_input_length",
    "token_size_x",
    "token_size_y",
    "token_size_diff",
    "batch_size_x",
    "batch_size_y",
    "batch_size_diff",
    "total_tokens_x",
    "total_tokens_y",
    "total_token_size_diff",
    "paddings_x",
    "paddings_y",
    "total_paddings_diff",
)
"""Column order of :func:`compute_features`, the spec's 13 features."""


def compute_features(
    max_input_length: ArrayLike,
    token_size_x: ArrayLike,
    batch_size_x: ArrayLike,
    total_tokens_x: ArrayLike,
    token_size_y: ArrayLike,
    batch_size_y: ArrayLike,
    total_tokens_y: ArrayLike,
) -> np.ndarray:
    """Computes the 13 features for many candidate batches at once.

    All arguments broadcast against each other (scalars for the first batch,
    arrays for the candidates is the usual call).

    Args:
        max_input_length: the truncation limit, in tokens.
        token_size_x: longest row of the first batch, in tokens.
        batch_size_x: rows in the first batch.
        total_tokens_x: real (non-pad) tokens in the first batch.
        token_size_y: longest row of each candidate batch.
        batch_size_y: rows in each candidate batch.
        total_tokens_y: real tokens in each candidate batch.

    Returns:
        A float64 array of shape ``(n, 13)``, columns in :data:`FEATURE_NAMES` order.

    Raises:
        ValueError: if a batch holds more real tokens than its rectangle
            (``total_tokens > batch_size * token_size``) or a size is negative.
    """
    arrays = np.broadcast_arrays(
        *(np.asarray(a, dtype=np.float64) for a in (
            max_input_length, token_size_x, batch_size_x, total_tokens_x, token_size_y, batch_size_y, total_tokens_y
        ))
    )
    names = ("max_input_length", "token_size_x", "batch_size_x", "total_tokens_x", "token_size_y",
             "batch_size_y", "total_tokens_y")
    for name, arr in zip(names, arrays):
        if (arr < 0).any():
            raise bad_value(name, "non-negative", arr[arr < 0].flat[0].item())
    max_len, tok_x, bs_x, tot_x, tok_y, bs_y, tot_y = (np.atleast_1d(a) for a in arrays)
    pad_x = bs_x * tok_x - tot_x
    pad_y = bs_y * tok_y - tot_y
    for side, bs, tok, tot, pad in (("x", bs_x, tok_x, tot_x, pad_x), ("y", bs_y, tok_y, tot_y, pad_y)):
        if (pad < 0).any():
            raise bad_value(f"total_tokens_{side}", f"at most batch_size_{side} * token_size_{side}",
                            tot[pad < 0][0].item())
    out = np.empty((max_len.shape[0], len(FEATURE_NAMES)), dtype=np.float64)
    out[:, 0] = max_len
    out[:, 1] = tok_x
    out[:, 2] = tok_y
    out[:, 3] = tok_y / np.maximum(tok_x, 1.0)
    out[:, 4] = bs_x
    out[:, 5] = bs_y
    out[:, 6] = bs_y / np.maximum(bs_x, 1.0)
    out[:, 7] = tot_x
    out[:, 8] = tot_y
    out[:, 9] = tot_y / np.maximum(tot_x, 1.0)
    out[:, 10] = pad_x
    out[:, 11] = pad_y
    out[:, 12] = (pad_y + 1.0) / (pad_x + 1.0)
    return out
