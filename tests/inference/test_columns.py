"""Rows as Arrow columns and back (dynabatch/inference/_columns.py): every kind of row ``run`` gives comes back
exactly (type, dtype, shape, values), and what Arrow cannot hold is refused by name."""

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dynabatch.inference._columns import Layout
from dynabatch.inference._decode import decode_rows, stack_columns


def _round_trip(rows, real_lengths=None):
    layout = Layout.infer(rows, real_lengths)
    columns = layout.encode(rows)
    table = pa.table(columns)
    again = Layout.from_json(layout.to_json())  # as read from a shard's metadata
    assert again == layout
    return layout, columns, decode_rows(again, {name: table.column(name) for name in columns})


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
                                   torch.int8, torch.bool, torch.uint8])
def test_tensor_rows_keep_dtype_and_shape(dtype):
    rows = [(torch.arange(6).reshape(2, 3) * (p + 1) % 5).to(dtype) for p in range(3)]  # (2, 3) per row
    vectors = [(torch.arange(4) * 0.37 * (p + 1)).to(dtype) for p in range(3)]
    scalars = [torch.tensor(p * 1.5).to(dtype) for p in range(3)]
    for given_rows in (rows, vectors, scalars):
        _, _, back = _round_trip(given_rows)
        for a, b in zip(given_rows, back):
            _equal(a, b)


def test_arrow_types_fixed_ragged_half_and_bfloat16():
    embeddings = [torch.randn(4, dtype=torch.float16) for _ in range(3)]
    assert str(Layout.infer(embeddings).encode(embeddings)["output"].type) == "fixed_size_list<item: halffloat>[4]"
    brain = [torch.randn(4).to(torch.bfloat16) for _ in range(3)]
    array = Layout.infer(brain).encode(brain)["output"]
    assert str(array.type) == "fixed_size_list<item: float>[4]"  # no Arrow bfloat16: float32, exact
    per_token = [torch.randn(n, 2) for n in (3, 1, 2)]
    assert str(Layout.infer(per_token).encode(per_token)["output"].type) == \
        "list<item: fixed_size_list<item: float>[2]>"
    tags = [torch.tensor([3, 0, 0]), torch.tensor([1, 2, 0])]  # token ids / tags: ragged whatever the first batch
    assert str(Layout.infer(tags).encode(tags)["output"].type) == "list<item: int64>"


def test_a_per_token_output_is_ragged_when_its_first_batch_is_all_one_length():
    rows = [torch.randn(5) for _ in range(4)]  # e.g. per-token scores of four rows truncated to 5 tokens
    assert Layout.infer(rows).specs["output"].shape == [5]  # a fixed vector, without the real lengths
    layout = Layout.infer(rows, real_lengths=np.array([5, 5, 5, 5]))
    assert layout.specs["output"].shape == [None]
    shorter = [torch.randn(2), torch.randn(4)]
    _equal(shorter, decode_rows(layout, layout.encode(shorter)))


def test_containers_scalars_lists_and_numpy_rows():
    rows = [
        {"vec": torch.ones(3) * p, "pair": (torch.tensor(p), f"label {p}"), "score": p / 3, "ok": p % 2 == 0,
         "n": p, "ids": [p, p + 1][: p + 1], "none": None, "array": np.arange(2, dtype=np.float16) + p,
         "np_scalar": np.int32(p)}
        for p in range(3)
    ]
    _, columns, back = _round_trip(rows)
    assert list(columns) == ["vec", "pair_0", "pair_1", "score", "ok", "n", "ids", "none", "array", "np_scalar"]
    for a, b in zip(rows, back):
        _equal(a, b)
    tuples = [(torch.ones(2) * p, torch.tensor(p)) for p in range(3)]  # a tuple result: output_0, output_1
    _, columns, back = _round_trip(tuples)
    assert list(columns) == ["output_0", "output_1"]
    for a, b in zip(tuples, back):
        _equal(a, b)
    for plain in ([1, 2, 3], [0.5, 1.5], [True, False], ["a", "b"], [None, None]):
        _, _, back = _round_trip(plain)
        assert back == plain and [type(v) for v in back] == [type(v) for v in plain]
    per_row_lists = [[torch.ones(2), torch.zeros(2)] for _ in range(2)]  # a list of tensors per row: output_0, _1
    _, columns, back = _round_trip(per_row_lists)
    assert list(columns) == ["output_0", "output_1"] and isinstance(back[0], list)


