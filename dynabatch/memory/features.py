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
token limit) does not make the ratio infinite; it stays ordered by the
candidate's padding.

Example:
    >>> from dynabatch.memory.features import FEATURE_NAMES, compute_features
    >>> f = compute_features(max_input_length=128, token_size_x=128, batch_size_x=4, total_tokens_x=512,
    ...                      token_size_y=[64, 32], batch_size_y=[8, 16], total_tokens_y=[500, 400])
    >>> f.shape
    (2, 13)
    >>> dict(zip(FEATURE_NAMES, f[0].tolist()))["total_paddings_diff"]  # (8*64-500+1) / (0+1)
    13.0

Model shape. When the model is known, one more feature,
``memory_ratio_estimate``, says how the candidate's memory compares with the
first batch's under the simplest model of a transformer call: every row holds
``hidden_size`` values per position (its input plus the ``max_new_tokens`` it
generates), and a ``generate`` call also holds a row of ``vocab_size`` logits
per beam whatever the length. That per-row part is what the 13 ratio features
cannot see, and it differs tenfold between models (a 32k and a 256k
vocabulary): with it the classifier holds on model families it was not
trained on (see ``train_classifier/REPORT.md``). It is an input to the
classifier, trained against measured memory, not a memory figure itself.

    >>> shape = ModelShape(vocab_size=50_000, hidden_size=500, max_new_tokens=10)
    >>> g = compute_features(128, 128, 8, 1024, token_size_y=[54], batch_size_y=[16], total_tokens_y=[800],
    ...                      shape=shape)
    >>> g.shape, round(float(g[0, -1]), 3)  # 16 * (50000 + 500 * 64) / (8 * (50000 + 500 * 138))
    ((1, 14), 1.378)
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

from dynabatch._validation import bad_type, bad_value
from dynabatch.memory.shape import ModelShape

__all__ = ["FEATURE_NAMES", "SHAPE_FEATURE_NAMES", "SPIKE_RATIO", "ModelShape", "compute_features"]

SPIKE_RATIO = 0.9
"""A batch *spikes* when its peak memory exceeds this fraction of the first batch's: the line the
classifier is trained on, the planner and measured mode keep under, and the report draws."""

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
"""Column order of :func:`compute_features`, dynabatch 0.1.6's 13 features."""

SHAPE_FEATURE_NAMES: tuple[str, ...] = (*FEATURE_NAMES, "memory_ratio_estimate")
"""Column order of :func:`compute_features` given a :class:`ModelShape`: the 13 and the estimate."""


def compute_features(
    max_input_length: ArrayLike,
    token_size_x: ArrayLike,
    batch_size_x: ArrayLike,
    total_tokens_x: ArrayLike,
    token_size_y: ArrayLike,
    batch_size_y: ArrayLike,
    total_tokens_y: ArrayLike,
    *,
    shape: ModelShape | None = None,
    vocab_size: ArrayLike | None = None,
    hidden_size: ArrayLike | None = None,
    max_new_tokens: ArrayLike = 0,
    num_beams: ArrayLike = 1,
) -> np.ndarray:
    """Computes the 13 features (14 with a model shape) for many candidate batches at once.

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
        shape: the model and call; adds ``memory_ratio_estimate``.
        vocab_size, hidden_size, max_new_tokens, num_beams: the same as
            arrays, one per row (how training passes profiled batches of many
            models); give either these or ``shape``.

    Returns:
        A float64 array of shape ``(n, 13)``, columns in :data:`FEATURE_NAMES`
        order, or ``(n, 14)`` in :data:`SHAPE_FEATURE_NAMES` order with a shape.

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
    if shape is not None:
        if not isinstance(shape, ModelShape):
            raise bad_type("shape", "a ModelShape or None", shape)
        if vocab_size is not None or hidden_size is not None:
            raise bad_value("vocab_size", "None when shape is given", vocab_size)
        vocab_size, hidden_size = shape.vocab_size, shape.hidden_size
        max_new_tokens, num_beams = shape.max_new_tokens, shape.num_beams
    with_shape = vocab_size is not None or hidden_size is not None
    width = len(SHAPE_FEATURE_NAMES) if with_shape else len(FEATURE_NAMES)
    out = np.empty((max_len.shape[0], width), dtype=np.float64)
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
    if with_shape:
        if vocab_size is None or hidden_size is None:
            raise bad_value("hidden_size" if hidden_size is None else "vocab_size", "given with the other", None)
        out[:, 13] = _memory_ratio_estimate(bs_x, tok_x, bs_y, tok_y, vocab_size, hidden_size, max_new_tokens,
                                            num_beams)
    return out


def _memory_ratio_estimate(bs_x, tok_x, bs_y, tok_y, vocab_size, hidden_size, max_new_tokens, num_beams):
    """Candidate over first batch under ``rows * (per_row + hidden_size * positions)``; see the module docs."""
    vocab, hidden, new, beams = (np.asarray(a, dtype=np.float64) for a in (vocab_size, hidden_size,
                                                                          max_new_tokens, num_beams))
    for name, arr, low in (("vocab_size", vocab, 1), ("hidden_size", hidden, 1), ("max_new_tokens", new, 0),
                           ("num_beams", beams, 1)):
        if (arr < low).any():
            raise bad_value(name, f"at least {low}", arr[arr < low].flat[0].item())
    per_row = np.where(new > 0, vocab * beams, 0.0)
    return bs_y * (per_row + hidden * (tok_y + new)) / (np.maximum(bs_x, 1.0) * (per_row + hidden * (np.maximum(tok_x, 1.0) + new)))
