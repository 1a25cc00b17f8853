"""The spike classifier: how likely a candidate batch is to exceed 90% of the first batch's peak.

Two files hold each bundled classifier in ``dynabatch/models/``:
``classifier.pkl``, the scikit-learn estimator that ``train_classifier/``
writes (and that users replace with their own), and ``classifier.npz`` beside
it, the same trees as plain arrays (:class:`~dynabatch.memory._tree_eval.CompiledTrees`),
tied to the pickle by its sha256 and checked, when written, to give
scikit-learn's predictions. dynabatch plans with the arrays: loading them
unpickles nothing and imports no scikit-learn, so a fresh process starts in
milliseconds. The classifier is loaded lazily, on first use, never at import.

A pickle without a matching ``.npz`` (copied in by hand, or with a damaged or
stale ``.npz``, which is refused with a warning) is unpickled once, after its
sha256 matches ``classifier.json`` and its scikit-learn version matches this
one, compiled, and the arrays are cached in :func:`cache_dir` under the
pickle's sha256: later processes load the cache. If the pickle itself cannot
be used (another scikit-learn version, a damaged file), dynabatch warns,
refits it from the bundled profiles (``profiles.csv.gz``, seconds) and caches
the result, keyed by versions and hashes. A user's classifier can be given as
a path (a joblib file, or an ``.npz`` written by dynabatch) or as a fitted
estimator with ``predict_proba``.

Two classifiers are bundled: ``classifier.pkl`` over dynabatch 0.1.6's 13 features,
and ``classifier-shape.pkl`` over those and ``memory_ratio_estimate``, for
when the planner is told the model's shape
(:class:`~dynabatch.memory.features.ModelShape`); ``load_classifier(shape=True)``
returns the second.

Unpickling runs code: load only files you trust. dynabatch never loads a path
it was not given explicitly.

This module finds, checks, caches and loads the files; the wrapper it returns,
:class:`SpikeClassifier`, is defined in ``_spike_classifier.py`` and imported
from here.

Example:
    >>> from dynabatch.memory.classifier import load_classifier
    >>> from dynabatch.memory.features import compute_features
    >>> clf = load_classifier()
    >>> f = compute_features(128, 128, 8, 1024, token_size_y=[120, 120], batch_size_y=[8, 64],
    ...                      total_tokens_y=[900, 7000])
    >>> p = clf.predict_spike_proba(f)
    >>> bool(p[0] < p[1])  # eight times the rows at nearly the same length is likelier to spike
    True
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from dynabatch._validation import bad_value, check_bool
from dynabatch.memory._spike_classifier import SpikeClassifier, probe_features
from dynabatch.memory._tree_eval import CompiledTrees, check_rows

__all__ = ["BUNDLED_CLASSIFIER", "BUNDLED_SHAPE_CLASSIFIER", "SpikeClassifier", "cache_dir", "load_classifier",
           "write_compiled"]

logger = logging.getLogger(__name__)

BUNDLED_CLASSIFIER = Path(__file__).resolve().parent.parent / "models" / "classifier.pkl"
"""Path of the classifier shipped with dynabatch; its metadata is ``classifier.json`` and its compiled
trees ``classifier.npz`` beside it."""

BUNDLED_SHAPE_CLASSIFIER = BUNDLED_CLASSIFIER.with_name("classifier-shape.pkl")
"""Path of the shipped classifier over :data:`~dynabatch.memory.features.SHAPE_FEATURE_NAMES` (``classifier-shape.json``)."""


def _read_metadata(path: Path) -> dict:
    meta = path.with_suffix(".json")
    if not meta.is_file():
        return {}
    with open(meta, encoding="utf-8") as fh:
        return json.load(fh)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def cache_dir() -> Path:
    """Where compiled and refitted classifiers are kept: ``$DYNABATCH_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/dynabatch``, else ``~/.cache/dynabatch``."""
    explicit = os.environ.get("DYNABATCH_CACHE_DIR")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dynabatch"


# --- compiled trees: the .npz beside a pickle, or one cached under the pickle's sha256 ------------------


def _cached_compiled(pkl: Path, sha: str) -> Path:
    return cache_dir() / f"{pkl.stem}-{sha[:16]}.npz"


def _read_compiled(npz: Path, sha: str, file_sha: str | None = None) -> tuple[CompiledTrees | None, str]:
    """The trees in ``npz`` if they were compiled from the pickle whose sha256 is ``sha``; else why not."""
    if not npz.is_file():
        return None, "is missing"
    if file_sha is not None and _sha256(npz) != file_sha:
        return None, "does not match the compiled_sha256 of its .json"
    try:
        trees, source = CompiledTrees.load(npz)
    except ValueError as exc:
        return None, f"is damaged ({exc})"
    if source != sha:
        return None, f"was compiled from another pickle (sha256 {source[:12]}..., not {sha[:12]}...)"
    return trees, ""


def _from_compiled(pkl: Path, sha: str, meta: dict) -> SpikeClassifier | None:
    """The classifier of ``pkl`` from its compiled trees (beside it, else cached), without unpickling; or None."""
    beside = pkl.with_suffix(".npz")
    file_sha = meta.get("compiled_sha256") if meta.get("classifier_sha256") == sha else None
    trees, why = _read_compiled(beside, sha, file_sha)
    if trees is not None:
        return SpikeClassifier(trees, meta)
    cached = _cached_compiled(pkl, sha)
    if why != "is missing":
        warnings.warn(f"dynabatch: {beside} {why}; it is not used: {pkl.name} is compiled instead (once, cached "
                      f"at {cached})", RuntimeWarning, stacklevel=5)
    trees, cached_why = _read_compiled(cached, sha)
    if trees is not None:
        return SpikeClassifier(trees, meta)
    if cached_why != "is missing":
        logger.warning("the cached compiled classifier %s %s; compiling again", cached, cached_why)
    return None


def _cache_compiled(clf: SpikeClassifier, pkl: Path, sha: str) -> None:
    """Keeps the trees of a just-unpickled ``pkl`` in the cache, so the next process does not unpickle it."""
    if clf._compiled is None:  # not a tree ensemble dynabatch can compile: predict_proba is used
        return
    cached = _cached_compiled(pkl, sha)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        clf._compiled.save(cached, sha)
    except OSError as exc:
        logger.warning("could not cache the compiled classifier at %s: %s", cached, exc)
        return
    logger.info("compiled %s once; later loads read %s", pkl, cached)


def write_compiled(estimator: Any, pkl: str | os.PathLike) -> str:
    """Writes the compiled trees of ``estimator``, already saved as ``pkl``, to the ``.npz`` beside it.

    ``train_classifier/`` calls it after writing each pickle. The file is read
    back and checked against the estimator on rows that walk through every
    split (:func:`~dynabatch.memory._tree_eval.check_rows`): decision scores
    bit-identical, probabilities equal to 1e-15.

    Returns:
        The sha256 of the ``.npz`` (recorded as ``compiled_sha256`` in the ``.json``).

    Raises:
        ValueError: the estimator is not a tree ensemble dynabatch can compile.
        RuntimeError: the compiled file does not reproduce the estimator.
    """
    pkl = Path(pkl)
    clf = SpikeClassifier(estimator)
    if clf._compiled is None:
        raise bad_value("estimator", "a binary HistGradientBoostingClassifier dynabatch can compile", estimator)
    npz = pkl.with_suffix(".npz")
    clf._compiled.save(npz, _sha256(pkl))
    trees, why = _read_compiled(npz, _sha256(pkl))
    if trees is None:
        raise RuntimeError(f"{npz} {why} right after it was written")
    rows = check_rows(trees, probe_features(clf.uses_shape))
    scores = np.asarray(estimator.decision_function(clf._as_input(rows))).ravel()
    want = np.asarray(estimator.predict_proba(clf._as_input(rows)))[:, 1]
    if not (np.array_equal(trees.decision_function(rows), scores)
            and np.allclose(trees.predict_proba1(rows), want, rtol=0, atol=1e-15)):
        raise RuntimeError(f"{npz} does not reproduce {pkl.name}'s predictions")
    return _sha256(npz)


# --- loading --------------------------------------------------------------------------------------------


def _load_path(path: Path) -> SpikeClassifier:
    """A user's file: an ``.npz`` written by dynabatch, or a trusted joblib pickle (its compiled trees if known)."""
    if not path.is_file():
        raise bad_value("classifier", "the path of an existing classifier file", str(path))
    meta = _read_metadata(path)
    if path.suffix == ".npz":
        try:
            trees, _ = CompiledTrees.load(path)
        except ValueError as exc:
            raise bad_value("classifier", "a compiled classifier written by dynabatch (.npz) or a joblib file",
                            f"{path}: {exc}") from None
        return SpikeClassifier(trees, meta)
    sha = _sha256(path)
    clf = _from_compiled(path, sha, meta)
    if clf is None:
        import joblib

        clf = SpikeClassifier(joblib.load(path), meta)
        _cache_compiled(clf, path, sha)
    return clf


