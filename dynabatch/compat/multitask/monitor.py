"""Metrics of a multi-task run: JSON files and plots (the multi-task system's ``DynamicBatchingMonitor``).

Files written to ``output_dir``:

* ``batch_metrics.json``: one record per optimizer step (:class:`BatchMetrics`);
* ``epoch_metrics.json``: one summary per epoch (:meth:`DynamicBatchingMonitor.end_epoch`);
* ``training_report.json``: the whole run (:meth:`DynamicBatchingMonitor.generate_report`);
* ``training_curves.png`` (loss, per-task loss) and ``training_curves_memory.png``
  (batch size, measured and predicted peak memory);
* ``task_comparison.png``: per task samples, mean loss and memory per sample.

Plots use matplotlib's object API (no pyplot, no global backend change).

Example:
    >>> import json, os, tempfile
    >>> from dynabatch.compat.multitask.monitor import BatchMetrics, DynamicBatchingMonitor
    >>> out = tempfile.mkdtemp()
    >>> monitor = DynamicBatchingMonitor(output_dir=out)
    >>> monitor.start_epoch()
    >>> monitor.record_batch(BatchMetrics(batch_idx=0, timestamp=0.0, task_types=["T1", "T2"], batch_size=2,
    ...                                   loss=0.5, per_task_loss={"T1": 0.4, "T2": 0.6}, memory_allocated_mb=50))
    >>> epoch = monitor.end_epoch(total_samples=2, total_batches=1)
    >>> epoch["task_counts"]
    {'T1': 1, 'T2': 1}
    >>> report = monitor.generate_report()
    >>> sorted(f for f in os.listdir(out) if f.endswith(".json"))
    ['batch_metrics.json', 'epoch_metrics.json', 'training_report.json']
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from dynabatch._distribution import import_extra
from dynabatch._validation import bad_type, check_non_negative_int

__all__ = ["BatchMetrics", "DynamicBatchingMonitor"]

logger = logging.getLogger(__name__)


@dataclass
class BatchMetrics:
    """What happened in one optimizer step (the multi-task system's fields first, then dynabatch's).

    ``loss`` is the step's loss (weighted mean over its samples or tokens);
    ``per_task_loss`` the unweighted mean loss of each task in the step;
    ``memory_allocated_mb`` the step's measured peak in MB (10**6 bytes, :data:`~dynabatch.memory.units.MB`).
    """

    batch_idx: int
    timestamp: float
    task_types: list[Any]
    batch_size: int
    loss: float
    per_task_loss: dict[Any, float] = field(default_factory=dict)
    memory_allocated_mb: float = 0.0
    predicted_memory_mb: float | None = None
    num_micro_batches: int = 1
    oom_splits: int = 0
    num_tokens: int | None = None
    padded_length: int | None = None
    learning_rate: float | None = None
    task_weights: dict[Any, float] | None = None
    epoch: int | None = None

    def to_json(self) -> dict[str, Any]:
        """A JSON-safe dict (task keys as str)."""
        out = dataclasses.asdict(self)
        out["task_types"] = [str(t) for t in self.task_types]
        for key in ("per_task_loss", "task_weights"):
            if out[key] is not None:
                out[key] = {str(k): float(v) for k, v in out[key].items()}
        return out


def _finite(values: list[float]) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(v)]


def _mean(values: list[float]) -> float | None:
    values = _finite(values)
    return sum(values) / len(values) if values else None


def _summary(batches: list[BatchMetrics]) -> dict[str, Any]:
    counts: Counter = Counter()
    task_loss_sum: dict[str, float] = defaultdict(float)
    task_memory: dict[str, list[float]] = defaultdict(list)
    for b in batches:
        mine = Counter(str(t) for t in b.task_types)
        counts.update(mine)
        for task, loss in b.per_task_loss.items():
            if loss is not None and math.isfinite(loss):
                task_loss_sum[str(task)] += loss * mine.get(str(task), 0)
        for task in mine:
            if b.batch_size:
                task_memory[task].append(b.memory_allocated_mb / b.batch_size)
    samples = sum(b.batch_size for b in batches)
    errors = [
        abs(b.predicted_memory_mb - b.memory_allocated_mb) / b.memory_allocated_mb
        for b in batches
        if b.predicted_memory_mb is not None and b.memory_allocated_mb
    ]
    return {
        "num_batches": len(batches),
        "num_samples": samples,
        "mean_loss": (sum(b.loss * b.batch_size for b in batches) / samples) if samples else None,
        "first_loss": batches[0].loss if batches else None,
        "last_loss": batches[-1].loss if batches else None,
        "task_counts": dict(counts),
        "per_task_mean_loss": {t: task_loss_sum[t] / counts[t] for t in counts if t in task_loss_sum},
        "per_task_memory_per_sample_mb": {t: _mean(v) for t, v in task_memory.items()},
        "mean_batch_size": samples / len(batches) if batches else None,
        "max_batch_size": max((b.batch_size for b in batches), default=None),
        "mean_memory_mb": _mean([b.memory_allocated_mb for b in batches]),
        "max_memory_mb": max((b.memory_allocated_mb for b in batches), default=None),
        "memory_prediction_mean_abs_error_pct": (100 * sum(errors) / len(errors)) if errors else None,
        "oom_splits": sum(b.oom_splits for b in batches),
    }


class DynamicBatchingMonitor:
    """Records per-step metrics, summarises epochs and writes the report and plots.

    Args:
        output_dir: where the files go (created if missing).
    """

    def __init__(self, output_dir: str = "./metrics") -> None:
        if not isinstance(output_dir, (str, os.PathLike)):
            raise bad_type("output_dir", "a path", output_dir)
        self.output_dir = os.fspath(output_dir)
        os.makedirs(self.output_dir, exist_ok=True)
        self.batches: list[BatchMetrics] = []
        self.epochs: list[dict[str, Any]] = []
        self._epoch_start_batch = 0
        self._epoch_start_time: float | None = None
        self._run_start_time = time.time()

    def start_epoch(self) -> None:
        """Marks the start of an epoch (its clock and its first batch)."""
        self._epoch_start_batch = len(self.batches)
        self._epoch_start_time = time.time()

    def record_batch(self, metrics: BatchMetrics) -> None:
        """Adds one step's metrics."""
        if not isinstance(metrics, BatchMetrics):
            raise bad_type("metrics", "a BatchMetrics", metrics)
        self.batches.append(metrics)

    def end_epoch(self, total_samples: int, total_batches: int) -> dict[str, Any]:
        """Summarises the epoch's batches, writes ``batch_metrics.json`` and ``epoch_metrics.json``.

        Args:
            total_samples: samples the epoch trained on.
            total_batches: optimizer steps of the epoch.

        Returns:
            The epoch's summary (also appended to ``epoch_metrics.json``).
        """
        total_samples = check_non_negative_int("total_samples", total_samples)
        total_batches = check_non_negative_int("total_batches", total_batches)
        if self._epoch_start_time is None:
            self.start_epoch()
        elapsed = time.time() - self._epoch_start_time
        summary = {
            "epoch": len(self.epochs),
            "duration_s": elapsed,
            "total_samples": total_samples,
            "total_batches": total_batches,
            "samples_per_second": total_samples / elapsed if elapsed > 0 else None,
            **_summary(self.batches[self._epoch_start_batch :]),
        }
        self.epochs.append(summary)
        self._write("batch_metrics.json", [b.to_json() for b in self.batches])
        self._write("epoch_metrics.json", self.epochs)
        self._epoch_start_time = None
        return summary

    def _write(self, name: str, data: Any) -> str:
        path = os.path.join(self.output_dir, name)
        with open(path, "w") as fh:
            json.dump(data, fh, indent=2, default=str)
        return path

    def generate_report(self) -> dict[str, Any]:
        """Writes ``training_report.json``, both JSON metric files and the training curves; returns the report."""
        report = {
            "duration_s": time.time() - self._run_start_time,
            "num_epochs": len(self.epochs),
            **_summary(self.batches),
            "epochs": self.epochs,
        }
        self._write("batch_metrics.json", [b.to_json() for b in self.batches])
        self._write("epoch_metrics.json", self.epochs)
        self._write("training_report.json", report)
        if self.batches:
            self.plot_training_curves()
        return report

    def _figure(self, rows: int, cols: int = 1, height: float = 3.0):
        figure = import_extra("matplotlib.figure", "train", "DynamicBatchingMonitor's training curves")
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        fig = figure.Figure(figsize=(7.5 if cols == 1 else 11.0, height * rows))
        FigureCanvasAgg(fig)
        return fig

    def plot_training_curves(self) -> list[str]:
        """Writes ``training_curves.png`` (losses) and ``training_curves_memory.png``; returns the paths."""
        steps = list(range(len(self.batches)))
        fig = self._figure(2)
        ax = fig.add_subplot(2, 1, 1)
        ax.plot(steps, [b.loss for b in self.batches], label="step loss")
        ax.set_ylabel("loss")
        ax.legend()
        ax = fig.add_subplot(2, 1, 2)
        tasks = sorted({str(t) for b in self.batches for t in b.per_task_loss})
        for task in tasks:
            points = [(i, b.per_task_loss[t]) for i, b in enumerate(self.batches) for t in b.per_task_loss if str(t) == task]
            ax.plot([p[0] for p in points], [p[1] for p in points], ".-", label=task, markersize=3)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("loss per task")
        if tasks:
            ax.legend()
        fig.tight_layout()
        paths = [os.path.join(self.output_dir, "training_curves.png")]
        fig.savefig(paths[0], dpi=90)

        fig = self._figure(2)
        ax = fig.add_subplot(2, 1, 1)
        ax.plot(steps, [b.batch_size for b in self.batches], label="samples per step")
        ax.set_ylabel("samples")
        ax.legend()
        ax = fig.add_subplot(2, 1, 2)
        ax.plot(steps, [b.memory_allocated_mb for b in self.batches], label="measured peak")
        predicted = [(i, b.predicted_memory_mb) for i, b in enumerate(self.batches) if b.predicted_memory_mb is not None]
        if predicted:
            ax.plot([p[0] for p in predicted], [p[1] for p in predicted], "--", label="predicted peak")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("MB")
        ax.legend()
        fig.tight_layout()
        paths.append(os.path.join(self.output_dir, "training_curves_memory.png"))
        fig.savefig(paths[1], dpi=90)
        return paths

    def plot_task_comparison(self) -> str:
        """Writes ``task_comparison.png``: samples, mean loss and memory per sample of each task."""
        summary = _summary(self.batches)
        tasks = sorted(summary["task_counts"])
        fig = self._figure(1, 3, height=3.5)
        panels = [
            ("samples", [summary["task_counts"][t] for t in tasks]),
            ("mean loss", [summary["per_task_mean_loss"].get(t) or 0.0 for t in tasks]),
            ("MB per sample (step peak / rows)", [summary["per_task_memory_per_sample_mb"].get(t) or 0.0 for t in tasks]),
        ]
        for i, (title, values) in enumerate(panels):
            ax = fig.add_subplot(1, 3, i + 1)
            ax.bar(tasks, values, color=["C0", "C1", "C2", "C3", "C4"][: len(tasks)] or None)
            ax.set_title(title, fontsize=10)
        fig.tight_layout()
        path = os.path.join(self.output_dir, "task_comparison.png")
        fig.savefig(path, dpi=90)
        return path
