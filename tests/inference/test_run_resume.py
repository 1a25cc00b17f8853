"""``run`` on real batches of real texts: resuming from output_path. Models are real (see conftest.py); nothing of dynabatch is mocked.
"""

import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap

import pytest
from runner_helpers import (
    _fails_at,
    _lengths,
    _load,
)

from dynabatch import BatchOutOfMemoryError, RunResult, run
from dynabatch.inference.report import RunReport

pytestmark = pytest.mark.usefixtures("one_thread")


# --- resuming from output_path -----------------------------------------------------------------------


def _summary(batch):
    """JSON-storable rows: a dict per row."""
    mask = batch["attention_mask"]
    return {"length": mask.sum(1), "mean_id": (batch["input_ids"] * mask).sum(1) / mask.sum(1)}


def _file_positions(path):
    with open(path) as f:
        lines = f.read().splitlines()
    header = json.loads(lines[0])
    return header, [p for line in lines[1:] for p in json.loads(line)["positions"]]


_KILLED_RUN = """
import os, signal, sys
os.environ["HF_HUB_OFFLINE"] = "1"
import torch
from transformers import AutoTokenizer
from dynabatch import build_dynamic_batch_dataloader, run
from dynabatch.demo import kjv_passages, minilm_path

tokenizer = AutoTokenizer.from_pretrained(minilm_path())
texts = kjv_passages()[300:500]
loader = build_dynamic_batch_dataloader(texts, tokenizer, batch_size=4, max_input_token_length=32, num_workers=0)
calls = []

def fn(batch):
    calls.append(1)
    if len(calls) == 4:
        os.kill(os.getpid(), signal.SIGKILL)  # killed in the middle of the run, as by the OOM killer
    mask = batch["attention_mask"]
    return {"length": mask.sum(1), "mean_id": (batch["input_ids"] * mask).sum(1) / mask.sum(1)}

run(fn, loader, output_path=sys.argv[1], progress=False)
"""


def test_a_killed_run_resumes_where_it_stopped(tokenizer, tmp_path):
    from dynabatch.demo import kjv_passages

    texts = kjv_passages()[300:500]
    path = tmp_path / "results.jsonl"
    script = tmp_path / "killed.py"
    script.write_text(textwrap.dedent(_KILLED_RUN))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, str(script), str(path)], env=env, capture_output=True, timeout=120, check=False
    )
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-2000:]
    header, positions = _file_positions(path)
    loader = _load(texts, tokenizer, max_input_token_length=32)
    planned = loader.batch_sampler.batches
    assert header["n_inputs"] == len(texts) and len(positions) == sum(len(b) for b in planned[:3])

    calls = []
    resumed = run(lambda b: calls.append(len(b.indices)) or _summary(b), loader, output_path=path, progress=False)
    assert len(calls) == len(planned) - 3  # only the batches not in the file ran
    clean = run(_summary, loader, output_path=tmp_path / "clean.jsonl", progress=False)
    assert resumed == clean  # JSON values for every row, resumed or not
    assert sorted(_file_positions(path)[1]) == list(range(len(texts)))  # every position exactly once
    assert resumed[0]["length"] == len(tokenizer(texts[0], truncation=True, max_length=32)["input_ids"])


def test_resume_ignores_a_cut_line_and_runs_only_missing_rows(tokenizer, texts, tmp_path, caplog):
    loader = _load(texts, tokenizer)
    path = tmp_path / "out.jsonl"
    clean = run(_summary, loader, output_path=path, adapt=False, progress=False)  # the plan's batches
    lines = path.read_text().splitlines()
    # Batch 0 kept for two of its rows only; the last batch's line cut off mid-write.
    first = json.loads(lines[1])
    first = {"positions": first["positions"][:2], "results": first["results"][:2]}
    path.write_text("\n".join([lines[0], json.dumps(first), *lines[2:-1], lines[-1][:-7]]))
    calls = []
    again = run(lambda b: calls.append(b.indices.tolist()) or _summary(b), loader, output_path=path, adapt=False,
                progress=False)
    planned = loader.batch_sampler.batches
    assert calls == [planned[0][2:].tolist(), planned[-1].tolist()]
    missing = len(planned[0]) - 2 + len(planned[-1])
    assert (f"resuming from output_path={str(path)!r}: found {len(texts) - missing} of {len(texts)} inputs already "
            f"done; running the other {missing}") in caplog.text  # a warning: shown without any logging set up
    assert again == clean
    assert sorted(_file_positions(path)[1]) == list(range(len(texts)))
    # Everything done: nothing runs, the results are read back.
    calls.clear()
    assert run(lambda b: calls.append(1) or _summary(b), loader, output_path=path, progress=False) == clean
    assert calls == []


