"""Stable ids of texts (dynabatch/data/ids.py): one unique str or int per text, as one Arrow array."""

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from dynabatch.data.ids import check_ids


def test_ids_become_one_arrow_array():
    assert check_ids(None, 3) is None
    assert check_ids(["a", "b"], 2).type == pa.string()
    assert check_ids(np.array([7, 3], dtype=np.int32), 2).to_pylist() == [7, 3]
    assert check_ids(np.array([7, 3], dtype=np.int32), 2).type == pa.int64()
    assert check_ids(pd.Series(["x", "y"], index=[9, 8]), 2).to_pylist() == ["x", "y"]
    assert check_ids(pa.chunked_array([["a"], ["b"]]), 2).to_pylist() == ["a", "b"]
    assert check_ids(range(3), 3).to_pylist() == [0, 1, 2]


@pytest.mark.parametrize(("ids", "n", "error", "match"), [
    ("abc", 3, TypeError, r"^ids should be a sequence of str or of int, one per text .*, but got ids='abc' of type str$"),
    ([1.5, 2.5], 2, TypeError, r"ids should be .*, but got ids=\[1\.5, 2\.5\] of Arrow type double"),
    ([True, False], 2, TypeError, r"of Arrow type bool"),
    ([1, "a"], 2, TypeError, r"ids should be .*, but got ids=\[1, 'a'\] holding int, str values"),
    (["a"], 2, ValueError, r"^len\(ids\) should be len\(texts\)=2, one id per text, but got len\(ids\)=1$"),
    (["a", None], 2, ValueError, r"^ids should give every text an id, but got 1 missing \(None, NaN\) at positions 1$"),
    (["a", "b", "a", "c", "c", "a"], 6, ValueError,
     (r"^ids should be unique \(one stable id per text\), but got 2 ids given to several texts \(first: 'a' at "
      r"positions 0, 2, 5\)$")),
])
def test_bad_ids_are_named(ids, n, error, match):
    with pytest.raises(error, match=match):
        check_ids(ids, n)


@pytest.mark.parametrize("ids", [pd.Series([4, np.nan, 7]), pd.Series([4, None, 7], dtype="Int64"),
                                 pd.Series(["a", None, "c"]), [4.0, float("nan"), 7.0], pa.array([4.0, None, 7.0])])
def test_a_missing_id_in_a_pandas_column_is_named_at_its_position(ids):
    # pandas holds an int column's missing value as NaN, in floats: refused as "of Arrow type double", not as missing
    with pytest.raises(ValueError, match=r"^ids should give every text an id, but got 1 missing \(None, NaN\) at "
                                         r"positions 1$"):
        check_ids(ids, 3)


def test_a_datasets_column_of_lists_or_bytes_is_refused_naming_the_column_and_its_feature():
    import datasets

    dataset = datasets.Dataset.from_dict({"tags": [["a"], ["b"]], "raw": [b"a", b"b"]})
    for column, kind in (("tags", "list<item: string>"), ("raw", "binary")):
        with pytest.raises(TypeError, match=rf"of Arrow type {kind} \(column '{column}', a datasets "):
            check_ids(dataset[column], 2)


@pytest.mark.parametrize("ids,position,value", [
    (pa.array([5, 2**63 + 1], pa.uint64()), 1, 2**63 + 1),  # a Parquet uint64 column
    (np.array([2**63, 5], dtype=np.uint64), 0, 2**63),
    ([2**63 + 1, 5], 0, 2**63 + 1),  # Python ints Arrow reads as uint64
    ([1, 2**64 + 3], 1, 2**64 + 3),  # and past uint64
    ([-(2**63) - 1, 2], 0, -(2**63) - 1),
])
def test_int_ids_outside_int64_are_refused_naming_the_range_the_id_and_its_position(ids, position, value):
    # Arrow's own words were "Integer value 9223372036854775809 not in range: 0 to 9223372036854775807", or a
    # TypeError saying ints are no ids
    with pytest.raises(ValueError, match=rf"^ids should be ints in int64's range \[-2\*\*63, 2\*\*63\) \(a store keys "
                       rf"rows by int64 ids\), but got id {value} at position {position}: give such ids as str$"):
        check_ids(ids, 2)
    assert check_ids([2**63 - 1, -(2**63)], 2).type == pa.int64()  # the range's ends