def test_stacking_every_row():
    rows = [{"vec": torch.randn(3).to(torch.bfloat16), "n": p} for p in range(4)]
    layout = Layout.infer(rows)
    columns = layout.encode(rows)
    tensors = stack_columns(layout, columns, as_tensor=True)
    assert tensors["vec"].dtype == torch.bfloat16 and torch.equal(tensors["vec"], torch.stack([r["vec"] for r in rows]))
    assert tensors["n"].tolist() == [0, 1, 2, 3]
    arrays = stack_columns(layout, columns, as_tensor=False)
    assert arrays["vec"].dtype == np.float32 and arrays["vec"].shape == (4, 3)  # numpy has no bfloat16
    ragged = [torch.randn(n) for n in (2, 3)]
    with pytest.raises(ValueError, match=r"output should have rows of one shape to stack, but got first dimensions "
                       r"from 2 to 3"):
        stack_columns(Layout.infer(ragged), Layout.infer(ragged).encode(ragged), as_tensor=True)
    same = [torch.tensor([1, 2]), torch.tensor([3, 4])]  # ragged by dtype, one length in fact: stacks
    assert stack_columns(Layout.infer(same), Layout.infer(same).encode(same), as_tensor=True).tolist() == [[1, 2], [3, 4]]


def test_what_arrow_cannot_hold_is_refused_by_name():
    with pytest.raises(TypeError, match=r"^output should be storable in Arrow with output_path set \(tensors, numpy "
                       r"arrays, int, float, bool, str or None, or tuples, lists or dicts \(str keys\) of those\), but "
                       r"got output of type object$"):
        Layout.infer([object(), object()])
    with pytest.raises(TypeError, match=r"output should be storable in Arrow with output_path set \(numbers or "
                       r"bools\), but got output of dtype complex64"):
        Layout.infer([torch.ones(2, dtype=torch.complex64)])
    with pytest.raises(TypeError, match=r"output keys should be str with output_path set \(column names\), but got "
                       r"key 1 of type int"):
        Layout.infer([{1: torch.ones(1)}])
    with pytest.raises(ValueError, match=r"fn\(batch\) should not name a result 'position' with output_path set"):
        Layout.infer([{"position": torch.ones(1)}])


def test_rows_that_do_not_fit_the_stored_layout_are_refused():
    layout = Layout.infer([torch.ones(4), torch.zeros(4)])
    with pytest.raises(ValueError, match=r"output should have dtype float32 and shape \(4,\) in every row, as stored "
                       r"\(n: any length\), but got dtype float32 and shape \(3,\)"):
        layout.encode([torch.ones(3)])
    with pytest.raises(ValueError, match=r"dtype float32 .* but got dtype float16"):
        layout.encode([torch.ones(4, dtype=torch.float16)])
    nested = Layout.infer([{"a": torch.ones(1), "b": 2}])
    with pytest.raises(ValueError, match=r"output should be a dict with keys \['a', 'b'\] in every row, as stored, "
                       r"but got \['a'\]"):
        nested.encode([{"a": torch.ones(1)}])
    with pytest.raises(TypeError, match=r"b should be values of one type in every row with output_path set \(int, as "
                       r"stored\), but got \['float'\]"):
        nested.encode([{"a": torch.ones(1), "b": 2.5}])  # Arrow alone would store 2
    with pytest.raises(TypeError, match=r"output should be values of one type in every row .*, but got \['float', "
                       r"'int'\]"):
        Layout.infer([1, 2.5])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=1, max_size=12), st.integers(1, 3), st.sampled_from(["float32", "int64"]))
