"""dynabatch embed: a corpus in, each text's own vector out, into a store that a killed run resumes."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
import torch

from dynabatch.cli import main

# Loaded by the command's process: every shard the second of two workers writes fails (a full disk), persistently.
WRITES_FAIL_HOOK = '''
import errno
import os

from dynabatch.inference import store_shards, store_writer

store_writer.COMMIT = store_writer.CommitPolicy(rows=8)
store_shards.RETRY_SECONDS = 0.0  # the retries' waits are store_shards.py's tests' concern
_replace = os.replace


def _failing(src, dst, *args, **kwargs):
    if "rank0.1-" in os.path.basename(os.fspath(dst)):
        raise OSError(errno.ENOSPC, "No space left on device", os.fspath(dst))
    return _replace(src, dst, *args, **kwargs)


os.replace = _failing
'''

# Loaded by the command's process: the model raises ERROR on any batch holding the token POISON.
POISON_HOOK = '''
import functools

import transformers.models.bert.modeling_bert as bert

_forward = bert.BertModel.forward


@functools.wraps(_forward)
def _poisoned(self, input_ids=None, *args, **kwargs):
    if input_ids is not None and bool((input_ids == POISON).any()):
        raise ERROR("cannot process this input")
    return _forward(self, input_ids, *args, **kwargs)


bert.BertModel.forward = _poisoned
'''


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
    assert f"{len(texts)} of {len(texts)} texts stored in {out} ({len(texts) - before} run now, {before} stored " \
           "before)" in again
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


def test_a_csv_is_read_as_a_table_never_as_lines_of_text(bert_dir, texts, tmp_path, cli, run_command):
    import csv

    rows, ids = list(texts[:12]), [f"doc-{i}" for i in range(12)]
    rows[3] = 'He said, "Let there be light"\nand there was light'  # a comma, quotes and a line break, quoted
    with open(tmp_path / "docs.csv", "w", newline="", encoding="utf-8") as file:
        csv.writer(file).writerows([("id", "text"), *zip(ids, rows)])
    out = tmp_path / "store"
    done = run_command([*cli, "embed", str(tmp_path / "docs.csv"), str(out), "--model", str(bert_dir), "--id-column",
                        "id", "--no-progress"])
    assert f"12 of 12 texts stored in {out} (12 run now, 0 stored before)" in done.stdout
    _check_every_id_once(out, ids, _alone(bert_dir, rows))  # the header and raw lines are no documents


def test_a_gzipped_jsonl_of_date_ids_stores_each_row_under_its_own_id(bert_dir, texts, tmp_path, capsys):
    # a docs.jsonl.gz was refused as a file of no known format, and ids that look like dates as timestamp[s]; the
    # blank lines and the byte order mark are no rows and no part of a text
    import gzip

    rows, ids = list(texts[:10]), [f"2024-01-{day:02d}" for day in range(1, 11)]
    lines = [json.dumps({"id": i, "text": t}) for i, t in zip(ids, rows)]
    lines.insert(4, "")
    (tmp_path / "docs.jsonl.gz").write_bytes(gzip.compress(("\ufeff" + "\r\n".join(lines) + "\r\n\r\n").encode()))
    out = tmp_path / "store"
    assert main(["embed", str(tmp_path / "docs.jsonl.gz"), str(out), "--model", str(bert_dir), "--id-column", "id",
                 "--no-progress"]) == 0
    assert f"10 of 10 texts stored in {out}" in capsys.readouterr().out
    _check_every_id_once(out, ids, _alone(bert_dir, rows))


def test_a_store_inside_its_corpus_folder_is_never_read_as_corpus(bert_dir, texts, tmp_path, cli, write_corpus,
                                                                 capsys, run_command):
    ids = [f"doc-{i}" for i in range(24)]
    corpus = write_corpus(tmp_path, texts[:24], ids)
    command = ["embed", str(corpus), str(corpus / "emb"), "--model", str(bert_dir), "--id-column", "id",
               "--no-progress"]
    assert main(command) == 0
    again = run_command([*cli, *command]).stdout  # the documented rerun
    assert f"24 of 24 texts stored in {corpus / 'emb'} (0 run now, 24 stored before)" in again


def test_the_same_model_files_under_another_folder_resume_the_store(bert_dir, texts, tmp_path, cli, capsys,
                                                                    run_command):
    elsewhere = tmp_path / "elsewhere" / "model"
    shutil.copytree(bert_dir, elsewhere)
    (tmp_path / "docs.txt").write_text("\n".join(texts[:20]) + "\n", encoding="utf-8")
    out = tmp_path / "store"
    assert main(["embed", str(tmp_path / "docs.txt"), str(out), "--model", str(bert_dir), "--no-progress"]) == 0
    again = run_command([*cli, "embed", str(tmp_path / "docs.txt"), str(out), "--model", str(elsewhere),
                         "--no-progress"]).stdout
    assert f"20 of 20 texts stored in {out} (0 run now, 20 stored before)" in again
    assert "s in all; nothing to run: every one was stored before\n" in again  # no rate, padding, memory or bound
    assert not any(line.startswith(("  padding", "  memory", "  bound")) for line in again.splitlines())


def test_a_finished_jobs_rerun_loads_no_model_and_says_nothing_was_left(bert_dir, corpus, tmp_path, capsys, request):
    # it loaded the weights (seconds to minutes of a real model) to run no batch
    argv = ["embed", str(corpus), str(tmp_path / "out"), "--model", str(bert_dir), "--id-column", "id",
            "--no-progress"]
    assert main(argv) == 0
    capsys.readouterr()
    request.getfixturevalue("no_model_loads")
    assert main(argv) == 0
    assert "6 of 6 texts stored" in (said := capsys.readouterr().out) and "nothing to run: every one was stored" in said


def test_a_smaller_corpus_is_told_of_the_rows_of_other_inputs_its_store_holds(bert_dir, texts, tmp_path, capsys,
                                                                               write_corpus):
    ids = [f"doc-{i}" for i in range(12)]
    out, report = tmp_path / "store", tmp_path / "report.json"

    def embed(corpus):
        return main(["embed", str(corpus), str(out), "--model", str(bert_dir), "--id-column", "id", "--no-progress",
                     "--report", str(report)])

    (tmp_path / "all").mkdir(), (tmp_path / "part").mkdir()
    assert embed(write_corpus(tmp_path / "all", texts[:12], ids)) == 0
    assert "  others " not in capsys.readouterr().out and json.loads(report.read_text())["store"]["other_rows"] == 0
    assert embed(write_corpus(tmp_path / "part", texts[:8], ids[:8])) == 0
    shown = capsys.readouterr().out
    assert f"8 of 8 texts stored in {out} (0 run now, 8 stored before)" in shown
    assert "\n  others     4 rows stored besides one per input of this corpus" in shown  # read-it reads all 12
    assert ds.dataset(out).count_rows() == 12 and json.loads(report.read_text())["store"]["other_rows"] == 4


def _same_as_encode(folder, texts, out, max_length):
    """The stored vectors are ``model.encode``'s, on texts longer than the max length (cosine above 0.9999)."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device="cpu")
    assert model.max_seq_length == max_length
    assert min(len(model.tokenizer(t)["input_ids"]) for t in texts) > max_length  # every text is cut
    want = torch.nn.functional.normalize(torch.as_tensor(model.encode(texts)), dim=-1)
    stored = ds.dataset(out).to_table().sort_by("position").column("output").to_numpy(zero_copy_only=False)
    got = torch.nn.functional.normalize(torch.as_tensor(np.stack(stored)), dim=-1)
    assert (got * want).sum(-1).min() > 0.9999