def test_resume_after_lowering_batch_size_keeps_every_row_done(tokenizer, texts, tmp_path):
    # The usual reason to resume: batches ran out of memory, so the user plans smaller ones. Results are kept
    # per input position, so the results file of the larger plan still counts: only the missing rows run.
    from dynabatch import build_dynamic_batch_dataloader

    path = tmp_path / "out.jsonl"
    big = build_dynamic_batch_dataloader(texts, tokenizer, batch_size=8, max_input_token_length=32, num_workers=0,
                                         progress=False)
    clean = run(_summary, big, output_path=path, progress=False)
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:3]) + "\n")  # the run was killed after two batches
    done = {p for line in lines[1:3] for p in json.loads(line)["positions"]}
    small = build_dynamic_batch_dataloader(texts, tokenizer, batch_size=2, max_input_token_length=32, num_workers=0,
                                           progress=False)
    calls = []
    again = run(lambda b: calls.extend(b.indices.tolist()) or _summary(b), small, output_path=path, progress=False)
    assert sorted(calls) == sorted(set(range(len(texts))) - done)  # the rows already done did not run again
    assert again == clean
    assert sorted(_file_positions(path)[1]) == list(range(len(texts)))


def test_resume_with_a_plain_iterable_of_batches(tokenizer, texts, tmp_path):
    batches = list(_load(texts[:30], tokenizer))
    path = tmp_path / "plain.jsonl"
    clean = run(_summary, batches, output_path=path, progress=False)
    lines = path.read_text().splitlines()
    first = json.loads(lines[1])
    first = {"positions": first["positions"][:1], "results": first["results"][:1]}
    path.write_text("\n".join([lines[0], json.dumps(first), *lines[2:-1]]) + "\n")
    calls = []
    again = run(
        lambda b: calls.append(b.indices.tolist()) or _summary(b),
        iter(batches),  # a one-shot iterator: read whole for the fingerprint
        output_path=path,
        progress=False,
    )
    assert calls == [batches[0].indices[1:].tolist(), batches[-1].indices.tolist()]
    assert again == clean


def test_resume_refuses_another_runs_file_and_unstorable_results(tokenizer, texts, tmp_path):
    path = tmp_path / "out.jsonl"
    run(_summary, _load(texts[:20], tokenizer), output_path=str(path), progress=False)
    with pytest.raises(
        ValueError,
        match=r"output_path should be a new file or the results file of these same inputs"
        r".*output_path='.*out\.jsonl'",
    ):
        run(_summary, _load(texts[:21], tokenizer), output_path=path, progress=False)
    with pytest.raises(TypeError, match="result should be JSON-storable.*of type object"):
        run(
            lambda b: [object()] * len(b.indices),
            _load(texts[:20], tokenizer),
            output_path=tmp_path / "x.jsonl",
            progress=False,
        )
    (tmp_path / "junk.jsonl").write_text('{"format": "dynabatch.run/1"}\n')
    with pytest.raises(ValueError, match="output_path should be a new file"):
        run(_summary, _load(texts[:20], tokenizer), output_path=tmp_path / "junk.jsonl", progress=False)


def test_output_path_results_are_json_values(tokenizer, texts, tmp_path):
    loader = _load(texts[:20], tokenizer)
    result = run(
        lambda b: (b["attention_mask"].sum(1) > 5).tolist(), loader, output_path=tmp_path / "a.jsonl", progress=False
    )
    assert all(isinstance(r, bool) for r in result)
    rows = run(_lengths, loader, output_path=tmp_path / "b.jsonl", progress=False)
    assert all(isinstance(r, list) and len(r) == 2 for r in rows)
    # skipped rows are not saved, so a rerun tries them again
    position = int(loader.batch_sampler.batches[0][0])
    skipped = run(
        _fails_at(_lengths, position), loader, output_path=tmp_path / "c.jsonl", on_oom="skip", progress=False
    )
    assert skipped.failed == [position] and position not in _file_positions(tmp_path / "c.jsonl")[1]
    retried = run(_lengths, loader, output_path=tmp_path / "c.jsonl", progress=False)
    assert retried == rows and retried.report.rows == 1


def test_batch_out_of_memory_error_pickles(tokenizer, texts):
    partial = RunResult([1, None], report=RunReport())
    error = pickle.loads(pickle.dumps(BatchOutOfMemoryError("input position 1 ran out", position=1, partial=partial)))
    assert str(error) == "input position 1 ran out" and error.position == 1 and error.partial == [1, None]
