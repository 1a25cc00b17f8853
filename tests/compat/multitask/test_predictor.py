"""MemoryPredictor: fitted from measured peaks per task; calibration on a real training step."""

import math

import pytest
import torch

from dynabatch.compat.multitask import MemoryPredictor, OOMGuardian, estimate_training_memory
from dynabatch.compat.multitask import predictor as predictor_module
from dynabatch.compat.multitask.collate import HeterogeneousCollator
from dynabatch.compat.multitask.predictor import last_measured_predictor
from dynabatch.memory.budget import GB, MB


def _linear_predictor():
    """Two tasks with known costs in MB: a = 5 + 0.1 * rows * L, b = 5 + 0.3 * rows * L."""
    p = MemoryPredictor("cpu")
    for rows in (1, 2, 4, 8, 16):  # up to the 16-row batches predicted below (the model bounds rows past its probes)
        for length in (8, 16, 32):
            p.record_actual_memory("a", 5 + 0.1 * rows * length, batch_size=rows, seq_length=length)
            p.record_actual_memory("b", 5 + 0.3 * rows * length, batch_size=rows, seq_length=length)
    return p


def test_predictions_follow_the_measured_peaks():
    p = _linear_predictor()
    assert p.predict_sample_memory("a", seq_length=20) * GB / MB == pytest.approx(5 + 2, rel=1e-6)
    assert p.predict_sample_memory("b") * GB / MB == pytest.approx(5 + 0.3 * 16, rel=1e-6)  # median length 16
    # a mixed batch padded to 20: the row-weighted mix of both tasks at 3 rows
    mixed = p.predict_batch_memory(["a", "a", "b"], lengths=[10, 20, 5]) * GB / MB
    assert mixed == pytest.approx(2 / 3 * (5 + 0.1 * 60) + 1 / 3 * (5 + 0.3 * 60), rel=1e-6)
    acc = p.get_calibration_accuracy()
    assert set(acc) == {"a", "b"} and all(v["mean_abs_error_pct"] < 1e-3 for v in acc.values())
    assert acc["a"]["num_measurements"] == 15
    assert last_measured_predictor() is p


def test_state_round_trip_predicts_the_same(tmp_path):
    p = _linear_predictor()
    path = tmp_path / "predictor.json"
    p.save(str(path))
    q = MemoryPredictor.load(str(path))
    for task in ("a", "b"):
        assert q.predict_sample_memory(task, seq_length=24) == p.predict_sample_memory(task, seq_length=24)
        assert q.typical_length(task) == p.typical_length(task)
    fn_p = p.batch_memory_function(["a", "b"])
    fn_q = q.batch_memory_function(["a", "b"])
    assert fn_p([2, 3], 17) == fn_q([2, 3], 17)
    # a snapshot does not move when the predictor learns more
    before = fn_p([2, 3], 17)
    p.record_actual_memory("a", 500, batch_size=5, seq_length=17)
    assert fn_p([2, 3], 17) == before != p.batch_memory_function(["a", "b"])([2, 3], 17)


def test_estimate_training_memory_from_the_predictor():
    p = _linear_predictor()
    est = estimate_training_memory(num_samples=5000, task_distribution={"a": 0.5, "b": 0.5}, batch_size=16,
                                   num_epochs=3, predictor=p)
    assert est["batches_per_epoch"] == 313 and est["total_steps"] == 939
    assert est["samples_per_task"] == {"a": 2500, "b": 2500}
    assert est["per_batch_mb"] == pytest.approx(5 + 0.5 * 0.1 * 16 * 16 + 0.5 * 0.3 * 16 * 16, rel=1e-6)
    assert est["estimated_peak_memory_mb"] == pytest.approx(5 + 0.3 * 16 * 16, rel=1e-6)  # all-b batch
    # the multi-task system's call passes no predictor: the one that last measured is used, and its numbers come back
    bare = estimate_training_memory(5000, {"a": 1.0}, 16, 3)
    assert bare["per_batch_mb"] == pytest.approx(5 + 0.1 * 16 * 16, rel=1e-6) and bare["batches_per_epoch"] == 313
    assert f"Per batch: {bare['per_batch_mb']:.0f}MB" == "Per batch: 31MB"
    with pytest.raises(ValueError, match=r"task_distribution should be non-negative fractions with a positive sum"):
        estimate_training_memory(10, {"a": -1.0}, 4, 1)


