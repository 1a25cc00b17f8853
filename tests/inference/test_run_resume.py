"""``run`` with ``output_path``: resuming from the Parquet results store, keys, ids, crashes, refusals.

Models are real (see conftest.py); nothing of dynabatch is mocked.
"""

import os
import signal
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pyarrow.dataset as ds
import pytest
import torch
from runner_helpers import MAX_LEN, _fails_at, _lengths, _load

from dynabatch import BatchOutOfMemoryError, PerRow, run
from dynabatch.inference.store_writer import CommitPolicy

pytestmark = pytest.mark.usefixtures("one_thread")


def _summary(batch):
    """A dict per row: real tokens (int64) and the mean real token id (float32)."""
    mask = batch["attention_mask"]
    return {"length": mask.sum(1), "mean_id": (batch["input_ids"] * mask).sum(1) / mask.sum(1)}


def _stored(path, column="position"):
    return ds.dataset(path).to_table(columns=[column]).column(column).to_pylist()


def _shards(path):
    return sorted(name for name in os.listdir(path) if name.endswith(".parquet"))


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for key in x:
            assert x[key].dtype == y[key].dtype and torch.equal(x[key], y[key]), key


@pytest.fixture
def small_shards(monkeypatch):
    """Shards of at most 8 rows, so that a run commits several."""
    monkeypatch.setattr("dynabatch.inference.store_writer.COMMIT", CommitPolicy(rows=8))


_KILLED_RUN = """
import os, signal, sys
os.environ["HF_HUB_OFFLINE"] = "1"
import torch
from transformers import AutoTokenizer
import dynabatch.inference.store_writer
from dynabatch import build_dynamic_batch_dataloader, run
from dynabatch.demo import kjv_passages, minilm_path

torch.set_num_threads(1)
# several shards commit before the kill
dynabatch.inference.store_writer.COMMIT = dynabatch.inference.store_writer.CommitPolicy(rows=16)
tokenizer = AutoTokenizer.from_pretrained(minilm_path())
loader = build_dynamic_batch_dataloader(kjv_passages()[300:600], tokenizer, batch_size=8, max_input_token_length=32,
                                        num_workers=0, progress=False)
calls = []

def lengths(batch):
    calls.append(1)
    if len(calls) == 9:
        os.kill(os.getpid(), signal.SIGKILL)  # killed mid-run, rows buffered, as by the OOM killer
    mask = batch["attention_mask"]
    return torch.stack([mask.sum(1), (batch["input_ids"] * mask).sum(1)], dim=1).float()

run(lengths, loader, output_path=sys.argv[1], key="lengths", progress=False)
"""


@pytest.mark.slow
def test_a_killed_run_resumes_and_stores_every_position_exactly_once(tokenizer, tmp_path):
    from dynabatch.demo import kjv_passages

    path = tmp_path / "store"
    script = tmp_path / "killed.py"
    script.write_text(textwrap.dedent(_KILLED_RUN))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(script), str(path)], env=env, capture_output=True, timeout=300,
                          check=False)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-2000:]
    before = _stored(path)
    assert len(_shards(path)) >= 2 and 0 < len(before) < 300  # some shards committed, the buffered rows lost
    assert len(set(before)) == len(before)

    loader = _load(kjv_passages()[300:600], tokenizer, batch_size=8, max_input_token_length=32, progress=False)
    resumed = run(_lengths, loader, output_path=path, key="lengths", progress=False)
    assert resumed.report.rows == 300 - len(before)  # only the rows not stored ran
    assert sorted(_stored(path)) == list(range(300))  # every position exactly once
    assert torch.equal(resumed.stack(), torch.stack(run(_lengths, loader, progress=False)))  # the killed run's too


