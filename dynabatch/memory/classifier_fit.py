"""Fitting the spike classifier from profiled batches.

Shared by ``train_classifier/train_classifier.py`` and by the loader's fallback
that retrains the bundled classifier when its pickle cannot be used (another
scikit-learn version, a damaged file), so both fit exactly the same model.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pandas as pd

from dynabatch.memory.features import FEATURE_NAMES, SHAPE_FEATURE_NAMES, compute_features

__all__ = [
    "DEFAULT_PARAMS",
    "MONOTONIC",
    "PROFILE_COLUMNS",
    "candidate_rows",
    "feature_names",
    "features_of",
    "fit_spike_classifier",
    "new_classifier",
    "sha256_files",
]

MONOTONIC = {
    "max_input_length": 0,
    "token_size_x": -1,
    "token_size_y": 1,
    "token_size_diff": 1,
    "batch_size_x": -1,
    "batch_size_y": 1,
    "batch_size_diff": 1,
    "total_tokens_x": -1,
    "total_tokens_y": 1,
    "total_token_size_diff": 1,
    "paddings_x": -1,
    "paddings_y": 1,
    "total_paddings_diff": 1,
    "memory_ratio_estimate": 1,
}
"""+1 where more of it never needs less memory in the candidate; -1 where a larger
first batch (a larger budget) never makes a spike likelier."""

DEFAULT_PARAMS = {"max_iter": 100, "learning_rate": 0.1, "max_leaf_nodes": 15}

PROFILE_COLUMNS = (
    "model", "family", "device", "max_input_length", "position", "batch_size", "token_size", "total_tokens",
    "peak_bytes", "first_batch_size", "first_token_size", "first_total_tokens", "first_peak_bytes",
    "vocab_size", "hidden_size", "max_new_tokens", "num_beams",
)
"""What training needs of a profiled batch (the data files hold more)."""


def sha256_files(files: Iterable[Path]) -> str:
    """One digest over the files' names and bytes, in name order."""
    digest = hashlib.sha256()
    for path in sorted(files, key=lambda p: p.name):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def candidate_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """The measured candidate batches (not the first batch itself), with their measured ``ratio``."""
    rows = frame
    if "status" in rows:
        rows = rows[rows["status"] == "ok"]
    rows = rows[rows["position"] > 0].copy()
    rows["ratio"] = rows["peak_bytes"] / rows["first_peak_bytes"]
    return rows.reset_index(drop=True)


def feature_names(shape: bool) -> tuple[str, ...]:
    """The columns of the shape-aware classifier (``shape=True``) or of dynabatch 0.1.6's 13-feature one."""
    return SHAPE_FEATURE_NAMES if shape else FEATURE_NAMES


def features_of(frame: pd.DataFrame, shape: bool = False) -> pd.DataFrame:
    """The classifier's features of profiled batches, by the planner's own function.

    With ``shape=True`` each row's model shape (``vocab_size``, ``hidden_size``,
    ``max_new_tokens``, ``num_beams`` columns) adds ``memory_ratio_estimate``.
    """
    extra = {}
    if shape:
        extra = {name: frame[name].to_numpy() for name in ("vocab_size", "hidden_size", "max_new_tokens",
                                                           "num_beams")}
    values = compute_features(
        max_input_length=frame["max_input_length"].to_numpy(),
        token_size_x=frame["first_token_size"].to_numpy(),
        batch_size_x=frame["first_batch_size"].to_numpy(),
        total_tokens_x=frame["first_total_tokens"].to_numpy(),
        token_size_y=frame["token_size"].to_numpy(),
        batch_size_y=frame["batch_size"].to_numpy(),
        total_tokens_y=frame["total_tokens"].to_numpy(),
        **extra,
    )
    return pd.DataFrame(values, columns=list(feature_names(shape)))


def new_classifier(max_iter: int, learning_rate: float, max_leaf_nodes: int, shape: bool = False):
    """A HistGradientBoostingClassifier with the physics' monotonic constraints, deterministic."""
    from sklearn.ensemble import HistGradientBoostingClassifier

    return HistGradientBoostingClassifier(
        max_iter=max_iter,
        learning_rate=learning_rate,
        max_leaf_nodes=max_leaf_nodes,
        l2_regularization=1.0,
        monotonic_cst=[MONOTONIC[name] for name in feature_names(shape)],
        early_stopping=False,
        random_state=0,
    )


def fit_spike_classifier(rows: pd.DataFrame, spike_ratio: float = 0.9, shape: bool = False, **params):
    """Fits the classifier on candidate rows (see :func:`candidate_rows`): label 1 when ``ratio > spike_ratio``.

    ``shape=True`` fits the shape-aware classifier (:data:`~dynabatch.memory.features.SHAPE_FEATURE_NAMES`).
    """
    labels = (rows["ratio"] > spike_ratio).to_numpy().astype(int)
    if len(np.unique(labels)) < 2:
        raise ValueError("the profiles hold only one class (all spikes or none); profile more settings")
    return new_classifier(**{**DEFAULT_PARAMS, **params}, shape=shape).fit(features_of(rows, shape), labels)
