"""What ``run`` returns (dynabatch/inference/results.py): the in-memory ``RunResult`` and the ``StoredRunResult``
read back from a results store give the same rows, and stack the same way. Real texts, a real tokenizer."""

import numpy as np
import pyarrow as pa
import pytest
import torch
from runner_helpers import _load

from dynabatch import PerRow, run
from dynabatch.inference.results import RunResult, StoredRunResult

pytestmark = pytest.mark.usefixtures("one_thread")


def _many_kinds(batch):
    """Every kind of result at once, one dict per row: half and bfloat16 vectors, per-token floats (cut to the real
    tokens), token ids, an int, a str, a tuple."""
    mask = batch["attention_mask"]
    ids = batch["input_ids"]
    return [
        {
            "half": (torch.stack([ids[r].sum(), ids[r].max(), ids[r].min(), mask[r].sum()]) / 1000).to(torch.float16),
            "brain": (torch.stack([ids[r].sum(), ids[r].max(), mask[r].sum()]) / 7).to(torch.bfloat16),
            "tokens": ids[r][mask[r].bool()].float() / 3,
            "ids": ids[r][mask[r].bool()],
            "length": int(mask[r].sum()),
            "label": f"n={int(mask[r].sum())}",
            "pair": (mask[r].sum().float(), torch.ones(2, dtype=torch.int32)),
        }
        for r in range(len(mask))
    ]


def _equal(a, b):
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b) and all(_equal(x, y) is None for x, y in zip(a, b))
    elif isinstance(a, dict):
        assert list(a) == list(b) and all(_equal(a[k], b[k]) is None for k in a)
    else:
        assert a == b


@pytest.fixture(scope="module")
def both(tokenizer, texts, tmp_path_factory):
    loader = _load(texts, tokenizer)
    path = tmp_path_factory.mktemp("results") / "store"
    return run(_many_kinds, loader, progress=False), run(_many_kinds, loader, output_path=path, progress=False)


def test_a_stored_result_gives_exactly_the_rows_of_the_run_in_memory(both, texts):
    memory, stored = both
    assert isinstance(memory, RunResult) and isinstance(memory, list)
    assert isinstance(stored, StoredRunResult) and not isinstance(stored, list) and len(stored) == len(texts)
    for a, b in zip(memory, stored):  # iteration decodes chunks of rows
        _equal(a, b)
    for p in (0, 5, -1, len(texts) - 2):  # one row read alone
        _equal(memory[p], stored[p])
    assert len(stored[3:9]) == 6 and all(_equal(a, b) is None for a, b in zip(memory[3:9], stored[3:9]))
    with pytest.raises(IndexError, match=r"index should be in range\(-103, 103\), but got index=103"):
        stored[len(texts)]
    assert stored.failed == [] and stored.report.rows == len(texts)
    assert repr(stored).startswith(f"StoredRunResult({len(texts)} inputs, {len(texts)} stored at ")


def test_numpy_stack_and_to_arrow_agree_between_memory_and_store(both, texts):
    memory, stored = both
    n = len(texts)
    for result in (memory, stored):
        with pytest.raises(ValueError, match=r"tokens should have rows of one shape to stack, but got first dimensions"):
            result.numpy()
    fixed = [{k: v for k, v in row.items() if k in ("half", "brain", "length", "pair")} for row in memory]
    stacked = RunResult(fixed).stack()
    assert stacked["half"].dtype == torch.float16 and stacked["half"].shape == (n, 4)
    assert stacked["brain"].dtype == torch.bfloat16 and torch.equal(stacked["brain"],
                                                                    torch.stack([r["brain"] for r in memory]))
    assert stacked["pair"][1].dtype == torch.int32 and stacked["pair"][1].shape == (n, 2)
    table_memory, table_stored = memory.to_arrow(), stored.to_arrow()
    assert table_memory.num_rows == table_stored.num_rows == n
    assert table_stored.column_names == ["position", "half", "brain", "tokens", "ids", "length", "label", "pair_0",
                                         "pair_1"]
    assert table_stored.column("position").to_pylist() == list(range(n))
    assert table_memory.column("label").to_pylist() == table_stored.column("label").to_pylist()


