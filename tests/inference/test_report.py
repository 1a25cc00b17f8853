"""``RunReport``: summary figures, the JSON round trip and the plot."""

import json
import sys

import pytest
import torch

from dynabatch import build_dynamic_batch_dataloader, run
from dynabatch.inference.report import BatchRecord, RunReport


def _report(measured=True):
    peak = (lambda b: b) if measured else (lambda b: None)
    return RunReport(
        [
            BatchRecord(
                batch=0, rows=4, width=10, real_tokens=30, padded_tokens=40, seconds=1.0, peak_bytes=peak(2000)
            ),
            BatchRecord(
                batch=1,
                rows=8,
                width=6,
                real_tokens=40,
                padded_tokens=48,
                seconds=0.5,
                peak_bytes=peak(1900),
                pre_split=True,
            ),
            BatchRecord(
                batch=2,
                rows=16,
                width=4,
                real_tokens=60,
                padded_tokens=64,
                seconds=0.5,
                peak_bytes=peak(2400),
                oom_splits=2,
                oom_events=3,
                failed_rows=1,
            ),
        ],
        budget_bytes=2000 if measured else None,
    )


def test_summary_figures_of_a_hand_built_report():
    summary = _report().summary()
    assert summary == {
        "rows": 28,
        "batches": 3,
        "seconds": 2.0,
        "rows_per_s": 14.0,
        "tokens_per_s": 65.0,
        "real_tokens": 130,
        "padded_tokens": 152,
        "padding_efficiency": pytest.approx(130 / 152),
        "oom_events": 3,
        "oom_splits": 2,
        "pre_split_batches": 1,
        "failed_rows": 1,
        "error_rows": 0,
        "skipped_inputs": 0,
        "truncated_inputs": 0,
        "budget_bytes": 2000,
        "device_budgets": {},
        "rebuilt_batches": 0,
        "max_peak_ratio": 1.2,
        "batches_over_budget": 1,
        "wall_seconds": None,
        "bound": None,
        "stage_shares": {},
        "background": {},
        "tokenize_cores": None,
        "workers": {},
        "accounting_seconds": 0.0,
    }
    assert _report().peak_ratios == [1.0, 0.95, 1.2]


def test_summary_without_memory_or_batches():
    unmeasured = _report(measured=False)
    assert unmeasured.peak_ratios == [None, None, None]
    assert unmeasured.max_peak_ratio is None and unmeasured.batches_over_budget == 0
    empty = RunReport().summary()
    assert empty["rows"] == empty["batches"] == empty["oom_events"] == 0
    assert empty["rows_per_s"] is None and empty["padding_efficiency"] is None and empty["max_peak_ratio"] is None


def test_no_bound_is_named_where_no_batch_ran():
    # A resumed run with every input stored: its worker timed only its wait on the tokenizing thread
    waited = RunReport(workers={"cuda:0": {"wall": 2.0, "stages": {"wait tokenize": 1.9, "device": 0.0}}},
                       background={"tokenize": 0.96})
    assert waited.stage_shares and waited.bound is None and waited.summary()["bound"] is None
    waited.records.append(BatchRecord(batch=0, rows=1, width=4, real_tokens=4, padded_tokens=4, seconds=0.1))
    assert waited.bound.startswith("host-bound: tokenizing took 96% of the wall")


@pytest.mark.parametrize("cores,advice", [([1, 4], "raise tokenize_cores (now 1 of 4 cores)"),
                                          ([4, 4], "more CPU cores would help"),
                                          (None, "more CPU cores would help")])
def test_a_tokenizing_bound_advises_the_cap_where_the_cap_is_below_the_cores(tmp_path, cores, advice):
    # A caller's tokenize_cores below the process's cores is the limit to raise; at the process's cores, only more help
    waited = RunReport([BatchRecord(batch=0, rows=1, width=4, real_tokens=4, padded_tokens=4, seconds=0.1)],
                       workers={"cpu": {"wall": 2.0, "stages": {"wait tokenize": 1.5, "device": 0.5}}},
                       background={"tokenize": 0.9}, tokenize_cores=cores)
    assert waited.bound == f"host-bound: tokenizing took 90% of the wall while the device waited 75%; {advice}"
    waited.to_json(tmp_path / "report.json")
    again = RunReport.from_json(tmp_path / "report.json")
    assert again.tokenize_cores == cores and again.bound == waited.bound


def test_json_round_trip(tmp_path):
    report = _report()
    report.to_json(tmp_path / "report.json")
    data = json.loads((tmp_path / "report.json").read_text())
    assert sorted(data) == ["batches", "summary"]
    assert data["summary"]["rows"] == 28 and data["batches"][2]["oom_splits"] == 2
    again = RunReport.from_json(tmp_path / "report.json")
    assert again == report and again.summary() == report.summary()
    report.skipped_inputs = 4  # bad inputs the loader skipped
    report.to_json(tmp_path / "skipped.json")
    assert RunReport.from_json(tmp_path / "skipped.json").skipped_inputs == 4
    with pytest.raises(TypeError, match="path should be a str or os.PathLike, but got path=3 of type int"):
        report.to_json(3)


def _png(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    return data


@pytest.mark.parametrize("measured", [True, False])
def test_plot_writes_a_png(tmp_path, measured):
    pytest.importorskip("matplotlib")
    _report(measured).plot(tmp_path / "report.png", title="hand-built")
    _png(tmp_path / "report.png")
    RunReport().plot(tmp_path / "empty.png")  # no batches: still a readable figure
    _png(tmp_path / "empty.png")


def test_plot_of_a_real_run(tokenizer, tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    from dynabatch.demo import kjv_passages, vary_lengths

    texts = vary_lengths(kjv_passages(), n=120, max_words=60, seed=3)
    loader = build_dynamic_batch_dataloader(texts, tokenizer, batch_size=4, max_input_token_length=64, num_workers=0)

    def fn(batch):
        if len(batch.indices) > 8:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        return torch.ones(*batch["input_ids"].shape, 32).sum(1)

    result = run(fn, loader, memory="measured", progress=False)
    assert result.report.budget_bytes == result.report.records[0].peak_bytes > 0
    result.report.plot(tmp_path / "run.png", title="120 KJV texts")
    height, width = imread(tmp_path / "run.png").shape[:2]
    assert width > 800 and height > 800


def test_plot_without_matplotlib_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ModuleNotFoundError, match=r"RunReport.plot needs matplotlib, which is not installed: "
                                                  r"pip install 'torch-dynabatch\[plot\]'$"):
        _report().plot(tmp_path / "x.png")
