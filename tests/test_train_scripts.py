"""The two training scripts, run as a user runs them (``--help`` in a fresh interpreter; the runs in a fork of
``tests/_warm.py``'s, without the imports' 15-20 s)."""

import hashlib
import json
import os
import re
import sys
from pathlib import Path

import _warm
import pandas as pd
import pytest

from dynabatch.memory._tree_eval import CompiledTrees
from dynabatch.memory.classifier import load_classifier
from dynabatch.memory.features import ModelShape, compute_features

TRAIN_DIR = Path(__file__).resolve().parents[1] / "train_classifier"
GENERATE = TRAIN_DIR / "generate_training_data.py"
TRAIN = TRAIN_DIR / "train_classifier.py"


def _run(script, *args, warm=None):
    """``python script *args``: a fresh interpreter, or with ``warm`` a fork of that server."""
    return _warm.run(warm, [sys.executable, str(script), *args], text=True, check=True,
                     env={**os.environ, "HF_HUB_OFFLINE": "1"})


def _options(script):
    src = script.read_text()
    return sorted(set(re.findall(r'add_argument\("(--[a-z-]+)"', src)))


@pytest.mark.parametrize("script", [GENERATE, TRAIN], ids=lambda p: p.name)
def test_help_documents_every_option(script):
    out = _run(script, "--help").stdout
    options = _options(script)
    assert len(options) >= 5
    for option in options:
        assert option in out, option


@pytest.fixture(scope="module")
def profiles(tmp_path_factory, warm):
    out = tmp_path_factory.mktemp("profiles")
    _run(GENERATE, "--models", "minilm-l6,marian-2l", "--max-input-lengths", "64", "--base-batch-sizes", "2",
         "--n-texts", "120", "--max-new-tokens", "2", "--threads", "2", "--out", str(out), warm=warm)
    return out


def test_generator_writes_raw_measurements_of_real_runs(profiles):
    frame = pd.concat([pd.read_csv(p) for p in sorted(profiles.glob("*.csv.gz"))])
    assert set(frame["model"]) == {"minilm-l6", "marian-2l"}
    assert set(frame["task"]) == {"forward", "generate"}
    ok = frame[frame["status"] == "ok"]
    assert (ok["peak_bytes"] > 0).all()
    first = ok[ok["position"] == 0]
    assert (first["peak_bytes"] == first["first_peak_bytes"]).all()
    assert (first["batch_size"] == 2).all()
    # candidates span the first batch size up to several times it, on both sides of the 0.9 line
    assert ok["batch_size"].max() >= 4 * 2
    ratio = ok["peak_bytes"] / ok["first_peak_bytes"]
    assert (ratio < 0.9).any() and (ratio > 0.9).any()
    assert (ok["paddings"] == ok["batch_size"] * ok["token_size"] - ok["total_tokens"]).all()


def test_training_on_the_generated_profiles_gives_a_loadable_classifier(profiles, tmp_path, warm):
    report = tmp_path / "REPORT.md"
    out = _run(TRAIN, "--data", str(profiles), "--out", str(tmp_path), "--max-iter", "20", "--report", str(report),
               warm=warm)
    assert "13 features: leave-one-model-out" in out.stdout and "+shape: leave-one-model-out" in out.stdout
    assert "| ALL |" in out.stdout
    text = report.read_text()
    assert "Leave-one-family-out" in text and "| marian-2l |" in text and "unsafe picks" in text
    assert "## Before / after: the model's shape" in text and "held-out families" in text
    clf = load_classifier(tmp_path / "classifier.pkl")
    assert clf.metadata["training_data"]["models"] == ["marian-2l", "minilm-l6"]
    # beside each pickle, its compiled trees, tied to it and checked by the script: what dynabatch loads
    for stem in ("classifier", "classifier-shape"):
        meta = json.loads((tmp_path / f"{stem}.json").read_text())
        trees, source = CompiledTrees.load(tmp_path / f"{stem}.npz")
        assert source == meta["classifier_sha256"] == hashlib.sha256((tmp_path / f"{stem}.pkl").read_bytes()).hexdigest()
        assert meta["compiled_sha256"] == hashlib.sha256((tmp_path / f"{stem}.npz").read_bytes()).hexdigest()
    assert isinstance(clf.estimator, CompiledTrees)
    p = clf.predict_spike_proba(compute_features(64, 64, 2, 120, [64, 10], [16, 2], [1000, 15]))
    assert p[0] > p[1]
    shaped = load_classifier(tmp_path / "classifier-shape.pkl")
    assert shaped.uses_shape and shaped.metadata["shape"] is True
    f = compute_features(64, 64, 2, 120, [64, 10], [16, 2], [1000, 15], shape=ModelShape(58101, 512, 2))
    p = shaped.predict_spike_proba(f)
    assert p[0] > p[1]


def test_compile_only_writes_the_compiled_trees_of_existing_pickles(tmp_path):
    import importlib.util
    import shutil

    from dynabatch.memory.classifier import BUNDLED_CLASSIFIER

    spec = importlib.util.spec_from_file_location("train_classifier_script", TRAIN)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    for stem in ("classifier", "classifier-shape"):
        for suffix in (".pkl", ".json"):
            shutil.copy(BUNDLED_CLASSIFIER.with_name(stem + suffix), tmp_path)
    assert script.main(["--compile-only", "--out", str(tmp_path)]) == 0
    for stem in ("classifier", "classifier-shape"):
        # the same bytes as the bundled .npz and .json: compiling is deterministic
        assert (tmp_path / f"{stem}.npz").read_bytes() == BUNDLED_CLASSIFIER.with_name(f"{stem}.npz").read_bytes()
        assert (tmp_path / f"{stem}.json").read_text() == BUNDLED_CLASSIFIER.with_name(f"{stem}.json").read_text()
    (tmp_path / "classifier.pkl").write_bytes(b"someone else's pickle")
    with pytest.raises(SystemExit, match="does not match the classifier_sha256 in classifier.json; not unpickling it"):
        script.main(["--compile-only", "--out", str(tmp_path)])