def _pickle_problem(pkl: Path, meta: dict) -> str | None:
    """Why the bundled pickle should not be used at all (missing, or not the file its .json describes), or None."""
    if not pkl.is_file():
        return "is missing"
    if not meta:
        return f"has no {pkl.with_suffix('.json').name}"
    if _sha256(pkl) != meta.get("classifier_sha256"):
        return f"does not match the sha256 in {pkl.with_suffix('.json').name}"
    return None


def _version_problem(meta: dict) -> str | None:
    """Why the bundled pickle should not be unpickled by this scikit-learn, or None."""
    import sklearn

    if meta.get("sklearn_version") != sklearn.__version__:
        return f"was trained with scikit-learn {meta.get('sklearn_version')} and this is scikit-learn {sklearn.__version__}"
    return None


def _refit_bundled(pkl: Path, meta: dict, problem: str) -> SpikeClassifier:
    """Refits a bundled classifier from the bundled profiles (seconds), cached per versions and hashes."""
    import joblib
    import pandas as pd
    import sklearn

    from dynabatch.memory.classifier_fit import candidate_rows, fit_spike_classifier

    profiles = pkl.parent / "profiles.csv.gz"
    shape = bool(meta.get("shape", False))
    if not profiles.is_file() or _sha256(profiles) != meta.get("profiles_sha256"):
        raise RuntimeError(f"the bundled spike classifier {problem}, and the bundled profiles to refit it from "
                           f"are missing or damaged ({profiles}); reinstall dynabatch")
    key = hashlib.sha256(json.dumps([sklearn.__version__, meta["profiles_sha256"], meta["params"],
                                     meta["spike_ratio"], shape], sort_keys=True).encode()).hexdigest()[:16]
    cached = cache_dir() / f"{pkl.stem}-{key}.pkl"
    warnings.warn(f"dynabatch: the bundled spike classifier {pkl.name} {problem}; using one refitted from the bundled "
                  f"profiles (cached at {cached})", RuntimeWarning, stacklevel=4)
    if cached.is_file():
        try:
            return SpikeClassifier(joblib.load(cached), meta)
        except Exception as exc:  # noqa: BLE001 - a damaged cache entry (any unpickling error) is refitted below
            logger.warning("cached classifier %s unusable (%s); refitting", cached, exc)
    estimator = fit_spike_classifier(candidate_rows(pd.read_csv(profiles)), meta["spike_ratio"], shape=shape,
                                     **meta["params"])
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial = cached.with_suffix(f".{os.getpid()}.tmp")
        joblib.dump(estimator, partial)
        os.replace(partial, cached)
    except OSError as exc:
        logger.warning("could not cache the refitted classifier at %s: %s", cached, exc)
    return SpikeClassifier(estimator, meta)


