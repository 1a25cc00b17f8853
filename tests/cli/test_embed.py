"""dynabatch embed: a corpus in, each text's own vector out, into a store that a killed run resumes."""

from __future__ import annotations

import sys
import time

import numpy as np
import pyarrow.dataset as ds
import pytest
import torch

from dynabatch.cli import main


def _store(out):
    table = ds.dataset(out, format="parquet").to_table()
    return table.column("id").to_pylist(), np.stack(table.column("output").to_numpy(zero_copy_only=False))


def _alone(folder, texts, max_length=64):
    """Each text's mean-pooled vector, the model run on that text alone."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer, model = AutoTokenizer.from_pretrained(folder), AutoModel.from_pretrained(folder).eval()
    with torch.inference_mode():
        return np.stack([model(**tokenizer(t, truncation=True, max_length=max_length, return_tensors="pt"))
                         .last_hidden_state[0].mean(0).numpy() for t in texts])


def _check_every_id_once(out, ids, want):
    stored, vectors = _store(out)
    assert sorted(stored, key=str) == sorted(ids, key=str) and len(stored) == len(set(stored))  # each id once
    where = {i: n for n, i in enumerate(ids)}
    order = [where[i] for i in stored]
    assert np.abs(vectors - want[order]).max() < 1e-4


@pytest.mark.slow
def test_killed_mid_run_then_rerun_stores_every_str_id_once_with_its_own_vector(
        bert_dir, texts, tmp_path, cli, write_corpus, kill_after_first_shard, run_command):
    ids = [f"doc-{i}" for i in range(len(texts))]
    corpus, out = write_corpus(tmp_path, texts, ids), tmp_path / "store"
    command = [*cli, "embed", str(corpus), str(out), "--model", str(bert_dir), "--id-column", "id",
               "--batch-size", "4", "--no-progress"]
    kill_after_first_shard(command, out, tmp_path / "hook")
    before = len(_store(out)[0])
    assert 8 <= before < len(texts)  # one shard stored when it was killed
    again = run_command(command).stdout
    assert f"{len(texts)} of {len(texts)} texts stored in {out} ({len(texts) - before} run now, {before} stored " \
           "before)" in again
    assert "out-of-memory events" in again and "read it    pyarrow.dataset.dataset(" in again
    _check_every_id_once(out, ids, _alone(bert_dir, texts))


@pytest.mark.slow
def test_under_torchrun_two_ranks_killed_then_rerun_store_every_int_id_once(
        bert_dir, texts, tmp_path, write_corpus, kill_after_first_shard, run_command):
    ids = [1000 + 7 * i for i in range(len(texts))]
    corpus, out = write_corpus(tmp_path, texts, ids), tmp_path / "store"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
               "dynabatch", "embed", str(corpus), str(out), "--model", str(bert_dir), "--id-column", "id",
               "--batch-size", "4", "--no-progress"]
    kill_after_first_shard(command, out, tmp_path / "hook")
    before = len(_store(out)[0])
    assert 0 < before < len(texts)
    again = run_command(command).stdout
    assert f"{len(texts)} of {len(texts)} texts stored in {out} (rank 0 ran" in again
    assert "rank 0 of 2 (torchrun)" in again
    _check_every_id_once(out, ids, _alone(bert_dir, texts))


@pytest.mark.slow
def test_the_default_model_gives_sentence_transformers_vectors_report_and_plot(tmp_path, capsys):
    from sentence_transformers import SentenceTransformer

    from dynabatch.demo import kjv_passages, minilm_path
    from dynabatch.inference.report import RunReport

    texts = kjv_passages()[:24]
    (tmp_path / "docs.txt").write_text("\n".join(texts) + "\n", encoding="utf-8")
    out, report, plot = tmp_path / "vectors", tmp_path / "report.json", tmp_path / "batches.png"
    assert main(["embed", str(tmp_path / "docs.txt"), str(out), "--batch-size", "8", "--no-progress",
                 "--report", str(report), "--plot", str(plot)]) == 0
    printed = capsys.readouterr().out
    assert "24 of 24 texts stored" in printed and "all-MiniLM-L6-v2 (its sentence-transformers modules)" in printed
    table = ds.dataset(out).to_table().sort_by("position")
    assert table.column("position").to_pylist() == list(range(24))  # a text file's rows: its lines
    vectors = np.stack(table.column("output").to_numpy(zero_copy_only=False))
    want = SentenceTransformer(minilm_path(), device="cpu").encode(texts)
    assert np.abs(vectors - want).max() < 1e-5
    assert RunReport.from_json(report).rows == 24
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("pooling", ["cls", "last"])
def test_cls_and_last_pooling_take_the_first_and_last_real_token(bert_dir, tmp_path, capsys, pooling):
    from transformers import AutoModel, AutoTokenizer

    texts = ["In the beginning God created the heaven and the earth.", "Amen.", "And God said"]
    (tmp_path / "docs.jsonl").write_text("".join(f'{{"text": "{t}"}}\n' for t in texts))
    out = tmp_path / "store"
    assert main(["embed", str(tmp_path / "docs.jsonl"), str(out), "--model", str(bert_dir), "--pooling", pooling,
                 "--normalize", "--no-progress"]) == 0
    vectors = np.stack(ds.dataset(out).to_table().sort_by("position").column("output").to_numpy(
        zero_copy_only=False))
    tokenizer, model = AutoTokenizer.from_pretrained(bert_dir), AutoModel.from_pretrained(bert_dir).eval()
    with torch.inference_mode():
        states = [model(**tokenizer(t, return_tensors="pt")).last_hidden_state[0] for t in texts]
    want = torch.stack([s[0] if pooling == "cls" else s[-1] for s in states])
    assert np.abs(vectors - torch.nn.functional.normalize(want, dim=-1).numpy()).max() < 1e-5


def test_devices_run_a_worker_each_and_a_sentence_transformers_length_is_the_default(bert_dir, texts, tmp_path,
                                                                                      capsys):
    import json

    folder = tmp_path / "model"
    folder.mkdir()
    for file in bert_dir.iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    (folder / "sentence_bert_config.json").write_text('{"max_seq_length": 16}')  # what it was trained with
    (tmp_path / "docs.txt").write_text("\n".join(texts[:40]) + "\n")
    out, report = tmp_path / "store", tmp_path / "report.json"
    assert main(["embed", str(tmp_path / "docs.txt"), str(out), "--model", str(folder), "--pooling", "mean",
                 "--devices", "cpu,cpu", "--batch-size", "4", "--report", str(report), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "(mean pooling), float32, max length 16, on cpu, cpu" in printed
    devices = {batch["device"] for batch in json.loads(report.read_text())["batches"]}
    assert devices <= {"cpu (worker 0)", "cpu (worker 1)"} and devices
    vectors = np.stack(ds.dataset(out).to_table().sort_by("position").column("output").to_numpy(
        zero_copy_only=False))
    assert np.abs(vectors - _alone(folder, texts[:40], max_length=16)).max() < 1e-4


# -- bad input: one line on stderr, exit status 2, before any model loads ------------------------------------------


@pytest.fixture()
def no_model_loads(monkeypatch):
    """Loading any weights fails the test: a bad input must be refused before."""
    import sentence_transformers
    import transformers

    def loaded(*args, **kwargs):
        raise AssertionError("a model loaded before the bad input was refused")

    monkeypatch.setattr(transformers.AutoModel, "from_pretrained", loaded)
    monkeypatch.setattr(sentence_transformers, "SentenceTransformer", loaded)


def _refused(argv, capsys):
    start = time.perf_counter()
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert time.perf_counter() - start < 10
    return err.strip().removeprefix("dynabatch embed: error: ")


@pytest.fixture()
def corpus(tmp_path, texts, write_corpus):
    return write_corpus(tmp_path, texts[:6], [f"d{i}" for i in range(6)])


def test_a_missing_column_is_refused(bert_dir, corpus, tmp_path, capsys, no_model_loads):
    base = ["embed", str(corpus), str(tmp_path / "out"), "--model", str(bert_dir)]
    assert _refused([*base, "--text-column", "body"], capsys) == \
        "--text-column should be a column of the input ['id', 'text'], but got --text-column='body'"
    assert _refused([*base, "--id-column", "key"], capsys) == \
        "--id-column should be a column of the input ['id', 'text'], but got --id-column='key'"


def test_an_empty_corpus_is_refused(bert_dir, tmp_path, capsys, no_model_loads):
    (tmp_path / "empty.jsonl").write_text("")
    path = str(tmp_path / "empty.jsonl")
    assert _refused(["embed", path, str(tmp_path / "out"), "--model", str(bert_dir)], capsys) == \
        f"input should hold at least one text, but got input={path!r} with no rows"


def test_an_unreadable_file_is_refused(bert_dir, tmp_path, capsys, no_model_loads):
    (tmp_path / "broken.parquet").write_bytes(b"not parquet at all")
    path = str(tmp_path / "broken.parquet")
    assert _refused(["embed", path, str(tmp_path / "out"), "--model", str(bert_dir)], capsys).startswith(
        f"input should be a readable Parquet file, but got input={path!r}: ")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    path = str(tmp_path / "latin1.txt")
    assert _refused(["embed", path, str(tmp_path / "out"), "--model", str(bert_dir)], capsys).startswith(
        f"input should be a UTF-8 text file, one document a line, but got input={path!r}: 'utf-8' codec can't")


def test_an_output_holding_another_jobs_store_is_refused(bert_dir, corpus, tmp_path, capsys, no_model_loads,
                                                         monkeypatch):
    out = tmp_path / "out"
    monkeypatch.undo()  # the first job loads its model
    assert main(["embed", str(corpus), str(out), "--model", str(bert_dir), "--id-column", "id",
                 "--no-progress"]) == 0
    capsys.readouterr()
    import transformers

    monkeypatch.setattr(transformers.AutoModel, "from_pretrained", lambda *a, **k: pytest.fail("a model loaded"))
    err = _refused(["embed", str(corpus), str(out), "--model", str(bert_dir), "--id-column", "id", "--pooling",
                    "cls"], capsys)
    assert err.startswith(f"output should be a new folder, or this same job's store to resume it, but got "
                          f"output={str(out)!r}: key should be the key the results at output_path=")
    assert "pooling=mean" in err and "pooling=cls" in err
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    assert "holding 1 other entries (todo.txt)" in _refused(
        ["embed", str(corpus), str(tmp_path / "notes"), "--model", str(bert_dir)], capsys)


def test_a_max_length_above_the_models_positions_is_refused(bert_dir, corpus, tmp_path, capsys, no_model_loads):
    assert _refused(["embed", str(corpus), str(tmp_path / "out"), "--model", str(bert_dir), "--max-length", "100"],
                    capsys) == "--max-length should be at most the model's max_position_embeddings=64, but got " \
                               "--max-length=100"


def test_a_bad_input_from_the_console_is_one_line_and_exit_status_2(cli, tmp_path):
    import subprocess

    done = subprocess.run([*cli, "embed", str(tmp_path / "missing.parquet"), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr == (f"dynabatch embed: error: input should be an existing file, folder or glob, but got "
                           f"input={str(tmp_path / 'missing.parquet')!r}\n")