@pytest.mark.parametrize("fn, kwargs, kind", [
    (lambda b: b["attention_mask"][:, :2].float(), {}, "fixed_size_list<item: float>[2]"),
    (lambda b: b["input_ids"].float() / 3, {"token_outputs": "per_token"}, "list<item: float>"),
    (lambda b: b["attention_mask"][:, :2, None].repeat(1, 1, 3).float(), {}, "list<item: "
     "fixed_size_list<item: float>[3]>")])
def test_a_resumed_runs_to_arrow_has_the_schema_of_a_fresh_run(tokenizer, texts, tmp_path, fn, kwargs, kind):
    """A store read back from its files named list items ``element`` (Parquet's), the rows in memory ``item``."""
    loader = _load(texts[:8], tokenizer)
    fresh = run(fn, loader, progress=False, **kwargs).to_arrow()
    run(fn, loader, output_path=tmp_path, progress=False, **kwargs)
    resumed = run(fn, loader, output_path=tmp_path, progress=False, **kwargs)  # every row read back from the files
    assert resumed.report.rows == 0 and str(resumed.to_arrow().schema.field("output").type) == kind
    assert resumed.to_arrow().schema.to_string(show_field_metadata=True) == fresh.schema.to_string(
        show_field_metadata=True) and resumed.to_arrow().equals(fresh)


def test_per_token_rows_of_equal_lengths_are_lists_in_memory_as_in_the_store(tokenizer, tmp_path):
    """Arrow types a per-token output by what it is, not by whether its rows' lengths happen to be equal."""
    loader = _load(["one two three"] * 3 + ["four five six"] * 3, tokenizer)  # every text of one length

    def per_token(batch):
        return batch["input_ids"].float() / 3  # (rows, tokens): cut to each text's tokens

    memory, stored = (run(per_token, loader, token_outputs="per_token", progress=False, **kwargs)
                      for kwargs in ({}, {"output_path": tmp_path / "s"}))
    assert memory.varying == {()}
    assert memory.to_arrow().schema.field("output").type == pa.list_(pa.float32())
    assert memory.to_arrow().schema.equals(stored.to_arrow().schema)
    assert np.array_equal(memory.numpy(), stored.numpy()) and memory.numpy().shape == (6, 5)


def test_stack_gives_tensors_and_the_other_columns_as_lists(both, tmp_path):
    from dynabatch.inference.store import open_store

    memory, _ = both
    fixed = [{k: v for k, v in row.items() if k in ("half", "length", "label")} for row in memory]
    store = open_store(tmp_path, key=None, n=len(fixed))  # the same rows stored
    writer = store.writer("0")
    writer.write(np.arange(len(fixed)), fixed, np.zeros(len(fixed), dtype=np.uint64))
    writer.close()
    stored = StoredRunResult(store.located(len(fixed)))
    store.close()
    for stacked in (RunResult(fixed).stack(), stored.stack()):
        assert stacked["label"] == [row["label"] for row in fixed]  # strings: a list, not torch's object-array error
        assert torch.equal(stacked["half"], torch.stack([row["half"] for row in fixed]))
        assert stacked["length"].tolist() == [row["length"] for row in fixed]
    assert RunResult(["a", "b"]).stack() == ["a", "b"] and RunResult([["a", "b"], ["c"]]).stack() == [["a", "b"], ["c"]]
    assert RunResult(["a", "b"]).numpy().tolist() == ["a", "b"]  # numpy holds strings: an array of objects


def test_stacking_names_the_inputs_without_a_result(tokenizer, texts, tmp_path):
    from runner_helpers import _fails_at

    loader = _load(texts[:20], tokenizer)
    position = int(loader.batch_sampler.batches[0][1])
    fn = _fails_at(lambda b: b["attention_mask"].sum(1).float(), position)
    for result in (run(fn, loader, on_oom="skip", progress=False),
                   run(fn, loader, on_oom="skip", output_path=tmp_path / "s", progress=False)):
        assert result[position] is None and result.failed == [position]
        with pytest.raises(ValueError, match=rf"every input should have a result to stack them, but got 1 inputs "
                           rf"without one \(positions {position}; see \.failed\)"):
            result.stack()
        assert result.to_arrow().column("output").null_count == 1


