"""MemoryModel: the fit, predictions, max_rows, online observations, out-of-memory points, JSON files."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from dynabatch import MemoryModel
from dynabatch.memory.model import describe_model

REPO = Path(__file__).resolve().parents[2]

GRID = [(r, L) for L in (4, 8, 16, 32, 64, 128, 256) for r in (16, 48)]


def phases(rows, length):
    """A maximum of two phases, as in generate: per-row logits vs a prefill growing with length."""
    rows, length = np.asarray(rows, dtype=float), np.asarray(length, dtype=float)
    decode = 300_000 + rows * (800_000 + 1_000 * length)
    prefill = 200_000 + rows * (16_000 * length + 20 * length**2)
    return np.maximum(decode, prefill)


def fitted(points=GRID, formula=phases, **kwargs):
    rows, lengths = zip(*points)
    return MemoryModel(device="cpu", **kwargs).fit(rows, lengths, formula(rows, lengths).round())


def test_fit_recovers_a_maximum_of_phases():
    mm = fitted(knots=[4, 8, 16, 32, 48, 64, 128, 256], points=GRID + [(16, 48), (40, 48)])
    assert mm.loo_error_ < 0.05
    assert all(c >= 0 for c in mm.coef_) and len(mm.coef_) == len(mm.terms_)
    # At the probed lengths, from half the fewest rows probed to twice the most: within 2%.
    rows, lengths = np.meshgrid(np.arange(8, 97), [4, 8, 16, 32, 48, 64, 128, 256])
    assert np.abs(mm.predict(rows, lengths) / phases(rows, lengths) - 1).max() < 0.02
    # Between them the fit is a chord of a convex curve: it errs high (timid), never low (unsafe).
    rows, lengths = np.meshgrid(np.arange(8, 97, 7), np.arange(4, 257))
    error = mm.predict(rows, lengths) / phases(rows, lengths) - 1
    assert error.min() > -0.005 and error.max() < 0.05


def test_predict_broadcasts_and_is_float64():
    mm = fitted()
    out = mm.predict(np.array([[16], [32]]), np.array([8, 16, 32]))
    assert out.shape == (2, 3) and out.dtype == np.float64
    assert (np.diff(out, axis=0) > 0).all() and (np.diff(out, axis=1) >= 0).all()
    assert mm.predict(16, 8).shape == ()


@pytest.mark.filterwarnings("ignore:MemoryModel extrapolates")
def test_max_rows_is_the_largest_count_under_the_budget():
    mm = fitted()
    lengths = np.arange(1, 257)
    budget = 0.9 * float(mm.predict(16, 256))
    rows = mm.max_rows(lengths, budget)
    assert rows.dtype == np.int64
    assert (mm.predict(rows, lengths) <= budget).all()
    assert (mm.predict(rows + 1, lengths) > budget).all()
    assert mm.max_rows(256, 1.0) == 0  # not even one row fits
    # broadcast over budgets too
    assert mm.max_rows(64, np.array([budget, 2 * budget])).tolist()[1] > mm.max_rows(64, budget)


@pytest.mark.filterwarnings("ignore:MemoryModel extrapolates")
def test_max_rows_plans_a_million_lengths_fast():
    mm = fitted()
    lengths = np.random.default_rng(0).integers(1, 257, size=1_000_000)
    budget = float(mm.predict(16, 256))
    mm.max_rows(lengths[:10], budget)
    start = time.process_time()  # CPU time: the machine may be shared
    rows = mm.max_rows(lengths, budget)
    assert time.process_time() - start < 0.5
    assert rows.shape == lengths.shape and rows.min() >= 16


def test_observe_refits_online():
    mm = MemoryModel()
    for r, L in GRID[:3]:
        mm.observe(r, L, float(phases(r, L)))
    before = float(mm.predict(48, 256))
    for r, L in GRID[3:]:
        mm.observe(r, L, float(phases(r, L)), source="run")
    assert abs(float(mm.predict(48, 256)) / float(phases(48, 256)) - 1) < 0.01
    assert before != float(mm.predict(48, 256))
    assert mm.probes_[-1]["source"] == "run" and len(mm.probes_) == len(GRID)
    mm.observe(16, 4, float(phases(16, 4)) + 1000)  # the same shape again keeps the larger peak
    assert len(mm.probes_) == len(GRID) and mm.probes_[0]["peak_bytes"] == int(phases(16, 4) + 1000)


def test_an_out_of_memory_point_caps_rows_and_bounds_the_fit():
    mm = fitted()
    unbounded = int(mm.max_rows(64, 1e12))
    mm.observe(100, 64, out_of_memory=True)  # bytes unknown (CUDA): a cap on rows at this length and longer
    assert int(mm.max_rows(64, 1e12)) == 99 and int(mm.max_rows(256, 1e12)) == 99
    assert int(mm.max_rows(32, 1e12)) > 99
    assert unbounded > 99
    # A known lower bound above the fit's prediction lifts the fit there.
    low = fitted()
    bound = 2 * float(low.predict(200, 200))
    low.observe(200, 200, bound, out_of_memory=True)
    assert float(low.predict(200, 200)) >= bound * 0.999
    assert "OOM" in fitted().observe(100, 64, out_of_memory=True).report()


def test_json_round_trip(tmp_path):
    model = torch.nn.Linear(4, 4)
    mm = fitted(model=model, metadata={"batch_size": 16})
    mm.observe(300, 8, out_of_memory=True)
    path = tmp_path / "mm.json"
    mm.save(path)
    data = json.loads(path.read_text())
    assert data["device"] == "cpu" and data["dtype"] == "torch.float32" and data["model"]["parameters"] == 20
    assert {"torch", "numpy", "scipy", "python"} <= set(data["versions"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = MemoryModel.load(path, model=model, device="cpu")
    assert loaded.probes_ == mm.probes_
    assert np.allclose(loaded.coef_, mm.coef_) and loaded.terms_ == mm.terms_
    lengths = np.arange(1, 257)
    assert np.array_equal(loaded.max_rows(lengths, 5e7), mm.max_rows(lengths, 5e7))
    assert loaded.metadata == {"batch_size": 16}


def test_loading_for_another_device_or_model_warns(tmp_path):
    path = tmp_path / "mm.json"
    fitted(model=torch.nn.Linear(4, 4)).save(path)
    with pytest.warns(UserWarning, match=r"device='cuda:0' differs .* \('cpu'\)"):
        MemoryModel.load(path, device="cuda:0")
    with pytest.warns(UserWarning, match=r"model=\{'parameters': 6\} differs"):
        MemoryModel.load(path, model=torch.nn.Linear(2, 2))
    mm = MemoryModel.load(path)
    with pytest.warns(UserWarning, match="model="):
        assert mm.check(model="another-model")


def test_loading_for_another_attention_implementation_warns(tmp_path):
    # One model with eager attention holds every row's length x length scores: on the CPU tracker this tiny Llama's
    # forward of 16 x 512 measured 37.8 MB with sdpa and 167.8 MB with eager. The file recorded name, class,
    # parameters and dtype only, so a model calibrated with sdpa loaded for its eager twin without a word.
    from transformers import AutoModel, LlamaConfig

    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=64)
    sdpa, eager = (AutoModel.from_config(copy.deepcopy(config), attn_implementation=kind) for kind in ("sdpa", "eager"))
    fitted(model=sdpa).save(tmp_path / "mm.json")
    assert json.loads((tmp_path / "mm.json").read_text())["model"]["attention"] == "sdpa"
    with pytest.warns(UserWarning, match=r"^model=\{'attention': 'eager'\} differs from the model the memory model "
                                         r"was measured on \(\{'attention': 'sdpa'\}\): calibrate for this model$"):
        MemoryModel.load(tmp_path / "mm.json", model=eager)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        MemoryModel.load(tmp_path / "mm.json", model=sdpa)
        data = json.loads((tmp_path / "mm.json").read_text())
        del data["model"]["attention"]  # a file saved before it was recorded: the rest is compared
        (tmp_path / "older.json").write_text(json.dumps(data))
        MemoryModel.load(tmp_path / "older.json", model=eager)


def test_loading_for_another_task_or_more_new_tokens_warns(tmp_path):
    # A file records the task and new tokens it was calibrated for, but load compared neither: one calibrated for
    # 64 new tokens planned a run of 256 (a KV cache four times as long), or a forward's for generate, silently.
    path = tmp_path / "mm.json"
    fitted(metadata={"task": "generate", "max_new_tokens": 64}).save(path)
    advice = r"calibrate for this setting \(dynabatch calibrate \.\.\. --task generate --max-new-tokens 256\)$"
    with pytest.warns(UserWarning, match=r"^max_new_tokens=256 exceeds the max_new_tokens the memory model was "
                                         r"calibrated for \(64\): its peaks under-predict the longer KV cache; " + advice):
        MemoryModel.load(path, task="generate", max_new_tokens=256)
    with pytest.warns(UserWarning, match=r"^task='forward' differs from the task the memory model was calibrated "
                                         r"for \('generate'\)"):
        assert len(MemoryModel.load(path).check(task="forward")) == 1
    fitted(metadata={"task": "forward", "max_new_tokens": 0}).save(tmp_path / "forward.json")
    with pytest.warns(UserWarning, match=r"^task='generate' differs .* \('forward'\): .*; " + advice):
        MemoryModel.load(tmp_path / "forward.json", task="generate", max_new_tokens=256)
    # new tokens without a task are a generate run's: a forward file was loaded for them without a word (review)
    with pytest.warns(UserWarning, match=r"^max_new_tokens=256 \(a generate run\) differs from the task the memory "
                                         r"model was calibrated for \('forward'\): .*; " + advice):
        MemoryModel.load(tmp_path / "forward.json", max_new_tokens=256)
    fitted(metadata={"max_new_tokens": 64}).save(tmp_path / "library.json")  # dynabatch.calibrate's: generate
    with pytest.warns(UserWarning, match=r"^task='train' differs .* \('generate'\)"):
        MemoryModel.load(tmp_path / "library.json", task="train")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # fewer new tokens than calibrated over-predict: safe; a file without the fields compares nothing
        assert MemoryModel.load(path, task="generate", max_new_tokens=16).check(max_new_tokens=64) == []
        fitted().save(tmp_path / "older.json")
        MemoryModel.load(tmp_path / "older.json", task="generate", max_new_tokens=256)
    with pytest.raises(ValueError, match=r"task should be one of \('generate', 'forward', 'train'\)"):
        MemoryModel.load(path, task="embed")
    with pytest.raises(ValueError, match=r"max_new_tokens should be None or 0 with task='forward'"):
        MemoryModel.load(path, task="forward", max_new_tokens=8)
    with pytest.raises(TypeError, match="max_new_tokens should be a non-negative integer"):
        MemoryModel.load(path).check(max_new_tokens=6.5)


def test_extrapolation_warns_once():
    mm = fitted()
    with pytest.warns(UserWarning, match=r"padded_length=512 beyond the longest probed \(256\)"):
        mm.predict(16, 512)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mm.predict(16, 1024)  # once per model
    with pytest.warns(UserWarning, match=r"rows=\d+ beyond 2x the most probed \(48\)"):
        fitted().max_rows(4, 1e10)


def test_bad_input():
    mm = fitted()
    with pytest.raises(ValueError, match="rows should be finite and >= 0"):
        mm.predict(-1, 8)
    with pytest.raises(TypeError, match="padded_length should be a number or an array of numbers"):
        mm.predict(1, "8")
    with pytest.raises(ValueError, match="peak_bytes should be a number of bytes for a point that did not run out"):
        mm.observe(4, 8)
    with pytest.raises(ValueError, match="rows should be a positive integer, but got rows=0"):
        mm.observe(0, 8, 100)
    with pytest.raises(TypeError, match="out_of_memory should be a bool"):
        mm.observe(4, 8, 100, out_of_memory="yes")
    with pytest.raises(RuntimeError, match="no measured point yet"):
        MemoryModel().predict(1, 1)
    with pytest.raises(ValueError, match="path should be a JSON file written by MemoryModel.save"):
        MemoryModel.load("/nonexistent/mm.json")


def saved_document(tmp_path):
    fitted().save(tmp_path / "mm.json")
    return json.loads((tmp_path / "mm.json").read_text())


def refused_on_load(tmp_path, document, why):
    """Loading ``document`` is refused with the path's message, saying ``why`` (a regular expression)."""
    (tmp_path / "bad.json").write_text(json.dumps(document))
    with pytest.raises(ValueError, match=rf"^path should be a JSON file written by MemoryModel.save \({why}\), "
                                         rf"but got path='.*bad.json'$"):
        MemoryModel.load(tmp_path / "bad.json")


