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
    (["a", None], 2, ValueError, r"^ids should give every text an id, but got 1 missing \(None\) at positions 1$"),
    (["a", "b", "a", "c", "c", "a"], 6, ValueError,
     (r"^ids should be unique \(one stable id per text\), but got 2 ids given to several texts \(first: 'a' at "
      r"positions 0, 2, 5\)$")),
])
def test_bad_ids_are_named(ids, n, error, match):
    with pytest.raises(error, match=match):
        check_ids(ids, n)