def _readable(batch):
    """Rows of every stored shape: a fixed float16 vector and bfloat16 (batch-first tensors), and, given one per
    row, token ids and per-token pairs (lists) and a str."""
    mask, ids = batch["attention_mask"], batch["input_ids"]
    return {"embedding": ids[:, :3].to(torch.float16), "brain": (ids[:, :2] / 7).to(torch.bfloat16),
            "tokens": PerRow(ids[r][mask[r].bool()] for r in range(len(mask))),
            "pairs": PerRow(torch.stack([ids[r], mask[r]], 1)[mask[r].bool()].float() for r in range(len(mask))),
            "label": [f"n={int(mask[r].sum())}" for r in range(len(mask))]}


@pytest.fixture(scope="module")
def readable(tokenizer, texts, tmp_path_factory):
    path = tmp_path_factory.mktemp("readable") / "store"
    ids = [f"doc-{i}" for i in range(40)]
    return path, ids, run(_readable, _load(texts[:40], tokenizer, ids=ids), output_path=path, progress=False)


def test_pyarrow_reads_the_store_as_it_is(readable):
    import pyarrow.dataset as ds

    path, ids, result = readable
    import pyarrow.compute as pc

    table = ds.dataset(path).to_table()  # keyed by id: no position column; joined on id into the run's order
    table = table.take(pc.index_in(pa.array(ids), value_set=table.column("id")))
    assert table.column_names == ["id", "input_hash", "embedding", "brain", "tokens", "pairs", "label"]
    assert {f.name: str(f.type) for f in table.schema if f.name in ("embedding", "tokens", "pairs")} == {
        "embedding": "fixed_size_list<element: halffloat>[3]", "tokens": "list<element: int64>",
        "pairs": "list<element: fixed_size_list<element: float>[2]>"}
    assert table.schema.field("brain").metadata == {b"dynabatch.dtype": b"bfloat16"}  # float32 values, exact
    assert table.column("id").to_pylist() == ids
    assert table.column("tokens").to_pylist() == [row["tokens"].tolist() for row in result]


def test_pandas_reads_the_store_as_it_is(readable):
    import pandas as pd

    path, ids, result = readable
    frame = pd.read_parquet(path).set_index("id").loc[ids].reset_index()
    assert frame["id"].tolist() == ids and frame["label"].tolist() == [row["label"] for row in result]
    assert np.array_equal(np.stack(frame["embedding"].to_numpy()), np.stack([row["embedding"] for row in result]))
    assert [np.stack(p).shape for p in frame["pairs"]] == [tuple(row["pairs"].shape) for row in result]


def test_polars_reads_the_store_as_it_is(readable):
    import polars as pl

    path, ids, result = readable
    frame = pl.read_parquet(path)  # only Parquet files in it: polars reads the folder
    frame = pl.DataFrame({"id": ids}).join(frame, on="id", how="left", maintain_order="left")
    assert frame["id"].to_list() == ids
    assert isinstance(frame["embedding"].dtype, pl.Array) and frame["embedding"].dtype.shape == (3,)
    assert frame["tokens"].to_list() == [row["tokens"].tolist() for row in result]
    assert frame["brain"].to_list()[5] == result[5]["brain"].float().tolist()


def test_datasets_reads_the_store_as_it_is(readable):
    import datasets

    path, ids, result = readable
    hf = datasets.load_dataset("parquet", data_files=str(path / "*.parquet"), split="train")
    assert sorted(hf["id"]) == sorted(ids) and len(hf) == 40
    row = hf[0]
    want = result[ids.index(row["id"])]
    assert row["pairs"] == want["pairs"].tolist() and row["label"] == want["label"]


def test_batch_out_of_memory_error_pickles_with_either_result(both):
    import pickle

    from dynabatch import BatchOutOfMemoryError
    from dynabatch.inference.report import RunReport

    memory, stored = both
    for partial in (RunResult([1, None], report=RunReport()), stored):
        error = pickle.loads(pickle.dumps(BatchOutOfMemoryError("input position 1 ran out", position=1,
                                                                partial=partial)))
        assert str(error) == "input position 1 ran out" and error.position == 1
        assert len(error.partial) == len(partial) and type(error.partial) is type(partial)
    _equal(error.partial[4], memory[4])  # the stored result still reads its rows after the round trip
