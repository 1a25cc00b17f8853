"""Pre-tokenized rows into the token store: as given, truncated as the tokenizer truncates, bad ids named."""

import numpy as np
import pytest
import torch

from dynabatch.data.token_ids import are_token_ids, store_token_ids

MAX_LEN = 64


@pytest.fixture(scope="module")
def texts():
    from dynabatch.demo import kjv_passages, vary_lengths

    return vary_lengths(kjv_passages(), n=300, max_words=200, seed=0)


def test_pre_tokenized_rows_are_stored_as_given_and_truncated_as_the_tokenizer_truncates(tokenizer, texts):
    rows = tokenizer(texts)["input_ids"]
    mixed = [rows[0], tuple(rows[1]), np.array(rows[2]), torch.tensor(rows[3]), *rows[4:]]
    assert are_token_ids(mixed) and not are_token_ids(texts)
    tokens = store_token_ids(mixed, MAX_LEN)
    assert max(map(len, rows)) > MAX_LEN
    assert all(tokens.row(i).tolist() == row[:MAX_LEN] for i, row in enumerate(rows))  # no special tokens added
    left = store_token_ids(rows, MAX_LEN, truncation_side="left")
    assert all(left.row(i).tolist() == row[-MAX_LEN:] for i, row in enumerate(rows))
    assert tokens.input_ids.dtype == np.int32 and tokens.extras == {}


def test_bad_pre_tokenized_rows_name_the_first_bad_id():
    with pytest.raises(TypeError, match=r"texts\[1\]\[1\] should be an int token id, but got texts\[1\]\[1\]=2.5"):
        store_token_ids([[1, 2], [3, 2.5]], 8)
    with pytest.raises(ValueError, match=r"texts\[1\]\[0\] should be a token id in \[0, 2\*\*31\), but got "
                       r"texts\[1\]\[0\]=-3"):
        store_token_ids([[1, 2], [-3]], 8)
    with pytest.raises(TypeError, match=r"texts\[1\] should be a row of int token ids, like texts\[0\], but got "
                       r"texts\[1\]='and'"):
        store_token_ids([[1, 2], "and"], 8)
    with pytest.raises(ValueError, match="truncation_side should be 'right' or 'left', but got truncation_side='up'"):
        store_token_ids([[1, 2]], 8, truncation_side="up")


def test_rows_of_rows_and_uint64_ids_are_refused_naming_the_id():
    # rows holding rows of one length were stored as rows of length 1 holding 2-D "ids"; of several lengths they
    # raised numpy's "inhomogeneous shape"; a uint64 id of 2**63 was named as -9223372036854775808
    for rows in ([[[1, 2]], [[3, 4]]], [[[1, 2]], [[3]]], [torch.tensor([[1, 2]])]):
        with pytest.raises(TypeError, match=r"^texts\[0\]\[0\] should be an int token id, but got texts\[0\]\[0\]=\[1, "
                                            r"2\] of type list$"):
            store_token_ids(rows, 8)
    with pytest.raises(ValueError, match=r"^texts\[1\]\[0\] should be a token id in \[0, 2\*\*31\), but got "
                                         r"texts\[1\]\[0\]=9223372036854775808$"):
        store_token_ids([np.array([5], np.uint64), np.array([2**63], np.uint64)], 8)
    assert store_token_ids([np.array([7, 2**31 - 1], np.uint64)], 8).row(0).tolist() == [7, 2**31 - 1]
