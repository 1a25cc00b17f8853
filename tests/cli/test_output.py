"""The output of a corpus job: made and probed before a model loads, taken back when a check fails, refused naming
what differs, and tallied from what the store holds."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch

from dynabatch.cli.output import Output
from dynabatch.inference.store import open_store


def _write(path, key, positions, n=5):
    store = open_store(path, key=key, n=n)
    stored = np.flatnonzero(store.done)
    store.check_inputs(stored, np.zeros(len(stored), dtype=np.uint64))
    writer = store.writer("test")
    writer.write(np.array(positions), [torch.ones(2) * p for p in positions], np.zeros(len(positions), np.uint64))
    writer.close()


def test_prepare_makes_the_folder_and_discard_takes_back_only_what_it_made(tmp_path):
    made = Output(tmp_path / "a" / "b" / "store")
    made.prepare()
    assert (tmp_path / "a" / "b" / "store").is_dir() and not list((tmp_path / "a" / "b" / "store").iterdir())
    made.discard()
    assert not (tmp_path / "a").exists()
    (tmp_path / "kept").mkdir()
    found = Output(tmp_path / "kept")
    found.prepare()
    found.discard()
    assert (tmp_path / "kept").is_dir()


def test_a_store_computed_otherwise_is_refused_naming_each_difference(tmp_path):
    _write(tmp_path / "store", 'embed model=aaaa pooling=mean prompt="query: "', [0])
    output = Output(tmp_path / "store")
    with pytest.raises(ValueError) as info:
        output.open(key="embed model=bbbb pooling=mean dtype=float16", n=5, ids=None)
    assert str(info.value) == (
        f"output should be a new folder, or the store of this same job to resume it, but got "
        f"output={str(tmp_path / 'store')!r} holding rows computed otherwise (model files of digest aaaa there, "
        f"bbbb here (--model); prompt=\"query: \" there, no prompt here; no dtype there, dtype=float16 here): use "
        f"another output folder for this job, or delete {str(tmp_path / 'store')!r} to compute it again")


def test_a_store_keyed_in_an_earlier_form_is_refused_saying_so_and_one_of_this_form_unmarked_resumes(tmp_path):
    # keys held no form: a store of the previous release's (the prompt as its flag was typed) was refused as "holding
    # rows computed otherwise" alone, not saying the key's form was the cause
    path = str(tmp_path / "earlier")
    _write(path, "embed model=aaaa pooling=sentence-transformers prompt=query", [0])
    with pytest.raises(ValueError) as info:
        Output(path).open(key='embed key_form=2 model=aaaa pooling=sentence-transformers prompt="query: "', n=5,
                          ids=None)
    assert str(info.value) == (
        f"output should be a new folder, or the store of this same job to resume it, but got output={path!r} written "
        "by an earlier dynabatch, whose job key had another form (no key_form there, key_form=2 here: a key of an "
        "earlier form may hold the prompt and the generation settings as the flags were typed, not as applied), its "
        "key differing (prompt=query there, prompt=\"query: \" here): use another output folder for this job, or "
        "resume the store with the dynabatch version that wrote it")
    # the keys of form 2 written before they said so: the same job, resumed under the key the rows were stored with
    path, unmarked = str(tmp_path / "unmarked"), "embed model=aaaa pooling=mean"
    _write(path, unmarked, [0])
    output = Output(path)
    assert output.open(key="embed key_form=2 model=aaaa pooling=mean", n=5, ids=None) == unmarked
    assert output.store.done.tolist() == [True, False, False, False, False]
    output.store.check_inputs(np.array([0]), np.zeros(1, dtype=np.uint64))
    writer = output.store.writer("test")
    writer.write(np.array([1, 2]), [torch.ones(2), torch.ones(2)], np.zeros(2, np.uint64))
    writer.close()
    output.close()
    again = Output(path)
    assert again.open(key="embed key_form=2 model=aaaa pooling=mean", n=5, ids=None) == unmarked
    assert again.store.done.tolist() == [True, True, True, False, False]
    again.close()
    with pytest.raises(ValueError, match=r"holding rows computed otherwise \(no dtype there, dtype=float16 here\)"):
        Output(path).open(key="embed model=aaaa pooling=mean dtype=float16", n=5, ids=None)  # both unmarked: no form


def test_an_output_inside_another_store_is_refused_a_corpus_folder_of_part_files_is_none(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    # the job ran, and the outer store's own job then refused its folder ("holding 1 other entries (inner)")
    _write(tmp_path / "store", "embed model=aaaa", [0])
    inner = tmp_path / "store" / "sub" / "inner"
    with pytest.raises(ValueError) as info:
        Output(inner).prepare()
    assert str(info.value) == (f"output should be a folder outside any other store (a store's folder holds its own "
                               f"files alone), but got output={str(inner)!r} inside the store "
                               f"{str(tmp_path / 'store')!r}")
    assert os.listdir(tmp_path / "store") != [] and not (tmp_path / "store" / "sub").exists()
    (tmp_path / "corpus").mkdir()
    pq.write_table(pa.table({"text": ["a"]}), tmp_path / "corpus" / "part-00000.parquet")  # as the demo names them
    Output(tmp_path / "corpus" / "out").prepare()
    assert (tmp_path / "corpus" / "out").is_dir()


def test_an_output_folder_holding_other_files_is_refused_before_the_store_opens(tmp_path):
    # refused by the store, once the model's files were hashed for the key, in its words ("output_path should be")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError) as info:
        Output(tmp_path / "data").prepare()
    assert str(info.value) == (f"output should be a new folder, or the store of this same job to resume it, but got "
                               f"output={str(tmp_path / 'data')!r} holding 1 other entries (notes.txt): remove them, "
                               "or use another output folder")
    _write(tmp_path / "store", "embed model=aaaa", [0])
    Output(tmp_path / "store").prepare()  # a store's own files: its shards, its failure records, its job lock


@pytest.mark.parametrize("blank", ["", "  "])
def test_an_empty_or_blank_output_is_refused_before_anything_is_made(tmp_path, monkeypatch, blank):
    # "" was the working folder to the probe and no folder to the store, which then raised FileNotFoundError: ''
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=f"^output should be a folder for the store \\(a path: not empty or blank\\), "
                                         f"but got output='{blank}'$"):
        Output(blank).prepare()
    assert list(tmp_path.iterdir()) == []


def _write_ids(path, key, ids):
    """A store keyed by ``ids`` (a pyarrow array), holding the first one's row."""
    store = open_store(path, key=key, n=len(ids), ids=ids)
    store.check_inputs(np.zeros(0, np.int64), np.zeros(0, np.uint64))
    writer = store.writer("test", ids=ids)
    writer.write(np.array([0]), [torch.ones(2)], np.zeros(1, np.uint64))
    writer.close()
    store.close()


