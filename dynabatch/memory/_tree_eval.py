"""Evaluates a fitted HistGradientBoostingClassifier with numpy, without per-call overhead.

scikit-learn's ``predict_proba`` validates its input and starts an OpenMP
region per tree on every call: about a millisecond for a handful of rows, which
dominates when the planner asks about a few candidates at a time. Here all
trees are flattened into one node table and walked together, level by level,
for all rows at once.

The result must equal ``predict_proba``; :func:`compile_trees` checks that on
probe rows and returns ``None`` (callers then use ``predict_proba``) for any
estimator it cannot reproduce exactly: another class, categorical splits,
multiclass, or a scikit-learn whose internals differ.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

__all__ = ["CompiledTrees", "compile_trees"]

logger = logging.getLogger(__name__)

_NODE_FIELDS = ("value", "feature_idx", "num_threshold", "missing_go_to_left", "left", "right", "is_leaf")


@dataclass(frozen=True)
class CompiledTrees:
    """All trees of a binary gradient-boosting classifier in one flat node table."""

    feature: np.ndarray  # (nodes,) intp; leaves point at feature 0
    threshold: np.ndarray  # (nodes,) float64; go left when x <= threshold
    nan_left: np.ndarray  # (nodes,) bool; where NaN goes
    children: np.ndarray  # (2 * nodes,) intp; [2i] left and [2i + 1] right child of node i; a leaf points at itself
    value: np.ndarray  # (nodes,) float64; leaf values (raw scores)
    roots: np.ndarray  # (trees,) intp
    depth: int  # enough levels to reach every leaf
    baseline: float

    def predict_proba1(self, X: np.ndarray) -> np.ndarray:
        """Probability of class 1 for each row of ``X`` (``(n, n_features)`` float64)."""
        n, width = X.shape
        node = np.broadcast_to(self.roots, (n, self.roots.shape[0])).copy()
        flat_x = X.ravel()
        row_base = (np.arange(n) * width)[:, None]
        has_nan = bool(np.isnan(flat_x).any())
        for _ in range(self.depth):
            x = flat_x[row_base + self.feature[node]]
            go_right = x > self.threshold[node]
            if has_nan:
                go_right |= np.isnan(x) & ~self.nan_left[node]
            node = self.children[2 * node + go_right]
        raw = self.value[node].sum(axis=1) + self.baseline
        return 1.0 / (1.0 + np.exp(-raw))


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
    return CompiledTrees(
        feature=np.where(leaf, 0, nodes["feature_idx"]).astype(np.intp),
        threshold=nodes["num_threshold"].astype(np.float64),
        nan_left=nodes["missing_go_to_left"].astype(bool),
        children=children,
        value=np.where(leaf, nodes["value"], 0.0).astype(np.float64),
        roots=starts,
        depth=int(nodes["depth"].max()) if "depth" in nodes.dtype.names else len(nodes),
        baseline=float(np.ravel(estimator._baseline_prediction)[0]),
    )


def compile_trees(estimator, probe: np.ndarray, reference: Callable[[np.ndarray], np.ndarray]) -> CompiledTrees | None:
    """Compiles ``estimator`` if it reproduces ``reference`` (its own probabilities) on ``probe`` rows.

    Returns None when it cannot, and the caller keeps using ``reference``.
    """
    if type(estimator).__name__ != "HistGradientBoostingClassifier" or list(getattr(estimator, "classes_", [])) != [0, 1]:
        return None
    try:
        compiled = _build(estimator)
        got = compiled.predict_proba1(probe)
    except (AttributeError, KeyError, IndexError, TypeError, ValueError) as exc:
        logger.debug("cannot compile %r, using predict_proba: %s", estimator, exc)
        return None
    want = reference(probe)
    if not np.allclose(got, want, rtol=0, atol=1e-12):
        logger.debug("compiled trees disagree with predict_proba; using predict_proba")
        return None
    return compiled
