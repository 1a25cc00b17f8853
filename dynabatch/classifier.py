"""The spike classifier: how likely a candidate batch is to exceed 90% of the first batch's peak.

The bundled classifier (``dynabatch/models/classifier.pkl``) is loaded lazily,
on first use, never at import. A user's classifier can be given as a path (a
joblib file) or as a fitted estimator with ``predict_proba``.

Unpickling runs code: load only files you trust. dynabatch never loads a path
it was not given explicitly.

Example:
    >>> from dynabatch.classifier import load_classifier
    >>> from dynabatch.features import compute_features
    >>> clf = load_classifier()
    >>> f = compute_features(128, 128, 8, 1024, token_size_y=[120, 120], batch_size_y=[8, 64],
    ...                      total_tokens_y=[900, 7000])
    >>> p = clf.predict_spike_proba(f)
    >>> bool(p[0] < p[1])  # eight times the rows at nearly the same length is likelier to spike
    True
"""

from __future__ import annotations

import functools
import json
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from dynabatch._tree_eval import compile_trees
from dynabatch._validation import bad_type, bad_value
from dynabatch.features import FEATURE_NAMES, compute_features

__all__ = ["BUNDLED_CLASSIFIER", "SpikeClassifier", "load_classifier"]

logger = logging.getLogger(__name__)

BUNDLED_CLASSIFIER = Path(__file__).resolve().parent / "models" / "classifier.pkl"
"""Path of the classifier shipped with dynabatch; its metadata is ``classifier.json`` beside it."""


class SpikeClassifier:
    """Wraps a fitted binary classifier over :data:`~dynabatch.features.FEATURE_NAMES`.

    Args:
        estimator: a fitted scikit-learn style classifier with ``predict_proba``
            and classes ``[0, 1]`` (1 = spike). If it records the feature names
            it was fitted on (``feature_names_in_``) they must equal
            :data:`FEATURE_NAMES`; otherwise it must take 13 features.
        metadata: what is known of how it was trained (``classifier.json``).
    """

    def __init__(self, estimator: Any, metadata: dict | None = None) -> None:
        if not callable(getattr(estimator, "predict_proba", None)):
            raise bad_type("classifier", "a path or a fitted estimator with predict_proba", estimator)
        names = getattr(estimator, "feature_names_in_", None)
        if names is not None and tuple(names) != FEATURE_NAMES:
            raise bad_value("classifier", f"fitted on the features {list(FEATURE_NAMES)}", list(names))
        n_features = getattr(estimator, "n_features_in_", len(FEATURE_NAMES))
        if n_features != len(FEATURE_NAMES):
            raise bad_value("classifier", f"fitted on {len(FEATURE_NAMES)} features", f"{n_features} features")
        classes = getattr(estimator, "classes_", None)
        if classes is not None and list(classes) != [0, 1]:
            raise bad_value("classifier", "a binary classifier with classes [0, 1]", list(classes))
        self.estimator = estimator
        self.metadata = dict(metadata or {})
        self._named = names is not None
        self._compiled = None
        self._compiled = compile_trees(estimator, _probe_features(), self.predict_spike_proba)

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
        if isinstance(cst, dict):
            signs = [cst.get(name, 0) for name in _GROWS_WITH_ROWS]
        else:
            signs = [list(cst)[FEATURE_NAMES.index(name)] for name in _GROWS_WITH_ROWS]
        return all(sign == 1 for sign in signs)

    def _as_input(self, features: np.ndarray):
        if self._named:
            import pandas as pd

            return pd.DataFrame(features, columns=list(FEATURE_NAMES), copy=False)
        return features

    def predict_spike_proba(self, features: np.ndarray) -> np.ndarray:
        """Returns, for each row of ``features`` (``(n, 13)``), the probability of a spike."""
        features = np.asarray(features, dtype=np.float64)
        if features.ndim != 2 or features.shape[1] != len(FEATURE_NAMES):
            raise bad_value("features", f"an array of shape (n, {len(FEATURE_NAMES)})", features.shape)
        if features.shape[0] == 0:
            return np.empty(0, dtype=np.float64)
        if self._compiled is not None:
            return self._compiled.predict_proba1(features)
        return np.asarray(self.estimator.predict_proba(self._as_input(features)))[:, 1]

    def __repr__(self) -> str:
        return f"SpikeClassifier({type(self.estimator).__name__}, trained={self.metadata.get('trained_on', '?')})"


_GROWS_WITH_ROWS = ("batch_size_y", "batch_size_diff", "total_tokens_y", "total_token_size_diff", "paddings_y",
                    "total_paddings_diff")


@functools.lru_cache(maxsize=1)
def _probe_features() -> np.ndarray:
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
    return compute_features(max_len, tok_x, bs_x, tot_x, tok_y, bs_y, tot_y)


def _read_metadata(pkl: Path) -> dict:
    meta = pkl.with_suffix(".json")
    if not meta.is_file():
        return {}
    with open(meta, encoding="utf-8") as fh:
        return json.load(fh)


def _load_path(path: Path) -> SpikeClassifier:
    import joblib

    if not path.is_file():
        raise bad_value("classifier", "the path of an existing classifier file", str(path))
    return SpikeClassifier(joblib.load(path), _read_metadata(path))


@functools.lru_cache(maxsize=1)
def _bundled() -> SpikeClassifier:
    logger.debug("loading the bundled spike classifier from %s", BUNDLED_CLASSIFIER)
    return _load_path(BUNDLED_CLASSIFIER)


def load_classifier(classifier: str | os.PathLike | Any | None = None) -> SpikeClassifier:
    """Returns the spike classifier to plan with.

    Args:
        classifier: ``None`` for the bundled classifier (loaded once, on first
            use); a path to a joblib file (unpickling runs code: trusted files
            only); a fitted estimator; or a :class:`SpikeClassifier`.

    Raises:
        TypeError: for anything else.
        ValueError: for a missing file or an estimator fitted on other features.
    """
    if classifier is None:
        return _bundled()
    if isinstance(classifier, SpikeClassifier):
        return classifier
    if isinstance(classifier, (str, os.PathLike)):
        return _load_path(Path(classifier))
    return SpikeClassifier(classifier)
