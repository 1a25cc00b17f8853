"""The results store (dynabatch/inference/store.py) and its columns on Arrow's own types: every kind
of row comes back exactly, a column's type is fixed once by the first shard, stored rows are checked before a run
writes, and what the store cannot hold or keep is refused by name. No model: rows are built here."""

import subprocess
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dynabatch.inference.columns import Columns
from dynabatch.inference.results import StoredRunResult
from dynabatch.inference.store import open_store
from dynabatch.inference.store_shards import HOST
from dynabatch.inference.store_writer import CommitPolicy


def _equal(a, b):
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        assert b.untyped_storage().nbytes() == b.numel() * b.element_size()  # compact: no shared chunk kept alive
    elif isinstance(a, (np.ndarray, np.generic)):
        assert a.dtype == b.dtype and np.shape(a) == np.shape(b) and np.array_equal(a, b)
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _equal(x, y)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            _equal(a[key], b[key])
    else:
        assert a == b


def _table(rows, **kwargs):
    columns = Columns.of(rows[0])
    return columns, columns.table([columns.parts(rows)], **kwargs)


def _types(rows):
    return {field.name: str(field.type) for field in _table(rows)[1].schema}


def _hashes(n, salt=0):
    return np.arange(salt, salt + n, dtype=np.uint64)


def _store_threads():
    return [t for t in threading.enumerate() if t.name.startswith("dynabatch-store")]


def _write(path, rows, positions=None, n=None, name="0", **kwargs):
    """Rows written into the store at ``path`` by one writer (positions 0.. by default; input ``p`` hashes to ``p``),
    after checking the stored rows; the opened store."""
    positions = np.arange(len(rows)) if positions is None else np.asarray(positions)
    store = open_store(path, key="k", n=n if n is not None else int(positions.max()) + 1, **kwargs)
    store.check_inputs(np.arange(store.n), _hashes(store.n))
    writer = store.writer(name)
    writer.write(positions, rows, positions.astype(np.uint64))
    writer.close()
    return store


# --- rows as Arrow columns and back ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool, torch.uint8])
def test_tensor_rows_keep_dtype_and_shape(dtype):
    rows = [(torch.arange(6).reshape(2, 3) * (p + 1) % 5).to(dtype) for p in range(3)]  # (2, 3) per row
    vectors = [(torch.arange(4) * 0.37 * (p + 1)).to(dtype) for p in range(3)]
    scalars = [torch.tensor(p * 1.5).to(dtype) for p in range(3)]
    for given_rows in (rows, vectors, scalars):
        columns, table = _table(given_rows)
        _equal(given_rows, columns.rows(table))


def test_arrow_types_say_dtype_and_shape():
    assert _types([torch.randn(4, dtype=torch.float16)] * 3) == {"output": "fixed_size_list<item: halffloat>[4]"}
    _columns, table = _table([torch.randn(4).to(torch.bfloat16) for _ in range(3)])
    field = table.schema.field("output")  # no Arrow bfloat16: float32 (exact), said in the field's metadata
    assert str(field.type) == "fixed_size_list<item: float>[4]" and field.metadata == {b"dynabatch.dtype": b"bfloat16"}
    per_token = [torch.randn(n, 2) for n in (3, 3, 3)]  # two or more dimensions: the first varies, whatever it shows
    assert _types(per_token) == {"output": "list<item: fixed_size_list<item: float>[2]>"}
    assert _types([torch.tensor([3, 0, 0]), torch.tensor([1, 2, 0])]) == {"output": "list<item: int64>"}  # token ids
    assert _types([torch.randn(2), torch.randn(3)]) == {"output": "list<item: float>"}  # lengths differ: a list
    assert _types([{"n": 1, "score": 0.5, "ok": True, "label": "a", "tags": [1, 2]}]) == {
        "n": "int64", "score": "double", "ok": "bool", "label": "string", "tags": "list<item: int64>"}


def test_containers_scalars_lists_and_numpy_rows():
    rows = [
        {"vec": torch.ones(3) * p, "pair": (torch.tensor(p), f"label {p}"), "score": p / 3, "ok": p % 2 == 0,
         "n": p, "ids": [p, p + 1][: p + 1], "none": None, "array": np.arange(2, dtype=np.float16) + p,
         "np_scalar": np.int32(p), "ragged": np.ones((p + 1, 2), dtype=np.int8)}
        for p in range(3)
    ]
    columns, table = _table(rows)
    assert table.column_names == ["vec", "pair_0", "pair_1", "score", "ok", "n", "ids", "none", "array", "np_scalar",
                                  "ragged"]
    _equal(rows, columns.rows(table))
    tuples = [(torch.ones(2) * p, torch.tensor(p)) for p in range(3)]  # a tuple result: output_0, output_1
    columns, table = _table(tuples)
    assert table.column_names == ["output_0", "output_1"]
    _equal(tuples, columns.rows(table))
    for plain in ([1, 2, 3], [0.5, 1.5], [True, False], ["a", "b"], [None, None], [[1, None], [], None]):
        columns, table = _table(plain)
        assert columns.rows(table) == plain and [type(v) for v in columns.rows(table)] == [type(v) for v in plain]
    per_row_lists = [[torch.ones(2), torch.zeros(2)] for _ in range(2)]  # a list of tensors per row: output_0, _1
    columns, table = _table(per_row_lists)
    assert table.column_names == ["output_0", "output_1"] and isinstance(columns.rows(table)[0], list)