def test_a_rerun_with_another_key_or_without_one_is_refused_naming_both(tokenizer, texts, tmp_path):
    loader = _load(texts[:20], tokenizer)
    keyed, plain = tmp_path / "keyed", tmp_path / "plain"
    run(_summary, loader, output_path=keyed, key="minilm@v2 mean-pool", progress=False)
    run(_summary, loader, output_path=plain, progress=False)
    stem = r"key should be the key the results at output_path='.*{}' were stored with \({}\) to resume them, but got "
    with pytest.raises(ValueError, match=stem.format("keyed", "key='minilm@v2 mean-pool'") + "key='minilm@v2 cls': "
                       "pass that key if the model and settings are the same, or another output_path"):
        run(_summary, loader, output_path=keyed, key="minilm@v2 cls", progress=False)
    with pytest.raises(ValueError, match=stem.format("keyed", "key='minilm@v2 mean-pool'") + "no key"):
        run(_summary, loader, output_path=keyed, progress=False)
    with pytest.raises(ValueError, match=stem.format("plain", "no key") + "key='minilm@v2 mean-pool'"):
        run(_summary, loader, output_path=plain, key="minilm@v2 mean-pool", progress=False)
    calls = []
    again = run(lambda b: calls.append(1) or _summary(b), loader, output_path=keyed, key="minilm@v2 mean-pool",
                progress=False)
    assert calls == [] and again.report.rows == 0  # the same key: everything read back


def test_stored_rows_of_other_inputs_at_the_same_positions_are_refused(tokenizer, texts, tmp_path):
    path = tmp_path / "store"
    run(_summary, _load(texts[:30], tokenizer), output_path=path, progress=False)
    changed = list(texts[:30])
    for p in (4, 9, 17):
        changed[p] = changed[p] + " amen"
    with pytest.raises(ValueError, match=r"output_path='.*store' should hold results of these inputs at their "
                       r"positions, but got 3 stored rows computed from other inputs \(positions 4, 9, 17\).*"
                       r"give the loader ids= to key rows by id"):
        run(_summary, _load(changed, tokenizer), output_path=path, progress=False)


def test_appended_texts_run_only_the_new_rows(tokenizer, texts, tmp_path):
    path = tmp_path / "store"
    run(_summary, _load(texts[:60], tokenizer), output_path=path, progress=False)
    grown = run(_summary, _load(texts[:90], tokenizer), output_path=path, progress=False)
    assert grown.report.rows == 30
    _same(grown, run(_summary, _load(texts[:90], tokenizer), progress=False))
    assert sorted(_stored(path)) == list(range(90))


def test_a_grown_and_reordered_corpus_with_ids_runs_only_the_new_ids(tokenizer, texts, tmp_path):
    path = tmp_path / "store"
    ids = [f"doc-{i}" for i in range(len(texts))]
    run(_summary, _load(texts[:60], tokenizer, ids=ids[:60]), output_path=path, progress=False)
    order = np.random.default_rng(0).permutation(90).tolist()  # 30 new documents, and a new order
    corpus, corpus_ids = [texts[i] for i in order], [ids[i] for i in order]
    calls = []
    grown = run(lambda b: calls.extend(b.indices.tolist()) or _summary(b), _load(corpus, tokenizer, ids=corpus_ids),
                output_path=path, progress=False)
    assert sorted(corpus_ids[p] for p in calls) == ids[60:90]  # only the new ids ran
    _same(grown, run(_summary, _load(corpus, tokenizer), progress=False))
    stored = _stored(path, "id")
    assert sorted(stored) == sorted(ids[:90]) and len(set(stored)) == 90
    part = order[:25:2]  # a smaller corpus: stored ids that are not in it are left alone
    subset = run(_summary, _load([texts[i] for i in part], tokenizer, ids=[ids[i] for i in part]), output_path=path,
                 progress=False)
    assert subset.report.rows == 0 and len(subset) == len(part)
    assert subset.accounting.others == 90 - len(part) and grown.accounting.others == 0  # rows of other inputs
    _same(subset, [grown[order.index(i)] for i in part])
    with pytest.raises(ValueError, match=r"the loader's ids should be of type string, as the ids of the results at "
                       r"output_path='.*', but got ids of type int64"):
        run(_summary, _load(texts[:3], tokenizer, ids=[0, 1, 2]), output_path=path, progress=False)
    with pytest.raises(ValueError, match=r"the loader's ids should be given \(the store keys rows by id\)"):
        run(_summary, _load(corpus, tokenizer), output_path=path, progress=False)
    run(_summary, _load(texts[:5], tokenizer), output_path=tmp_path / "positions", progress=False)
    with pytest.raises(ValueError, match=r"the loader's ids should be None \(the store keys rows by position\)"):
        run(_summary, _load(texts[:5], tokenizer, ids=ids[:5]), output_path=tmp_path / "positions", progress=False)
    swapped = list(corpus)
    swapped[0], swapped[1] = corpus[1], corpus[0]  # two ids now name each other's text
    with pytest.raises(ValueError, match=r"but got 2 stored rows computed from other inputs \(ids doc-\d+, doc-\d+\)"):
        run(_summary, _load(swapped, tokenizer, ids=corpus_ids), output_path=path, progress=False)


