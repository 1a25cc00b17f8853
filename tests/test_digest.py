"""The one fingerprint (dynabatch/_digest.py): ``row_hashes``, one 64-bit hash per row of a flat store."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dynabatch._digest import row_hashes


def _flat(rows):
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum([len(r) for r in rows], out=offsets[1:])
    return np.concatenate([np.asarray(r, dtype=np.int32) for r in rows] or [np.zeros(0, np.int32)]), offsets


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 50), max_size=6), min_size=1, max_size=20))
def test_equal_rows_hash_equal_and_a_hash_depends_only_on_its_row(rows):
    values, offsets = _flat(rows)
    hashes = row_hashes({"input_ids": values}, offsets)
    for i, row in enumerate(rows):
        alone, alone_offsets = _flat([row])
        assert hashes[i] == row_hashes({"input_ids": alone}, alone_offsets)[0]  # not its position or neighbours
        for j, other in enumerate(rows):
            assert (hashes[i] == hashes[j]) == (row == other)  # no collision among these small rows


def test_order_length_streams_and_their_names_count():
    values, offsets = _flat([[1, 2], [2, 1], [1, 2, 0], [1, 2]])
    hashes = row_hashes({"input_ids": values}, offsets)
    assert len(set(hashes[:3].tolist())) == 3 and hashes[0] == hashes[3]  # order and a trailing 0 count
    extra = np.array([0, 0, 0, 0, 0, 0, 0, 1, 0], dtype=np.int32)  # token_type_ids differ in row 3 only
    both = row_hashes({"input_ids": values, "token_type_ids": extra}, offsets)
    assert both[0] != both[3] and not (both == hashes).any()
    assert (row_hashes({"ids": values}, offsets) != hashes).all()
    empty = row_hashes({"input_ids": np.zeros(0, np.int32)}, np.zeros(3, dtype=np.int64))
    assert empty[0] == empty[1]


def test_a_million_rows_in_chunks_match_rows_hashed_alone():
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 9, size=1_000_000)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = rng.integers(0, 30_000, size=int(offsets[-1]), dtype=np.int32)
    hashes = row_hashes({"input_ids": values}, offsets)  # several chunks of about a million values
    for i in (0, 123_456, 999_999):
        alone = row_hashes({"input_ids": values[offsets[i]:offsets[i + 1]]}, np.array([0, lengths[i]]))
        assert hashes[i] == alone[0]
