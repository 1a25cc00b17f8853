"""A fitted HistGradientBoostingClassifier as plain numpy arrays: evaluated, saved and loaded without scikit-learn.

scikit-learn's ``predict_proba`` validates its input and starts an OpenMP
region per tree on every call: about a millisecond for a handful of rows, which
dominates when the planner asks about a few candidates at a time. Here all
trees are flattened into one node table and walked together, level by level,
for all rows at once. The trees' values are added in scikit-learn's own order
(the baseline, then tree after tree), so the decision scores are bit-identical
to ``decision_function``.

The same arrays are what dynabatch ships beside each bundled pickle
(``classifier.npz``): :meth:`CompiledTrees.load` reads them with
``allow_pickle=False`` (no code runs), checks that they form well-made trees,
and needs neither scikit-learn nor unpickling. :func:`compile_trees` builds
them from a fitted estimator and returns ``None`` (callers then use
``predict_proba``) for any estimator it cannot reproduce exactly: another
class, categorical splits, multiclass, or a scikit-learn whose internals differ.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["FORMAT_VERSION", "CompiledTrees", "check_rows", "compile_trees"]

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
"""Version of the ``.npz`` layout written by :meth:`CompiledTrees.save`; others are refused."""

_NODE_FIELDS = ("value", "feature_idx", "num_threshold", "missing_go_to_left", "left", "right", "is_leaf")
_ARRAYS = ("feature", "threshold", "nan_left", "children", "value", "roots")


@dataclass(frozen=True, eq=False)
class CompiledTrees:
    """All trees of a binary gradient-boosting classifier in one flat node table.

    It answers like the estimator it was compiled from (``predict_proba``,
    ``decision_function``, ``classes_``, ``n_features_in_``,
    ``feature_names_in_``, ``monotonic_cst``), so it can stand in for it.
    """

    feature: np.ndarray  # (nodes,) intp; leaves point at feature 0
    threshold: np.ndarray  # (nodes,) float64; go left when x <= threshold
    nan_left: np.ndarray  # (nodes,) bool; where NaN goes
    children: np.ndarray  # (2 * nodes,) intp; [2i] left and [2i + 1] right child of node i; a leaf points at itself
    value: np.ndarray  # (nodes,) float64; leaf values (raw scores)
    roots: np.ndarray  # (trees,) intp, in boosting order
    depth: int  # enough levels to reach every leaf
    baseline: float
    n_features: int
    feature_names: tuple[str, ...] | None = None
    monotonic_cst: tuple[int, ...] | None = None  # per feature, as the estimator was constrained

    @property
    def classes_(self) -> np.ndarray:
        return np.array([0, 1])

    @property
    def n_features_in_(self) -> int:
        return self.n_features

    @property
    def feature_names_in_(self) -> np.ndarray | None:
        return None if self.feature_names is None else np.array(self.feature_names, dtype=object)

    def decision_function(self, X: np.ndarray) -> np.ndarray:
        """Raw scores of each row of ``X`` (``(n, n_features)`` float64), summed in scikit-learn's order."""
        X = np.asarray(X, dtype=np.float64)
        n, width = X.shape
        if n == 1:  # a one-column sum would be reduced pairwise, not tree after tree
            return self.decision_function(np.repeat(X, 2, axis=0))[:1]
        node = np.repeat(self.roots[:, None], n, axis=1)  # (trees, rows)
        flat_x = X.ravel()
        row_base = np.arange(n) * width
        has_nan = bool(np.isnan(flat_x).any())
        for _ in range(self.depth):
            x = flat_x[row_base + self.feature[node]]
            go_right = x > self.threshold[node]
            if has_nan:
                go_right |= np.isnan(x) & ~self.nan_left[node]
            node = self.children[2 * node + go_right]
        # Reduced along the first axis, numpy adds row after row: baseline, tree 0, tree 1, ... as scikit-learn does.
        return self.value[node].sum(axis=0, initial=self.baseline)

    def predict_proba1(self, X: np.ndarray) -> np.ndarray:
        """Probability of class 1 for each row of ``X`` (``(n, n_features)`` float64)."""
        return 1.0 / (1.0 + np.exp(-self.decision_function(X)))

    def predict_proba(self, X: np.ndarray) -> np.ndarray:
        """Probabilities of classes 0 and 1, ``(n, 2)``, as the estimator's ``predict_proba``."""
        p = self.predict_proba1(X)
        return np.column_stack([1.0 - p, p])

    def save(self, path: str | os.PathLike, source_sha256: str) -> None:
        """Writes the trees to ``path`` (an ``.npz``), recording the sha256 of the pickle they were compiled from.

        The same trees always give the same bytes (members are stamped 1980-01-01), and the file is
        written beside and then moved into place, so a reader never sees half of it.
        """
        import zipfile

        path = Path(path)
        arrays = {
            "format_version": np.int64(FORMAT_VERSION),
            "source_sha256": np.str_(source_sha256),
            "depth": np.int64(self.depth),
            "baseline": np.float64(self.baseline),
            "n_features": np.int64(self.n_features),
            "feature_names": np.array(self.feature_names or (), dtype=np.str_),
            "monotonic_cst": np.array(self.monotonic_cst or (), dtype=np.int64),
            **{name: getattr(self, name) for name in _ARRAYS},
        }
        partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with zipfile.ZipFile(partial, "w", compression=zipfile.ZIP_DEFLATED) as archive:
            for name, value in arrays.items():
                member = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
                member.compress_type = zipfile.ZIP_DEFLATED
                with archive.open(member, "w") as fh:
                    np.lib.format.write_array(fh, np.asanyarray(value), allow_pickle=False)
        os.replace(partial, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> tuple[CompiledTrees, str]:
        """Reads trees written by :meth:`save`: ``(trees, sha256 of their source pickle)``.

        Raises:
            ValueError: the file is not one :meth:`save` wrote (damaged,
                another format version, or arrays that do not form trees).
        """
        try:
            with np.load(path, allow_pickle=False) as data:
                fields = {key: data[key] for key in data.files}
        except Exception as exc:  # a truncated or corrupted zip, a missing member, an object array
            raise ValueError(f"{path} cannot be read ({type(exc).__name__}: {exc})") from exc
        missing = sorted({"format_version", "source_sha256", "depth", "baseline", "n_features", "feature_names",
                          "monotonic_cst", *_ARRAYS} - set(fields))
        if missing:
            raise ValueError(f"{path} lacks {missing}")
        if int(fields["format_version"]) != FORMAT_VERSION:
            raise ValueError(f"{path} has format version {int(fields['format_version'])}, not {FORMAT_VERSION}")
        names = tuple(str(s) for s in fields["feature_names"])
        cst = tuple(int(c) for c in fields["monotonic_cst"])
        trees = cls(
            feature=fields["feature"].astype(np.intp),
            threshold=fields["threshold"].astype(np.float64),
            nan_left=fields["nan_left"].astype(bool),
            children=fields["children"].astype(np.intp),
            value=fields["value"].astype(np.float64),
            roots=fields["roots"].astype(np.intp),
            depth=int(fields["depth"]),
            baseline=float(fields["baseline"]),
            n_features=int(fields["n_features"]),
            feature_names=names or None,
            monotonic_cst=cst or None,
        )
        problem = trees._problem()
        if problem:
            raise ValueError(f"{path} does not hold well-formed trees: {problem}")
        return trees, str(fields["source_sha256"])

    def _problem(self) -> str | None:
        """Why these arrays are not trees every row can be walked through in ``depth`` levels, or None."""
        nodes = len(self.value)
        if not nodes or any(getattr(self, name).shape != (nodes,) for name in ("feature", "threshold", "nan_left")):
            return "node arrays of different lengths"
        if self.children.shape != (2 * nodes,) or self.roots.ndim != 1 or not len(self.roots):
            return "children or roots of the wrong shape"
        if self.children.min() < 0 or self.children.max() >= nodes or self.roots.min() < 0 or self.roots.max() >= nodes:
            return "a child or root outside the node table"
        if self.feature.min() < 0 or self.feature.max() >= self.n_features or self.depth < 0:
            return "a feature index outside the features, or a negative depth"
        if self.feature_names is not None and len(self.feature_names) != self.n_features:
            return "feature names of another length than the features"
        if self.monotonic_cst is not None and len(self.monotonic_cst) != self.n_features:
            return "monotonic constraints of another length than the features"
        if not (np.isfinite(self.value).all() and np.isfinite(self.baseline)):
            return "non-finite leaf values"
        reached = self.roots
        for _ in range(self.depth):  # a mask per level, not np.unique: its first call imports numpy.ma (0.1 s)
            mask = np.zeros(nodes, dtype=bool)
            mask[self.children[2 * reached]] = mask[self.children[2 * reached + 1]] = True
            reached = np.flatnonzero(mask)
        if (self.children[2 * reached] != reached).any() or (self.children[2 * reached + 1] != reached).any():
            return f"nodes left unresolved after depth {self.depth}"
        return None


def _constraints(estimator, n_features: int) -> tuple[int, ...] | None:
    cst = getattr(estimator, "monotonic_cst", None)
    if cst is None:
        return None
    if isinstance(cst, dict):
        names = list(getattr(estimator, "feature_names_in_", []))
        if not names:
            return None
        return tuple(int(cst.get(name, 0)) for name in names)
    cst = tuple(int(c) for c in cst)
    return cst if len(cst) == n_features else None


def _build(estimator) -> CompiledTrees:
    predictors = [iteration[0] for iteration in estimator._predictors]
    tables = [p.nodes for p in predictors]
    if any(not set(_NODE_FIELDS) <= set(t.dtype.names) for t in tables):
        raise ValueError("unknown node layout")
    if any("is_categorical" in t.dtype.names and t["is_categorical"].any() for t in tables):
        raise ValueError("categorical splits")
    sizes = np.array([len(t) for t in tables])
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.intp)
    nodes = np.concatenate(tables)
    shift = np.repeat(starts, sizes)
    leaf = nodes["is_leaf"].astype(bool)
    own = np.arange(len(nodes), dtype=np.intp)
    children = np.empty(2 * len(nodes), dtype=np.intp)
    children[0::2] = np.where(leaf, own, nodes["left"].astype(np.intp) + shift)
    children[1::2] = np.where(leaf, own, nodes["right"].astype(np.intp) + shift)
    names = getattr(estimator, "feature_names_in_", None)
    n_features = int(estimator.n_features_in_)
    return CompiledTrees(
        feature=np.where(leaf, 0, nodes["feature_idx"]).astype(np.intp),
        threshold=nodes["num_threshold"].astype(np.float64),
        nan_left=nodes["missing_go_to_left"].astype(bool),
        children=children,
        value=np.where(leaf, nodes["value"], 0.0).astype(np.float64),
        roots=starts,
        depth=int(nodes["depth"].max()) if "depth" in nodes.dtype.names else len(nodes),
        baseline=float(np.ravel(estimator._baseline_prediction)[0]),
        n_features=n_features,
        feature_names=None if names is None else tuple(str(s) for s in names),
        monotonic_cst=_constraints(estimator, n_features),
    )


