"""The output of a corpus job: made and probed before a model loads, taken back when a check fails, refused naming
what differs, and tallied from what the store holds."""

from __future__ import annotations

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


def test_tally_counts_what_the_store_holds_stored_before_and_stored_now(tmp_path):
    key = "embed model=aaaa pooling=mean"
    _write(tmp_path / "store", key, [0, 1])
    output = Output(tmp_path / "store")
    output.open(key=key, n=5, ids=None)
    _write(tmp_path / "store", key, [3])  # what the run stores
    tally = output.tally(5)
    assert (tally.n, tally.stored, tally.before, tally.now, tally.missing.tolist()) == (5, 3, 2, 1, [2, 4])
    assert tally.to_dict() == {"inputs": 5, "stored": 3, "stored_before": 2, "stored_now": 1, "failed": [],
                               "missing": [{"position": 2}, {"position": 4}]}
    output.close()