@pytest.fixture(scope="module")
def long_texts(texts):
    """16 texts of more than 20 words: longer than a max length of 16 tokens."""
    return [t for t in texts if len(t.split()) > 20][:16]


@pytest.mark.slow
def test_a_sentence_transformers_6_folder_runs_at_the_length_sentence_transformers_runs_it(
        st_folder, long_texts, tmp_path, cli, run_command):
    folder = st_folder("6.2.0")  # keeps max_seq_length=16 as its tokenizer's model_max_length alone
    (tmp_path / "docs.txt").write_text("\n".join(long_texts) + "\n", encoding="utf-8")
    out = tmp_path / "store"
    done = run_command([*cli, "embed", str(tmp_path / "docs.txt"), str(out), "--model", str(folder), "--no-progress"])
    assert "(its sentence-transformers modules), float32, max length 16, on cpu" in done.stdout
    _same_as_encode(folder, long_texts, out, 16)


@pytest.mark.slow
@pytest.mark.parametrize("version", ["2.2.2", "3.0.1", "4.1.0", "5.0.0"])
def test_a_folder_saved_by_sentence_transformers_2_to_5_runs_as_sentence_transformers_runs_it(
        st_folder, long_texts, tmp_path, capsys, version):
    folder = st_folder(version)
    (tmp_path / "docs.txt").write_text("\n".join(long_texts) + "\n", encoding="utf-8")
    out = tmp_path / "store"
    assert main(["embed", str(tmp_path / "docs.txt"), str(out), "--model", str(folder), "--no-progress"]) == 0
    assert "(its sentence-transformers modules), float32, max length 16, on cpu" in capsys.readouterr().out
    _same_as_encode(folder, long_texts, out, 16)


def test_a_folder_whose_transformer_cuts_at_its_own_max_length_runs_at_it_and_max_length_applies_to_it(
        bert_dir, long_texts, tmp_path, capsys):
    # its Transformer's processing_kwargs cut at 40 where max_seq_length is 16: the command planned for 16 and the
    # loader refused every longer row; and --max-length set max_seq_length alone, which preprocess does not apply
    # over the Transformer's own max_length: --max-length 12 stored the vectors cut at 40
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    folder = tmp_path / "model"
    body = Transformer(str(bert_dir), max_seq_length=16, processing_kwargs={"text": {"max_length": 40}})
    SentenceTransformer(modules=[body, Pooling(32, pooling_mode="mean")], device="cpu").save(str(folder))
    model = SentenceTransformer(str(folder), device="cpu")
    (tmp_path / "docs.txt").write_text("\n".join(long_texts) + "\n", encoding="utf-8")
    for length, call in ((None, {}), (12, {"processing_kwargs": {"text": {"max_length": 12}}})):
        out = tmp_path / f"store-{length}"
        flags = [] if length is None else ["--max-length", str(length)]
        capsys.readouterr()
        assert main(["embed", str(tmp_path / "docs.txt"), str(out), "--model", str(folder), "--no-progress",
                     *flags]) == 0
        assert f"float32, max length {length or 40}, on cpu" in capsys.readouterr().out
        want = model.encode(long_texts, **call)
        stored = ds.dataset(out).to_table().sort_by("position").column("output").to_numpy(zero_copy_only=False)
        assert np.abs(np.stack(stored) - want).max() < 1e-5, length