def test_a_file_without_its_probes_is_refused_when_loaded(tmp_path):
    # The fit is made again from the probes: without them the file loaded as an empty model, and its first
    # predict() said the model had no measured point, to be built with MemoryModel.load.
    data = saved_document(tmp_path)
    for probes, shown in (([], "'<0 probes>'"), (None, "None"), ([{"rows": 4}], "'<1 probes>'")):
        refused_on_load(tmp_path, {**data, "probes": probes},
                        rf"data should be a document with at least one probe, .* but got data={shown}")


def test_a_file_of_another_format_version_is_refused_when_loaded(tmp_path):
    # format_version was written and never read: a file of another layout (a later dynabatch's, or one without the
    # field) loaded as version 1 and planned with whatever its fields meant there, without a word.
    data = saved_document(tmp_path)
    assert data["format_version"] == 1
    rule = (r"data should be a document of format_version=1, the one this dynabatch reads \(calibrate again with "
            r"this dynabatch, or load the file with the dynabatch that wrote it\)")
    for version, shown in ((2, "2"), ("1", "'1'"), (True, "True")):
        refused_on_load(tmp_path, {**data, "format_version": version}, rf"{rule}, but got data={shown}")
    refused_on_load(tmp_path, {k: v for k, v in data.items() if k != "format_version"}, rf"{rule}, but got data=None")