@functools.lru_cache(maxsize=2)
def _bundled(shape: bool = False) -> SpikeClassifier:
    """A bundled classifier: its compiled trees when they match the pickle; else the pickle, verified before it is
    unpickled and compiled into the cache; else (once, with a warning) refitted from the bundled profiles."""
    pkl = BUNDLED_SHAPE_CLASSIFIER if shape else BUNDLED_CLASSIFIER
    logger.debug("loading the bundled spike classifier %s", pkl)
    meta = _read_metadata(pkl)
    problem = _pickle_problem(pkl, meta)
    if problem is None:
        sha = meta["classifier_sha256"]
        clf = _from_compiled(pkl, sha, meta)
        if clf is not None:
            return clf
        problem = _version_problem(meta)
        if problem is None:
            import joblib

            try:
                clf = SpikeClassifier(joblib.load(pkl), meta)
            except Exception as exc:  # noqa: BLE001 - any unpickling error is reported as a problem
                problem = f"could not be loaded ({type(exc).__name__}: {exc})"
            else:
                _cache_compiled(clf, pkl, sha)
                return clf
    return _refit_bundled(pkl, meta, problem)


def load_classifier(classifier: str | os.PathLike | Any | None = None, *, shape: bool = False) -> SpikeClassifier:
    """Returns the spike classifier to plan with.

    Args:
        classifier: ``None`` for the bundled classifier (loaded once, on first
            use, from its compiled trees); a path to a joblib file (unpickling
            runs code: trusted files only; its compiled trees, beside it as
            ``.npz`` or cached from an earlier load, are used instead when they
            match its sha256) or to an ``.npz`` written by dynabatch; a fitted
            estimator; or a :class:`SpikeClassifier`.
        shape: with ``classifier=None``, the bundled shape-aware classifier
            (for plans given a :class:`~dynabatch.memory.features.ModelShape`).

    Raises:
        TypeError: for anything else.
        ValueError: for a missing or unreadable file or an estimator fitted on other features.
    """
    check_bool("shape", shape)
    if classifier is None:
        return _bundled(shape)
    if isinstance(classifier, SpikeClassifier):
        return classifier
    if isinstance(classifier, (str, os.PathLike)):
        return _load_path(Path(classifier))
    return SpikeClassifier(classifier)
