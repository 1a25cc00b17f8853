import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dynabatch.features import FEATURE_NAMES, compute_features


def _as_dict(row):
    return dict(zip(FEATURE_NAMES, row.tolist()))


def test_the_spec_features_in_the_spec_order():
    assert FEATURE_NAMES == (
        "max_input_length", "token_size_x", "token_size_y", "token_size_diff", "batch_size_x", "batch_size_y",
        "batch_size_diff", "total_tokens_x", "total_tokens_y", "total_token_size_diff", "paddings_x", "paddings_y",
        "total_paddings_diff",
    )


def test_values_of_one_candidate():
    f = compute_features(256, token_size_x=200, batch_size_x=4, total_tokens_x=700,
                         token_size_y=50, batch_size_y=12, total_tokens_y=500)
    assert f.shape == (1, 13)
    assert _as_dict(f[0]) == {
        "max_input_length": 256.0,
        "token_size_x": 200.0,
        "token_size_y": 50.0,
        "token_size_diff": 0.25,
        "batch_size_x": 4.0,
        "batch_size_y": 12.0,
        "batch_size_diff": 3.0,
        "total_tokens_x": 700.0,
        "total_tokens_y": 500.0,
        "total_token_size_diff": 500 / 700,
        "paddings_x": 100.0,
        "paddings_y": 100.0,
        "total_paddings_diff": 1.0,
    }


def test_scalars_for_the_first_batch_broadcast_over_candidates():
    f = compute_features(128, 128, 8, 1024, token_size_y=[100, 90, 80], batch_size_y=[8, 16, 24],
                         total_tokens_y=[700, 1300, 1800])
    assert f.shape == (3, 13)
    assert (f[:, 1] == 128).all()
    assert f[:, 5].tolist() == [8, 16, 24]


def test_a_first_batch_without_padding_gives_finite_ordered_features():
    # Every text cut at the token limit: the published version divided by zero here.
    f = compute_features(128, 128, 8, 8 * 128, token_size_y=[100, 100, 100], batch_size_y=[8, 8, 8],
                         total_tokens_y=[800, 700, 600])
    assert np.isfinite(f).all()
    padding_ratio = f[:, FEATURE_NAMES.index("total_paddings_diff")]
    assert padding_ratio.tolist() == [1.0, 101.0, 201.0]


def test_no_padding_on_either_side_is_a_ratio_of_one():
    f = compute_features(64, 64, 4, 256, 64, 4, 256)
    assert _as_dict(f[0])["total_paddings_diff"] == 1.0


def test_all_empty_texts_are_still_finite():
    f = compute_features(16, 0, 4, 0, 0, 4, 0)
    assert np.isfinite(f).all()


@given(
    st.integers(1, 4096),
    st.lists(st.tuples(st.integers(1, 2048), st.integers(0, 4096), st.floats(0, 1)), min_size=2, max_size=2),
)
def test_every_valid_batch_has_finite_features(max_len, sides):
    (bs_x, tok_x, fill_x), (bs_y, tok_y, fill_y) = sides
    tot_x = int(bs_x * tok_x * fill_x)
    tot_y = int(bs_y * tok_y * fill_y)
    f = compute_features(max_len, tok_x, bs_x, tot_x, tok_y, bs_y, tot_y)
    assert np.isfinite(f).all()
    assert (f[:, [10, 11]] >= 0).all()


def test_more_real_tokens_than_the_rectangle_is_refused():
    with pytest.raises(ValueError, match=r"total_tokens_y should be at most batch_size_y \* token_size_y, "
                                         r"but got total_tokens_y=99"):
        compute_features(128, 128, 1, 100, token_size_y=[10, 10], batch_size_y=[9, 9], total_tokens_y=[50, 99])


def test_negative_sizes_are_refused():
    with pytest.raises(ValueError, match="batch_size_x should be non-negative, but got batch_size_x=-1"):
        compute_features(128, 128, -1, 0, 10, 1, 1)