def test_a_store_keyed_otherwise_is_refused_naming_the_id_column_never_the_librarys_ids(tmp_path):
    import pyarrow as pa

    # the store's own words were "the loader's ids should be ... use the same ids, or another output_path"
    key, path = "embed model=aaaa pooling=mean", tmp_path / "by-position"
    _write(path, key, [0])
    with pytest.raises(ValueError) as info:
        Output(path).open(key=key, n=5, ids=pa.array(list("abcde")), id_column="name")
    assert str(info.value) == (
        f"--id-column should be left out (the store keys its rows by position) to resume output={str(path)!r}, but got "
        "--id-column='name': leave it out, or use another output folder to key rows by id")
    path = tmp_path / "by-id"
    _write_ids(path, key, pa.array([7, 8, 9]))
    same = "pass the --id-column of the job that wrote it, or use another output folder"
    with pytest.raises(ValueError) as info:
        Output(path).open(key=key, n=3, ids=None)
    assert str(info.value) == (f"--id-column should be given (the store keys its rows by id) to resume "
                               f"output={str(path)!r}, but got no --id-column: {same}")
    with pytest.raises(ValueError) as info:
        Output(path).open(key=key, n=3, ids=pa.array(["7", "8", "9"]), id_column="name")
    assert str(info.value) == (f"--id-column should name ids of type int64, the ids the store at output={str(path)!r} "
                               f"keys its rows by, to resume it, but got --id-column='name' holding ids of type "
                               f"string: {same}")
    output = Output(path)
    output.open(key=key, n=3, ids=pa.array([9, 8, 7]), id_column="name")  # the same ids, in another order
    assert output.store.done.tolist() == [False, False, True]
    output.close()