def test_an_id_keyed_store_after_a_reordered_rerun_holds_each_id_once_and_no_position_to_sort_by(tokenizer, texts,
                                                                                                 tmp_path):
    import pandas as pd

    path, ids = tmp_path / "store", [f"verse-{i}" for i in range(50)]
    run(_summary, _load(texts[:40], tokenizer, ids=ids[:40]), output_path=path, progress=False)
    order = list(range(49, -1, -1))  # the documented rerun: ten more texts, the corpus in another order
    again = run(_summary, _load([texts[i] for i in order], tokenizer, ids=[ids[i] for i in order]), output_path=path,
                progress=False)
    assert again.report.rows == 10
    frame = pd.read_parquet(path)  # positions of two runs would repeat (10 of 50): ids key the rows instead
    assert "position" not in frame.columns and sorted(frame["id"]) == sorted(ids)
    joined = frame.set_index("id").loc[[ids[i] for i in order]]  # join on id: the rerun's order
    assert joined["mean_id"].tolist() == [float(row["mean_id"]) for row in again]


def test_a_run_writes_into_the_store_its_caller_opened(tokenizer, texts, tmp_path):
    from dynabatch.inference.store import open_store

    ids = [f"doc-{i}" for i in range(20)]
    loader = _load(texts[:20], tokenizer, ids=ids)
    store = open_store(tmp_path, key="k", ids=loader.plan.ids)  # what the command line does before a model loads
    assert not store.done.any() and store.n == 20
    result = run(_summary, loader, output_path=store, progress=False)  # the one open: no second scan of the store
    assert result.report.rows == 20 and not result.failed and store.located(20).failures == {}
    store.close()  # a store the caller opened is the caller's to close: the run leaves it held
    again = open_store(tmp_path, key="k", ids=_load(texts[:10], tokenizer, ids=ids[:10]).plan.ids)
    with pytest.raises(ValueError, match=r"output_path should be a store opened for this run's inputs and key "
                       r"\(n=20, key=None, ids given\), but got one opened with n=10, key='k', other ids"):
        run(_summary, loader, output_path=again, progress=False)
    assert run(_summary, _load(texts[:10], tokenizer, ids=ids[:10]), output_path=again, progress=False).report.rows == 0
    again.close()


def test_stored_rows_the_caller_checked_are_not_tokenized_again_by_the_run(tokenizer, texts, tmp_path):
    # the command line checks the stored rows' input hashes before its model loads; the run hashed them all again
    import copy
    import shutil

    import pyarrow as pa

    from dynabatch.data.input_hashes import token_store_hashes
    from dynabatch.data.text_source import source_of
    from dynabatch.data.tokenization import ParallelTokenizer
    from dynabatch.inference.store import open_store

    seen = []

    class Counting(type(tokenizer)):  # the texts each call tokenizes (its own call: the backend rule's)
        def __call__(self, batch, *args, **kwargs):
            seen.extend(batch)
            return super().__call__(batch, *args, **kwargs)

    counting = copy.deepcopy(tokenizer)
    counting.__class__ = Counting
    ids = [f"doc-{i}" for i in range(40)]

    def streamed(n):
        return _load(source_of(pa.array(texts[:n], pa.large_string())), counting, ids=ids[:n], stream=True,
                     progress=False)

    run(_summary, streamed(30), output_path=tmp_path / "a", key="k", progress=False)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    tokenized = {}
    for folder, caller_checks in (("a", False), ("b", True)):
        loader = streamed(40)
        store = open_store(tmp_path / folder, key="k", ids=loader.plan.ids)
        assert store.unchecked().tolist() == list(range(30))
        if caller_checks:  # as the loader tokenizes them (its tokenizer, limit and keywords)
            tokens = ParallelTokenizer(copy.deepcopy(tokenizer), MAX_LEN, {})(texts[:30])
            store.check_inputs(np.arange(30), token_store_hashes(tokens))
            assert not store.unchecked().size
        seen.clear()
        assert run(_summary, loader, output_path=store, progress=False).report.rows == 10
        tokenized[folder] = len(seen)
        store.close()
    assert tokenized["a"] - tokenized["b"] == 30  # the 30 stored texts, hashed once: by the caller
    assert sorted(_stored(tmp_path / "a", "id")) == sorted(_stored(tmp_path / "b", "id")) == sorted(ids)