def test_a_folder_of_no_length_limit_runs_at_max_length_and_without_it_is_refused_naming_it(
        tokenizer, long_texts, tmp_path, capsys, monkeypatch):
    # a relative-position encoder (T5's: no positions in its config) whose tokenizer sets no model_max_length: the
    # model's own limit was read before --max-length was applied, so '--max-length 12' was refused, naming
    # model.max_seq_length
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling
    from transformers import T5Config, T5EncoderModel

    encoder, folder = tmp_path / "t5", tmp_path / "model"
    with torch.random.fork_rng():
        torch.manual_seed(0)
        T5EncoderModel(T5Config(vocab_size=len(tokenizer), d_model=32, d_kv=16, d_ff=64, num_layers=2,
                                num_heads=2)).save_pretrained(encoder)
    unlimited = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)  # the shared one stays as it is
    unlimited.model_max_length = int(1e30)
    unlimited.save_pretrained(encoder)
    SentenceTransformer(modules=[Transformer(str(encoder)), Pooling(32, pooling_mode="mean")],
                        device="cpu").save(str(folder))
    model = SentenceTransformer(str(folder), device="cpu")
    assert model.max_seq_length > 10**9  # no limit of its own
    (tmp_path / "docs.txt").write_text("\n".join(long_texts) + "\n", encoding="utf-8")
    argv = ["embed", str(tmp_path / "docs.txt"), "--model", str(folder), "--no-progress"]
    import dynabatch.memory.calibrate as calibrate

    checked, check_positions = [], calibrate.check_positions
    monkeypatch.setattr(calibrate, "check_positions", lambda config, length, *a, **k: (
        checked.append(length), check_positions(config, length, *a, **k))[1])
    assert main([*argv, str(tmp_path / "store"), "--max-length", "12"]) == 0
    assert "float32, max length 12, on cpu" in capsys.readouterr().out
    assert checked == [12]  # a given --max-length is checked against the positions once, before the model is cut
    model.max_seq_length = 12
    want = model.encode(long_texts)
    stored = ds.dataset(tmp_path / "store").to_table().sort_by("position").column("output").to_numpy(
        zero_copy_only=False)
    assert np.abs(np.stack(stored) - want).max() < 1e-5
    assert _refused([*argv, str(tmp_path / "refused")], capsys).startswith(
        "--max-length should be given: the model's folder, config and tokenizer set no length limit")


def test_a_worker_whose_writes_fail_ends_the_job_non_zero_naming_what_is_missing(
        bert_dir, texts, tmp_path, cli, write_corpus, run_command):
    rows, ids = texts[:48], [f"doc-{i}" for i in range(48)]
    corpus, out = write_corpus(tmp_path, rows, ids), tmp_path / "store"
    command = [*cli, "embed", str(corpus), str(out), "--model", str(bert_dir), "--id-column", "id", "--devices",
               "cpu,cpu", "--batch-size", "4", "--no-progress"]
    failed = run_command(command, hook=WRITES_FAIL_HOOK, hook_in=tmp_path / "hook", status=1)
    said = re.search(r"(\d+) of 48 texts stored in", failed.stdout + failed.stderr)
    stored = len(_store(out)[0]) if list(out.glob("part-*.parquet")) else 0  # the failure may come first
    assert said is not None and int(said.group(1)) == stored < 48, failed.stdout + failed.stderr
    assert f"{48 - stored} of 48 texts are neither stored nor listed failed (ids 'doc-" in failed.stderr
    again = run_command(command).stdout
    assert f"48 of 48 texts stored in {out} ({48 - stored} run now, {stored} stored before)" in again
    _check_every_id_once(out, ids, _alone(bert_dir, rows))