def test_tally_counts_what_the_store_holds_stored_before_and_stored_now(tmp_path):
    key = "embed model=aaaa pooling=mean"
    _write(tmp_path / "store", key, [0, 1])
    output = Output(tmp_path / "store")
    output.open(key=key, n=5, ids=None)
    output.store.check_inputs(np.arange(2), np.zeros(2, np.uint64))  # what the run does in the store it opened
    writer = output.store.writer("run")
    writer.write(np.array([3]), [torch.ones(2) * 3], np.zeros(1, np.uint64))
    writer.close()
    tally = output.tally(5)
    assert (tally.n, tally.stored, tally.before, tally.now, tally.missing.tolist()) == (5, 3, 2, 1, [2, 4])
    assert tally.to_dict() == {"inputs": 5, "stored": 3, "stored_before": 2, "stored_now": 1, "other_rows": 0,
                               "failed": [], "missing": [{"position": 2}, {"position": 4}]}
    assert output.tally(2).others == 1  # position 3's row: no input of a corpus of 2
    output.close()


def test_the_summary_reads_the_runs_accounting_the_store_scanned_once_after_the_run(tmp_path, monkeypatch):
    from dynabatch.inference.sink import StoreSink
    from dynabatch.inference.store import Store

    key = "embed model=aaaa pooling=mean"
    _write(tmp_path / "store", key, [0, 1])
    output = Output(tmp_path / "store")
    output.open(key=key, n=5, ids=None)
    sink = StoreSink(output.store, owned=False)  # what the run makes of the store the command opened
    sink.check_inputs(np.arange(2), np.zeros(2, np.uint64))
    writer = sink.writer("run")
    writer.write(np.array([3]), [torch.ones(2) * 3], np.zeros(1, np.uint64))
    writer.fail(np.array([4]), np.zeros(1, np.uint64), ["ValueError: not this one"])
    writer.close()
    scans, scan = [], Store._scan
    monkeypatch.setattr(Store, "_scan", lambda store, verify: scans.append(1) or scan(store, verify))
    result, missing = sink.result(5)
    tally = output.tally(5, result)
    assert len(scans) == 1 and missing.tolist() == [2] and tally.missing.tolist() == [2]
    assert (tally.stored, tally.before, tally.now, tally.failures) == (3, 2, 1, {4: "ValueError: not this one"})
    assert output.tally(5).to_dict() == tally.to_dict() and len(scans) == 2  # no result: the store read now
    output.close()


def _open(output):
    """What a command does with its output before the model loads: made and probed, then the store opened; ``None``
    where refused (the checks' block discards what the job made)."""
    try:
        with output.checked():
            output.open(key="embed model=aaaa", n=2, ids=None)
    except ValueError as exc:
        assert "should be a store no other job is writing" in str(exc)
        return None
    return output


def _end(output, path):
    """The job that holds the store writes its rows and ends; the store holds them."""
    writer = output.store.writer("0")
    writer.write(np.arange(2), [torch.ones(2)] * 2, np.zeros(2, np.uint64))
    writer.close()
    output.close()
    store = open_store(path, key="embed model=aaaa", n=2)
    assert store.done.all()
    store.close()


@pytest.mark.parametrize("maker_holds", [True, False])
def test_a_job_refused_by_the_store_touches_nothing_of_it_whoever_made_the_folder(tmp_path, maker_holds):
    path = tmp_path / "new" / "out"
    maker, other = Output(path), Output(path)
    maker.prepare()
    other.prepare()
    assert maker.made == str(tmp_path / "new") and other.made is None  # mkdir says which job made it
    first, second = (maker, other) if maker_holds else (other, maker)
    assert _open(first) is first and _open(second) is None
    assert path.is_dir() and len([n for n in os.listdir(path) if n.startswith(".lock-")]) == 1  # the holder's
    _end(first, path)


def test_two_jobs_started_at_once_on_a_new_folder_leave_one_running(tmp_path):
    for attempt in range(10):
        path = tmp_path / f"attempt-{attempt}" / "out"  # parents made in the race too
        barrier, outcomes = threading.Barrier(2), []

        def job():
            output = Output(path)
            barrier.wait()
            outcomes.append(_open(output))

        threads = [threading.Thread(target=job) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        held = [o for o in outcomes if o is not None]
        assert len(outcomes) == 2 and len(held) == 1, attempt
        _end(held[0], path)