def test_resume_with_a_lower_batch_size_runs_only_the_missing_shard(tokenizer, texts, tmp_path, small_shards):
    path = tmp_path / "store"
    clean = list(run(_summary, _load(texts, tokenizer, batch_size=8), output_path=path, progress=False))
    lost = _shards(path)[1]
    lost_rows = set(ds.dataset(path / lost).to_table().column("position").to_pylist())
    (path / lost).unlink()
    calls = []
    again = run(lambda b: calls.extend(b.indices.tolist()) or _summary(b), _load(texts, tokenizer, batch_size=2),
                output_path=path, progress=False)
    assert sorted(calls) == sorted(lost_rows)
    _same(again, clean)
    assert sorted(_stored(path)) == list(range(len(texts)))



def test_a_guarded_rerun_whose_first_batch_is_rows_left_runs_batches_as_planned(tokenizer, texts, tmp_path):
    # The rows left of the first batch set the budget: every later batch was split into rows alone.
    loader = _load(texts, tokenizer)
    with pytest.raises(BatchOutOfMemoryError):  # the first batch's last row: its other rows are stored
        run(_fails_at(_lengths, int(loader.batch_sampler.batches[0][-1])), loader, memory="guarded",
            output_path=tmp_path / "s", progress=False)
    calls = []
    rows = run(lambda b: calls.append(len(b.indices)) or _lengths(b), loader, memory="guarded",
               output_path=tmp_path / "s", progress=False)
    assert calls[0] == 1 and calls[1:] == [len(b) for b in loader.batch_sampler.batches[1:]]
    assert rows.report.pre_split_batches == 0 and all(r is not None for r in rows)


def test_resume_with_a_plain_iterable_of_batches(tokenizer, texts, tmp_path, small_shards):
    batches = list(_load(texts[:30], tokenizer))
    path = tmp_path / "store"
    clean = list(run(_summary, batches, output_path=path, progress=False))  # read before a shard goes
    lost = _shards(path)[0]
    lost_rows = set(ds.dataset(path / lost).to_table().column("position").to_pylist())
    (path / lost).unlink()
    calls = []
    again = run(lambda b: calls.extend(b.indices.tolist()) or _summary(b), iter(batches), output_path=path,
                progress=False)  # a one-shot iterator: read whole once to check the stored rows
    assert sorted(calls) == sorted(lost_rows)
    _same(again, clean)
    # The loader's rows hash as its batches' rows do: a store of plain batches resumes with the loader.
    assert run(_summary, _load(texts[:30], tokenizer), output_path=path, progress=False).report.rows == 0