def test_ragged_rows_of_any_lengths_come_back_exactly(lengths, width, dtype):
    rng = np.random.default_rng(len(lengths))
    rows = [torch.from_numpy(rng.normal(size=(n, width)).astype(dtype)) for n in lengths]
    layout = Layout.infer(rows)
    table = pa.table(layout.encode(rows))
    half = table.slice(len(rows) // 2)  # a slice of a shard, as a row read back alone
    back = decode_rows(layout, {"output": half.column("output")})
    for a, b in zip(rows[len(rows) // 2:], back):
        _equal(a, b)


def test_a_column_none_in_every_row_so_far_takes_the_type_of_its_first_value():
    first = [{"vec": None, "n": 1}, {"vec": None, "n": 2}]
    layout = Layout.infer(first)
    assert layout.untyped == {"vec"} and layout.describe() == "vec: None so far, n: scalar int"
    before = layout.convert(first)  # a shard stored before the type is known: a null column
    assert str(layout.to_arrow([before])["vec"].type) == "null"
    later = [{"vec": torch.ones(3, dtype=torch.float16), "n": 3}, {"vec": None, "n": 4}]
    after = layout.convert(later)
    assert layout.untyped == set() and layout.describe() == "vec: tensor float16(3,), n: scalar int"
    columns = layout.to_arrow([before, after])
    assert str(columns["vec"].type) == "fixed_size_list<item: halffloat>[3]" and columns["vec"].null_count == 3
    back = decode_rows(layout, columns)
    _equal(back, [*first, *later])  # None anywhere after the type settled: a null
    with pytest.raises(ValueError, match=r"vec should have a value in every row to stack, but got None in 3 rows"):
        stack_columns(layout, columns, as_tensor=True)
    with pytest.raises(TypeError, match=r"vec should be a tensor or None in every row, as stored, but got int"):
        layout.convert([{"vec": 5, "n": 5}])


def test_layouts_of_shards_before_and_after_a_column_settled_merge_into_the_typed_one():
    untyped = Layout.infer([{"vec": None, "ids": []}])
    typed = Layout.infer([{"vec": torch.ones(2), "ids": [4, 5]}])
    assert untyped.untyped == {"vec", "ids"} and typed.untyped == set()
    assert Layout.merge([untyped, typed]) == typed and Layout.merge([typed, untyped]) == typed
    half = Layout.infer([{"vec": None, "ids": [1]}])
    assert Layout.merge([untyped, half, typed]) == typed
    assert Layout.merge([typed, Layout.infer([{"vec": torch.ones(3), "ids": [1]}])]) is None  # typed otherwise
    assert Layout.merge([typed, Layout.infer([{"other": None, "ids": [1]}])]) is None  # another structure
    lists = Layout.infer([[], []])  # lists empty so far: their items' type settles too
    parts = [lists.convert([[], []]), lists.convert([[1, None, 2], None])]
    assert str(lists.fields()[0].type) == "list<item: int64>"
    assert decode_rows(lists, lists.to_arrow(parts)) == [[], [], [1, None, 2], None]


def test_a_container_where_a_column_was_none_in_every_row_is_refused_with_what_to_return():
    layout = Layout.infer([{"extra": None}])
    with pytest.raises(ValueError, match=r"^extra should be one value \(a column\) in every row, as stored: it was "
                       r"None in every row before, but got a dict; return the dict in every row, with None inside "
                       r"where empty$"):
        layout.convert([{"extra": {"a": torch.ones(1)}}])


def test_a_per_token_output_settling_after_none_rows_is_ragged_by_the_real_tokens_of_its_rows():
    layout = Layout.infer([{"tags": None}, {"tags": None}])
    layout.convert([{"tags": torch.ones(3)}, {"tags": None}, {"tags": torch.ones(3)}], real_lengths=np.array([3, 5, 3]))
    assert layout.describe() == "tags: tensor float32(n,)"  # 3 real tokens each: a per-token output, any length
