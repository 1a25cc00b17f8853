"""The multi-task system's Quick Reference, call by call, with ``dynabatch`` in place of its modules.

Differences, all forced by this machine: the guardian runs on ``"cpu"`` (no CUDA here to ask for free
memory), and the predictor is first given measurements (it has no built-in table to predict from).
"""

import inspect
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from dynabatch.compat.multitask import (
    BatchMetrics,
    DynamicBatchingMonitor,
    GradientCheckpointManager,
    HeterogeneousCollator,
    HeterogeneousTrainingConfig,
    MemoryAwareBatchSampler,
    MemoryPredictor,
    OOMGuardian,
    estimate_training_memory,
)


class SeedDataset(torch.utils.data.Dataset):
    """The seed's dataset: samples with one or two subjects, get_sample_metadata as in its step 1."""

    def __init__(self, n=40):
        self.samples = [{"subject_id": [i, i + 1] if i % 4 == 0 else i, "input_ids": list(range(1, 5 + i % 9))}
                        for i in range(n)]

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, idx):
        sample = self.samples[idx]
        return {"input_ids": sample["input_ids"], "labels": sample["input_ids"],
                "task_type": self.get_sample_metadata(idx)["task_type"]}

    def get_sample_metadata(self, idx):
        sample = self.samples[idx]
        is_multi_subject = isinstance(sample['subject_id'], list)
        task_type = 'T3' if is_multi_subject else 'T1'
        return {
            'task_type': task_type,
            'num_images': 2 if is_multi_subject else 1
        }


def test_quick_reference(tmp_path, tokenizer):
    train_dataset = SeedDataset()
    predictor = MemoryPredictor(device="cuda:0")
    for batch_size in (1, 2, 4, 8, 16):  # measurements: what the seed's calibration phase records
        predictor.record_actual_memory('T1', 50.0 + 100.0 * batch_size, batch_size=batch_size)
        predictor.record_actual_memory('T3', 50.0 + 210.0 * batch_size, batch_size=batch_size)
        predictor.record_actual_memory('T2', 50.0 + 150.0 * batch_size, batch_size=batch_size)

    memory_gb = predictor.predict_sample_memory('T1', is_training=True)
    assert abs(memory_gb * 1000 - 150.0) < 1e-6  # GB = 10**9 bytes, MB = 10**6
    batch_memory = predictor.predict_batch_memory(['T1', 'T2', 'T3'], is_training=True)
    assert abs(batch_memory * 1000 - (50 + 100 + 150 + 210)) < 1e-6
    actual_memory_mb = 260.0
    predictor.record_actual_memory('T1', actual_memory_mb)
    accuracy = predictor.get_calibration_accuracy()
    assert set(accuracy) == {'T1', 'T2', 'T3'}

    # measured: with the predictor passed, batches are planned under max_memory_mb
    sampler = MemoryAwareBatchSampler(dataset=train_dataset, batch_size=16, max_memory_mb=3000, shuffle=True,
                                      task_diversity_weight=0.5, predictor=predictor)
    assert sampler.calibrated
    dataloader = DataLoader(train_dataset, batch_sampler=sampler, collate_fn=HeterogeneousCollator(tokenizer=tokenizer))
    seen = []
    for batch in dataloader:
        seen += batch["task_type"]
        assert batch["input_ids"].shape[0] == len(batch["task_type"]) <= 16
    assert sorted(seen) == sorted(train_dataset.get_sample_metadata(i)["task_type"] for i in range(40))

    guardian = OOMGuardian(device="cpu", memory_margin_percent=0.10)
    safe_size = guardian.estimate_safe_batch_size('T1')
    assert safe_size > 0
    predicted_memory_gb = 1e-3
    if not guardian.preflight_check(predicted_memory_gb):
        guardian.emergency_cleanup()
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)])
    GradientCheckpointManager.enable_gradient_checkpointing(model)

    monitor = DynamicBatchingMonitor(output_dir=str(tmp_path / "metrics"))
    monitor.start_epoch()
    batch_metrics = BatchMetrics(
        batch_idx=0,
        timestamp=0.0,
        task_types=['T1', 'T2'],
        batch_size=16,
        loss=0.5,
        per_task_loss={'T1': 0.4, 'T2': 0.6},
        memory_allocated_mb=5000
    )
    monitor.record_batch(batch_metrics)
    epoch_metrics = monitor.end_epoch(
        total_samples=160,
        total_batches=10
    )
    report = monitor.generate_report()
    monitor.plot_task_comparison()
    assert epoch_metrics["total_samples"] == 160 and report["num_batches"] == 1

    estimates = estimate_training_memory(
        num_samples=5000,
        task_distribution={'T1': 0.4, 'T2': 0.3, 'T3': 0.3},
        batch_size=16,
        num_epochs=3,
        predictor=predictor,
    )
    print(f"Per batch: {estimates['per_batch_mb']:.0f}MB")
    print(f"Peak memory: {estimates['estimated_peak_memory_mb']:.0f}MB")
    assert estimates['per_batch_mb'] > 0
    assert estimates['estimated_peak_memory_mb'] >= estimates['per_batch_mb']

    config = HeterogeneousTrainingConfig()
    config.num_epochs = 3
    config.learning_rate = 5e-5
    config.base_batch_size = 16
    config.max_memory_mb = 30000
    assert (config.memory_margin_percent, config.target_batch_size, config.gradient_accumulation_steps,
            config.grad_norm_alpha, config.warmup_steps) == (0.10, 32, 2, 1.5, 500)