def test_a_torn_shard_and_a_dead_writers_temporary_file_are_set_aside(tokenizer, texts, tmp_path, caplog,
                                                                      small_shards):
    from dynabatch.inference.store_shards import HOST as _HOST

    path = tmp_path / "store"
    clean = list(run(_summary, _load(texts[:40], tokenizer), output_path=path, progress=False))
    torn = _shards(path)[0]
    torn_rows = set(ds.dataset(path / torn).to_table().column("position").to_pylist())
    data = (path / torn).read_bytes()
    (path / torn).write_bytes(data[: len(data) // 2])  # a shard cut in half (not by dynabatch: by a bad copy)
    dead = subprocess.Popen(["true"])  # a writer that is gone
    dead.wait()
    temp = path / f".tmp-{_HOST}-{dead.pid}-part-x-00000.parquet.tmp"
    temp.write_bytes(b"PAR1 half written")
    calls = []
    again = run(lambda b: calls.extend(b.indices.tolist()) or _summary(b), _load(texts[:40], tokenizer),
                output_path=path, progress=False)
    assert sorted(calls) == sorted(torn_rows)
    _same(again, clean)
    assert f"{torn} cannot be read" in caplog.text and "a shard a killed run did not finish" in caplog.text
    assert f"moving it to .torn-{torn}.torn" in caplog.text and not temp.exists()
    assert not list(path.glob(".torn-*"))  # removed: the run stored every input again
    assert sorted(ds.dataset(path).to_table().column("position").to_pylist()) == list(range(40))


def test_results_of_earlier_versions_and_foreign_folders_are_refused(tokenizer, texts, tmp_path):
    loader = _load(texts[:10], tokenizer)
    old = tmp_path / "out.jsonl"
    old.write_text('{"format":"dynabatch.run/1","n_inputs":10,"fingerprint":"abc"}\n')
    rule = r"output_path should be a directory for a Parquet results store \(say 'results/'\), but got output_path="
    with pytest.raises(ValueError, match=rule + r"'.*out\.jsonl', a file of JSONL results written by an earlier "
                       r"dynabatch: results are now stored as Parquet shards with a key; pass a new directory"):
        run(_summary, loader, output_path=old, progress=False)
    (tmp_path / "ranks.rank0-of-2.jsonl").write_text("{}\n")
    (tmp_path / "ranks.rank1-of-2.jsonl").write_text("{}\n")
    with pytest.raises(ValueError, match=rule + r"'.*ranks\.jsonl', per-rank JSONL files \(ranks\.rank0-of-2\.jsonl, "
                       r"ranks\.rank1-of-2\.jsonl\)"):
        run(_summary, loader, output_path=tmp_path / "ranks.jsonl", progress=False)
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"output_path should be a new or empty directory, or a dynabatch results "
                       r"store, but got output_path='.*home' holding 1 other entries \(notes\.txt\)"):
        run(_summary, loader, output_path=tmp_path / "home", progress=False)
    with pytest.raises(ValueError, match=r"key should be None without output_path"):
        run(_summary, loader, key="k", progress=False)
    with pytest.raises(TypeError, match=r"key should be None or a str naming the model, revision and settings, but "
                       r"got key=3 of type int"):
        run(_summary, loader, output_path=tmp_path / "x", key=3, progress=False)


def test_a_result_arrow_cannot_store_fails_at_the_first_batch(tokenizer, texts, tmp_path):
    calls = []
    with pytest.raises(TypeError, match=r"output should be storable in Arrow with output_path set \(tensors, numpy "
                       r"arrays, int, float, bool, str or None, .*\), but got output of type object"):
        run(lambda b: calls.append(1) or [object()] * len(b.indices), _load(texts, tokenizer),
            output_path=tmp_path / "store", progress=False)
    assert calls == [1]


def test_failed_rows_are_not_stored_and_a_rerun_tries_them_again(tokenizer, texts, tmp_path):
    loader = _load(texts[:20], tokenizer)
    path = tmp_path / "store"
    position = int(loader.batch_sampler.batches[0][0])
    skipped = run(_fails_at(_lengths, position), loader, output_path=path, on_oom="skip", progress=False)
    assert skipped.failed == [position] and skipped[position] is None
    assert position not in _stored(path) and len(_stored(path)) == 19
    retried = run(_lengths, loader, output_path=path, progress=False)
    assert retried.report.rows == 1 and retried.failed == [] and sorted(_stored(path)) == list(range(20))
    with pytest.raises(BatchOutOfMemoryError) as raised:
        run(_fails_at(_lengths, position), loader, output_path=tmp_path / "raised", progress=False)
    partial = raised.value.partial  # the rows that finished, read from the store
    assert partial[position] is None and len(partial) == 20


@pytest.mark.parametrize("memory", ["auto", "off"])  # measured mode (the planner's batches) and the plan as it is
def test_bad_inputs_skipped_come_back_as_none_and_are_not_stored(tokenizer, texts, tmp_path, memory):
    import pandas as pd

    dirty = pd.Series(list(texts[:40]))
    dirty[[3, 17, 18]] = None  # a pandas column with missing texts (NaN / None)
    loader = _load(dirty, tokenizer, on_bad_input="skip")
    path = tmp_path / "store"
    for result in (run(_lengths, loader, memory=memory, progress=False),
                   run(_lengths, loader, memory=memory, output_path=path, progress=False)):
        assert len(result) == 40 and result.failed == [3, 17, 18]
        assert [p for p in range(40) if result[p] is None] == [3, 17, 18]  # every input once, the bad ones None
        assert result.report.skipped_inputs == 3 and result.report.rows == 37
        assert result.report.summary()["skipped_inputs"] == 3
    assert sorted(_stored(path)) == sorted(set(range(40)) - {3, 17, 18})
    again = run(_lengths, loader, memory=memory, output_path=path, progress=False)  # reported again, nothing runs
    assert again.failed == [3, 17, 18] and again.report.rows == 0


# --- a column None in every row of the first shard; a damaged shard; a refused rerun writes nothing ----------------


def _late_vectors(none_calls):
    """One dict per row, as given: ``vec`` None in the rows of the first ``none_calls`` calls, a float16 vector
    later; ``n`` the row's real tokens."""
    from dynabatch import PerRow

    calls = []

    def fn(batch):
        calls.append(1)
        n = batch["attention_mask"].sum(1)
        vec = (torch.stack([n, 2 * n, 3 * n], 1) / 7).to(torch.float16)
        return PerRow([{"vec": None if len(calls) <= none_calls else vec[r], "n": n[r]} for r in range(len(n))])

    return fn


def test_a_column_none_in_the_first_shard_is_typed_by_a_later_one_and_every_reader_reads_every_row(
        tokenizer, texts, tmp_path, monkeypatch):
    import datasets
    import pandas as pd
    import polars as pl

    loader = _load(texts[:40], tokenizer)
    first = loader.batch_sampler.batches[0].tolist()
    in_memory = run(_late_vectors(1), loader, progress=False)
    for name, rows in (("typed", None), ("null", 4)):  # vec None in the first batch; "null": alone in the 1st shard
        if rows is not None:
            monkeypatch.setattr("dynabatch.inference.store_writer.COMMIT", CommitPolicy(rows=rows))
        path = tmp_path / name
        stored = run(_late_vectors(1), loader, output_path=path, progress=False)
        for p in range(40):
            assert (stored[p]["vec"] is None) == (p in first) and torch.equal(stored[p]["n"], in_memory[p]["n"])
            assert p in first or torch.equal(stored[p]["vec"], in_memory[p]["vec"])
        assert str(ds.dataset(path).schema.field("vec").type) == "list<element: halffloat>"  # given per row: varying
        assert len(pd.read_parquet(path)) == len(pl.read_parquet(f"{path}/*.parquet")) == 40
        assert pd.read_parquet(path)["vec"].notna().sum() == 40 - len(first)
        assert len(datasets.load_dataset("parquet", data_files=f"{path}/*.parquet", split="train")) == 40


@pytest.mark.parametrize("column", ["mean_id", "position"])  # a float read back wrong; the index, unreadable
def test_a_damaged_shard_is_set_aside_and_its_rows_run_again(tokenizer, texts, tmp_path, caplog, small_shards, column):
    import pyarrow.parquet as pq

    path = tmp_path / "store"
    clean = list(run(_summary, _load(texts[:40], tokenizer), output_path=path, progress=False))
    damaged = _shards(path)[1]
    damaged_rows = set(_stored(path / damaged))
    index = pq.read_schema(path / damaged).names.index(column)  # no dictionary: the values' own page
    chunk = pq.read_metadata(path / damaged).row_group(0).column(index)
    data = bytearray((path / damaged).read_bytes())
    end = chunk.data_page_offset + chunk.total_compressed_size
    data[end - 12:end - 2] = bytes(b ^ 0x5A for b in data[end - 12:end - 2])  # inside a data page; footer intact
    (path / damaged).write_bytes(bytes(data))
    calls = []
    again = run(lambda b: calls.extend(b.indices.tolist()) or _summary(b), _load(texts[:40], tokenizer),
                output_path=path, progress=False)
    assert sorted(calls) == sorted(damaged_rows)
    _same(again, clean)
    assert f"{damaged} cannot be read (could not verify page integrity, CRC checksum verification failed" in caplog.text
    assert f"moving it to .torn-{damaged}.torn" in caplog.text and sorted(_stored(path)) == list(range(40))


def test_a_streamed_rerun_over_other_inputs_is_refused_before_it_writes(tokenizer, tmp_path, monkeypatch):
    import dynabatch.data.streaming as token_streaming

    monkeypatch.setattr(token_streaming, "FIRST_CHUNK", 8)
    monkeypatch.setattr(token_streaming, "CHUNK_SIZE", 8)
    monkeypatch.setattr("dynabatch.inference.store_writer.COMMIT", CommitPolicy(rows=4))
    path = tmp_path / "store"
    corpus = [" ".join(["light"] * (41 - i)) for i in range(40)]  # longest first: the first rows run are stored

    def stops_at(call):
        def fn(batch):
            fn.calls += 1
            if fn.calls == call:
                raise RuntimeError("interrupted")
            return _summary(batch)
        fn.calls = 0
        return fn

    with pytest.raises(RuntimeError, match="interrupted"):  # a streamed job, interrupted: some rows stored
        run(stops_at(4), _load(corpus, tokenizer, stream=True), output_path=path, progress=False)
    before = sorted(_stored(path))
    assert 0 < len(before) < 40
    assert not [t.name for t in threading.enumerate() if t.name.startswith("dynabatch")]  # tokenizing stopped too
    # The corpus in another order: its first batches (the longest texts, now at the end) are not stored positions;
    # the stored positions come last. Refused all the same, and before it writes a row.
    with pytest.raises(ValueError, match=r"stored rows computed from other inputs"):
        run(_summary, _load(corpus[::-1], tokenizer, stream=True), output_path=path, progress=False)
    assert sorted(_stored(path)) == before  # refused before it wrote a row
    resumed = run(_summary, _load(corpus, tokenizer, stream=True), output_path=path, progress=False)
    assert resumed.report.rows == 40 - len(before) and sorted(_stored(path)) == list(range(40))


_STORES = ("results/", "embeddings/", "big-vectors/")  # the store folders the docs read
_READ = r"""(?P<call>[\w.]+)\(\s*(?:"parquet",\s*data_files=)?["'](?P<path>[^"']+)["']"""


def _documented_reads():
    """Each read of a results store the README and docs/ show, as ``(function, form)``: ``form`` is ``folder`` or
    ``glob`` (``folder/*.parquet``); the records of ``_failed/`` are not rows and are left out."""
    import re
    from pathlib import Path

    root = Path(__file__).parents[2]
    found = set()
    for page in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for match in re.finditer(_READ, page.read_text()):
            call, path = match["call"], match["path"]
            if call.split(".")[-1] in ("read_parquet", "dataset", "load_dataset") and path.startswith(_STORES) \
                    and "_failed" not in path:
                found.add((call.split(".")[-1], "glob" if path.endswith("*.parquet") else "folder",
                           "polars" if call.startswith(("pl.", "polars.")) else ""))
    return found


def _read_ids(folder, cache):
    """The ids each documented reader reads from the store ``folder`` (polars' folder read: ``None`` where it stops
    with its own error, which it does while the store holds anything but shards)."""
    import datasets
    import pandas as pd
    import polars as pl

    def polars_folder():
        try:
            return pl.read_parquet(f"{folder}/")["id"].to_list()
        except (pl.exceptions.PolarsError, OSError):
            return None

    return {("dataset", "folder", ""): ds.dataset(folder, format="parquet").to_table(columns=["id"])["id"].to_pylist(),
            ("read_parquet", "folder", ""): pd.read_parquet(folder)["id"].tolist(),
            ("read_parquet", "glob", "polars"): pl.read_parquet(f"{folder}/*.parquet")["id"].to_list(),
            ("load_dataset", "glob", ""): datasets.load_dataset("parquet", data_files=f"{folder}/*.parquet",
                                                                split="train", cache_dir=str(cache))["id"],
            ("read_parquet", "folder", "polars"): polars_folder()}


def test_every_documented_reader_reads_each_stored_row_once_after_a_kill_a_torn_shard_and_a_failure(
        tokenizer, texts, tmp_path, monkeypatch, small_shards):
    import pyarrow.parquet as pq

    from dynabatch.inference import store_shards as store_module

    path = tmp_path / "results"
    ids = [f"doc-{i}" for i in range(24)]

    def fails(batch):  # input 5 raises, every time: on_error="skip" records it failed
        if 5 in batch.indices.tolist():
            raise ValueError("cannot summarize input 5")
        return _summary(batch)

    run(fails, _load(texts[:24], tokenizer, ids=ids), output_path=path, key="k", on_error="skip", progress=False)
    assert os.listdir(path / "_failed")  # (c) a failed row recorded
    shard = _shards(path)[0]
    with monkeypatch.context() as killed:  # (a) a writer killed after writing its temporary shard, before the rename
        def kill(file):
            raise RuntimeError("killed")

        killed.setattr(store_module, "_fsync", kill)
        with pytest.raises(RuntimeError, match="killed"):
            store_module.write_whole(str(path), shard, pq.read_table(path / shard))
    assert len(list(path.glob(".tmp-*"))) == 1  # its writer (this process) lives: the next open leaves it
    torn = _shards(path)[1]  # (b) a torn shard, set aside by the rerun, whose rows run again (but the failed one)
    (path / torn).write_bytes((path / torn).read_bytes()[:200])
    run(fails, _load(texts[:24], tokenizer, ids=ids), output_path=path, key="k", on_error="skip", progress=False)
    assert (path / f".torn-{torn}.torn").exists()  # kept: the run did not store every input
    stored = sorted(i for i in ids if i != "doc-5")
    cache = tmp_path / "cache"
    documented = _documented_reads()
    reads = _read_ids(path, cache / "1")
    assert documented and documented <= set(reads)  # every read the docs show is tried here
    for form, read in reads.items():
        assert read is None if form[1:] == ("folder", "polars") else sorted(read) == stored, form
    run(_summary, _load(texts[:24], tokenizer, ids=ids), output_path=path, key="k", progress=False)
    assert not list(path.glob(".torn-*"))  # every input stored: the set-aside shard is removed
    for form, read in _read_ids(path, cache / "2").items():
        assert read is None if form[1:] == ("folder", "polars") else sorted(read) == sorted(ids), form


def test_rows_padded_to_their_batchs_width_are_refused_saying_how_to_store_them(tokenizer, texts, tmp_path,
                                                                                  monkeypatch):
    monkeypatch.setattr("dynabatch.inference.store_writer.COMMIT", CommitPolicy(rows=4))  # the first batch: a shard
    padded = lambda b: b["input_ids"].float()  # each row as wide as its batch: (48,), then (45,), ...
    with pytest.raises(ValueError, match=r"shape \(48,\) in every row, as stored, but got dtype float32 and shape "
                       r"\(\d+,\); .* return dynabatch.PerRow\(list\(output\)\) from the first batch on"):
        run(padded, _load(texts, tokenizer), output_path=tmp_path / "fixed", token_outputs="whole", progress=False)
    per_row = lambda b: PerRow(list(padded(b)))
    stored = run(per_row, _load(texts, tokenizer), output_path=tmp_path / "varying", progress=False)
    in_memory = run(padded, _load(texts, tokenizer), token_outputs="whole", progress=False)
    assert len({len(row) for row in stored}) > 1
    assert all(torch.equal(a, b) for a, b in zip(in_memory, stored, strict=True))


def test_a_rerun_reading_rows_otherwise_than_the_stored_ones_is_refused_not_mixed(tokenizer, tmp_path):
    texts = ["one two three four five six"] * 2 + ["one two three four five"] * 2 + ["one two three"] * 8
    queries = lambda b: b["input_ids"][:, :1, None].float().expand(-1, 8, 4).clone()  # 8 per row, as wide as batch 1
    with pytest.raises(ValueError, match=r"as at its first batch \(width 8, where it was read as per-token"):
        run(queries, _load(texts, tokenizer, batch_size=4), output_path=tmp_path, progress=False)  # batch 1 stored
    with pytest.raises(ValueError, match=r"^output should be read as the rows stored at output_path='.*' were, each "
                       r"its own length \(cut per token .*\), but got rows read whole .*; use the same fn and "
                       r"token_outputs, or another output_path$"):  # it stored batch 1's rows cut to 7 and 8 tokens
        run(queries, _load(texts, tokenizer, batch_size=4), output_path=tmp_path, token_outputs="whole",
            progress=False)
