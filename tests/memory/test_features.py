import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dynabatch.memory.features import (
    FEATURE_NAMES,
    SHAPE_FEATURE_NAMES,
    ModelShape,
    compute_features,
)


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


# --- the model's shape ---------------------------------------------------------------------------


def test_the_estimate_is_the_rectangle_ratio_for_a_forward_pass():
    f = compute_features(128, 100, 8, 700, [50, 25], [16, 64], [700, 1500], shape=ModelShape(30522, 384))
    assert f.shape == (2, len(SHAPE_FEATURE_NAMES))
    np.testing.assert_allclose(f[:, :13], compute_features(128, 100, 8, 700, [50, 25], [16, 64], [700, 1500]))
    np.testing.assert_allclose(f[:, 13], [16 * 50 / (8 * 100), 64 * 25 / (8 * 100)])


def test_generate_adds_a_per_row_part_that_length_does_not_shrink():
    shape = ModelShape(vocab_size=256000, hidden_size=1000, max_new_tokens=20, num_beams=4)
    f = compute_features(128, 100, 8, 700, [10], [16], [100], shape=shape)
    per_row = 256000 * 4
    assert f[0, 13] == pytest.approx(16 * (per_row + 1000 * 30) / (8 * (per_row + 1000 * 120)))
    assert f[0, 13] > 1.8  # twice the rows at a tenth of the length: still nearly twice the memory


def test_per_row_shapes_broadcast_like_the_rest():
    f = compute_features(128, 100, 8, 700, [50, 50], [16, 16], [700, 700], vocab_size=[30000, 250000],
                         hidden_size=512, max_new_tokens=[0, 8])
    assert f.shape == (2, 14) and f[0, 13] == pytest.approx(1.0) and f[1, 13] > 1.5


def test_model_shape_from_a_real_model_and_from_a_config():
    from transformers import BertConfig, BertModel, T5Config

    model = BertModel(BertConfig(vocab_size=1000, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                 intermediate_size=64))
    assert ModelShape.from_model(model) == ModelShape(1000, 32)
    t5 = ModelShape.from_model(T5Config(vocab_size=32128, d_model=512), max_new_tokens=16, num_beams=4)
    assert t5 == ModelShape(32128, 512, max_new_tokens=16, num_beams=4)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"vocab_size": 0, "hidden_size": 8}, ValueError, "vocab_size should be a positive integer, but got vocab_size=0"),
        ({"vocab_size": 8, "hidden_size": 2.5}, TypeError, "hidden_size should be a positive integer"),
        ({"vocab_size": 8, "hidden_size": 8, "max_new_tokens": -1}, ValueError,
         "max_new_tokens should be a non-negative integer, but got max_new_tokens=-1"),
        ({"vocab_size": 8, "hidden_size": 8, "num_beams": 0}, ValueError, "num_beams should be a positive integer"),
    ],
)
def test_bad_shapes_are_named(kwargs, error, match):
    with pytest.raises(error, match=match):
        ModelShape(**kwargs)


def test_from_model_needs_a_transformers_config():
    with pytest.raises(TypeError, match="model should be a transformers model or config with vocab_size and "
                                        "hidden_size, but got model=42"):
        ModelShape.from_model(42)


def test_shape_and_per_row_sizes_are_exclusive():
    with pytest.raises(ValueError, match="vocab_size should be None when shape is given"):
        compute_features(1, 1, 1, 1, 1, 1, 1, shape=ModelShape(8, 8), vocab_size=8)
    with pytest.raises(TypeError, match="shape should be a ModelShape or None"):
        compute_features(1, 1, 1, 1, 1, 1, 1, shape=(8, 8))
