"""What a :func:`dynabatch.inference.runner.run` did, batch by batch: sizes, padding, time, memory, OOM recovery.

A :class:`RunReport` holds one :class:`BatchRecord` per batch that ran, the memory budget and summary figures;
:meth:`~RunReport.to_json` saves it, :meth:`~RunReport.from_json` reads it back, :meth:`~RunReport.plot` draws it.

Example:
    >>> from dynabatch.inference.report import BatchRecord, RunReport
    >>> report = RunReport([
    ...     BatchRecord(batch=0, rows=4, width=10, real_tokens=36, padded_tokens=40, seconds=0.5, peak_bytes=1000),
    ...     BatchRecord(batch=1, rows=8, width=5, real_tokens=32, padded_tokens=40, seconds=0.5, peak_bytes=1100),
    ... ], budget_bytes=1000)
    >>> report.rows, report.rows_per_s, report.padding_efficiency, report.max_peak_ratio, report.batches_over_budget
    (12, 12.0, 0.85, 1.1, 1)
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from dynabatch._distribution import import_extra
from dynabatch._validation import bad_type
from dynabatch.inference.meter import name_bound
from dynabatch.memory.features import SPIKE_RATIO

__all__ = ["BatchRecord", "RunReport"]

_NOTE = {"ha": "center", "va": "center", "color": "gray"}  # a note across a plot's empty panel


@dataclass
class BatchRecord:
    """One batch of a run.

    Attributes:
        batch: the batch's number in the plan (the loader's order).
        rows: rows of the batch as planned (the rows it ran, when a resumed run ran only some).
        width: its padded length, in tokens.
        real_tokens: tokens that are not padding (the attention mask's sum) of the rows that ran to completion.
        padded_tokens: tokens of the padded tensors that ran to completion (less than ``rows * width`` when split).
        seconds: wall time of the batch, failed attempts and splits included.
        peak_bytes: the largest peak activation memory of its calls, ``None`` unless memory was measured.
        oom_splits: times a piece of it ran out of memory and was split in halves.
        pre_split: split before it was tried (as large as a shape that had run out of memory, or bound above budget).
        oom_events: out-of-memory errors it raised (splits plus single rows that failed).
        failed_rows: rows that ran out of memory on their own and were skipped.
        error_rows: rows whose ``fn`` call raised on their own, set aside (``on_error="skip"``).
        device: the device that ran it, when ``run`` was given several (``devices=``).
        stages: the seconds its worker's loop spent on it, by stage (:class:`~dynabatch.inference.meter.Laps`).
        finished: when it finished, in seconds from the run's start.
    """

    batch: int
    rows: int
    width: int
    real_tokens: int
    padded_tokens: int
    seconds: float
    peak_bytes: int | None = None
    oom_splits: int = 0
    pre_split: bool = False
    oom_events: int = 0
    failed_rows: int = 0
    error_rows: int = 0
    device: str | None = None
    stages: dict[str, float] | None = None
    finished: float | None = None


def _check_path(path: Any) -> None:
    if not isinstance(path, (str, os.PathLike)):
        raise bad_type("path", "a str or os.PathLike", path)


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator else None


def _total(field_name: str, doc: str) -> property:
    """A :class:`RunReport` property: a field of :class:`BatchRecord` summed over the records (an int)."""
    return property(lambda report: int(sum(getattr(r, field_name) for r in report.records)), doc=doc)


def _quotient(top: str, bottom: str, doc: str) -> property:
    """A :class:`RunReport` property: one of its figures over another (``None`` where the other is 0)."""
    return property(lambda report: _ratio(getattr(report, top), getattr(report, bottom)), doc=doc)


@dataclass
class RunReport:
    """Per-batch records of a run and its summary figures.

    Attributes:
        records: one :class:`BatchRecord` per batch that ran, in the order they ran.
        budget_bytes: the first batch's peak bytes, the budget later batches are measured against (``None``: not
            measured).
        skipped_inputs: inputs the loader skipped as bad (``on_bad_input="skip"``).
        truncated_inputs: inputs that ran cut to the loader's ``max_input_token_length`` (counted by
            :func:`dynabatch.generate`, whose reply to a cut prompt is to the cut text; 0 elsewhere).
        device_budgets: with several devices, each device's own budget (its first measured peak).
        rebuilt_batches: batches built ahead that a measured peak re-sized since, so built again.
        workers: per worker, its loop's wall seconds and where they went (``{"wall": s, "stages": {stage: s}}``).
        wall_seconds: the run's wall time, from its first stage to the end of its workers (their rows handed to the
            sink: a store's committed).
        background: the share of the wall each background stage worked (``"tokenize"``, ``"build"``, ``"read"``,
            ``"store"``).
        tokenize_cores: ``[cores the run's tokenizing was allowed, cores this process may use]`` where it tokenized
            (a streaming loader's chunks; the first is ``tokenize_cores`` where that is fewer), which the bound's
            advice names; ``None`` where every input was tokenized before the run.
        accounting_seconds: the CPU seconds keeping these figures and the display took.
    """

    records: list[BatchRecord] = field(default_factory=list)
    budget_bytes: int | None = None
    skipped_inputs: int = 0
    truncated_inputs: int = 0
    device_budgets: dict[str, int] = field(default_factory=dict)
    rebuilt_batches: int = 0
    workers: dict[str, dict[str, Any]] = field(default_factory=dict)
    wall_seconds: float | None = None
    background: dict[str, float] = field(default_factory=dict)
    tokenize_cores: list[int] | None = None
    accounting_seconds: float = 0.0

    # totals over the records, and rates
    rows = _total("rows", "Rows that ran.")
    real_tokens = _total("real_tokens", "Tokens that were not padding.")
    padded_tokens = _total("padded_tokens", "Tokens of the padded tensors that ran to completion.")
    oom_events = _total("oom_events", "Out-of-memory errors caught and recovered from (or skipped).")
    oom_splits = _total("oom_splits", "Batches or pieces split in halves after running out of memory.")
    failed_rows = _total("failed_rows", "Rows skipped because they ran out of memory on their own.")
    error_rows = _total("error_rows", "Rows set aside because ``fn`` raised on them alone (``on_error='skip'``).")
    pre_split_batches = _total("pre_split", "Batches split before they were tried: as large as a shape that had "
                               "failed, or bound above the budget.")
    rows_per_s = _quotient("rows", "seconds", "Rows per second (``None`` before any time was spent).")
    tokens_per_s = _quotient("real_tokens", "seconds", "Real (not padding) tokens per second.")
    padding_efficiency = _quotient("real_tokens", "padded_tokens", "Real tokens over padded tokens: 1.0 when nothing "
                                   "was padding.")

    @property
    def batches(self) -> int:
        """Batches that ran."""
        return len(self.records)

    @property
    def seconds(self) -> float:
        """Wall time of the batches: their sum, or with several devices (side by side) the busiest device's sum."""
        per_device: dict[str | None, float] = {}
        for r in self.records:
            per_device[r.device] = per_device.get(r.device, 0.0) + r.seconds
        return max(per_device.values(), default=0.0)

    @property
    def peak_ratios(self) -> list[float | None]:
        """Each batch's peak over the budget (``None`` where not measured)."""
        return [None if r.peak_bytes is None else
                _ratio(r.peak_bytes, self.device_budgets.get(r.device, self.budget_bytes) or 0) for r in self.records]

    @property
    def max_peak_ratio(self) -> float | None:
        """The largest peak over the budget; ``None`` when memory was not measured."""
        return max((r for r in self.peak_ratios if r is not None), default=None)

    @property
    def batches_over_budget(self) -> int:
        """Batches whose peak went past the budget (ratio above 1.0)."""
        return sum(1 for r in self.peak_ratios if r is not None and r > 1.0)

    @property
    def stage_shares(self) -> dict[str, float]:
        """Where the device loops' wall went, as shares of it by stage (averaged over the workers): ``"device"``
        the device's share, the rest what it waited for."""
        shares: dict[str, float] = {}
        walls = [w for w in self.workers.values() if w.get("wall")]
        for worker in walls:
            for stage, seconds in worker["stages"].items():
                shares[stage] = shares.get(stage, 0.0) + seconds / worker["wall"] / len(walls)
        return dict(sorted(shares.items(), key=lambda kv: -kv[1]))

    @property
    def bound(self) -> str | None:
        """One line naming what bound the run (:func:`~dynabatch.inference.meter.name_bound`); ``None`` when no
        worker was timed or no batch ran (a resumed run with nothing left: the loop's wait bound no device)."""
        shares = self.stage_shares
        if not shares or not self.records:
            return None
        return name_bound(shares, self.background.get("tokenize"), tokenize_cores=self.tokenize_cores)

    def summary(self) -> dict[str, Any]:
        """The summary figures as a dict (JSON-ready)."""
        names = ("rows", "batches", "seconds", "rows_per_s", "tokens_per_s", "real_tokens", "padded_tokens",
                 "padding_efficiency", "oom_events", "oom_splits", "pre_split_batches", "failed_rows", "error_rows",
                 "skipped_inputs", "truncated_inputs", "budget_bytes", "device_budgets", "rebuilt_batches",
                 "max_peak_ratio",
                 "batches_over_budget", "wall_seconds", "bound", "stage_shares", "background", "tokenize_cores",
                 "workers", "accounting_seconds")
        return {name: getattr(self, name) for name in names}

    def to_json(self, path: str | os.PathLike) -> None:
        """Writes the summary and every batch record to ``path`` as JSON."""
        _check_path(path)
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n", encoding="utf-8")

    def to_dict(self) -> dict[str, Any]:
        """The summary and every batch record (JSON-ready), as :meth:`to_json` writes them."""
        return {"summary": self.summary(), "batches": [asdict(r) for r in self.records]}

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> RunReport:
        """Reads a report written by :meth:`to_json`."""
        _check_path(path)
        return cls.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunReport:
        """A report from :meth:`to_dict`'s dict."""
        names = {f.name for f in fields(BatchRecord)}
        records = [BatchRecord(**{k: v for k, v in r.items() if k in names}) for r in data["batches"]]
        kept = {f.name for f in fields(cls)} - {"records"}  # the summary's figures computed from them are not kept
        return cls(records, **{k: v for k, v in data["summary"].items() if k in kept})

    def plot(self, path: str | os.PathLike, *, title: str | None = None) -> None:
        """Draws the run into a PNG at ``path``: by batch number, rows per batch (out-of-memory and pre-split batches
        marked), padded over real tokens and each batch's peak over the budget; and where the wall went, stage by
        stage, over the run's seconds.

        Raises:
            ModuleNotFoundError: matplotlib is not installed (the ``plot`` extra).
        """
        _check_path(path)
        figure = import_extra("matplotlib.figure", "plot", "RunReport.plot")

        fig = figure.Figure(figsize=(9, 11), layout="constrained")  # no pyplot: no global state, any backend
        ax_rows, ax_pad, ax_mem, ax_wall = fig.subplots(4, 1, height_ratios=[1, 1, 1, 1.1])
        ax_rows.sharex(ax_mem)
        ax_pad.sharex(ax_mem)
        rate = f"{self.rows_per_s:.1f} rows/s" if self.rows_per_s else "no time measured"
        real = "no tokens" if self.padding_efficiency is None else f"{self.padding_efficiency:.0%} of tokens real"
        fig.suptitle(f"{title or 'dynabatch run'}: {self.rows} rows in {self.batches} batches, {rate}, {real}, "
                     f"{self.oom_events} OOM events", fontsize=11)

        numbers = [r.batch for r in self.records]
        top = max((r.rows for r in self.records), default=0)
        ax_rows.bar(numbers, [r.rows for r in self.records], width=0.8, color="tab:blue", label="rows")
        for marked, lift, marker, color, label in (
                ([r for r in self.records if r.oom_events], 0.0, "x", "tab:red", "ran out of memory (split)"),
                ([r for r in self.records if r.pre_split], 0.06 * top, "v", "tab:orange",
                 "split before trying (a failed shape, or over the bound)")):
            if marked:
                ax_rows.scatter([r.batch for r in marked], [r.rows + lift for r in marked], s=40, zorder=3,
                                marker=marker, color=color, label=label)
        ax_rows.set(title="Batch size", ylabel="rows")
        if self.records:
            ax_rows.set_ylim(0, 1.45 * top)  # room for the legend above the bars
        ax_rows.legend(loc="upper left", fontsize=8, ncol=3)

        ratios = [r.padded_tokens / r.real_tokens if r.real_tokens else float("nan") for r in self.records]
        ax_pad.plot(numbers, ratios, marker=".", color="tab:green", label="padded / real tokens")
        ax_pad.axhline(1.0, color="gray", linestyle=":", linewidth=1, label="no padding")
        ax_pad.set(title="Padding", ylabel="padded / real tokens")
        ax_pad.legend(loc="best", fontsize=8)
        if not numbers:
            for ax in (ax_rows, ax_pad):
                ax.text(0.5, 0.5, "no batches ran", transform=ax.transAxes, **_NOTE)

        self._plot_stages(ax_wall)
        ax_mem.set(title="Peak memory relative to the first batch", ylabel="peak / budget", xlabel="batch number")
        measured = [(n, p) for n, p in zip(numbers, self.peak_ratios) if p is not None]
        if measured:
            ax_mem.plot(*zip(*measured), marker=".", color="tab:purple", label="peak / first batch's peak")
            ax_mem.axhline(1.0, color="tab:red", linestyle="--", linewidth=1, label="budget (1.0)")
            ax_mem.axhline(SPIKE_RATIO, color="tab:orange", linestyle=":", linewidth=1, label=f"target ({SPIKE_RATIO})")
            ax_mem.legend(loc="best", fontsize=8)
        else:
            ax_mem.text(0.5, 0.5, "memory not measured (memory='off', or a device that cannot be measured)",
                        transform=ax_mem.transAxes, **_NOTE)
            ax_mem.set_yticks([])
        fig.savefig(path, dpi=110)

    def _plot_stages(self, ax: Any, stretches: int = 40) -> None:
        """Where the wall went over the run: each record's stage seconds, spread evenly over the time it took up to
        when it finished, summed in ``stretches`` stretches of the run and stacked as shares."""
        bound = self.bound
        ax.set(title=f"Where the wall went ({bound})" if bound else "Where the wall went")
        timed = [r for r in self.records if r.stages and r.finished is not None and sum(r.stages.values()) > 0]
        if not timed:  # (a record that took no time has nothing to spread)
            ax.text(0.5, 0.5, "no stages timed", transform=ax.transAxes, **_NOTE)
            ax.set_yticks([])
            return
        stages = sorted({s for r in timed for s in r.stages}, key=lambda s: (s != "device", s))
        seconds = np.array([[r.stages.get(s, 0.0) for s in stages] for r in timed])  # record x stage
        finished, took = np.array([[r.finished] for r in timed]), seconds.sum(axis=1, keepdims=True)
        edges = np.linspace(0.0, finished.max(), stretches + 1)
        overlap = np.minimum(finished, edges[1:]) - np.maximum(finished - took, edges[:-1])  # record x stretch
        spread = seconds.T @ (np.maximum(overlap, 0.0) / took)  # stage x stretch
        totals = spread.sum(axis=0)
        ax.stackplot((edges[1:] + edges[:-1]) / 2, spread / np.where(totals > 0, totals, 1.0), labels=stages)
        ax.set(ylim=(0, 1), xlim=(0, edges[-1]), ylabel="share of the wall", xlabel="seconds from the run's start")
        ax.legend(loc="upper left", fontsize=8, ncol=4)
