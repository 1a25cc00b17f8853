"""HeterogeneousCollator and DynamicBatchingMonitor (the seed's calls, files that parse)."""

import json
import os

import pytest
import torch

from dynabatch.compat.multitask import BatchMetrics, DynamicBatchingMonitor, HeterogeneousCollator


def test_collator_pads_stacks_and_keeps_metadata(tokenizer):
    collate = HeterogeneousCollator(tokenizer=tokenizer)
    batch = collate([
        {"input_ids": [101, 7, 8, 102], "labels": [101, 7, 8, 102], "task_type": "T1", "image": torch.ones(2, 3),
         "score": 0.5, "note": "a"},
        {"input_ids": [101, 9, 102], "labels": [101, 9, 102], "task_type": "T2", "image": torch.zeros(2, 3),
         "score": 1.5, "note": "b"},
    ])
    assert batch["input_ids"].tolist() == [[101, 7, 8, 102], [101, 9, 102, tokenizer.pad_token_id]]
    assert batch["labels"].tolist() == [[101, 7, 8, 102], [101, 9, 102, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert batch["image"].shape == (2, 2, 3) and batch["score"].tolist() == [0.5, 1.5]
    assert batch["task_type"] == ["T1", "T2"] and batch["note"] == ["a", "b"]
    left = HeterogeneousCollator(pad_token_id=0, padding_side="left", pad_to_multiple_of=4)
    assert left([{"input_ids": [5]}, {"input_ids": [6, 7]}])["input_ids"].tolist() == [[0, 0, 0, 5], [0, 0, 6, 7]]


def test_collator_bad_input():
    collate = HeterogeneousCollator(pad_token_id=0)
    with pytest.raises(ValueError, match=r"features\[1\] should be a sample with the field 'labels' like the others"):
        collate([{"input_ids": [1], "labels": [1]}, {"input_ids": [2]}])
    with pytest.raises(ValueError, match=r"image should be tensors of one shape"):
        collate([{"image": torch.ones(2, 2)}, {"image": torch.ones(3, 2)}])
    with pytest.raises(ValueError, match=r"tokenizer should be a tokenizer with a pad_token_id"):
        HeterogeneousCollator(None)


def test_monitor_seed_calls_write_files_that_parse(tmp_path):
    monitor = DynamicBatchingMonitor(output_dir=str(tmp_path / "metrics"))
    for epoch in range(2):
        monitor.start_epoch()
        for i in range(5):
            monitor.record_batch(BatchMetrics(
                batch_idx=i, timestamp=float(i), task_types=["T1", "T2", "T2"], batch_size=3,
                loss=1.0 / (1 + i + 5 * epoch), per_task_loss={"T1": 0.4, "T2": 0.6}, memory_allocated_mb=100 + i,
                predicted_memory_mb=100.0))
        epoch_metrics = monitor.end_epoch(total_samples=15, total_batches=5)
        assert epoch_metrics["task_counts"] == {"T1": 5, "T2": 10}
        assert epoch_metrics["per_task_mean_loss"] == pytest.approx({"T1": 0.4, "T2": 0.6})
        assert epoch_metrics["max_memory_mb"] == 104
    report = monitor.generate_report()
    monitor.plot_task_comparison()
    out = tmp_path / "metrics"
    assert len(json.loads((out / "batch_metrics.json").read_text())) == 10
    assert [e["epoch"] for e in json.loads((out / "epoch_metrics.json").read_text())] == [0, 1]
    saved = json.loads((out / "training_report.json").read_text())
    assert saved["num_batches"] == report["num_batches"] == 10 and saved["num_samples"] == 30
    assert saved["memory_prediction_mean_abs_error_pct"] == pytest.approx(100 * sum(i / (100 + i) for i in range(5)) / 5)
    for name in ("training_curves.png", "training_curves_memory.png", "task_comparison.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    assert sorted(os.listdir(out)) == ["batch_metrics.json", "epoch_metrics.json", "task_comparison.png",
                                       "training_curves.png", "training_curves_memory.png", "training_report.json"]
    with pytest.raises(TypeError, match=r"metrics should be a BatchMetrics"):
        monitor.record_batch({"loss": 1.0})


def test_collator_label_sequence_pads_with_minus_100_and_is_named_labels():
    collate = HeterogeneousCollator(pad_token_id=0)
    tagged = collate([{"input_ids": [5, 6, 7], "label": [0, 2, 1]}, {"input_ids": [8], "label": [1]}])
    assert "label" not in tagged and tagged["labels"].tolist() == [[0, 2, 1], [1, -100, -100]]
    ids = collate([{"input_ids": [5, 6], "label_ids": [3, 4]}, {"input_ids": [8], "label_ids": [0]}])
    assert ids["labels"].tolist() == [[3, 4], [0, -100]]
    classes = collate([{"input_ids": [5, 6], "label": 0}, {"input_ids": [8], "label": 1}])
    assert classes["labels"].tolist() == [0, 1] and classes["input_ids"].tolist() == [[5, 6], [8, 0]]
