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
from typing import Any

from dynabatch._validation import bad_type
from dynabatch.memory.features import SPIKE_RATIO

__all__ = ["BatchRecord", "RunReport"]



@dataclass
class BatchRecord:
    """One batch of a run.

    Attributes:
        batch: the batch's number in the plan (the loader's order).
        rows: rows of the batch as planned (the rows it ran, when a resumed run ran only some).
        width: its padded length, in tokens.
        real_tokens: tokens that are not padding (the attention mask's sum).
        padded_tokens: tokens of the padded tensors that ran to completion (less than ``rows * width`` when split).
        seconds: wall time of the batch, failed attempts and splits included.
        peak_bytes: the largest peak activation memory of its calls, ``None`` unless memory was measured.
        oom_splits: times a piece of it ran out of memory and was split in halves.
        pre_split: split before it was tried (as large as a shape that had run out of memory, or bound above the
            budget).
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


@dataclass
class RunReport:
    """Per-batch records of a run and its summary figures.

    Attributes:
        records: one :class:`BatchRecord` per batch that ran, in the order they ran.
        budget_bytes: the first batch's peak bytes, the budget later batches are measured against (``None``: not
            measured).
        skipped_inputs: inputs the loader skipped as bad (``on_bad_input="skip"``).
        device_budgets: with several devices, each device's own budget (its first measured peak).
        rebuilt_batches: batches built ahead that a measured peak re-sized since, so built again.
        workers: per worker, its loop's wall seconds and where they went (``{"wall": s, "stages": {stage: s}}``).
        wall_seconds: the run's wall time, from its first stage to its last batch.
        background: the share of the wall each background stage worked (``"tokenize"``, ``"build"``, ``"read"``).
        accounting_seconds: the CPU seconds keeping these figures and the display took.
    """

    records: list[BatchRecord] = field(default_factory=list)
    budget_bytes: int | None = None
    skipped_inputs: int = 0
    device_budgets: dict[str, int] = field(default_factory=dict)
    rebuilt_batches: int = 0
    workers: dict[str, dict[str, Any]] = field(default_factory=dict)
    wall_seconds: float | None = None
    background: dict[str, float] = field(default_factory=dict)
    accounting_seconds: float = 0.0

    # totals over the records
    rows = _total("rows", "Rows that ran.")
    real_tokens = _total("real_tokens", "Tokens that were not padding.")
    padded_tokens = _total("padded_tokens", "Tokens of the padded tensors that ran to completion.")
    oom_events = _total("oom_events", "Out-of-memory errors caught and recovered from (or skipped).")
    oom_splits = _total("oom_splits", "Batches or pieces split in halves after running out of memory.")
    failed_rows = _total("failed_rows", "Rows skipped because they ran out of memory on their own.")
    error_rows = _total("error_rows", "Rows set aside because ``fn`` raised on them alone (``on_error='skip'``).")
    pre_split_batches = _total("pre_split", "Batches split before they were tried: as large as a shape that had "
                               "failed, or bound above the budget.")

    @property
    def batches(self) -> int:
        """Batches that ran."""
        return len(self.records)

    @property
    def seconds(self) -> float:
        """Wall time of the batches: their sum, or with several devices (which ran side by side) the busiest
        device's sum."""
        per_device: dict[str | None, float] = {}
        for r in self.records:
            per_device[r.device] = per_device.get(r.device, 0.0) + r.seconds
        return max(per_device.values(), default=0.0)

    @property
    def rows_per_s(self) -> float | None:
        """Rows per second (``None`` before any time was spent)."""
        return _ratio(self.rows, self.seconds)

    @property
    def tokens_per_s(self) -> float | None:
        """Real (not padding) tokens per second."""
        return _ratio(self.real_tokens, self.seconds)

    @property
    def padding_efficiency(self) -> float | None:
        """Real tokens over padded tokens: 1.0 when nothing was padding."""
        return _ratio(self.real_tokens, self.padded_tokens)

    @property
    def peak_ratios(self) -> list[float | None]:
        """Each batch's peak over the budget (``None`` where not measured)."""
        budgets = self.device_budgets
        return [None if r.peak_bytes is None else _ratio(r.peak_bytes, budgets.get(r.device, self.budget_bytes) or 0)
                for r in self.records]

    @property
    def max_peak_ratio(self) -> float | None:
        """The largest peak over the budget; ``None`` when memory was not measured."""
        ratios = [r for r in self.peak_ratios if r is not None]
        return max(ratios) if ratios else None

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
        """One line naming what bound the run (``"device-bound: the device was busy 94% of the run"``); ``None``
        when no worker was timed."""
        from dynabatch.inference.meter import name_bound

        shares = self.stage_shares
        return name_bound(shares, self.background.get("tokenize")) if shares else None

    def summary(self) -> dict[str, Any]:
        """The summary figures as a dict (JSON-ready)."""
        names = ("rows", "batches", "seconds", "rows_per_s", "tokens_per_s", "real_tokens", "padded_tokens",
                 "padding_efficiency", "oom_events", "oom_splits", "pre_split_batches", "failed_rows", "error_rows",
                 "skipped_inputs", "budget_bytes", "device_budgets", "rebuilt_batches", "max_peak_ratio",
                 "batches_over_budget", "wall_seconds", "bound", "stage_shares", "background", "workers",
                 "accounting_seconds")
        return {name: getattr(self, name) for name in names}

    def to_json(self, path: str | os.PathLike) -> None:
        """Writes the summary and every batch record to ``path`` as JSON."""
        _check_path(path)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=1)
            f.write("\n")

    def to_dict(self) -> dict[str, Any]:
        """The summary and every batch record (JSON-ready), as :meth:`to_json` writes them."""
        return {"summary": self.summary(), "batches": [asdict(r) for r in self.records]}

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> RunReport:
        """Reads a report written by :meth:`to_json`."""
        _check_path(path)
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunReport:
        """A report from :meth:`to_dict`'s dict."""
        names = {f.name for f in fields(BatchRecord)}
        records = [BatchRecord(**{k: v for k, v in r.items() if k in names}) for r in data["batches"]]
        kept = {f.name for f in fields(cls)} - {"records"}  # the summary's figures computed from them are not kept
        return cls(records, **{k: v for k, v in data["summary"].items() if k in kept})

    def plot(self, path: str | os.PathLike, *, title: str | None = None) -> None:
        """Draws the run into a PNG at ``path``: rows per batch (out-of-memory and pre-split batches marked), padded
        over real tokens, and each batch's peak over the budget, by batch number; and where the wall went, stage by
        stage, over the run's seconds.

        Raises:
            ImportError: matplotlib is not installed.
        """
        _check_path(path)
        try:
            from matplotlib.figure import Figure
        except ImportError as exc:
            raise ImportError("RunReport.plot needs matplotlib, which is not installed: pip install matplotlib"
                              ) from exc

        numbers = [r.batch for r in self.records]
        fig = Figure(figsize=(9, 11), layout="constrained")  # no pyplot: no global state, any backend
        ax_rows, ax_pad, ax_mem, ax_wall = fig.subplots(4, 1, height_ratios=[1, 1, 1, 1.1])
        ax_rows.sharex(ax_mem)
        ax_pad.sharex(ax_mem)
        self._plot_stages(ax_wall)
        summary = self.summary()
        headline = title or "dynabatch run"
        rate = f"{summary['rows_per_s']:.1f} rows/s" if summary["rows_per_s"] else "no time measured"
        efficiency = summary["padding_efficiency"]
        efficiency_text = f"{efficiency:.0%} of tokens real" if efficiency is not None else "no tokens"
        fig.suptitle(f"{headline}: {summary['rows']} rows in {summary['batches']} batches, {rate}, "
                     f"{efficiency_text}, {summary['oom_events']} OOM events", fontsize=11)

        ax_rows.set_title("Batch size")
        ax_rows.bar(numbers, [r.rows for r in self.records], width=0.8, color="tab:blue", label="rows")
        top = max((r.rows for r in self.records), default=0)
        for marked, lift, style in (
            ([r for r in self.records if r.oom_events], 0.0,
             {"marker": "x", "color": "tab:red", "label": "ran out of memory (split)"}),
            ([r for r in self.records if r.pre_split], 0.06 * top,
             {"marker": "v", "color": "tab:orange",
              "label": "split before trying (a failed shape, or over the bound)"}),
        ):
            if marked:
                ax_rows.scatter([r.batch for r in marked], [r.rows + lift for r in marked], s=40, zorder=3, **style)
        ax_rows.set_ylabel("rows")
        if self.records:
            ax_rows.set_ylim(0, 1.45 * top)  # room for the legend above the bars
        ax_rows.legend(loc="upper left", fontsize=8, ncol=3)

        ax_pad.set_title("Padding")
        ratios = [r.padded_tokens / r.real_tokens if r.real_tokens else float("nan") for r in self.records]
        ax_pad.plot(numbers, ratios, marker=".", color="tab:green", label="padded / real tokens")
        ax_pad.axhline(1.0, color="gray", linestyle=":", linewidth=1, label="no padding")
        ax_pad.set_ylabel("padded / real tokens")
        ax_pad.legend(loc="best", fontsize=8)

        ax_mem.set_title("Peak memory relative to the first batch")
        measured = [(n, p) for n, p in zip(numbers, self.peak_ratios) if p is not None]
        if measured:
            ax_mem.plot(*zip(*measured), marker=".", color="tab:purple", label="peak / first batch's peak")
            ax_mem.axhline(1.0, color="tab:red", linestyle="--", linewidth=1, label="budget (1.0)")
            ax_mem.axhline(SPIKE_RATIO, color="tab:orange", linestyle=":", linewidth=1, label=f"target ({SPIKE_RATIO})")
            ax_mem.legend(loc="best", fontsize=8)
        else:
            ax_mem.text(0.5, 0.5, "memory not measured (memory='off', or a device that cannot be measured)",
                        ha="center", va="center", transform=ax_mem.transAxes, color="gray")
            ax_mem.set_yticks([])
        ax_mem.set_ylabel("peak / budget")
        ax_mem.set_xlabel("batch number")
        if not numbers:
            for ax in (ax_rows, ax_pad):
                ax.text(0.5, 0.5, "no batches ran", ha="center", va="center", transform=ax.transAxes, color="gray")
        fig.savefig(path, dpi=110)

    def _plot_stages(self, ax: Any, stretches: int = 40) -> None:
        """Where the wall went over the run: each record's stage seconds, spread over the time it took, in
        ``stretches`` stretches of the run, stacked as shares."""
        timed = [r for r in self.records if r.stages and r.finished is not None]
        ax.set_title(f"Where the wall went ({self.bound})" if self.bound else "Where the wall went")
        if not timed:
            ax.text(0.5, 0.5, "no stages timed", ha="center", va="center", transform=ax.transAxes, color="gray")
            ax.set_yticks([])
            return
        end = max(r.finished for r in timed)
        stages = sorted({s for r in timed for s in r.stages}, key=lambda s: (s != "device", s))
        seconds = {s: [0.0] * stretches for s in stages}
        width = end / stretches if end > 0 else 1.0
        for r in timed:  # a record's seconds spread over the stretches of the time it took, up to when it finished
            took = sum(r.stages.values())
            begin = max(r.finished - took, 0.0)
            for i in range(int(begin / width), min(int(r.finished / width) + 1, stretches)):
                overlap = min(r.finished, (i + 1) * width) - max(begin, i * width)
                share = overlap / took if took > 0 else 1.0
                for stage, value in r.stages.items():
                    seconds[stage][i] += value * max(share, 0.0)
        totals = [sum(seconds[s][i] for s in stages) or 1.0 for i in range(stretches)]
        middles = [(i + 0.5) * end / stretches for i in range(stretches)]
        ax.stackplot(middles, [[seconds[s][i] / totals[i] for i in range(stretches)] for s in stages], labels=stages)
        ax.set_ylim(0, 1)
        ax.set_xlim(0, end)
        ax.set_ylabel("share of the wall")
        ax.set_xlabel("seconds from the run's start")
        ax.legend(loc="upper left", fontsize=8, ncol=4)