def test_estimate_training_memory_with_nothing_measured_says_how_to_measure(monkeypatch):
    monkeypatch.setattr(predictor_module, "_last", [])  # a fresh process: no predictor has measured anything
    with pytest.raises(ValueError, match=r"estimate_training_memory needs measured peaks, .*record_actual_memory"):
        estimate_training_memory(num_samples=5000, task_distribution={"T1": 0.4, "T2": 0.6}, batch_size=16,
                                 num_epochs=3)


def test_memory_units_are_those_of_every_memory_size_dynabatch_parses():
    # MB = 10**6 bytes and GB = 10**9 bytes, as "12GB" and "800MB" parse everywhere (accelerate's convention)
    assert (MB, GB) == (10**6, 10**9)
    p = MemoryPredictor("cpu")
    p.record_actual_memory("t", 1500.0)  # one row, 1500 MB
    assert p.predict_sample_memory("t") == pytest.approx(1.5)  # GB
    assert float(p.predict_bytes("t", 1, 1)) == pytest.approx(1.5e9)
    assert OOMGuardian("cpu", max_memory_mb=2000).budget_bytes() == 2e9
    assert OOMGuardian("cpu", max_memory_mb=2000, memory_margin_percent=0.25).usable_bytes() == pytest.approx(1.5e9)


def test_unmeasured_task_and_bad_records_are_named():
    p = _linear_predictor()
    with pytest.raises(ValueError, match=r"task_type should be a task with a measured training step \(known: 'a', 'b'.*"
                                         r"but got task_type='T3'"):
        p.predict_sample_memory("T3")
    with pytest.raises(ValueError, match=r"task_type should be a task with a measured forward pass"):
        p.predict_sample_memory("a", is_training=False)
    with pytest.raises(ValueError, match=r"actual_memory_mb should be a finite number >= 0, but got actual_memory_mb=-1"):
        p.record_actual_memory("a", -1)
    with pytest.raises(ValueError, match=r"batch_size should be a positive integer, but got batch_size=0"):
        p.record_actual_memory("a", 1.0, batch_size=0)
    with pytest.raises(TypeError, match=r"task_type should be a hashable task type"):
        p.record_actual_memory(None, 1.0)
    with pytest.raises(ValueError, match=r"lengths should be None or one length per task type \(2\)"):
        p.predict_batch_memory(["a", "b"], lengths=[3])


def test_calibration_on_a_real_training_step_is_within_ten_percent(one_thread, tokenizer):
    """The multi-task system's target: < 10% error per task after 10 measured batches on the test model."""
    from transformers import BertConfig, BertForMaskedLM

    from dynabatch.demo import joke_texts, kjv_passages

    torch.manual_seed(0)
    model = BertForMaskedLM(BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2,
                                       num_attention_heads=2, intermediate_size=64, max_position_embeddings=64))
    texts = {"joke": joke_texts()[:40], "verse": kjv_passages()[:40]}
    collate = HeterogeneousCollator(tokenizer)

    def step(batch):
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
        out.loss.backward()
        model.zero_grad(set_to_none=True)

    probes = []
    for task, lines in texts.items():
        enc = tokenizer(lines, truncation=True, max_length=32)["input_ids"]
        for i, rows in enumerate((2, 3, 4, 5, 6, 2, 3, 4, 5, 6)):  # 10 batches of real samples per task
            picked = [{"input_ids": ids, "labels": ids} for ids in enc[i * 3: i * 3 + rows]]
            probes.append((task, collate(picked)))
    p = MemoryPredictor("cpu")
    assert p.calibrate(step, probes) == 20
    for task, acc in p.get_calibration_accuracy().items():
        assert acc["mean_abs_error_pct"] < 10, (task, acc)
    assert math.isfinite(p.predict_batch_memory(["joke", "verse"], lengths=[12, 40]))