def test_numpy_rows_of_the_other_byte_order_are_stored_in_this_machines():
    swapped = ">" if np.little_endian else "<"  # arrays read from a file written on another machine, say
    rows = [{"vec": np.arange(3, dtype=swapped + "f4") + p, "ids": np.arange(p + 1, dtype=swapped + "i8")}
            for p in range(3)]
    columns, table = _table(rows)
    assert [str(table.schema.field(n).type) for n in ("vec", "ids")] == ["fixed_size_list<item: float>[3]",
                                                                         "list<item: int64>"]
    _equal([{key: value.astype(value.dtype.newbyteorder("=")) for key, value in row.items()} for row in rows],
           columns.rows(table))


def test_stacking_every_row():
    rows = [{"vec": torch.randn(3).to(torch.bfloat16), "n": p, "ids": torch.tensor([p, p])} for p in range(4)]
    columns, table = _table(rows)
    tensors = columns.stack(table, as_tensor=True)
    assert tensors["vec"].dtype == torch.bfloat16 and torch.equal(tensors["vec"], torch.stack([r["vec"] for r in rows]))
    assert tensors["n"].tolist() == [0, 1, 2, 3] and tensors["ids"].shape == (4, 2)  # a list column of one length
    arrays = columns.stack(table, as_tensor=False)
    assert arrays["vec"].dtype == np.float32 and arrays["vec"].shape == (4, 3)  # numpy has no bfloat16
    ragged = [torch.randn(n) for n in (2, 3)]
    columns, table = _table(ragged)
    with pytest.raises(ValueError, match=r"output should have rows of one shape to stack, but got first dimensions "
                       r"from 2 to 3"):
        columns.stack(table, as_tensor=True)
    columns, table = _table([{"vec": torch.ones(2)}, {"vec": None}])
    with pytest.raises(ValueError, match=r"vec should have a value in every row to stack, but got None in 1 rows"):
        columns.stack(table, as_tensor=True)


def test_what_arrow_cannot_hold_is_refused_by_name():
    with pytest.raises(TypeError, match=r"^output should be storable in Arrow with output_path set \(tensors, numpy "
                       r"arrays, int, float, bool, str or None, or tuples, lists or dicts \(str keys\) of those\), but "
                       r"got output of type object$"):
        _table([object(), object()])
    with pytest.raises(TypeError, match=r"output should be storable in Arrow with output_path set \(numbers or "
                       r"bools\), but got output of dtype complex64: convert it to a dtype of numbers"):
        _table([torch.ones(2, dtype=torch.complex64)])
    with pytest.raises(TypeError, match=r"output of dtype <U5: return a list of str \(array\.tolist\(\)\)"):
        _table(list(np.array(["label", "other"])[:, None]))  # a numpy array of labels, one per row
    with pytest.raises(TypeError, match=r"output keys should be str with output_path set \(column names\), but got "
                       r"key 1 of type int"):
        _table([{1: torch.ones(1)}])
    with pytest.raises(ValueError, match=r"fn\(batch\) should not name a result 'position' with output_path set"):
        _table([{"position": torch.ones(1)}])
    with pytest.raises(TypeError, match=r"output should be values of one type in every row with output_path set, "
                       r"but got \['float', 'int'\]"):  # Arrow alone would store 2.5 as 2
        _table([1, 2.5])
    with pytest.raises(ValueError, match=r"output should have dtype float32 and shape \(n, 2\) in every row, in the "
                       r"same batch \(n: any length\), but got dtype float32 and shape \(2, 3\)"):
        _table([torch.ones(1, 2), torch.ones(2, 3)])
    with pytest.raises(ValueError, match=r"output should be a list of 1 items in every row, as stored, but got list "
                       r"of 2 items: a row that is a list of lists, .* return each row as one tensor"):
        _table([[[0, 3]], [[0, 3], [5, 7]]])  # entity spans, a number per row
    with pytest.raises(ValueError, match=r"output should be a dict with keys \['a', 'b'\] in every row, as stored, "
                       r"but got \['b', 'a'\]: the same keys in another order, .*; give every row's keys in one order$"):
        _table([{"a": 1, "b": 2}, {"b": 2, "a": 1}])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=1, max_size=12), st.integers(1, 3), st.sampled_from(["float32", "int64"]))
