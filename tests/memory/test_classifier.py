import hashlib
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import joblib
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.ensemble import HistGradientBoostingClassifier
from sklearn.linear_model import LogisticRegression

from dynabatch.memory._tree_eval import CompiledTrees, check_rows
from dynabatch.memory.classifier import (
    BUNDLED_CLASSIFIER,
    BUNDLED_SHAPE_CLASSIFIER,
    SpikeClassifier,
    load_classifier,
    probe_features,
)
from dynabatch.memory.classifier_fit import sha256_files
from dynabatch.memory.features import (
    FEATURE_NAMES,
    SHAPE_FEATURE_NAMES,
    ModelShape,
    compute_features,
)

TRAIN_DIR = Path(__file__).resolve().parents[2] / "train_classifier"


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Compiled and refitted classifiers go to a fresh cache directory, never the user's."""
    monkeypatch.setenv("DYNABATCH_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


_FRESH_PROCESS = """
import sys
import dynabatch, dynabatch.memory.classifier as c
print(c._bundled.cache_info().currsize)
from transformers import AutoTokenizer
from dynabatch.demo import kjv_passages, minilm_path
tokenizer = AutoTokenizer.from_pretrained(minilm_path())
loader = dynabatch.build_dynamic_batch_dataloader(kjv_passages()[:300], tokenizer, 8, 64, num_workers=0)
from dynabatch.sampling.planner import plan_batches
shaped = plan_batches([60, 50, 40, 30, 20] * 20, 4, 64, model_shape=dynabatch.ModelShape(32000, 512, 8))
print(sum(len(b.indices) for b in loader), sum(map(len, shaped)), type(c.load_classifier().estimator).__name__)
print(sorted(m for m in ("sklearn", "joblib", "pandas", "scipy") if m in sys.modules))
"""


def test_a_fresh_process_plans_with_the_bundled_classifiers_without_sklearn(tmp_path):
    # Importing loads nothing; planning (both classifiers) reads the compiled trees: no scikit-learn, no
    # unpickling, no cache (the cache directory stays empty).
    env = {**os.environ, "DYNABATCH_CACHE_DIR": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", _FRESH_PROCESS], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:3] == ["0", "300 100 CompiledTrees", "[]"]
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("pkl", [BUNDLED_CLASSIFIER, BUNDLED_SHAPE_CLASSIFIER], ids=lambda p: p.stem)
def test_the_compiled_trees_give_scikit_learns_predictions(pkl):
    import pandas as pd

    meta = json.loads(pkl.with_suffix(".json").read_text())
    trees, source = CompiledTrees.load(pkl.with_suffix(".npz"))
    assert source == meta["classifier_sha256"] == hashlib.sha256(pkl.read_bytes()).hexdigest()
    assert meta["compiled_sha256"] == hashlib.sha256(pkl.with_suffix(".npz").read_bytes()).hexdigest()
    estimator = joblib.load(pkl)
    shape = bool(meta["shape"])
    # rows on and just above every threshold, NaN rows, and realistic random batches of every kind
    rng = np.random.default_rng(7)
    n = 2000
    tok_x = rng.integers(1, 1025, n)
    bs_x = rng.integers(1, 513, n)
    tok_y = np.maximum(1, (tok_x * rng.random(n)).astype(int))
    bs_y = (bs_x * rng.uniform(1, 10, n)).astype(int)
    shape_args = {"vocab_size": rng.integers(1000, 300_000, n), "hidden_size": rng.integers(64, 8192, n),
                  "max_new_tokens": rng.integers(0, 512, n), "num_beams": rng.integers(1, 8, n)} if shape else {}
    realistic = compute_features(np.maximum(tok_x, rng.integers(1, 2049, n)), tok_x, bs_x,
                                 (bs_x * tok_x * rng.uniform(0.2, 1, n)).astype(int), tok_y, bs_y,
                                 (bs_y * tok_y * rng.uniform(0.2, 1, n)).astype(int), **shape_args)
    rows = np.concatenate([check_rows(trees, probe_features(shape), n=8000), realistic])
    frame = pd.DataFrame(rows, columns=meta["feature_names"])
    # The trees are the same when the raw scores are: bit for bit (summed in scikit-learn's order).
    np.testing.assert_array_equal(trees.decision_function(rows), estimator.decision_function(frame))
    # The probabilities are the logistic of those scores; numpy's exp and scipy's expit round differently from
    # one version to the next (tens of ULP seen), so they are compared at a relative 1e-12, far below any
    # change a different tree would make (a leaf value moves a probability by 1e-4 or more), and the spike
    # decisions at the default threshold must agree exactly.
    proba, expected = trees.predict_proba(rows), estimator.predict_proba(frame)
    np.testing.assert_allclose(proba, expected, rtol=1e-12, atol=1e-300)
    np.testing.assert_array_equal(proba[:, 1] > 0.025, expected[:, 1] > 0.025)
    for k in (1, 2, 3):  # few rows, as the planner asks
        np.testing.assert_allclose(trees.predict_proba1(rows[:k]), estimator.predict_proba(frame[:k])[:, 1],
                                   rtol=1e-12, atol=1e-300)
    assert trees.monotonic_cst == tuple(estimator.monotonic_cst)
    assert trees.feature_names == tuple(estimator.feature_names_in_)


def test_bundled_classifier_loads_once_and_gives_probabilities():
    clf = load_classifier()
    assert load_classifier() is clf
    f = compute_features(256, 256, 8, 1800, token_size_y=[200, 100, 30], batch_size_y=[8, 16, 48],
                         total_tokens_y=[1500, 1400, 1300])
    p = clf.predict_spike_proba(f)
    assert p.shape == (3,)
    assert ((p >= 0) & (p <= 1)).all()


def test_bundled_metadata_matches_the_files():
    meta = json.loads(BUNDLED_CLASSIFIER.with_suffix(".json").read_text())
    assert meta["feature_names"] == list(FEATURE_NAMES)
    assert meta["classifier_sha256"] == hashlib.sha256(BUNDLED_CLASSIFIER.read_bytes()).hexdigest()
    # the bundled classifier was trained on exactly the committed profiles
    assert meta["training_data"]["sha256"] == sha256_files(sorted((TRAIN_DIR / "data").glob("*.csv.gz")))
    assert meta["profiles_sha256"] == hashlib.sha256(
        BUNDLED_CLASSIFIER.with_name("profiles.csv.gz").read_bytes()).hexdigest()
    assert len(meta["training_data"]["families"]) >= 3


@settings(max_examples=60, deadline=None)
@given(
    tok_y=st.integers(1, 512),
    bs_y=st.integers(1, 512),
    fill=st.floats(0.05, 1.0),
    grow=st.integers(1, 256),
)
def test_more_rows_at_the_same_length_never_lowers_the_spike_probability(tok_y, bs_y, fill, grow):
    # The physics is certain: adding rows never needs less memory; the bundled
    # classifier is trained with monotonic constraints, so the planner can rely on it.
    clf = load_classifier()
    tot = int(bs_y * tok_y * fill)
    added = int(grow * tok_y * fill)
    f = compute_features(512, 512, 16, 16 * 500, token_size_y=[tok_y, tok_y], batch_size_y=[bs_y, bs_y + grow],
                         total_tokens_y=[tot, tot + added])
    p = clf.predict_spike_proba(f)
    assert p[1] >= p[0]


def test_a_path_loads_a_users_classifier(tmp_path):
    rng = np.random.default_rng(0)
    X = rng.random((200, 13))
    est = LogisticRegression().fit(X, (X[:, 5] > 0.5).astype(int))
    path = tmp_path / "mine.pkl"
    joblib.dump(est, path)
    clf = load_classifier(path)
    assert isinstance(clf, SpikeClassifier)
    np.testing.assert_allclose(clf.predict_spike_proba(X[:5]), est.predict_proba(X[:5])[:, 1])
    assert load_classifier(str(path)).predict_spike_proba(X[:1]).shape == (1,)


def test_an_estimator_object_is_wrapped_and_a_wrapper_passes_through():
    rng = np.random.default_rng(1)
    X = rng.random((100, 13))
    est = LogisticRegression().fit(X, (X[:, 0] > 0.5).astype(int))
    clf = load_classifier(est)
    assert clf.estimator is est
    assert load_classifier(clf) is clf


def test_feature_names_that_do_not_match_are_refused():
    import pandas as pd

    rng = np.random.default_rng(2)
    X = pd.DataFrame(rng.random((100, 13)), columns=[f"f{i}" for i in range(13)])
    est = HistGradientBoostingClassifier(max_iter=5).fit(X, (X["f0"] > 0.5).astype(int))
    with pytest.raises(ValueError, match=r"classifier should be fitted on the features \['max_input_length'.*"
                                         r"but got classifier=\['f0'"):
        load_classifier(est)


def test_an_estimator_fitted_on_another_number_of_features_is_refused():
    rng = np.random.default_rng(3)
    X = rng.random((50, 5))
    est = LogisticRegression().fit(X, (X[:, 0] > 0.5).astype(int))
    with pytest.raises(ValueError, match="classifier should be fitted on 13 or 14 features, but got classifier='5 features'"):
        load_classifier(est)


def test_things_that_are_not_classifiers_are_refused():
    with pytest.raises(TypeError, match="classifier should be a path or a fitted estimator with predict_proba, "
                                        "but got classifier=42 of type int"):
        load_classifier(42)


def test_a_missing_path_is_a_clear_error(tmp_path):
    missing = tmp_path / "nope.pkl"
    with pytest.raises(ValueError, match="classifier should be the path of an existing classifier file"):
        load_classifier(missing)


def test_features_of_the_wrong_shape_are_refused():
    with pytest.raises(ValueError, match=r"features should be an array of shape \(n, 13\), but got features=\(4,\)"):
        load_classifier().predict_spike_proba(np.zeros(4))


# --- the bundled classifier never breaks a user -------------------------------------------------


@pytest.fixture
def bundled_copy(tmp_path, monkeypatch):
    """A copy of the bundled files that a test may damage (the cache directory is fresh: see own_cache)."""
    import shutil

    import dynabatch.memory.classifier as module

    folder = tmp_path / "models"
    shutil.copytree(BUNDLED_CLASSIFIER.parent, folder)
    monkeypatch.setattr(module, "BUNDLED_CLASSIFIER", folder / "classifier.pkl")
    monkeypatch.setattr(module, "BUNDLED_SHAPE_CLASSIFIER", folder / "classifier-shape.pkl")
    module._bundled.cache_clear()
    yield folder
    module._bundled.cache_clear()


def _probe():
    return probe_features()


def _edit_metadata(folder, stem="classifier", **changes):
    path = folder / f"{stem}.json"
    meta = json.loads(path.read_text())
    meta.update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        del meta[key]
    path.write_text(json.dumps(meta))


def _new_process():
    import dynabatch.memory.classifier as module

    module._bundled.cache_clear()


@pytest.fixture
def no_unpickling(monkeypatch):
    """Makes every way of unpickling fail the test."""
    import pickle

    import joblib

    def refuse(*args, **kwargs):
        pytest.fail("unpickled")

    for module, name in ((joblib, "load"), (pickle, "load"), (pickle, "loads")):
        monkeypatch.setattr(module, name, refuse)


@pytest.fixture
def no_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def test_the_compiled_trees_do_not_depend_on_the_scikit_learn_version(bundled_copy, no_unpickling, no_warnings):
    _edit_metadata(bundled_copy, sklearn_version="0.0.1")
    clf = load_classifier()
    assert isinstance(clf.estimator, CompiledTrees) and clf.monotone_in_rows
    reference = CompiledTrees.load(BUNDLED_CLASSIFIER.with_suffix(".npz"))[0]
    np.testing.assert_array_equal(clf.predict_spike_proba(_probe()), reference.predict_proba1(_probe()))


def _users_classifier(folder, shape=False):
    """A user's own classifier copied into the package folder as train_classifier/ writes it, but for the .npz:
    an estimator over dynabatch 0.1.6's features (14 with shape), its pickle and its .json."""
    import sklearn

    from dynabatch.memory.classifier_fit import new_classifier

    names = list(SHAPE_FEATURE_NAMES if shape else FEATURE_NAMES)
    probe = probe_features(shape)
    import pandas as pd

    labels = (probe[:, names.index("batch_size_diff")] > 3).astype(int)
    estimator = new_classifier(max_iter=10, learning_rate=0.3, max_leaf_nodes=7, shape=shape)
    estimator.fit(pd.DataFrame(probe, columns=names), labels)
    stem = "classifier-shape" if shape else "classifier"
    pkl = folder / f"{stem}.pkl"
    joblib.dump(estimator, pkl)
    meta = {"sklearn_version": sklearn.__version__, "shape": shape, "feature_names": names,
            "classifier_sha256": hashlib.sha256(pkl.read_bytes()).hexdigest(), "trained_on": "mine"}
    (folder / f"{stem}.json").write_text(json.dumps(meta))
    return estimator.predict_proba(pd.DataFrame(probe, columns=names))[:, 1]


def test_a_users_pickle_without_compiled_trees_is_compiled_once_and_cached(bundled_copy, own_cache, monkeypatch):
    (bundled_copy / "classifier.npz").unlink()
    expected = _users_classifier(bundled_copy)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the documented workflow: no warning
        first = load_classifier()
    np.testing.assert_allclose(first.predict_spike_proba(_probe()), expected, rtol=0, atol=1e-15)
    assert first.metadata["trained_on"] == "mine"
    sha = hashlib.sha256((bundled_copy / "classifier.pkl").read_bytes()).hexdigest()
    cached = own_cache / f"classifier-{sha[:16]}.npz"
    assert CompiledTrees.load(cached)[1] == sha
    assert not (bundled_copy / "classifier.npz").exists()  # the package folder is left as it is
    _new_process()
    import joblib as joblib_module

    monkeypatch.setattr(joblib_module, "load", lambda *a, **k: pytest.fail("unpickled again"))
    again = load_classifier()
    assert isinstance(again.estimator, CompiledTrees)
    np.testing.assert_array_equal(again.predict_spike_proba(_probe()), first.predict_spike_proba(_probe()))


def test_compiled_trees_of_another_pickle_are_refused_with_a_warning(bundled_copy, own_cache):
    # A user copies in a new pickle and .json but leaves the old .npz: the old trees must not be used.
    expected = _users_classifier(bundled_copy, shape=True)
    with pytest.warns(RuntimeWarning, match=r"classifier-shape.npz was compiled from another pickle .*it is not "
                                            r"used: classifier-shape.pkl is compiled instead \(once, cached at "):
        clf = load_classifier(shape=True)
    np.testing.assert_allclose(clf.predict_spike_proba(probe_features(True)), expected, rtol=0, atol=1e-15)
    assert list(own_cache.glob("classifier-shape-*.npz"))


@pytest.mark.parametrize("recorded", [True, False], ids=["sha256 in json", "no sha256 in json"])
def test_damaged_compiled_trees_are_refused_and_compiled_again(bundled_copy, recorded, monkeypatch):
    expected = load_classifier(bundled_copy / "classifier.npz").predict_spike_proba(_probe())
    npz = bundled_copy / "classifier.npz"
    npz.write_bytes(npz.read_bytes()[:-200] + bytes(200))
    if not recorded:
        _edit_metadata(bundled_copy, compiled_sha256=None)
    why = "does not match the compiled_sha256 of its .json" if recorded else "is damaged"
    with pytest.warns(RuntimeWarning, match=rf"classifier.npz {why}.*classifier.pkl is compiled instead"):
        clf = load_classifier()
    np.testing.assert_array_equal(clf.predict_spike_proba(_probe()), expected)
    _new_process()  # the next process warns about the package's file, and reads the cache: no unpickling
    import joblib as joblib_module

    monkeypatch.setattr(joblib_module, "load", lambda *a, **k: pytest.fail("unpickled again"))
    with pytest.warns(RuntimeWarning, match=why):
        np.testing.assert_array_equal(load_classifier().predict_spike_proba(_probe()), expected)


def test_damaged_compiled_trees_and_another_sklearn_refit_the_classifier(bundled_copy):
    (bundled_copy / "classifier.npz").write_bytes(b"PK not a zip")
    _edit_metadata(bundled_copy, sklearn_version="0.0.1", compiled_sha256=None)
    with pytest.warns(RuntimeWarning) as caught:
        clf = load_classifier()
    messages = " | ".join(str(w.message) for w in caught)
    assert "classifier.npz is damaged" in messages and "trained with scikit-learn 0.0.1" in messages
    assert clf.predict_spike_proba(_probe()).shape == (len(_probe()),)


def test_arrays_that_are_not_trees_are_refused(tmp_path):
    import dataclasses

    trees, source = CompiledTrees.load(BUNDLED_CLASSIFIER.with_suffix(".npz"))
    children = trees.children.copy()
    children[7] = len(trees.value) + 5
    broken = tmp_path / "broken.npz"
    dataclasses.replace(trees, children=children).save(broken, source)
    with pytest.raises(ValueError, match="does not hold well-formed trees: a child or root outside the node table"):
        CompiledTrees.load(broken)
    shallow = tmp_path / "shallow.npz"
    dataclasses.replace(trees, depth=trees.depth - 1).save(shallow, source)
    with pytest.raises(ValueError, match=f"nodes left unresolved after depth {trees.depth - 1}"):
        CompiledTrees.load(shallow)
    with pytest.raises(ValueError, match=r"classifier should be a compiled classifier written by dynabatch "
                                         r"\(.npz\) or a joblib file, but got classifier='.*shallow.npz: "):
        load_classifier(shallow)


def test_a_compiled_file_loads_by_path_without_unpickling(no_unpickling):
    clf = load_classifier(BUNDLED_SHAPE_CLASSIFIER.with_suffix(".npz"))
    assert clf.uses_shape and clf.monotone_in_rows and clf.metadata["shape"] is True
    assert load_classifier(BUNDLED_SHAPE_CLASSIFIER).predict_spike_proba(probe_features(True)).tolist() == \
        clf.predict_spike_proba(probe_features(True)).tolist()  # the pickle's path reads the .npz beside it


def test_a_users_pickle_path_is_unpickled_once(tmp_path, own_cache, monkeypatch):
    from dynabatch.memory.classifier_fit import new_classifier

    rng = np.random.default_rng(4)
    X = rng.random((300, 13))
    est = new_classifier(max_iter=5, learning_rate=0.3, max_leaf_nodes=5).fit(X, (X[:, 5] > 0.5).astype(int))
    path = tmp_path / "mine.pkl"
    joblib.dump(est, path)
    first = load_classifier(path)
    assert list(own_cache.glob("mine-*.npz"))
    import joblib as joblib_module

    monkeypatch.setattr(joblib_module, "load", lambda *a, **k: pytest.fail("unpickled again"))
    again = load_classifier(path)
    np.testing.assert_array_equal(again.predict_spike_proba(X), first.predict_spike_proba(X))
    np.testing.assert_allclose(again.predict_spike_proba(X), est.predict_proba(X)[:, 1], rtol=0, atol=1e-15)


def test_without_compiled_trees_another_sklearn_version_refits_the_same_classifier_once(bundled_copy, own_cache):
    expected = load_classifier(bundled_copy / "classifier.npz").predict_spike_proba(_probe())
    (bundled_copy / "classifier.npz").unlink()
    _edit_metadata(bundled_copy, sklearn_version="0.0.1")
    with pytest.warns(RuntimeWarning, match="trained with scikit-learn 0.0.1 .*refitted from the bundled profiles"):
        clf = load_classifier()
    # same rows, same parameters, deterministic fit: the very same predictions
    np.testing.assert_allclose(clf.predict_spike_proba(_probe()), expected, atol=1e-12)
    assert list(own_cache.glob("classifier-*.pkl"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_classifier() is clf  # warned once, then cached in the process


def test_a_damaged_pickle_is_never_unpickled_and_is_replaced(bundled_copy, monkeypatch):
    import joblib

    (bundled_copy / "classifier.pkl").write_bytes(b"not a pickle")
    calls = []
    monkeypatch.setattr(joblib, "load", lambda *a, **k: calls.append(a) or pytest.fail("unpickled"))
    with pytest.warns(RuntimeWarning, match="does not match the sha256 in classifier.json"):
        clf = load_classifier()
    assert calls == []
    assert clf.predict_spike_proba(_probe()).shape == (len(_probe()),)


def test_the_refitted_classifier_is_reused_from_the_cache(bundled_copy, monkeypatch):
    import dynabatch.memory.classifier_fit as training

    (bundled_copy / "classifier.npz").unlink()
    _edit_metadata(bundled_copy, sklearn_version="0.0.1")
    with pytest.warns(RuntimeWarning):
        first = load_classifier().predict_spike_proba(_probe())
    _new_process()
    monkeypatch.setattr(training, "fit_spike_classifier", lambda *a, **k: pytest.fail("refitted again"))
    with pytest.warns(RuntimeWarning):
        again = load_classifier().predict_spike_proba(_probe())
    np.testing.assert_array_equal(first, again)


def test_damaged_profiles_leave_a_clear_error(bundled_copy):
    (bundled_copy / "classifier.npz").unlink()
    _edit_metadata(bundled_copy, sklearn_version="0.0.1")
    (bundled_copy / "profiles.csv.gz").write_bytes(b"damaged")
    with pytest.raises(RuntimeError, match="bundled profiles to refit it from are missing or damaged"):
        load_classifier()


# --- the shape-aware classifier ------------------------------------------------------------------


def test_bundled_shape_classifier_metadata_matches_the_files():
    meta = json.loads(BUNDLED_SHAPE_CLASSIFIER.with_suffix(".json").read_text())
    assert meta["shape"] is True and meta["feature_names"] == list(SHAPE_FEATURE_NAMES)
    assert meta["classifier_sha256"] == hashlib.sha256(BUNDLED_SHAPE_CLASSIFIER.read_bytes()).hexdigest()
    assert meta["training_data"] == json.loads(BUNDLED_CLASSIFIER.with_suffix(".json").read_text())["training_data"]


def test_shape_classifier_takes_fourteen_features_and_the_plain_one_thirteen():
    plain, shaped = load_classifier(), load_classifier(shape=True)
    assert not plain.uses_shape and shaped.uses_shape and shaped.monotone_in_rows
    f = compute_features(128, 128, 8, 1024, [64], [16], [900], shape=ModelShape(32000, 512, max_new_tokens=8))
    assert shaped.predict_spike_proba(f).shape == (1,)
    with pytest.raises(ValueError, match=r"features should be an array of shape \(n, 13\)"):
        plain.predict_spike_proba(f)


def test_the_shape_tells_a_large_vocabulary_from_a_small_one():
    # Twice the rows at a quarter of the length: half the tokens. For a forward pass that is no spike; for
    # a generate call whose logits dwarf the hidden states (a 256k vocabulary, 512-wide) it is one.
    clf = load_classifier(shape=True)
    args = {"max_input_length": 256, "token_size_x": 256, "batch_size_x": 8, "total_tokens_x": 2048, "token_size_y": [64],
                "batch_size_y": [16], "total_tokens_y": [1024]}
    forward = clf.predict_spike_proba(compute_features(**args, shape=ModelShape(32000, 1024)))
    generate = clf.predict_spike_proba(compute_features(**args, shape=ModelShape(256000, 512, max_new_tokens=64)))
    assert forward[0] < 0.025 < generate[0]


def test_a_damaged_shape_pickle_is_refitted_from_the_profiles(bundled_copy, own_cache):
    expected = load_classifier(bundled_copy / "classifier-shape.pkl").predict_spike_proba(probe_features(True))
    (bundled_copy / "classifier-shape.pkl").write_bytes(b"damaged")
    with pytest.warns(RuntimeWarning, match="classifier-shape.pkl does not match the sha256 in classifier-shape.json"):
        clf = load_classifier(shape=True)
    assert clf.uses_shape
    np.testing.assert_allclose(clf.predict_spike_proba(probe_features(True)), expected, atol=1e-12)
    assert list(own_cache.glob("classifier-shape-*.pkl"))


def test_load_classifier_refuses_a_non_bool_shape():
    with pytest.raises(TypeError, match="shape should be a bool, but got shape='yes'"):
        load_classifier(shape="yes")