def test_a_poison_text_is_named_or_set_aside_with_on_error_skip_and_a_rerun_retries_it(
        bert_dir, tokenizer, texts, tmp_path, cli, write_corpus, run_command):
    rows, ids = list(texts[:30]), [f"doc-{i}" for i in range(30)]
    rows[7] = "the zebra"
    corpus, out, report = write_corpus(tmp_path, rows, ids), tmp_path / "store", tmp_path / "report.json"
    command = [*cli, "embed", str(corpus), str(out), "--model", str(bert_dir), "--id-column", "id", "--batch-size",
               "4", "--no-progress"]
    hook = POISON_HOOK.replace("POISON", str(tokenizer.convert_tokens_to_ids("zebra")))
    stopped = run_command(command, hook=hook.replace("ERROR", "ValueError"), hook_in=tmp_path / "hook",
                          status=2).stderr  # a refusal of the input: one line
    assert "Traceback" not in stopped and "--on-error skip" in stopped
    assert re.search(r"error: cannot process this input \(.*input position 7 \(id doc-7\), alone", stopped), stopped
    hook = hook.replace("ERROR", "RuntimeError")  # the model failing: its traceback, exit status 1
    crashed = run_command([*command[:-2], "24", "--no-progress"], hook=hook, hook_in=tmp_path / "hook",
                          status=1).stderr  # a batch of 24 rows split down to the text
    assert re.search(r"the run stopped \(RuntimeError: cannot process this input \(.*input position 7 \(id doc-7\), "
                     r"alone .*--on-error skip", crashed), crashed
    skipped = run_command([*command, "--on-error", "skip", "--report", str(report)], hook=hook,
                          hook_in=tmp_path / "hook").stdout
    assert f"29 of 30 texts stored in {out}" in skipped and "'doc-7': " in skipped
    assert f"each with its cause in {report}; the same command again retries them" in skipped
    failures = json.loads(report.read_text())["store"]["failed"]
    assert [(f["id"], f["position"]) for f in failures] == [("doc-7", 7)]
    assert "cannot process this input" in failures[0]["cause"]
    again = run_command(command).stdout  # the model no longer raises: the text set aside is retried
    assert f"30 of 30 texts stored in {out} (1 run now, 29 stored before)" in again