_AS_WRITTEN = """
import logging, sys
import torch
from torch.utils.data import DataLoader
from transformers import AutoTokenizer
from dynabatch.demo import minilm_path
from dynabatch.compat.multitask import (MemoryPredictor, MemoryAwareBatchSampler, HeterogeneousCollator,
                                        OOMGuardian, GradientCheckpointManager, estimate_training_memory)
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(levelname)s %(name)s: %(message)s")
""" + textwrap.dedent(inspect.getsource(SeedDataset)) + """
train_dataset = SeedDataset()
tokenizer = AutoTokenizer.from_pretrained(minilm_path())

# Memory Prediction (the quick reference's order: nothing is measured yet)
predictor = MemoryPredictor(device="cuda:0")
try:
    memory_gb = predictor.predict_sample_memory('T1', is_training=True)
except ValueError as exc:
    print("UNMEASURED:", exc)
actual_memory_mb = 5000.0
predictor.record_actual_memory('T1', actual_memory_mb)
accuracy = predictor.get_calibration_accuracy()

# Dynamic Batching
sampler = MemoryAwareBatchSampler(
    dataset=train_dataset,
    batch_size=16,
    max_memory_mb=30000,
    shuffle=True,
    task_diversity_weight=0.5
)
collator = HeterogeneousCollator(tokenizer=tokenizer)
dataloader = DataLoader(
    train_dataset,
    batch_sampler=sampler,
    collate_fn=collator
)
print("ROWS:", sum(batch["input_ids"].shape[0] for batch in dataloader))

# OOM Safety (on the CPU: there is no CUDA device to ask for free memory here)
guardian = OOMGuardian(device="cpu", memory_margin_percent=0.10)
safe_size = guardian.estimate_safe_batch_size('T1')
predicted_memory_gb = 5.0
if not guardian.preflight_check(predicted_memory_gb):
    guardian.emergency_cleanup()
model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)])
GradientCheckpointManager.enable_gradient_checkpointing(model)

# Memory Estimation
estimates = estimate_training_memory(
    num_samples=5000,
    task_distribution={'T1': 1.0},
    batch_size=16,
    num_epochs=3
)

print(f"Per batch: {estimates['per_batch_mb']:.0f}MB")
print(f"Peak memory: {estimates['estimated_peak_memory_mb']:.0f}MB")
"""


def test_quick_reference_as_written_in_its_order_in_a_fresh_process(tmp_path):
    # Nothing is measured when the sampler is built: it plans by batch_size and warns once, using no predictor it was
    # not given; estimate_training_memory gives numbers once a measurement exists; an unmeasured prediction raises.
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(Path(__file__).resolve().parents[3]))
    out = subprocess.run([sys.executable, "-c", _AS_WRITTEN], capture_output=True, text=True, env=env, timeout=120,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert any(line.startswith("UNMEASURED: task_type should be a task with a measured training step") for line in lines)
    warnings = [line for line in lines if line.startswith("WARNING dynabatch.compat.multitask.sampler")]
    assert len(warnings) == 1 and "memory is not calibrated yet" in warnings[0]
    assert "ROWS: 40" in lines
    assert "Per batch: 80000MB" in lines and "Peak memory: 80000MB" in lines  # 16 rows x 5000 MB