def test_a_hand_edited_probe_is_refused_naming_its_field(tmp_path):
    # out_of_memory went through bool(): a probe edited to "false" loaded as out of memory, a failed shape capping
    # every plan at its length and longer. A probe's rows of another type: a TypeError naming rows, not the file.
    data = saved_document(tmp_path)
    for field, value, rule in (("out_of_memory", "false", r"probes\[3\]\['out_of_memory'\] should be a bool"),
                               ("rows", "16", "rows should be a positive integer")):
        probes = [dict(p) for p in data["probes"]]
        probes[3][field] = value
        refused_on_load(tmp_path, {**data, "probes": probes}, rf"{rule}, but got .*'{value}' of type str")
    with pytest.raises(TypeError, match=r"probes\[3\]\['out_of_memory'\] should be a bool"):
        MemoryModel.from_dict({**data, "probes": probes[:3] + [{**probes[3], "rows": 16, "out_of_memory": 0}]})


def test_a_save_cut_short_leaves_the_file_it_replaces_whole(tmp_path):
    # save() wrote in place: a save cut short (here the file size limit, as a full disk or a kill mid-write) emptied
    # the last good calibration first and left half a document. A process of its own: the limit is per process.
    fitted().save(tmp_path / "mm.json")
    before = (tmp_path / "mm.json").read_text()
    bigger = fitted(metadata={"note": "x" * 2 * len(before)})
    (tmp_path / "bigger.json").write_text(json.dumps(bigger.to_dict()))
    script = f"""
import resource, signal
from dynabatch import MemoryModel
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead of killing
bigger = MemoryModel.load({str(tmp_path / "bigger.json")!r})
resource.setrlimit(resource.RLIMIT_FSIZE, ({len(before) + 100}, resource.RLIM_INFINITY))
try:
    bigger.save({str(tmp_path / "mm.json")!r})
except OSError as exc:
    print("cut short:", exc.errno)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0 and "cut short: 27" in done.stdout, done.stderr[-2000:]  # 27: EFBIG
    assert (tmp_path / "mm.json").read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bigger.json", "mm.json"]  # no temporary file left
    bigger.save(tmp_path / "mm.json")
    assert MemoryModel.load(tmp_path / "mm.json").metadata == bigger.metadata


def test_two_saves_of_one_path_at_once_each_write_whole(tmp_path, monkeypatch):
    # The file beside the path was named by the process alone: two threads saving one path wrote the same file,
    # and the second rename found it gone (FileNotFoundError) after the first had renamed the other's document.
    # Found by review. Both saves reach their rename before either makes it.
    both, rename, raised = threading.Barrier(2, timeout=10), os.replace, []

    def replace_when_both_wrote(src, dst):
        both.wait()
        rename(src, dst)

    def save(model):
        try:
            model.save(tmp_path / "mm.json")
        except OSError as exc:
            raised.append(exc)

    monkeypatch.setattr(os, "replace", replace_when_both_wrote)
    models = [fitted(metadata={"which": k}) for k in range(2)]
    threads = [threading.Thread(target=save, args=(m,)) for m in models]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    monkeypatch.undo()
    assert raised == []
    assert MemoryModel.load(tmp_path / "mm.json").metadata["which"] in (0, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mm.json"]


def test_describe_model():
    assert describe_model(None) is None
    with pytest.raises(TypeError, match="model should be a torch module"):
        describe_model(42)


# --------------------------------------------------------------------------- a real training step, measured


def test_a_plan_from_a_fitted_training_step_stays_within_its_budget(tokenizer, one_thread):
    """A training step's peak is max(optimizer step: row-free, activations): probes at few rows
    sit on the flat part, their per-row cost looks tiny. Rows planned beyond the rows probed
    must not trust it (the old fit planned 400 x 64 rows, measured 9.8x the budget)."""
    from transformers import BertConfig, BertForSequenceClassification

    from dynabatch.compat.bionemo import collect_peak_alloc

    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=128, max_position_embeddings=128, num_labels=2)
    model = BertForSequenceClassification(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(0)

    def step(shape):
        rows, length = shape
        ids = torch.randint(1000, len(tokenizer), (rows, length), generator=generator)
        loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=torch.zeros(rows, dtype=torch.long)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return shape

    step((2, 8))  # the optimizer's state exists before anything is measured, as after the first step
    shapes = [(rows, length) for rows in (2, 16) for length in (16, 32, 64, 128)]
    _, peaks = collect_peak_alloc(shapes, step, "cpu")
    mm = MemoryModel(device="cpu").fit(*zip(*shapes), peaks)
    budget = float(mm.predict(16, 128))  # the longest batch probed: known to fit
    plan = [(int(mm.max_rows(length, budget)), length) for length in (12, 24, 64)]
    assert all(rows >= 16 for rows, _ in plan)  # at least the rows probed at the longer lengths
    _, measured = collect_peak_alloc(plan, step, "cpu")
    assert max(measured) <= 1.02 * budget, (plan, [m / budget for m in measured])


# Measured by calibrate() on a GPT-2-shaped training step (vocabulary 30,522, hidden 64, 2 layers; forward, loss,
# backward) on the CPU tracker, max_input_token_length 512, batch_size 8: (rows, padded length, peak bytes).
GPT2_STEP_PROBES = [
    (8, 4, 27917312), (8, 8, 32350720), (8, 16, 64743936), (8, 32, 129682944), (8, 64, 260150784),
    (8, 128, 523446272), (8, 256, 1059474432), (8, 512, 2169279488), (32, 4, 64670208), (14, 256, 1854077952),
    (30, 128, 1962917888), (62, 64, 2016158208), (133, 32, 2155959808), (298, 16, 2411660800),
    (512, 8, 2070185472), (512, 4, 1034700288), (512, 6, 1552344576), (375, 11, 2085448704),
    (172, 23, 2002277888), (86, 45, 1962842112), (42, 91, 1946931712), (20, 181, 1859674624),
    (10, 362, 1891127296), (512, 5, 1293497856), (512, 7, 1811240448), (450, 9, 2047135744),
    (306, 13, 2011509760), (206, 19, 1980269568), (144, 27, 1968610816), (399, 10, 2017000448),
    (329, 12, 1996145152), (280, 14, 1982366208),
]


def test_a_gigabyte_fit_predicts_no_probe_under_its_peak(caplog):
    # The upper fit's program in bytes put 1e-9 in every row; HiGHS called it infeasible and the least-squares
    # fallback predicted up to 4% under these probes: a relative budget at memory_margin=0.0 planned a step
    # measured 1.009x its reference step. In units near 1 the program is solved and errs high only.
    rows, lengths, peaks = (np.array(c) for c in zip(*GPT2_STEP_PROBES))
    knots = [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 16, 19, 23, 27, 32, 45, 64, 91, 128, 181, 256, 362, 512]
    with caplog.at_level("WARNING", logger="dynabatch.memory._model_fit"):
        mm = MemoryModel(device="cpu", knots=knots).fit(rows, lengths, peaks)
    assert "least squares instead" not in caplog.text
    assert (mm.predict(rows, lengths) >= peaks * (1 - 1e-9)).all()
    assert float(mm.predict(8, 512)) == pytest.approx(2169279488, rel=1e-6)  # the reference shape, as measured


def test_loading_for_the_same_model_folder_spelt_another_way_does_not_warn(tmp_path, monkeypatch):
    # dynabatch calibrate --model ./my-model records "./my-model"; from_pretrained("my-model") names it "my-model"
    (tmp_path / "my-model").mkdir()
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "mm.json"
    fitted(model="./my-model").save(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in ("my-model", "my-model/", str(tmp_path / "my-model")):
            assert MemoryModel.load(path).check(model=name) == []
    with pytest.warns(UserWarning, match=r"model=\{'name': 'other-model'\} differs .*\{'name': './my-model'\}"):
        MemoryModel.load(path, model="other-model")