def check_rows(trees: CompiledTrees, probe: np.ndarray, n: int = 2048, seed: int = 0) -> np.ndarray:
    """Rows that walk through every split of ``trees``: the ``probe`` rows, then ``n`` random rows whose
    values sit exactly on a threshold, just above one, or at a probe row's value, plus NaN rows."""
    rng = np.random.default_rng(seed)
    probe = np.asarray(probe, dtype=np.float64)
    split = trees.children[0::2] != np.arange(len(trees.value))
    columns = []
    for j in range(trees.n_features):
        at = trees.threshold[split & (trees.feature == j)]
        pool = np.concatenate([at, np.nextafter(at, np.inf), probe[:, j]])
        columns.append(rng.choice(pool, size=n))
    grid = np.column_stack(columns)
    missing = grid[: max(n // 16, 1)].copy()
    missing[rng.random(missing.shape) < 0.2] = np.nan
    return np.concatenate([probe, grid, missing])


def compile_trees(estimator, probe: np.ndarray, reference: Callable[[np.ndarray], np.ndarray]) -> CompiledTrees | None:
    """Compiles ``estimator`` if it reproduces ``reference`` (its own probabilities) on :func:`check_rows`.

    Returns None when it cannot, and the caller keeps using ``reference``.
    """
    if isinstance(estimator, CompiledTrees):
        return estimator
    if type(estimator).__name__ != "HistGradientBoostingClassifier" or list(getattr(estimator, "classes_", [])) != [0, 1]:
        return None
    try:
        compiled = _build(estimator)
        rows = check_rows(compiled, probe)
        got = compiled.predict_proba1(rows)
    except (AttributeError, KeyError, IndexError, TypeError, ValueError) as exc:
        logger.debug("cannot compile %r, using predict_proba: %s", estimator, exc)
        return None
    want = reference(rows)
    # Bit-identical scores give probabilities equal to the last bit, but for exp itself (numpy's vs scipy's).
    if not np.allclose(got, want, rtol=0, atol=1e-15):
        logger.debug("compiled trees disagree with predict_proba; using predict_proba")
        return None
    return compiled
