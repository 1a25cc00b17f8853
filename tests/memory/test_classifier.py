import hashlib
import json
import subprocess
import sys
from pathlib import Path

import joblib
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.ensemble import HistGradientBoostingClassifier
from sklearn.linear_model import LogisticRegression

from dynabatch.memory.classifier_fit import sha256_files
from dynabatch.memory.classifier import (
    BUNDLED_CLASSIFIER,
    BUNDLED_SHAPE_CLASSIFIER,
    SpikeClassifier,
    _probe_features,
    load_classifier,
)
from dynabatch.memory.features import (
    FEATURE_NAMES,
    SHAPE_FEATURE_NAMES,
    ModelShape,
    compute_features,
)

TRAIN_DIR = Path(__file__).resolve().parents[2] / "train_classifier"


def test_importing_dynabatch_does_not_load_the_classifier():
    code = "import dynabatch, dynabatch.memory.classifier as c; print(c._bundled.cache_info().currsize)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "0"


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
    """A copy of the bundled files that a test may damage, and an empty cache directory."""
    import shutil

    import dynabatch.memory.classifier as module

    folder = tmp_path / "models"
    shutil.copytree(BUNDLED_CLASSIFIER.parent, folder)
    monkeypatch.setattr(module, "BUNDLED_CLASSIFIER", folder / "classifier.pkl")
    monkeypatch.setattr(module, "BUNDLED_SHAPE_CLASSIFIER", folder / "classifier-shape.pkl")
    monkeypatch.setenv("DYNABATCH_CACHE_DIR", str(tmp_path / "cache"))
    module._bundled.cache_clear()
    yield folder
    module._bundled.cache_clear()


def _probe():
    return _probe_features()


def _edit_metadata(folder, **changes):
    path = folder / "classifier.json"
    meta = json.loads(path.read_text())
    meta.update(changes)
    path.write_text(json.dumps(meta))


def test_another_sklearn_version_refits_the_same_classifier_once_with_a_warning(bundled_copy, tmp_path):
    expected = load_classifier(bundled_copy / "classifier.pkl").predict_spike_proba(_probe())
    _edit_metadata(bundled_copy, sklearn_version="0.0.1")
    with pytest.warns(RuntimeWarning, match="trained with scikit-learn 0.0.1 .*refitted from the bundled profiles"):
        clf = load_classifier()
    # same rows, same parameters, deterministic fit: the very same predictions
    np.testing.assert_allclose(clf.predict_spike_proba(_probe()), expected, atol=1e-12)
    assert list((tmp_path / "cache").glob("classifier-*.pkl"))
    import warnings

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
    import dynabatch.memory.classifier as module

    _edit_metadata(bundled_copy, sklearn_version="0.0.1")
    with pytest.warns(RuntimeWarning):
        first = load_classifier().predict_spike_proba(_probe())
    module._bundled.cache_clear()  # a new process, as it were
    monkeypatch.setattr(training, "fit_spike_classifier", lambda *a, **k: pytest.fail("refitted again"))
    with pytest.warns(RuntimeWarning):
        again = load_classifier().predict_spike_proba(_probe())
    np.testing.assert_array_equal(first, again)


def test_damaged_profiles_leave_a_clear_error(bundled_copy):
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


def test_a_damaged_shape_pickle_is_refitted_from_the_profiles(bundled_copy, tmp_path):
    expected = load_classifier(bundled_copy / "classifier-shape.pkl").predict_spike_proba(_probe_features(True))
    (bundled_copy / "classifier-shape.pkl").write_bytes(b"damaged")
    with pytest.warns(RuntimeWarning, match="classifier-shape.pkl does not match the sha256 in classifier-shape.json"):
        clf = load_classifier(shape=True)
    assert clf.uses_shape
    np.testing.assert_allclose(clf.predict_spike_proba(_probe_features(True)), expected, atol=1e-12)
    assert list((tmp_path / "cache").glob("classifier-shape-*.pkl"))


def test_load_classifier_refuses_a_non_bool_shape():
    with pytest.raises(TypeError, match="shape should be a bool, but got shape='yes'"):
        load_classifier(shape="yes")