def test_the_summarys_read_it_line_reads_a_position_keyed_store_in_input_order(bert_dir, texts, tmp_path, capsys):
    # the line read the rows in the order they were stored (longest texts first), which it did not say: a user's
    # np.stack of its vectors gave them out of input order
    import pyarrow

    (tmp_path / "docs.txt").write_text("\n".join(texts[:40]) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    assert main(["embed", str(tmp_path / "docs.txt"), str(out), "--model", str(bert_dir), "--no-progress"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("  read it"))
    table = eval(line.removeprefix("  read it").strip().split("  (")[0], {"pyarrow": pyarrow})  # as the line says
    assert table.column("position").to_pylist() == list(range(40)) and "(input order;" in line


def test_the_summary_says_where_each_failed_input_is_listed_with_its_cause():
    # it said "each with its cause in --report" of a run given no --report
    from dynabatch.cli import job
    from dynabatch.cli.output import Tally

    tally = Tally(n=3, stored=2, before=0, now=2, failures={1: "ValueError: no"}, missing=np.zeros(0, np.int64))
    shown = {"output": "out", "what": "texts", "model": "m", "place": job.Placement(0, 1, [torch.device("cpu")]),
             "seconds": 1.0, "columns": ["position", "output"]}
    failed = job.summary("embed", None, tally, **shown).splitlines()[-1]
    assert failed == ("  failed     1 texts listed failed (1: ValueError: no): --report FILE lists each with its "
                      "cause; the same command again retries them")
    failed = job.summary("embed", None, tally, **shown, report_path=Path("r.json")).splitlines()[-1]
    assert "(1: ValueError: no): each with its cause in r.json; the same" in failed


@pytest.mark.slow
def test_a_second_job_on_a_store_a_live_job_writes_refuses_at_once_naming_it(
        bert_dir, texts, tmp_path, cli, write_corpus, kill_after_first_shard, run_command):
    ids = [f"doc-{i}" for i in range(len(texts))]
    corpus, out = write_corpus(tmp_path, texts, ids), tmp_path / "store"
    command = [*cli, "embed", str(corpus), str(out), "--model", str(bert_dir), "--id-column", "id", "--batch-size",
               "4", "--no-progress"]
    refused = []
    kill_after_first_shard(command, out, tmp_path / "hook",
                           while_stalled=lambda: refused.append(run_command(command, status=2).stderr))
    assert len(refused[0].strip().splitlines()) == 1, refused[0]
    assert "output should be a store no other job is writing" in refused[0] and socket.gethostname() in refused[0]
    again = run_command(command).stdout  # the killed job's lock never blocks the rerun
    assert f"120 of 120 texts stored in {out}" in again
    _check_every_id_once(out, ids, _alone(bert_dir, texts))


# -- bad input: one line on stderr, exit status 2, before any model loads ------------------------------------------


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
    assert err == (f"output should be a new folder, or the store of this same job to resume it, but got "
                   f"output={str(out)!r} holding rows computed otherwise (pooling=mean there, pooling=cls here): use "
                   f"another output folder for this job, or delete {str(out)!r} to compute it again")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    assert "holding 1 other entries (todo.txt)" in _refused(
        ["embed", str(corpus), str(tmp_path / "notes"), "--model", str(bert_dir)], capsys)


def _between_sampled_blocks(size, block=64 * 1024, blocks=16):
    """A byte the earlier model identity never read: the middle of the gap after the 8th of its 16 sampled blocks."""
    starts = np.linspace(0, size - block, blocks).astype(np.int64)
    return int(starts[7] + block + (starts[8] - starts[7] - block) // 2)


def test_weights_saved_over_with_one_byte_changed_are_another_model_refused_on_a_rerun(
        bert_dir, corpus, tmp_path, capsys, no_model_loads, monkeypatch):
    model, out = tmp_path / "model", tmp_path / "out"
    shutil.copytree(bert_dir, model)
    argv = ["embed", str(corpus), str(out), "--model", str(model), "--id-column", "id", "--no-progress"]
    monkeypatch.undo()  # the first job loads its model
    assert main(argv) == 0
    capsys.readouterr()
    import transformers

    monkeypatch.setattr(transformers.AutoModel, "from_pretrained", lambda *a, **k: pytest.fail("a model loaded"))
    weights = model / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[_between_sampled_blocks(len(data))] ^= 1  # a fine-tune saved over it: same size, same header
    weights.write_bytes(bytes(data))
    err, where = _refused(argv, capsys), re.escape(repr(str(out)))
    assert re.fullmatch(
        rf"output should be a new folder, or the store of this same job to resume it, but got output={where} "
        r"holding rows computed otherwise \(model files of digest v2\.[0-9a-f]{16} there, v2\.[0-9a-f]{16} here "
        rf"\(--model\)\): use another output folder for this job, or delete {where} to compute it again", err), err


def test_a_module_folder_linked_into_the_model_is_part_of_its_identity_so_its_changed_weights_are_refused(
        st_model_folder, corpus, tmp_path, capsys):
    # the identity walked the folder without following linked folders: a Dense module linked from where it was
    # trained was never read, and its weights saved over resumed the store with other vectors
    from safetensors.torch import load_file, save_file

    model, out, dense = tmp_path / "model", tmp_path / "out", tmp_path / "dense"
    shutil.copytree(st_model_folder(dense=True), model)
    (linked,) = model.glob("*_Dense")
    shutil.move(linked, dense)
    linked.symlink_to(dense, target_is_directory=True)
    argv = ["embed", str(corpus), str(out), "--model", str(model), "--id-column", "id", "--no-progress"]
    assert main(argv) == 0
    capsys.readouterr()
    (weights,) = dense.glob("*.safetensors")
    tensors = load_file(weights)
    save_file({name: tensor * 2 for name, tensor in tensors.items()}, weights)
    assert re.search(r"holding rows computed otherwise \(model files of digest v2\.[0-9a-f]{16} there, "
                     r"v2\.[0-9a-f]{16} here \(--model\)\)", _refused(argv, capsys))


def test_a_store_keyed_by_the_earlier_sampled_identity_is_refused_saying_how_to_go_on(
        bert_dir, corpus, tmp_path, capsys, monkeypatch):
    from dynabatch.cli import job

    out = tmp_path / "out"
    argv = ["embed", str(corpus), str(out), "--model", str(bert_dir), "--id-column", "id", "--no-progress"]
    with monkeypatch.context() as earlier:
        earlier.setattr(job, "model_digest", lambda folder: "0123456789abcdef")  # how keys were written before
        assert main(argv) == 0
    capsys.readouterr()
    here = job.model_digest(str(bert_dir))
    assert _refused(argv, capsys) == (
        f"output should be a new folder, or the store of this same job to resume it, but got output={str(out)!r} "
        f"holding rows computed otherwise (model files of digest 0123456789abcdef there, {here}"
        " here (--model): the store was written by an earlier dynabatch whose model identity sampled the weights, so "
        "whether its rows come from these files cannot be told): use another output folder for this job, or delete "
        f"{str(out)!r} to compute it again")


def test_the_models_default_prompt_named_or_given_resumes_its_store_and_another_prompt_is_refused(
        st_model_folder, corpus, tmp_path, capsys):
    # the key held the flag as given: no --prompt-name (the model's default, query) and --prompt-name query were two
    # jobs, though the same prompt computed the rows; it holds the prompt applied
    folder = st_model_folder(prompts={"query": "query: ", "passage": "passage: "}, default_prompt_name="query")
    out = tmp_path / "out"
    argv = ["embed", str(corpus), str(out), "--model", str(folder), "--id-column", "id", "--no-progress"]
    assert main(argv) == 0
    for same in (["--prompt-name", "query"], ["--prompt", "query: "]):
        capsys.readouterr()
        assert main([*argv, *same]) == 0
        assert f"6 of 6 texts stored in {out} (0 run now, 6 stored before)" in capsys.readouterr().out
    assert _refused([*argv, "--prompt-name", "passage"], capsys) == (
        f"output should be a new folder, or the store of this same job to resume it, but got output={str(out)!r} "
        'holding rows computed otherwise (prompt="query: " there, prompt="passage: " here): use another output folder '
        f"for this job, or delete {str(out)!r} to compute it again")


def _unmarked_key(command, model_folder, **settings):
    """A job key as dynabatch wrote it before keys said their form (no key_form)."""
    from dynabatch.cli import job

    return f"{command} model={job.model_digest(model_folder)} " + " ".join(f"{k}={v}" for k, v in settings.items())


def test_a_store_keyed_in_the_earlier_form_is_refused_saying_so_and_this_forms_unmarked_store_resumes(
        st_model_folder, texts, write_corpus, tmp_path, capsys, monkeypatch):
    # the key changed form (the prompt's text, where it held --prompt-name as typed) and said nothing of it: the
    # previous release's store was refused as "holding rows computed otherwise" alone, the cause untold
    from dynabatch.cli import job

    folder = st_model_folder(prompts={"query": "query: "}, default_prompt_name="query")
    corpus, out = write_corpus(tmp_path, texts[:6], [f"d{i}" for i in range(6)]), tmp_path / "out"
    argv = ["embed", str(corpus), str(out), "--model", str(folder), "--id-column", "id", "--no-progress"]
    with monkeypatch.context() as earlier:  # the previous release's key of --prompt-name query
        earlier.setattr(job, "job_key", lambda *a, **settings: _unmarked_key(*a, **{**settings, "prompt": "query"}))
        assert main([*argv, "--prompt-name", "query"]) == 0
    capsys.readouterr()
    assert _refused([*argv, "--prompt-name", "query"], capsys) == (
        f"output should be a new folder, or the store of this same job to resume it, but got output={str(out)!r} "
        "written by an earlier dynabatch, whose job key had another form (no key_form there, key_form=2 here: a key of "
        "an earlier form may hold the prompt and the generation settings as the flags were typed, not as applied), "
        'its key differing (prompt=query there, prompt="query: " here): use another output folder for this job, or '
        "resume the store with the dynabatch version that wrote it")
    # a store of this form written before keys said so (no key_form), a part of the corpus: resumed and completed
    shutil.rmtree(out)
    (tmp_path / "few").mkdir()
    few = write_corpus(tmp_path / "few", texts[:3], [f"d{i}" for i in range(3)])
    with monkeypatch.context() as unmarked:
        unmarked.setattr(job, "job_key", _unmarked_key)
        assert main(["embed", str(few), *argv[2:]]) == 0
    capsys.readouterr()
    assert main(argv) == 0
    assert f"6 of 6 texts stored in {out} (3 run now, 3 stored before)" in capsys.readouterr().out
    assert main(argv) == 0
    assert f"6 of 6 texts stored in {out} (0 run now, 6 stored before)" in capsys.readouterr().out


def test_a_max_length_above_the_models_positions_is_refused(bert_dir, corpus, tmp_path, capsys, no_model_loads):
    assert _refused(["embed", str(corpus), str(tmp_path / "out"), "--model", str(bert_dir), "--max-length", "100"],
                    capsys) == "--max-length should be at most the model's max_position_embeddings=64, but got " \
                               "--max-length=100"


@pytest.fixture()
def prompted_folder(st_model_folder):
    """A sentence-transformers folder with a prompt (made before ``no_model_loads``)."""
    return st_model_folder(max_seq_length=16, prompts={"query": "query: "})


def test_a_max_length_holding_no_token_of_a_text_is_refused_for_a_sentence_transformers_folder_too(
        bert_dir, prompted_folder, corpus, tmp_path, capsys, no_model_loads):
    # sentence-transformers cut every text to [CLS] [SEP] (or to the prompt): every vector the same, and 1 failed
    # in the run's planner ("lengths should be at most max_input_token_length=1")
    folder = prompted_folder
    base = ["embed", str(corpus), str(tmp_path / "out"), "--model", str(folder)]
    for length in ("1", "2"):
        assert _refused([*base, "--max-length", length], capsys) == (
            "--max-length should be at least 3 (the model's tokenization adds 2 tokens to every text: its special "
            f"tokens), but got --max-length={length}")
    assert _refused([*base, "--prompt-name", "query", "--max-length", "4"], capsys) == (
        "--max-length should be at least 5 (the model's tokenization adds 4 tokens to every text: its special tokens "
        "and the prompt), but got --max-length=4")
    # a transformers folder: refused by the loader, once the weights had loaded
    assert _refused([*base[:-1], str(bert_dir), "--max-length", "2"], capsys) == (
        "--max-length should be at least 3 (the tokenizer adds 2 special tokens to every text), but got --max-length=2")


def test_an_empty_text_of_no_token_is_refused_naming_its_row_and_id_before_the_weights_load(
        no_bos_llama_dir, bert_dir, tmp_path, capsys, write_corpus, no_model_loads):
    # the stream found it only when its chunk (the shortest texts: the last) was tokenized: most of the corpus ran
    # and was stored, then exit status 2 naming texts[i] and on_bad_input='skip', no flag of the command
    docs = ["In the beginning", "", "   ", "God created", ""]
    corpus = write_corpus(tmp_path, docs, [f"d{i}" for i in range(5)])
    base = ["embed", str(corpus), str(tmp_path / "out"), "--model", str(no_bos_llama_dir)]
    rule = ("--text-column should name a column of texts that each hold a token once tokenized (the model's tokenizer "
            "adds no special token to a text: an empty one would be padding alone), but got --text-column='text' with "
            "2 texts of no token (empty, or of characters its tokenizer drops: whitespace, control, zero-width), at "
            "rows 1, 4")
    assert _refused([*base, "--id-column", "id"], capsys) == f"{rule} (--id-column 'd1', 'd4'): fill or drop them"
    assert _refused(base, capsys) == f"{rule}: fill or drop them"  # "   " is a token of this tokenizer: kept
    assert not (tmp_path / "out").exists()
    from transformers import AutoTokenizer

    from dynabatch.cli.job import check_tokens
    from dynabatch.data.text_source import source_of

    # a tokenizer adding special tokens ([CLS] [SEP]) to every text gives an empty one tokens: none is refused
    assert check_tokens(source_of(iter(docs)), AutoTokenizer.from_pretrained(bert_dir), 64, None, "--text-column",
                        "text") is None


def test_a_text_its_tokenizer_strips_to_nothing_is_refused_before_the_weights_load(
        no_special_bert_dir, tmp_path, capsys, write_corpus, no_model_loads):
    # BERT's normalizer drops control, zero-width (format) and combining characters: with no special token added,
    # these texts are no token, which only the empty and whitespace-only candidates missed (found mid-run, streamed)
    from transformers import AutoTokenizer

    stripped = ["\u200b", "\ufeff\x01\x7f", "\u0301\u00a0\u3000", "\ufffd\u2028"]
    docs = ["In the beginning", *stripped, "e\u0301", "God created"]
    loader_tokenizer = AutoTokenizer.from_pretrained(no_special_bert_dir)  # as the CLI reads it, called as the loader
    assert [len(ids) for ids in loader_tokenizer(docs)["input_ids"]] == [3, 0, 0, 0, 0, 1, 2]
    corpus = write_corpus(tmp_path, docs, [f"d{i}" for i in range(len(docs))])
    argv = ["embed", str(corpus), str(tmp_path / "out"), "--model", str(no_special_bert_dir), "--id-column", "id"]
    assert _refused(argv, capsys) == (
        "--text-column should name a column of texts that each hold a token once tokenized (the model's tokenizer "
        "adds no special token to a text: an empty one would be padding alone), but got --text-column='text' with 4 "
        "texts of no token (empty, or of characters its tokenizer drops: whitespace, control, zero-width), at rows "
        "1, 2, 3, 4 (--id-column 'd1', 'd2', 'd3', 'd4'): fill or drop them")
    assert not (tmp_path / "out").exists()


def test_a_bad_input_from_the_console_is_one_line_and_exit_status_2(cli, tmp_path):
    import subprocess

    done = subprocess.run([*cli, "embed", str(tmp_path / "missing.parquet"), str(tmp_path / "out")], check=False,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr == (f"dynabatch embed: error: input should be an existing file, folder or glob, but got "
                           f"input={str(tmp_path / 'missing.parquet')!r}\n")


def test_an_unknown_suffix_is_refused_naming_the_formats(bert_dir, tmp_path, capsys, no_model_loads):
    (tmp_path / "docs.dat").write_text("id,text\n1,hello world\n")
    err = _refused(["embed", str(tmp_path / "docs.dat"), str(tmp_path / "out"), "--model", str(bert_dir)], capsys)
    assert err.startswith("input should be a file whose suffix names its format, or given --format parquet, csv, tsv, "
                          "jsonl, arrow, text (one document a line) or datasets; suffixes .parquet, .csv, .tsv")
    assert not (tmp_path / "out").exists()


def test_a_corpus_file_lacking_the_text_column_is_named(bert_dir, corpus, tmp_path, capsys, no_model_loads):
    pq.write_table(pa.table({"id": ["d9"]}), corpus / "part-2.parquet")
    assert _refused(["embed", str(corpus), str(tmp_path / "out"), "--model", str(bert_dir), "--id-column", "id"],
                    capsys) == (f"--text-column should be a column of every file of the input "
                                f"({str(corpus / 'part-2.parquet')!r} lacks it; its columns: ['id']), but got "
                                "--text-column='text'")


@pytest.fixture()
def unwritable(tmp_path):
    """A folder this user cannot write: read-only for a user, sysfs for root (whom file modes do not stop)."""
    if os.geteuid() != 0:
        folder = tmp_path / "read-only"
        folder.mkdir()
        folder.chmod(0o555)
        yield folder
        folder.chmod(0o755)
    elif Path("/sys/kernel").is_dir():
        yield Path("/sys")
    else:
        pytest.skip("root, and no sysfs: no folder root cannot write")


def test_an_output_folder_this_user_cannot_write_is_one_line_before_any_model_loads(
        bert_dir, corpus, unwritable, tmp_path, capsys, cli, no_model_loads):
    err = _refused(["embed", str(corpus), str(unwritable), "--model", str(bert_dir)], capsys)
    assert err.startswith(f"output should be a folder this user can write, but got output={str(unwritable)!r}: ")
    below = unwritable / "store"
    err = _refused(["embed", str(corpus), str(below), "--model", str(bert_dir)], capsys)
    assert err.startswith(f"output should be a folder this user can make, but got output={str(below)!r}: ")
    import subprocess

    done = subprocess.run([*cli, "embed", str(corpus), str(below), "--model", str(bert_dir)], check=False,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr


def test_a_new_output_folder_is_taken_back_when_a_later_check_fails(bert_dir, corpus, tmp_path, capsys,
                                                                    no_model_loads):
    out = tmp_path / "new" / "store"
    assert _refused(["embed", str(corpus), str(out), "--model", str(bert_dir), "--max-length", "100"],
                    capsys).startswith("--max-length should be at most the model's max_position_embeddings=64")
    assert not (tmp_path / "new").exists()


def test_a_rerun_on_another_text_column_under_the_stored_ids_is_refused_before_the_weights_load(
        bert_dir, texts, tmp_path, capsys, monkeypatch):
    # the stored rows' input hashes told it only once the run began: after the model had loaded
    (tmp_path / "corpus").mkdir()
    ids = [f"d{i}" for i in range(6)]
    pq.write_table(pa.table({"id": ids, "text": texts[:6], "title": texts[6:12]}), tmp_path / "corpus" / "a.parquet")
    out = tmp_path / "out"
    argv = ["embed", str(tmp_path / "corpus"), str(out), "--model", str(bert_dir), "--id-column", "id", "--no-progress"]
    assert main([*argv, "--text-column", "text"]) == 0
    capsys.readouterr()
    import transformers

    monkeypatch.setattr(transformers.AutoModel, "from_pretrained", lambda *a, **k: pytest.fail("a model loaded"))
    err = _refused([*argv, "--text-column", "title"], capsys)
    assert err.startswith(f"output={str(out)!r} should hold results of these inputs at their ids, but got 6 stored "
                          "rows computed from other inputs (ids d0, d1, d2, d3, d4, ...): the texts, their order, the "
                          "tokenizer or its settings differ from the run that stored them (key='embed key_form=2 model="), err
    assert err.endswith("); use another output folder"), err


def test_a_rerun_on_other_texts_at_the_stored_positions_is_one_line_naming_output_and_id_column(
        bert_dir, texts, tmp_path, capsys):
    # the store's own words named the library's output_path and "give the loader ids=", which the command has not
    docs, out = tmp_path / "docs.txt", tmp_path / "out"
    docs.write_text("\n".join(texts[:4]) + "\n", encoding="utf-8")
    argv = ["embed", str(docs), str(out), "--model", str(bert_dir), "--no-progress"]
    assert main(argv) == 0
    docs.write_text("\n".join([texts[10], *texts[:4]]) + "\n", encoding="utf-8")  # a line put first
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(argv)  # refused before the model loads (job.check_stored_inputs)
    lines = [line for line in re.split(r"[\r\n]+", capsys.readouterr().err) if line and "Loading weights" not in line]
    assert info.value.code == 2 and len(lines) == 1, lines
    line = lines[0].removeprefix("dynabatch embed: error: ")
    assert line.startswith(f"output={str(out)!r} should hold results of these inputs at their positions, but got "), line
    assert line.endswith("; use another output folder (with --id-column, a grown or reordered corpus reruns only its "
                         "new ids)"), line
    assert "output_path" not in line and "loader" not in line, line


@pytest.fixture()
def other_kinds(bert_dir, tmp_path_factory):
    """Folders sentence-transformers saves that are no ``SentenceTransformer``: ``{kind: folder}`` of a SparseEncoder,
    a CrossEncoder, a MultiVectorEncoder, and a SentenceTransformer whose first module is a query/document Router
    (made before ``no_model_loads``)."""
    from sentence_transformers import CrossEncoder, MultiVectorEncoder, SentenceTransformer, SparseEncoder
    from sentence_transformers.base.modules import Router, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling
    from sentence_transformers.sparse_encoder.modules import SpladePooling

    def route(pooling):
        return [Transformer(str(bert_dir), max_seq_length=16), Pooling(32, pooling_mode=pooling)]

    models = {"SparseEncoder": SparseEncoder(modules=[Transformer(str(bert_dir), transformer_task="fill-mask"),
                                                      SpladePooling("max")], device="cpu"),
              "CrossEncoder": CrossEncoder(str(bert_dir), num_labels=1, device="cpu"),
              "MultiVectorEncoder": MultiVectorEncoder(modules=[Transformer(str(bert_dir))], device="cpu"),
              "Router": SentenceTransformer(modules=[Router.for_query_document(route("mean"), route("cls"))],
                                            device="cpu")}
    folders = {}
    for kind, model in models.items():
        folders[kind] = tmp_path_factory.mktemp(kind.lower()) / "model"
        model.save(str(folders[kind]))
    return folders


def test_a_sentence_transformers_folder_of_another_kind_or_a_router_first_is_refused_before_any_weights_load(
        other_kinds, corpus, tmp_path, capsys, no_model_loads):
    # SentenceTransformer(folder) converted the first three with a warning (their transformer and a mean pooling: the
    # sparse head, the classifier dropped) and the command stored those vectors; a Router first was told to be "a
    # Hugging Face model folder (with a config.json)"
    for kind, method in (("SparseEncoder", "encode"), ("CrossEncoder", "predict or .rank"),
                         ("MultiVectorEncoder", "encode")):
        folder = str(other_kinds[kind])
        assert _refused(["embed", str(corpus), str(tmp_path / "out"), "--model", folder], capsys) == (
            f"--model should be a SentenceTransformer folder (or be given --pooling mean, cls or last to pool its "
            f"transformer's outputs), but got --model={folder!r}, a {kind} (the model_type of its "
            f"config_sentence_transformers.json): call sentence_transformers.{kind}(folder).{method} for it")
    folder = str(other_kinds["Router"])
    assert _refused(["embed", str(corpus), str(tmp_path / "out"), "--model", folder], capsys) == (
        f"--model should be a sentence-transformers folder whose first module is a Transformer, but got "
        f"--model={folder!r}, whose first module is a Router (a route per task, such as query and document, which "
        "the command does not choose): call model.encode_query or model.encode_document for it")
    assert not (tmp_path / "out").exists()