def test_rows_of_any_lengths_come_back_exactly_from_a_slice(lengths, width, dtype):
    rng = np.random.default_rng(len(lengths))
    rows = [torch.from_numpy(rng.normal(size=(n, width)).astype(dtype)) for n in lengths]
    columns, table = _table(rows)
    half = table.slice(len(rows) // 2)  # a slice of a shard, as a row read back alone
    _equal(rows[len(rows) // 2:], columns.rows(half))


# --- the store: one schema fixed by the first shard --------------------------------------------------------


def test_rows_written_come_back_and_the_store_says_which_inputs_it_holds(tmp_path):
    rows = [{"vec": torch.full((3,), p, dtype=torch.bfloat16), "label": f"r{p}"} for p in range(4)]
    _write(tmp_path, rows, positions=[5, 1, 3, 0], n=6)
    store = open_store(tmp_path, key="k", n=6)
    assert store.done.tolist() == [True, True, False, True, False, True]
    result = StoredRunResult(store.located(6))
    assert result[2] is None and result.failed == [] and len(result) == 6  # failed: failure records, none here
    _equal(result[5], rows[0])
    _equal(list(result), [rows[3], rows[1], None, rows[2], None, rows[0]])
    assert result.to_arrow().column("label").to_pylist() == ["r3", "r1", None, "r2", None, "r0"]


def test_a_float_vector_of_one_length_in_the_first_shard_is_fixed_unless_declared_varying(tmp_path):
    same = [torch.ones(5) for _ in range(4)]  # per-token scores of four rows all cut to 5 tokens, say
    _write(tmp_path / "fixed", same)
    with pytest.raises(ValueError, match=r"output should have dtype float32 and shape \(5,\) in every row, as stored, "
                       r"but got dtype float32 and shape \(2,\); a float vector is stored with a "
                       r"fixed length when it has one length in every row of the first shard, unless declared"):
        _write(tmp_path / "fixed", [torch.ones(2)], positions=[4])
    store = open_store(tmp_path / "declared", key="k", n=6)
    writer = store.writer("0")
    writer.write(np.arange(4), same, _hashes(4), varying=[()])  # the run says: per-token, any length
    writer.write(np.array([4, 5]), [torch.ones(2), torch.ones(7)], _hashes(2))
    writer.close()
    assert str(pq.read_schema(next(tmp_path.glob("declared/part-*"))).field("output").type) == "list<element: float>"
    assert [len(row) for row in StoredRunResult(store.located(6))] == [5, 5, 5, 5, 2, 7]


def test_a_column_none_in_the_first_shard_is_typed_by_its_first_value_and_every_reader_reads_all_shards(tmp_path):
    import datasets
    import pandas as pd
    import polars as pl
    import pyarrow.dataset as ds

    _write(tmp_path, [{"note": None, "vec": None, "n": p} for p in range(3)])  # the first shard: two null columns
    assert str(pq.read_schema(next(tmp_path.glob("part-*"))).field("note").type) == "null"
    later = [{"note": "late", "vec": torch.ones(2, dtype=torch.float16), "n": 3}, {"note": None, "vec": None, "n": 4}]
    store = _write(tmp_path, later, positions=[3, 4], n=5)  # typed now: stored, not refused
    located = store.located(5)  # the end of a run: the null shard rewritten with the types (settled)
    assert {str(pq.read_schema(f).field("note").type) for f in tmp_path.glob("part-*")} == {"string"}
    rows = list(StoredRunResult(located))
    assert [r["note"] for r in rows] == [None, None, None, "late", None] and rows[3]["vec"].dtype == torch.float16
    assert ds.dataset(tmp_path).to_table().sort_by("position").column("note").to_pylist()[3] == "late"
    assert pd.read_parquet(tmp_path).sort_values("position")["note"].tolist()[3] == "late"
    assert pl.read_parquet(f"{tmp_path}/*.parquet").sort("position")["note"].to_list()[3] == "late"
    hf = datasets.load_dataset("parquet", data_files=f"{tmp_path}/*.parquet", split="train")
    assert hf["note"].count("late") == 1 and hf["note"].count(None) == 4
    late = open_store(tmp_path / "late", key="k", n=4)  # a value before the first shard is committed: typed
    writer = late.writer("0")
    writer.write(np.arange(2), [{"vec": None}, {"vec": None}], _hashes(2))
    writer.write(np.arange(2, 4), [{"vec": torch.ones(2, dtype=torch.float16)}, {"vec": None}], _hashes(2))
    writer.close()
    assert str(late.schema.field("vec").type) == "fixed_size_list<item: halffloat>[2]"
    assert [r["vec"] is None for r in StoredRunResult(late.located(4))] == [True, True, False, True]


def test_a_real_type_change_is_refused_at_the_write_that_shows_it_naming_the_column_and_both_types(tmp_path):
    store = open_store(tmp_path, key="k", n=6)
    writer = store.writer("0")
    writer.write(np.arange(2), [{"label": 1}, {"label": None}], _hashes(2))  # buffered, no shard yet
    with pytest.raises(TypeError, match=r"^label should keep one type in every row with output_path set \(int, as in "
                       r"the rows stored or written before\), but got str: convert it"):
        writer.write(np.array([2]), [{"label": "two"}], _hashes(1))
    other = store.writer("1")  # another device's writer of the same store: refused at its write too
    with pytest.raises(TypeError, match=r"label should keep one type .*\(int, as in .*\), but got float"):
        other.write(np.array([3]), [{"label": 2.5}], _hashes(1))
    writer.close()
    other.close()
    assert StoredRunResult(store.located(6)).to_arrow().column("label").to_pylist()[:3] == [1, None, None]
    store.close()  # one run at a time: the next open is another run
    with pytest.raises(TypeError, match=r"label should be values of one type in every row with output_path set "
                       r"\(int, as stored\), but got \['str'\]"):  # the stored type, from another open
        _write(tmp_path, [{"label": "four"}], positions=[4], n=6)


def test_a_path_under_the_home_directory_is_one_folder_for_the_store_and_its_shards(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)  # a literal "~" folder would be made here
    _write("~/results", [torch.ones(2)] * 2).close()  # pyarrow writes the shards to $HOME/results
    assert pq.read_table(tmp_path / "home" / "results").num_rows == 2 and not (tmp_path / "~").exists()


def test_a_hidden_file_dropped_into_a_store_is_left_alone_as_its_readers_skip_it(tmp_path):
    _write(tmp_path, [torch.ones(2)] * 2, n=3).close()
    (tmp_path / ".DS_Store").write_bytes(b"Bud1")  # macOS's Finder writes one into every folder it shows
    store = open_store(tmp_path, key="k", n=3)
    assert store.done.tolist() == [True, True, False] and pq.read_table(tmp_path).num_rows == 2
    store.close()
    pq.write_table(pa.table({"x": [1]}), tmp_path / ".x.parquet")  # a glob of *.parquet may read it: refused
    with pytest.raises(ValueError, match=r"holding 1 other entries \(\.x\.parquet\); remove them"):
        open_store(tmp_path, key="k")


def test_rows_that_do_not_fit_the_stored_columns_are_refused(tmp_path):
    _write(tmp_path, [{"a": torch.ones(4), "b": 2}])
    for rows, error, message in [
        ([{"a": torch.ones(4, dtype=torch.float16), "b": 2}], ValueError, (r"a should have dtype float32 and shape "
         r"\(4,\) in every row, as stored, but got dtype float16 and shape \(4,\); convert it to that type, or use "
         r"another output_path")),
        ([{"a": torch.ones(4)}], ValueError, (r"output should be a dict with keys \['a', 'b'\] in every row, as stored, "
         r"but got \['a'\]")),
        ([{"a": torch.ones(4), "b": 2.5}], TypeError, (r"b should be values of one type in every row with output_path "
         r"set \(int, as stored\), but got \['float'\]")),
        ([{"a": np.ones(4, dtype=np.float32), "b": 2}], TypeError, (r"a should be a tensor or None in every row, as "
         r"stored, but got a numpy array")),
    ]:
        with pytest.raises(error, match=message):
            _write(tmp_path, rows, positions=[1])


def test_several_writers_write_into_one_store(tmp_path):
    rows = [torch.full((2,), float(p)) for p in range(6)]
    stores = [open_store(tmp_path, key="k", n=6, job="one job") for _ in range(2)]  # two processes (ranks), say
    writers = [stores[0].writer("cpu0"), stores[0].writer("cpu1"), stores[1].writer("0")]
    for i, writer in enumerate(writers):
        writer.write(np.array([i, i + 3]), [rows[i], rows[i + 3]], _hashes(2))
    for writer in writers:
        writer.close()
    assert len(list(tmp_path.glob("part-*.parquet"))) == 3 and not _store_threads()
    _equal(list(StoredRunResult(stores[1].located(6))), rows)


# --- checked before written, committed or dropped, threads stopped ---------------------------------------------


def test_stored_rows_of_other_inputs_are_refused_and_the_refused_run_writes_nothing(tmp_path):
    _write(tmp_path, [torch.ones(2)] * 4)
    store = open_store(tmp_path, key="k", n=6)
    writer = store.writer("0")
    with pytest.raises(RuntimeError, match=r"4 stored rows of this run's inputs should be checked "
                       r"\(store.check_inputs\) before the run writes"):
        writer.write(np.array([4]), [torch.ones(2)], _hashes(1))
    store.check_inputs(np.arange(2), _hashes(2))  # half of them checked: still not written
    with pytest.raises(RuntimeError, match=r"2 stored rows"):
        writer.write(np.array([4]), [torch.ones(2)], _hashes(1))
    with pytest.raises(ValueError, match=r"output_path='.*' should hold results of these inputs at their positions, "
                       r"but got 1 stored rows computed from other inputs \(positions 3\).*key='k'.*give the loader "
                       r"ids= to key rows by id"):
        store.check_inputs(np.arange(2, 6), np.array([2, 99, 4, 5], dtype=np.uint64))
    writer.close(commit=True)  # nothing buffered, nothing committed: the store stays as it was
    store.close()
    assert len(list(tmp_path.glob("part-*"))) == 1 and open_store(tmp_path, key="k").n == 4


def test_ids_key_rows_and_are_named_when_refused(tmp_path):
    ids = pa.array(["a", "b", "c"])
    _write(tmp_path, [torch.ones(1)] * 3, ids=ids)
    store = open_store(tmp_path, key="k", ids=pa.array(["c", "x", "a"]))
    assert store.done.tolist() == [True, False, True]
    with pytest.raises(ValueError, match=r"at their ids, but got 1 stored rows computed from other inputs \(ids c\)"):
        store.check_inputs(np.arange(3), np.array([9, 0, 0], dtype=np.uint64))
    store.close()
    with pytest.raises(ValueError, match=r"the loader's ids should be of type string, as the ids of the results at "
                       r"output_path='.*', but got ids of type int64"):
        open_store(tmp_path, key="k", ids=pa.array([1, 2]))
    with pytest.raises(ValueError, match=r"the loader's ids should be given \(the store keys rows by id\)"):
        open_store(tmp_path, key="k", n=3)
    assert open_store(tmp_path, key="k", keyed_by="id").ids.to_pylist() == ["a", "b", "c"]  # the ids stored


def test_close_commits_or_drops_the_buffer_and_its_thread_has_stopped(tmp_path, monkeypatch):
    monkeypatch.setattr("dynabatch.inference.store_writer.COMMIT", CommitPolicy(rows=2))
    store = open_store(tmp_path, key="k", n=4)
    writer = store.writer("0")
    try:
        writer.write(np.arange(2), [torch.ones(2)] * 2, _hashes(2))  # a full shard: handed to the thread
        assert _store_threads()
        writer.write(np.array([2]), [torch.ones(2)], _hashes(1))  # buffered
        raise KeyboardInterrupt
    except KeyboardInterrupt:
        pass
    finally:
        writer.close(commit=False)  # what a run does on Ctrl-C: the shard handed over lands, the buffer is dropped
        store.close()
    assert not _store_threads() and open_store(tmp_path, key="k").done.tolist() == [True, True]
    writer = open_store(tmp_path, key="k", n=4).writer("1")
    writer.store.check_inputs(np.arange(2), _hashes(2))
    writer.write(np.array([3]), [torch.ones(2)], _hashes(1))
    writer.close()  # commit=True: the buffered row is committed
    writer.store.close()
    assert open_store(tmp_path, key="k").done.tolist() == [True, True, False, True] and not _store_threads()


def test_what_is_not_a_store_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"output_path should be a new or empty directory, or a dynabatch results "
                       r"store, but got output_path='.*' holding 1 other entries \(notes\.txt\); remove them, or use "
                       r"another directory"):
        open_store(tmp_path, key="k")
    (tmp_path / ".DS_Store").write_bytes(b"Bud1")  # hidden: no store here to leave it alone in
    with pytest.raises(ValueError, match=r"holding 2 other entries \(\.DS_Store, notes\.txt\)"):
        open_store(tmp_path, key="k")
    (tmp_path / "notes.txt").unlink()
    pq.write_table(pa.table({"x": [1]}), tmp_path / "part-x.parquet")
    with pytest.raises(ValueError, match=r"holding part-x\.parquet, a Parquet file dynabatch did not write"):
        open_store(tmp_path, key="k")


@pytest.mark.parametrize("damage", [b'"key": "k"', b'"format"', b"position"])  # another key, not JSON, no key column
def test_a_shard_whose_footer_has_a_flipped_byte_is_set_aside_not_refusing_the_store(tmp_path, caplog, damage):
    import base64
    import re

    _write(tmp_path, [torch.ones(3)] * 2).close()
    shard = next(tmp_path.glob("part-*.parquet"))
    data = shard.read_bytes()
    # The schema and metadata readers take are the footer's ARROW:schema (base64), which no page checksum covers.
    at = data.index(b"ARROW:schema")  # then the base64 of an IPC message, which starts with its continuation marker
    encoded = re.compile(rb"/////[A-Za-z0-9+/]*=*").search(data, at).group()
    schema = bytearray(base64.b64decode(encoded))
    schema[schema.index(damage) + len(damage) - 2] ^= 0x01
    flipped = base64.b64encode(bytes(schema))
    assert len(flipped) == len(encoded)
    shard.write_bytes(data.replace(encoded, flipped))
    store = open_store(tmp_path, key="k", n=2)
    assert not store.done.any()  # its rows run again, not a refusal naming another key, nor a KeyError
    assert (tmp_path / f".torn-{shard.name}.torn").exists() and f"{shard.name} cannot be read" in caplog.text
    store.close()


# --- failure records, commits that never drop rows, early commits, merged shards -----------------------------------


def test_failure_records_are_reported_kept_out_of_the_rows_readers_read_and_retried(tmp_path):
    import datasets
    import pandas as pd
    import polars as pl
    import pyarrow.dataset as ds

    store = open_store(tmp_path, key="k", n=5)
    writer = store.writer("0")
    writer.write(np.array([0, 2]), [torch.ones(2)] * 2, np.array([0, 2], dtype=np.uint64))
    writer.fail(np.array([1, 3]), np.array([1, 3], dtype=np.uint64), ["ValueError: cannot process this input\n  (a traceback line)",
                                               "out of memory alone: 1 row of 40 tokens"])
    writer.close()
    assert store.located(5).failures == {1: "ValueError: cannot process this input", 3: "out of memory alone: 1 row of 40 tokens"}
    located = store.located(5)
    result = StoredRunResult(located)
    assert result.failed == [1, 3] and result[1] is None and result.failures[3].startswith("out of memory")
    assert located.where[4] < 0 and 4 not in result.failures  # no row, no record: the case a run raises for
    assert result.accounting.missing.tolist() == [4] and (result.accounting.stored, result.accounting.now) == (2, 2)
    store.close()
    assert ds.dataset(tmp_path).to_table().column("position").to_pylist() == [0, 2]  # the records are not rows
    assert len(pd.read_parquet(tmp_path)) == len(pl.read_parquet(f"{tmp_path}/*.parquet")) == 2
    assert len(datasets.load_dataset("parquet", data_files=f"{tmp_path}/*.parquet", split="train")) == 2
    rerun = open_store(tmp_path, key="k", n=5)  # a rerun: the failed inputs are not done, so they run again
    assert rerun.done.tolist() == [True, False, True, False, False]
    rerun.check_inputs(np.arange(5), _hashes(5))
    writer = rerun.writer("0")
    writer.write(np.array([1]), [torch.zeros(2)], _hashes(1, salt=1))  # stored now
    writer.fail(np.array([3]), _hashes(1, salt=3), ["RuntimeError: still failing"])  # the latest record counts
    writer.close()
    assert rerun.located(5).failures == {3: "RuntimeError: still failing"}
    rerun.close()


def test_a_transient_write_error_is_retried_and_a_lasting_one_raised_with_the_rows_kept(tmp_path, monkeypatch,
                                                                                        caplog):
    import errno

    from dynabatch.inference import store_shards as store_module

    monkeypatch.setattr(store_module, "RETRY_SECONDS", 0.0)
    write, failures = pq.write_table, []

    def flaky(table, where, **kwargs):
        if failures:
            failures.pop()
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(table, where, **kwargs)

    monkeypatch.setattr(store_module.pq, "write_table", flaky)
    store = open_store(tmp_path, key="k", n=4, job="one job")  # its opens below: other processes of the job
    writer = store.writer("0")
    failures.append(1)  # one shard write fails once: tried again, stored
    writer.write(np.arange(2), [torch.ones(2)] * 2, _hashes(2))
    writer.close()
    assert store.done.sum() == 0 and open_store(tmp_path, key="k", n=4, job="one job").done.tolist() == [True, True,
                                                                                                         False, False]
    assert "No space left on device" in caplog.text and "trying again (2 of 5)" in caplog.text
    store.check_inputs(np.arange(4), _hashes(4))
    writer = store.writer("1")
    failures.extend([1] * 5)  # every try fails: raised at close, the rows kept for a later close
    writer.write(np.array([2, 3]), [torch.ones(2)] * 2, _hashes(2, salt=2))
    with pytest.raises(OSError, match=r"No space left on device") as raised:
        writer.close()
    assert "failed 5 times; its rows are kept by the writer" in str(raised.value.__notes__)
    assert not list(tmp_path.glob(".tmp-*")) and len(writer.sealed) == 1
    writer.close()  # the disk has room again: the kept rows are committed
    assert open_store(tmp_path, key="k", n=4, job="one job").done.all()


def test_a_row_that_does_not_fit_is_refused_at_write_and_the_rows_before_it_are_kept(tmp_path):
    store = open_store(tmp_path, key="k", n=4)
    writer = store.writer("0")
    writer.write(np.arange(2), [{"vec": torch.ones(3)}] * 2, _hashes(2))
    with pytest.raises(ValueError, match=r"^vec should have dtype float32 and shape \(n,\) in every row, in the same "
                       r"batch \(n: any length\), but got dtype float32 and shape \(4, 3\)"):
        writer.write(np.array([2, 3]), [{"vec": torch.ones(3)}, {"vec": torch.ones(4, 3)}], _hashes(2))
    with pytest.raises(TypeError, match=r"^vec should keep one type in every row with output_path set \(float32 \(3,\), "
                       r"as in the rows stored or written before\), but got int64 \(n,\)"):
        writer.write(np.array([2]), [{"vec": torch.ones(3, dtype=torch.int64)}], _hashes(1))
    writer.close()
    store.close()
    assert open_store(tmp_path, key="k", n=4).done.tolist() == [True, True, False, False]


def test_rows_are_committed_within_seconds_without_another_write_the_first_shard_sooner(tmp_path, monkeypatch):
    from dynabatch.inference import store_writer

    assert (store_writer.COMMIT.first_seconds, store_writer.COMMIT.seconds) == (2.0, 10.0)
    monkeypatch.setattr(store_writer, "COMMIT", CommitPolicy(first_seconds=0.4, seconds=1.2))
    store = open_store(tmp_path, key="k", n=4)
    writer = store.writer("0")

    def shards_after(seconds):
        time.sleep(seconds)
        return len(list(tmp_path.glob("part-*.parquet")))

    writer.write(np.arange(2), [torch.ones(2)] * 2, _hashes(2))  # then the device is busy, say, and nothing comes
    assert shards_after(0.1) == 0 and shards_after(0.8) == 1  # on disk: a kill now keeps these rows
    writer.write(np.arange(2, 4), [torch.ones(2)] * 2, _hashes(2, salt=2))
    assert shards_after(0.5) == 1 and shards_after(1.3) == 2  # a later shard waits longer
    writer.close()


def test_small_shards_are_merged_and_a_crash_between_steps_leaves_each_row_once(tmp_path, monkeypatch):
    import pyarrow.dataset as ds

    from dynabatch.inference import store as store_module

    monkeypatch.setattr("dynabatch.inference.store_writer.COMMIT", CommitPolicy(rows=1, compact=4))  # shard per row
    store = open_store(tmp_path, key="k", n=10)
    writer = store.writer("0")
    for p in range(10):
        writer.write(np.array([p]), [torch.full((2,), float(p))], _hashes(1, salt=p))
        if p % 2:
            writer.fail(np.array([p + 10]), _hashes(1), [f"failed {p}"])  # outside n: kept, merged alike
    writer.close()
    names = sorted(f.name for f in tmp_path.glob("part-*.parquet"))  # 15 shards (rows, records) merged 4 at a time
    assert len(names) == 5 and names[0].endswith("-00000-00003.parquet") and names[2].endswith("-00008-00011.parquet")
    assert len(list((tmp_path / "_failed").glob("*.parquet"))) == 4  # records merged with the shards of their seq
    assert sorted(pq.read_table(tmp_path / "_failed").column("cause").to_pylist()) == [f"failed {p}" for p in (1, 3,
                                                                                                            5, 7, 9)]
    assert sorted(ds.dataset(tmp_path).to_table().column("position").to_pylist()) == list(range(10))
    # A crash after a merged shard is in place, before its parts are removed: both on disk.
    monkeypatch.setattr(store_module.StoreWriter, "_remove", lambda self, parts: None)
    crashed = tmp_path / "crashed"
    store = open_store(crashed, key="k", n=6)
    writer = store.writer("0")
    for p in range(6):
        writer.write(np.array([p]), [torch.full((2,), float(p))], _hashes(1, salt=p))
    writer.close()
    store.close()
    assert len(list(crashed.glob("part-*.parquet"))) == 7  # 4 parts, their merged shard, the 5th and 6th
    dead = subprocess.Popen(["true"])
    dead.wait()
    temp = crashed / f".tmp-{HOST}-{dead.pid}-part-x-00000-00009.parquet.tmp"  # a merge cut short earlier
    temp.write_bytes(b"PAR1 half")
    reopened = open_store(crashed, key="k", n=6)  # the parts a merged shard holds are removed: each row once
    assert reopened.done.all() and len(list(crashed.glob("part-*.parquet"))) == 3 and not temp.exists()
    assert sorted(ds.dataset(crashed).to_table().column("position").to_pylist()) == list(range(6))
    assert [float(r[0]) for r in StoredRunResult(reopened.located(6))] == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize("later_run", [False, True])
def test_a_reader_during_a_merge_reads_no_row_twice_and_a_merge_a_kill_cut_short_is_finished(tmp_path, monkeypatch,
                                                                                               caplog, later_run):
    import os

    import pyarrow.dataset as ds

    from dynabatch.inference import store_writer

    monkeypatch.setattr("dynabatch.inference.store_writer.COMMIT", CommitPolicy(rows=1, compact=4))  # shard per row
    seen, remove = [], store_writer.StoreWriter._remove

    def crashing(self, parts):  # a reader looks just before the parts go; then a kill after the first two went
        seen.append(ds.dataset(tmp_path).to_table().column("position").to_pylist())
        remove(self, parts[:2])
        raise RuntimeError("killed")

    monkeypatch.setattr(store_writer.StoreWriter, "_remove", crashing)
    store = open_store(tmp_path, key="k", n=4)
    writer = store.writer("0")
    for p in range(4):
        writer.write(np.array([p]), [torch.full((2,), float(p))], _hashes(1, salt=p))
    with pytest.raises(RuntimeError, match="killed"):
        writer.close()
    store.close()
    monkeypatch.undo()
    assert seen == [[0, 1, 2, 3]]  # the merged shard of 0-3 not read beside its parts
    dead = subprocess.Popen(["true"])
    dead.wait()
    (hidden,) = tmp_path.glob(".merge-*")  # the killed writer's: its pid no longer runs
    hidden.rename(tmp_path / hidden.name.replace(f"-{os.getpid()}-", f"-{dead.pid}-"))
    assert sorted(ds.dataset(tmp_path).to_table().column("position").to_pylist()) == [2, 3]  # the merged one hidden
    if later_run:  # a run on another host (the killed writer's lies on this one) ran 0 and 1 again since
        (elsewhere,) = tmp_path.glob(".merge-*")
        away = elsewhere.rename(tmp_path / elsewhere.name.replace(f".merge-{HOST}-", ".merge-elsewhere-"))
        _write(tmp_path, [torch.zeros(2)] * 2, positions=[0, 1], n=4).close()
        away.rename(elsewhere)  # opened on its host again: it would hold 0 and 1 a second time
        reopened = open_store(tmp_path, key="k", n=4)
        assert not list(tmp_path.glob(".merge-*")) and f"{elsewhere.name}, a merge a killed run" in caplog.text
        assert sorted(ds.dataset(tmp_path).to_table().column("position").to_pylist()) == list(range(4))
        assert [float(r[0]) for r in StoredRunResult(reopened.located(4))] == [0, 0, 2, 3]
        return
    reopened = open_store(tmp_path, key="k", n=4)  # renamed in place, the parts it holds removed: each row once
    assert reopened.done.all() and not list(tmp_path.glob(".merge-*"))
    assert sorted(ds.dataset(tmp_path).to_table().column("position").to_pylist()) == list(range(4))
    assert [float(r[0]) for r in StoredRunResult(reopened.located(4))] == [0, 1, 2, 3]


def test_a_shard_committed_full_is_never_merged_however_small_its_file(tmp_path, monkeypatch):
    # Zeros compress to a Parquet file a small fraction of their 64 KiB of Arrow data: judged by the file, every shard
    # would read as small and be merged (16 at a time in a real run: their whole data read back and written again).
    monkeypatch.setattr("dynabatch.inference.store_writer.COMMIT", CommitPolicy(bytes=64 * 2**10, compact=2))
    store = open_store(tmp_path, key="k", n=4096)
    writer = store.writer("0")
    for start in range(0, 4096, 1024):
        writer.write(np.arange(start, start + 1024), [torch.zeros(16)] * 1024, _hashes(1024, salt=start))
    writer.close()
    store.close()
    files = sorted(tmp_path.glob("part-*.parquet"))
    assert [f.name.rsplit("-", 1)[-1] for f in files] == ["00000.parquet", "00001.parquet", "00002.parquet",
                                                         "00003.parquet"]  # none merged
    assert max(f.stat().st_size for f in files) < 64 * 2**10 // 4  # and each file is small
    assert open_store(tmp_path, key="k", n=4096).done.all()


def test_positions_are_not_stored_where_ids_key_the_rows(tmp_path):
    ids = pa.array([f"id-{i}" for i in range(6)])
    _write(tmp_path, [torch.ones(1)] * 4, ids=ids.slice(0, 4))  # a first run over four ids
    order = np.array([5, 4, 3, 2, 1, 0])  # a rerun over all six, in another order
    store = open_store(tmp_path, key="k", ids=ids.take(pa.array(order)))
    assert store.done.tolist() == [False, False, True, True, True, True]
    store.check_inputs(np.arange(6), np.arange(6, dtype=np.uint64)[order])
    writer = store.writer("0")
    writer.write(np.array([0, 1]), [torch.zeros(1)] * 2, np.array([5, 4], dtype=np.uint64))
    writer.close()
    table = pq.read_table(tmp_path)
    assert "position" not in table.column_names and sorted(table.column("id").to_pylist()) == ids.to_pylist()
