"""SpikeClassifier: a fitted spike classifier checked against the features and predicting with compiled trees.

:func:`~dynabatch.memory.classifier.load_classifier` (in ``classifier.py``,
with the bundled files, the cache of compiled trees and the refit) returns
one; it is importable from there as
``dynabatch.memory.classifier.SpikeClassifier``. This module holds the wrapper
itself and the feature rows compiled trees are checked on.

Example:
    >>> from dynabatch.memory.classifier import SpikeClassifier, load_classifier
    >>> clf = load_classifier()
    >>> isinstance(clf, SpikeClassifier), len(clf.feature_names), clf.uses_shape, clf.monotone_in_rows
    (True, 13, False, True)
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from dynabatch._validation import bad_type, bad_value
from dynabatch.memory._tree_eval import CompiledTrees, compile_trees
from dynabatch.memory.features import (
    FEATURE_NAMES,
    SHAPE_FEATURE_NAMES,
    compute_features,
)

__all__ = ["SpikeClassifier", "probe_features"]


class SpikeClassifier:
    """Wraps a fitted binary classifier over :data:`~dynabatch.memory.features.FEATURE_NAMES` (or the shape features).

    Args:
        estimator: a fitted scikit-learn style classifier with ``predict_proba``
            and classes ``[0, 1]`` (1 = spike), or the compiled trees of one
            (:class:`~dynabatch.memory._tree_eval.CompiledTrees`, what the
            bundled classifier holds). If it records the feature names it
            was fitted on (``feature_names_in_``) they must equal
            :data:`FEATURE_NAMES` or :data:`SHAPE_FEATURE_NAMES`; otherwise it
            must take 13 (or 14) features.
        metadata: what is known of how it was trained (``classifier.json``).

    Attributes:
        feature_names: the columns it takes, :data:`FEATURE_NAMES` or :data:`SHAPE_FEATURE_NAMES`.
    """

    def __init__(self, estimator: Any, metadata: dict | None = None) -> None:
        if not callable(getattr(estimator, "predict_proba", None)):
            raise bad_type("classifier", "a path or a fitted estimator with predict_proba", estimator)
        names = getattr(estimator, "feature_names_in_", None)
        if names is not None and tuple(names) not in (FEATURE_NAMES, SHAPE_FEATURE_NAMES):
            raise bad_value("classifier", f"fitted on the features {list(FEATURE_NAMES)} (and optionally "
                            f"{SHAPE_FEATURE_NAMES[-1]!r})", list(names))
        n_features = getattr(estimator, "n_features_in_", len(FEATURE_NAMES))
        if n_features not in (len(FEATURE_NAMES), len(SHAPE_FEATURE_NAMES)):
            raise bad_value("classifier", f"fitted on {len(FEATURE_NAMES)} or {len(SHAPE_FEATURE_NAMES)} features",
                            f"{n_features} features")
        self.feature_names = SHAPE_FEATURE_NAMES if n_features == len(SHAPE_FEATURE_NAMES) else FEATURE_NAMES
        classes = getattr(estimator, "classes_", None)
        if classes is not None and list(classes) != [0, 1]:
            raise bad_value("classifier", "a binary classifier with classes [0, 1]", list(classes))
        self.estimator = estimator
        self.metadata = dict(metadata or {})
        self._named = names is not None
        self._compiled: CompiledTrees | None = None
        if isinstance(estimator, CompiledTrees):
            self._compiled = estimator
        else:
            self._compiled = compile_trees(estimator, probe_features(self.uses_shape), self.predict_spike_proba)

    @property
    def uses_shape(self) -> bool:
        """Whether it takes ``memory_ratio_estimate`` (plans need a :class:`~dynabatch.memory.features.ModelShape`)."""
        return self.feature_names == SHAPE_FEATURE_NAMES

    @property
    def monotone_in_rows(self) -> bool:
        """Whether adding rows to a candidate can never lower its spike probability.

        True when the estimator was fitted with a ``+1`` monotonic constraint on
        every feature that grows with the candidate's rows (as the bundled
        classifier is). The planner then checks a candidate size with two
        probabilities instead of all smaller candidates.
        """
        cst = getattr(self.estimator, "monotonic_cst", None)
        if cst is None:
            return False
        grows = _GROWS_WITH_ROWS + (("memory_ratio_estimate",) if self.uses_shape else ())
        if isinstance(cst, dict):
            signs = [cst.get(name, 0) for name in grows]
        else:
            signs = [list(cst)[self.feature_names.index(name)] for name in grows]
        return all(sign == 1 for sign in signs)

    def _as_input(self, features: np.ndarray):
        if self._named:
            import pandas as pd

            return pd.DataFrame(features, columns=list(self.feature_names), copy=False)
        return features

    def predict_spike_proba(self, features: np.ndarray) -> np.ndarray:
        """Returns, for each row of ``features`` (``(n, 13)``, or ``(n, 14)`` with shape), the probability of a spike."""
        features = np.asarray(features, dtype=np.float64)
        if features.ndim != 2 or features.shape[1] != len(self.feature_names):
            raise bad_value("features", f"an array of shape (n, {len(self.feature_names)})", features.shape)
        if features.shape[0] == 0:
            return np.empty(0, dtype=np.float64)
        if self._compiled is not None:
            return self._compiled.predict_proba1(features)
        return np.asarray(self.estimator.predict_proba(self._as_input(features)))[:, 1]

    def __repr__(self) -> str:
        return f"SpikeClassifier({type(self.estimator).__name__}, trained={self.metadata.get('trained_on', '?')})"


_GROWS_WITH_ROWS = ("batch_size_y", "batch_size_diff", "total_tokens_y", "total_token_size_diff", "paddings_y",
                    "total_paddings_diff")


@functools.lru_cache(maxsize=2)
def probe_features(shape: bool = False) -> np.ndarray:
    """Realistic feature rows (first batches and candidates of many shapes) to check compiled trees on."""
    rng = np.random.default_rng(0)
    n = 512
    max_len = rng.choice([64, 128, 256, 512, 1024], size=n)
    tok_x = np.maximum(1, (max_len * rng.uniform(0.3, 1.0, n)).astype(int))
    bs_x = rng.choice([1, 4, 8, 16, 64, 128, 256, 512], size=n)
    tot_x = (bs_x * tok_x * rng.uniform(0.5, 1.0, n)).astype(int)
    tok_y = np.maximum(1, (tok_x * rng.uniform(0.01, 1.0, n)).astype(int))
    bs_y = np.ceil(bs_x * rng.uniform(1.0, 8.0, n)).astype(int)
    tot_y = (bs_y * tok_y * rng.uniform(0.3, 1.0, n)).astype(int)
    if not shape:
        return compute_features(max_len, tok_x, bs_x, tot_x, tok_y, bs_y, tot_y)
    return compute_features(max_len, tok_x, bs_x, tot_x, tok_y, bs_y, tot_y,
                            vocab_size=rng.choice([30522, 32000, 50257, 151936, 256206], size=n),
                            hidden_size=rng.choice([384, 512, 768, 1024, 2048], size=n),
                            max_new_tokens=rng.choice([0, 8, 64, 256], size=n), num_beams=rng.choice([1, 4], size=n))
