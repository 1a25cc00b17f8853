import json
import logging
import os

import numpy as np
import pandas as pd
import pytest

from dynabatch.data.sources import read_source, tokenize_source

ROWS = [
    {"source": "In the beginning God created the heaven and the earth.", "target": "Light", "label": 1},
    {"source": "And the earth was without form, and void.", "target": "Darkness was upon the deep", "label": 0},
    {"source": "And God said, Let there be light.", "target": "And there was light", "label": 1},
]


def _expected(tokenizer, field, max_length=None):
    kwargs = {"truncation": True, "max_length": max_length} if max_length else {}
    return [tokenizer(r[field], **kwargs)["input_ids"] for r in ROWS]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sources")
    (folder / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    pd.DataFrame(ROWS).to_csv(folder / "rows.csv", index=False)
    pd.DataFrame(ROWS).to_parquet(folder / "rows.parquet")
    return folder


@pytest.mark.parametrize("kind", ["list_of_dicts", "dict_of_lists", "pandas", "datasets", "jsonl", "csv", "parquet"])
def test_every_kind_of_source_gives_the_same_tokens_and_lengths(tokenizer, files, kind):
    import datasets

    source = {
        "list_of_dicts": lambda: ROWS,
        "dict_of_lists": lambda: {k: [r[k] for r in ROWS] for k in ROWS[0]},
        "pandas": lambda: pd.DataFrame(ROWS),
        "datasets": lambda: datasets.Dataset.from_list(ROWS),
        "jsonl": lambda: str(files / "rows.jsonl"),
        "csv": lambda: files / "rows.csv",
        "parquet": lambda: [files / "rows.parquet"],
    }[kind]()
    tokens = tokenize_source(source, tokenizer, fields={"input_ids": "source", "labels": "target"},
                             max_length=8, keep=["label"])
    assert tokens.dataset["input_ids"] == _expected(tokenizer, "source", 8)
    assert tokens.dataset["labels"] == _expected(tokenizer, "target", 8)
    assert tokens.dataset["label"] == [1, 0, 1]
    for key in ("input_ids", "labels"):
        assert tokens.lengths[key].tolist() == [len(ids) for ids in tokens.dataset[key]]
    assert len(tokens) == 3


def test_a_list_of_texts_is_the_text_field(tokenizer):
    tokens = tokenize_source(["a b c", "d"], tokenizer)
    assert tokens.dataset.column_names == ["input_ids"]
    assert tokens.lengths["input_ids"].tolist() == [5, 3]


def test_several_processes_give_what_one_gives(tokenizer):
    from dynabatch.demo import kjv_passages

    texts = kjv_passages()[:400]

    def slow_tokenizer(batch, **kwargs):  # a plain Python callable: not a fast tokenizer
        return tokenizer(batch, **kwargs)

    one = tokenize_source(texts, slow_tokenizer, max_length=32, num_proc=1)
    two = tokenize_source(texts, slow_tokenizer, max_length=32, num_proc=2)
    assert two.dataset["input_ids"] == one.dataset["input_ids"]
    np.testing.assert_array_equal(two.lengths["input_ids"], one.lengths["input_ids"])


def _lengths_as_ids(texts, **kwargs):  # a tokenizer that is not fast: the automatic num_proc applies
    return {"input_ids": [[1] * len(text) for text in texts]}


def test_a_slow_tokenizer_gets_a_process_per_core_this_process_may_use(monkeypatch, caplog):
    # The machine's count was taken: under taskset -c 0 on 2 cores, 6,000 rows of a slow BERT tokenizer ran in 2
    # processes on the one core, 6.0-7.2 s against 2.8-4.8 s in one
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})  # pinned to one core
    with caplog.at_level(logging.DEBUG, logger="dynabatch.data.sources"):
        tokenize_source(["ab"] * 4000, _lengths_as_ids, progress=False)
    assert "in 1 process(es)" in caplog.text


def test_lengths_follow_a_selected_view(tokenizer):
    tokens = tokenize_source(["a", "b c d e", "f g"], tokenizer)
    view = tokens.dataset.select([2, 0])
    from dynabatch.data.sources import _list_lengths

    assert _list_lengths(view, "input_ids").tolist() == [4, 3]


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda t: tokenize_source(42, t), TypeError, "source should be a datasets.Dataset, a pandas DataFrame"),
        (lambda t: tokenize_source([1, 2], t), TypeError, "source should be a datasets.Dataset"),
        (lambda t: tokenize_source("no/such/file.jsonl", t), ValueError,
         "source should be existing files .*no/such/file.jsonl"),
        (lambda t: tokenize_source(ROWS, t), ValueError, r"fields should be columns of the source \[.*\], but got fields='text'"),
        (lambda t: tokenize_source(ROWS, t, fields="source", keep=["nope"]), ValueError, "but got fields='nope'"),
        (lambda t: tokenize_source(ROWS, t, fields={"input_ids": 3}), TypeError, "fields should be a text field name"),
        (lambda t: tokenize_source(ROWS, t, fields="source", keep=["input_ids"]), ValueError,
         r"keep should be columns other than the output columns \['input_ids'\]"),
        (lambda t: tokenize_source(ROWS, t, fields="label"), TypeError, r"source\['label'\] should be str in every row"),
        (lambda t: tokenize_source(ROWS, t, fields="source", max_length=0), ValueError, "max_length should be a positive"),
        (lambda t: tokenize_source(ROWS, t, fields="source", num_proc=0), ValueError, "num_proc should be a positive"),
        (lambda t: tokenize_source(ROWS, "tok", fields="source"), TypeError, "tokenizer should be a callable"),
    ],
)
def test_bad_input(tokenizer, call, error, match):
    with pytest.raises(error, match=match):
        call(tokenizer)


def test_files_of_mixed_or_unknown_formats_are_refused(files, tmp_path):
    (tmp_path / "rows.txt").write_text("x")
    with pytest.raises(ValueError, match="source should be files of one format"):
        read_source([files / "rows.csv", files / "rows.jsonl"])
    with pytest.raises(ValueError, match="source should be files of one format"):
        read_source(tmp_path / "rows.txt")
