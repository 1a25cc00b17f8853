import logging
import multiprocessing
import os
import threading
import time

import numpy as np
import pandas as pd
import pytest
from transformers import BertTokenizer  # transformers 5: the fast WordPiece tokenizer

from dynabatch.data import tokenization, workers
from dynabatch.data.tokenization import (
    CALL_PATH,
    FORBIDDEN_TOKENIZER_KWARGS,
    ParallelTokenizer,
    TokenizedTexts,
    fast_backend,
    split_bad_texts,
    tokenize_texts,
    validate_texts,
)

MAX_LEN = 64


@pytest.fixture(scope="module")
def texts():
    from dynabatch.demo import kjv_passages, vary_lengths

    return vary_lengths(kjv_passages(), n=300, max_words=200, seed=0)


def _reference_lengths(tokenizer, texts, max_length, **kwargs):
    return [len(tokenizer(t, truncation=True, max_length=max_length, **kwargs)["input_ids"]) for t in texts]


# --- tokenize_texts on a real tokenizer -------------------------------------------------------------


def test_lengths_equal_the_tokenizer_on_each_text(tokenizer, texts):
    tokens = tokenize_texts(texts, tokenizer, MAX_LEN)
    assert len(tokens) == len(texts)
    assert tokens.lengths.tolist() == _reference_lengths(tokenizer, texts, MAX_LEN)
    assert tokens.lengths.dtype == np.int64


def test_long_texts_are_truncated_to_the_limit_special_tokens_included(tokenizer, texts):
    tokens = tokenize_texts(texts, tokenizer, MAX_LEN)
    assert tokens.lengths.max() == MAX_LEN
    untruncated = [len(ids) for ids in tokenizer(texts)["input_ids"]]
    assert max(untruncated) > MAX_LEN
    longest = int(np.argmax(untruncated))
    assert tokens.row(longest)[0] == tokenizer.cls_token_id
    assert tokens.row(longest)[-1] == tokenizer.sep_token_id


def test_rows_are_the_token_ids_in_input_order(tokenizer, texts):
    tokens = tokenize_texts(texts, tokenizer, MAX_LEN, chunk_size=7)  # many chunks, one uneven
    expected = tokenizer(texts, truncation=True, max_length=MAX_LEN)
    for i in range(len(texts)):
        assert tokens.row(i).tolist() == expected["input_ids"][i]
    assert tokens.row(-1).tolist() == expected["input_ids"][-1]
    flat_types = [v for row in expected["token_type_ids"] for v in row]
    assert tokens.extras["token_type_ids"].tolist() == flat_types


def test_store_layout(tokenizer, texts):
    tokens = tokenize_texts(texts, tokenizer, MAX_LEN)
    assert tokens.input_ids.dtype == np.int32
    assert tokens.offsets.dtype == np.int64
    assert tokens.offsets.shape == (len(texts) + 1,)
    assert tokens.offsets[0] == 0 and tokens.offsets[-1] == len(tokens.input_ids)
    assert set(tokens.extras) == {"token_type_ids"}  # no attention mask stored
    assert tokens.extras["token_type_ids"].dtype == np.int32
    assert np.shares_memory(tokens.row(3), tokens.input_ids)


def test_chunk_size_does_not_change_the_result(tokenizer, texts):
    one = tokenize_texts(texts, tokenizer, MAX_LEN)
    many = tokenize_texts(texts, tokenizer, MAX_LEN, chunk_size=16)
    assert np.array_equal(one.input_ids, many.input_ids)
    assert np.array_equal(one.offsets, many.offsets)


def test_add_special_tokens_false_applies(tokenizer, texts):
    with_special = tokenize_texts(texts, tokenizer, MAX_LEN)
    without = tokenize_texts(texts, tokenizer, MAX_LEN, add_special_tokens=False)
    assert without.lengths.tolist() == _reference_lengths(tokenizer, texts, MAX_LEN, add_special_tokens=False)
    assert without.lengths.tolist() != with_special.lengths.tolist()
    assert tokenizer.cls_token_id not in without.input_ids


def test_empty_strings_and_duplicates_are_kept(tokenizer):
    texts = ["", "And God said", "", "And God said"]
    tokens = tokenize_texts(texts, tokenizer, MAX_LEN)
    assert tokens.lengths.tolist() == [2, 5, 2, 5]
    assert tokens.row(1).tolist() == tokens.row(3).tolist()
    bare = tokenize_texts(texts, tokenizer, MAX_LEN, add_special_tokens=False)
    assert bare.lengths.tolist() == [0, 3, 0, 3]
    assert bare.row(0).size == 0


def test_pandas_series_and_tuple_give_the_same_store(tokenizer, texts):
    base = tokenize_texts(texts[:20], tokenizer, MAX_LEN)
    for variant in (pd.Series(texts[:20], index=range(100, 120)), tuple(texts[:20]), np.array(texts[:20], dtype=object)):
        other = tokenize_texts(variant, tokenizer, MAX_LEN)
        assert np.array_equal(other.input_ids, base.input_ids)
        assert np.array_equal(other.offsets, base.offsets)


# --- the backend rule -------------------------------------------------------------------------------


def _subclass(tokenizer, name):
    """A copy of ``tokenizer`` whose class overrides ``name`` (by a method that defers to transformers' own)."""
    import copy

    def override(self, *args, **kwargs):
        return getattr(super(cls, self), name)(*args, **kwargs)

    cls = type(f"Own{name}", (type(tokenizer),), {name: override})
    other = copy.deepcopy(tokenizer)
    other.__class__ = cls
    return other


@pytest.mark.parametrize("which", ["wordpiece", "llama"])
def test_the_backend_gives_the_tokenizers_rows(which, tokenizer, llama_tokenizer, texts):
    tok = tokenizer if which == "wordpiece" else llama_tokenizer
    assert fast_backend(tok, {}) is not None and fast_backend(tok, {"add_special_tokens": False}) is not None
    for kwargs in ({}, {"add_special_tokens": False}):
        tokens = tokenize_texts(texts, tok, 40, progress=False, **kwargs)
        expected = tok(texts, truncation=True, max_length=40, **kwargs)["input_ids"]
        assert [tokens.row(i).tolist() for i in range(len(texts))] == expected


@pytest.mark.parametrize("name", ["__call__", "_encode_plus", "encode", "prepare_for_tokenization", "tokenize",
                                  "_convert_encoding"])
def test_a_subclass_overriding_the_call_path_goes_through_its_call(tokenizer, name):
    assert name in CALL_PATH and fast_backend(_subclass(tokenizer, name), {}) is None


def test_the_backend_is_refused_for_instance_overrides_other_arguments_and_other_callables(tokenizer):
    import copy

    patched = copy.deepcopy(tokenizer)
    patched.tokenize = lambda text, **kwargs: text.split()
    assert fast_backend(patched, {}) is None
    assert fast_backend(tokenizer, {"return_length": True}) is None
    assert fast_backend(lambda texts, **kwargs: {"input_ids": [[1]]}, {}) is None


def test_the_backend_applies_split_special_tokens(tokenizer):
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.split_special_tokens = True
    texts = ["in the beginning [SEP] was the word", "[CLS]"]
    tokens = tokenize_texts(texts, tok, MAX_LEN, progress=False)
    assert [tokens.row(i).tolist() for i in range(2)] == tok(texts, truncation=True, max_length=MAX_LEN)["input_ids"]
    assert tokens.row(1).tolist() != [101, 101, 102]


def test_taking_rows_of_a_store(tokenizer, texts):
    tokens = tokenize_texts(texts[:30], tokenizer, MAX_LEN)
    picked = tokens.take([7, 2, 7])
    assert [picked.row(i).tolist() for i in range(3)] == [tokens.row(i).tolist() for i in (7, 2, 7)]
    assert picked.extras["token_type_ids"].size == len(picked.input_ids)


def test_one_batched_call_per_chunk_with_the_loader_arguments():
    calls = []

    def fake(batch, **kwargs):
        calls.append((list(batch), kwargs))
        return {"input_ids": [[1] * len(t) for t in batch], "length": [len(t) for t in batch]}

    tokens = tokenize_texts(["a", "bb", "ccc", "dddd", "e"], fake, 4, chunk_size=2, add_special_tokens=False)
    assert [batch for batch, _ in calls] == [["a", "bb"], ["ccc", "dddd"], ["e"]]
    assert calls[0][1] == {
        "truncation": True, "max_length": 4, "padding": False, "return_attention_mask": False,
        "add_special_tokens": False,
    }
    assert tokens.lengths.tolist() == [1, 2, 3, 4, 1]
    assert tokens.extras == {}  # "length" is one value per text, not per token


def test_an_extra_missing_from_one_chunk_is_dropped():
    def fake(batch, **kwargs):
        out = {"input_ids": [[7] * len(t) for t in batch]}
        if batch[0] == "a":
            out["token_type_ids"] = [[0] * len(t) for t in batch]
        return out

    tokens = tokenize_texts(["a", "bb", "ccc"], fake, 8, chunk_size=2)
    assert tokens.extras == {}


def test_logs_at_debug(tokenizer, caplog):
    with caplog.at_level(logging.DEBUG, logger="dynabatch.data.tokenization"):
        tokenize_texts(["In the beginning", ""], tokenizer, MAX_LEN)
    assert "tokenized 2 texts into 7 tokens" in caplog.text


def test_progress_bar_is_on_by_default_and_turns_off(tokenizer, capsys):
    tokenize_texts(["In the beginning"], tokenizer, MAX_LEN)
    assert "tokenizing" in (err := capsys.readouterr().err) and " 1/1 " in err and "text/s" in err  # counts texts
    tokenize_texts(["In the beginning"], tokenizer, MAX_LEN, progress=False)
    assert capsys.readouterr().err == ""



_NO_BAR = """
from transformers import AutoTokenizer

from dynabatch import tokenize_texts
from dynabatch.demo import minilm_path

tokenize_texts(["In the beginning"], AutoTokenizer.from_pretrained(minilm_path()), 16, progress=False)
"""


def test_no_progress_bar_leaves_no_thread_of_tqdm(threads_left):
    # Found by the kill probe: after run(..., progress=False) returned, threading.enumerate() held tqdm_monitor, the
    # daemon thread tqdm starts with its first bar (a disabled one too) and keeps for the process's life. A fresh
    # interpreter: one bar of any earlier test in this process would have started it
    assert threads_left(_NO_BAR) == ["MainThread"]

# --- errors -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", sorted(FORBIDDEN_TOKENIZER_KWARGS))
def test_loader_owned_kwargs_are_refused(tokenizer, key):
    with pytest.raises(ValueError, match=rf"tokenizer_kwargs should not set '{key}' \(.*\), but got tokenizer_kwargs=\{{'{key}': 10\}}"):
        tokenize_texts(["a"], tokenizer, MAX_LEN, **{key: 10})


def test_padding_side_as_a_keyword_is_refused_naming_the_tokenizers_setting(tokenizer):
    # the call takes padding_side and ignores it (padding=False); the batches were padded on tokenizer.padding_side
    with pytest.raises(ValueError, match=r"^tokenizer_kwargs should not set 'padding_side' \(dynabatch pads each batch on the tokenizer's side: set tokenizer.padding_side instead\), but got tokenizer_kwargs=\{'padding_side': 'left'\}$"):
        tokenize_texts(["a"], tokenizer, MAX_LEN, padding_side="left")


@pytest.mark.parametrize("key, reason", [("text_pair", "dynabatch takes one str per text, and reorders"),
                                         ("text_target", "dynabatch batches the texts' own token ids only"),
                                         ("text_pair_target", "dynabatch batches the texts' own token ids only")])
def test_pairs_and_targets_are_refused(tokenizer, key, reason):
    # a stream paired each chunk (sorted by length) with the whole list in input order: wrong ids, silently; the
    # targets' rows were dropped
    with pytest.raises(ValueError, match=rf"^tokenizer_kwargs should not set '{key}' \({reason}"):
        tokenize_texts(["f", "a b c"], tokenizer, MAX_LEN, progress=False, **{key: ["x", "y y"]})
    with pytest.raises(ValueError, match=r"but got tokenizer_kwargs=<dict of 1 item: \{'text_pair': \['x', 'x', .*\]\}>$"):
        tokenize_texts(["a"] * 1000, tokenizer, MAX_LEN, progress=False, text_pair=["x"] * 1000)  # not all of it


def test_a_nested_tokenizer_kwargs_dict_is_refused(tokenizer):
    # the call merged it, past every check: padding_side was ignored, add_special_tokens=False unseen by the limit's
    with pytest.raises(ValueError, match=r"^tokenizer_kwargs should not set 'tokenizer_kwargs' \(pass each tokenizer "
                                         r"keyword as a keyword of its own, such as add_special_tokens=False: "):
        tokenize_texts(["a"], tokenizer, MAX_LEN, progress=False, tokenizer_kwargs={"padding_side": "left"})


def test_max_length_message_names_the_limit_argument(tokenizer):
    with pytest.raises(ValueError, match=r"^tokenizer_kwargs should not set 'max_length' \(dynabatch sets it from max_input_token_length\), but got tokenizer_kwargs=\{'max_length': 10\}$"):
        tokenize_texts(["a"], tokenizer, MAX_LEN, max_length=10)


@pytest.mark.parametrize("value, error", [(0, ValueError), (-3, ValueError), (1.5, TypeError), (True, TypeError)])
def test_bad_max_input_token_length(tokenizer, value, error):
    with pytest.raises(error, match=rf"max_input_token_length should be a positive integer, but got max_input_token_length={value!r}"):
        tokenize_texts(["a"], tokenizer, value)


def test_bad_chunk_size(tokenizer):
    with pytest.raises(ValueError, match=r"chunk_size should be a positive integer, but got chunk_size=0"):
        tokenize_texts(["a"], tokenizer, MAX_LEN, chunk_size=0)


def test_a_tokenizer_that_is_not_callable():
    with pytest.raises(TypeError, match=r"tokenizer should be a callable tokenizer .*, but got tokenizer='bert' of type str"):
        tokenize_texts(["a"], "bert", MAX_LEN)


def test_a_tokenizer_that_returns_no_mapping():
    with pytest.raises(TypeError, match=r"type\(tokenizer\(texts\)\) should be a mapping with 'input_ids', but got type\(tokenizer\(texts\)\)=<class 'list'>"):
        tokenize_texts(["a"], lambda batch, **kw: [[1]], MAX_LEN)


def test_a_tokenizer_that_returns_no_input_ids():
    with pytest.raises(ValueError, match=r"tokenizer\(texts\)\.keys\(\) should be a collection including 'input_ids', but got tokenizer\(texts\)\.keys\(\)=\['ids'\]"):
        tokenize_texts(["a"], lambda batch, **kw: {"ids": [[1]]}, MAX_LEN)


class Untruncated:
    """A callable tokenizer that ignores ``truncation`` and ``max_length``."""

    def __call__(self, texts, **kwargs):
        return {"input_ids": [[1] * (len(t) + 1) for t in texts]}


def test_a_tokenizer_that_does_not_truncate_is_named_with_the_first_long_text(tokenizer):
    # it was the planner's "lengths should be at most max_input_token_length=4 ..., but got lengths=6": no text named
    rule = (r"should be at most max_input_token_length=4 \(the tokenizer is called with truncation=True, max_length=4: "
            r"make its call honour them, and pass a limit above the special tokens it adds\), but got ")
    with pytest.raises(ValueError, match=rf"^len\(tokenizer\(prompts\[1\]\)\['input_ids'\]\) {rule}"):
        tokenize_texts(["ab", "abcde", "abcdefgh"], Untruncated(), 4, progress=False, texts_name="prompts")
    with pytest.raises(ValueError, match=r"^len\(tokenizer\(texts\[7\]\)\['input_ids'\]\) should be at most "):
        ParallelTokenizer(Untruncated(), 4, {}, cores=1)(["a", "abcde"], positions=np.array([3, 7]))  # a chunk's
    with pytest.raises(ValueError, match=r"^len\(tokenizer\(texts\[0\]\)\['input_ids'\]\) .* above the special tokens it adds\), but got "):
        tokenize_texts(["a b"], tokenizer, 1, progress=False)  # the specials kept (the loader refuses it first)


def test_a_tokenizer_that_returns_the_wrong_number_of_rows():
    with pytest.raises(ValueError, match=r"len\(tokenizer\(texts\)\['input_ids'\]\) should be 2, one row per text, but got len\(tokenizer\(texts\)\['input_ids'\]\)=1"):
        tokenize_texts(["a", "b"], lambda batch, **kw: {"input_ids": [[1]]}, MAX_LEN)


# --- validate_texts ---------------------------------------------------------------------------------


def test_validate_texts_returns_a_list():
    assert validate_texts(["a", "", "a"]) == ["a", "", "a"]
    assert validate_texts(("a", "b")) == ["a", "b"]
    assert validate_texts(pd.Series(["x", "y"], index=[5, 3])) == ["x", "y"]
    converted = validate_texts(np.array(["a", "bc"]))
    assert converted == ["a", "bc"] and all(type(t) is str for t in converted)


def test_validate_texts_takes_any_non_str_sequence():
    class Column:  # like a Hugging Face datasets column
        def __init__(self, values):
            self._values = values

        def __len__(self):
            return len(self._values)

        def __getitem__(self, i):
            return self._values[i]

    import collections.abc

    collections.abc.Sequence.register(Column)
    assert validate_texts(Column(["a", "b"])) == ["a", "b"]


def test_validate_texts_turns_str_subclasses_into_str():
    out = validate_texts([np.str_("a"), "b"])
    assert out == ["a", "b"] and [type(t) for t in out] == [str, str]


@pytest.mark.parametrize(
    "value, shown",
    [("a text", "'a text' of type str"), (42, "42 of type int"), ({"a"}, r"\{'a'\} of type set"),
     (None, "None of type NoneType")],
)
def test_validate_texts_refuses_non_sequences(value, shown):
    with pytest.raises(TypeError, match=rf"texts should be a list of str \(.*\), but got texts={shown}"):
        validate_texts(value)


def test_validate_texts_refuses_a_dict_naming_the_fix_without_printing_it():
    texts = {f"id {i}": "a long text of many words " * 3 for i in range(2000)}  # 164 KB of text
    with pytest.raises(TypeError, match=r"texts should be a list of str \(.*\); of a mapping, pass its texts "
                                        r"\(e.g. list\(texts.values\(\)\)\), but got texts=<dict of 2000 items: "
                                        r"\{'id 0': 'a long text of ma...ext of many words ', .*\}> of type dict$",
                       ) as info:
        validate_texts(texts)
    assert len(str(info.value)) < 500


def test_validate_texts_refuses_a_generator():
    with pytest.raises(TypeError, match=r"texts should be a list of str .*, but got texts=<generator .* of type generator"):
        validate_texts(t for t in ["a"])


def test_validate_texts_refuses_empty():
    with pytest.raises(ValueError, match=r"^texts should be a non-empty sequence of str, but got texts=\[\]$"):
        validate_texts([])
    with pytest.raises(ValueError, match=r"texts should be a non-empty sequence of str, but got texts=\(\)"):
        validate_texts(())


def test_validate_texts_names_how_many_items_are_not_str_and_the_first_ten():
    with pytest.raises(TypeError, match=r"^texts\[3\] should be a str, but got texts\[3\]=None of type NoneType; 2 of 5 "
                       r"texts are not str \(positions 3, 4\): clean them, or pass "
                       r"on_bad_input='skip' to skip them \(their results are None\)$"):
        validate_texts(["a", "b", "", None, 5])
    with pytest.raises(TypeError, match=r"texts\[1\] should be a str, but got texts\[1\]=nan of type float; 1 of 2"):
        validate_texts(pd.Series(["a", float("nan")]))
    dirty = ["ok"] * 100
    for p in range(5, 100, 7):
        dirty[p] = None
    with pytest.raises(TypeError, match=r"; 14 of 100 texts are not str \(positions 5, 12, 19, 26, 33, 40, 47, 54, 61, "
                       r"68, \.\.\.\)"):
        validate_texts(dirty)


def test_split_bad_texts_blanks_them_and_gives_their_positions():
    items, bad = split_bad_texts(["a", None, np.str_("b"), b"c", float("nan")])
    assert items == ["a", "", "b", "", ""] and type(items[2]) is str
    assert bad.tolist() == [1, 3, 4] and bad.dtype == np.int64
    clean = ["a", "b"]
    items, bad = split_bad_texts(clean)
    assert items is clean and bad.size == 0


def test_tokenize_texts_validates_texts(tokenizer):
    with pytest.raises(TypeError, match=r"texts\[0\] should be a str, but got texts\[0\]=b'a' of type bytes"):
        tokenize_texts([b"a"], tokenizer, MAX_LEN)


def test_validate_texts_is_fast_on_a_million_texts():
    import time

    texts = ["some text"] * 1_000_000
    start = time.perf_counter()
    assert validate_texts(texts) is texts
    assert time.perf_counter() - start < 1.0


# --- TokenizedTexts ---------------------------------------------------------------------------------


def test_tokenized_texts_row_bounds():
    tokens = TokenizedTexts(np.arange(5, dtype=np.int32), np.array([0, 2, 2, 5]), {})
    assert len(tokens) == 3
    assert tokens.lengths.tolist() == [2, 0, 3]
    assert tokens.row(2).tolist() == [2, 3, 4]
    with pytest.raises(IndexError, match=r"i should be in range\(-3, 3\), but got i=3"):
        tokens.row(3)


def test_tokenized_texts_checks_its_layout():
    with pytest.raises(ValueError, match=r"offsets should be an array from 0 to len\(input_ids\)=5, but got offsets="):
        TokenizedTexts(np.arange(5, dtype=np.int32), np.array([0, 2, 4]), {})
    with pytest.raises(ValueError, match=r"len\(extras\['token_type_ids'\]\) should be len\(input_ids\)=5, but got len\(extras\['token_type_ids'\]\)=4"):
        TokenizedTexts(np.arange(5, dtype=np.int32), np.array([0, 5]), {"token_type_ids": np.zeros(4, np.int32)})


# --- on every core: the same ids as one thread ------------------------------------------------------

TRICKY = ["", " ", "\t\n  \r\n", "e\u0301 cafe\u0301 n\u0303 \u0928\u093f", ("\U0001f469\u200d\U0001f469\u200d\U0001f467 "
          "party \U0001f389\U0001f1eb\U0001f1f7"), "\u0645\u0631\u062d\u0628\u0627 \u05e9\u05dc\u05d5\u05dd world",
          "a [SEP] b [CLS] </s> <s> [PAD] [MASK] <unk>", "nul\x00byte \x01\x07\x1b ctrl", "mixed\r\nnew\rlines\n\n",
          "word " * 400, "x" * 3000, "\u00c5\u00c6\u00d8 \u00df \ufb01 \u200b zero \uff26\uff55\uff4c\uff4c"]
"""Texts that tokenizers split in surprising ways (empty, whitespace, combining marks, emoji, right-to-left, special
tokens as text, NUL and control characters, mixed newlines, texts cut at the limit)."""


class AmenCall(BertTokenizer):
    """A tokenizer whose own ``__call__`` changes every text (so its call, not the backend, must run)."""

    def __call__(self, text, *args, **kwargs):
        text = [t + " amen" for t in text] if isinstance(text, list) else text + " amen"
        return super().__call__(text, *args, **kwargs)


class AmenEncode(BertTokenizer):
    """A tokenizer whose ``_encode_plus`` (transformers 5) and ``_batch_encode_plus`` (4.x) change every text."""

    def _encode_plus(self, text, *args, **kwargs):
        text = [t + " amen" for t in text] if isinstance(text, list) else text + " amen"
        return super()._encode_plus(text, *args, **kwargs)

    def _batch_encode_plus(self, texts, *args, **kwargs):
        return super()._batch_encode_plus([t + " amen" for t in texts], *args, **kwargs)


def _as(tokenizer, cls):
    import copy

    other = copy.deepcopy(tokenizer)
    other.__class__ = cls
    return other


@pytest.fixture(scope="module")
def slow_tokenizer():
    """The WordPiece tokenizer in pure Python (transformers' slow implementation)."""
    from transformers import BertTokenizerLegacy

    from dynabatch.demo import minilm_path

    return BertTokenizerLegacy.from_pretrained(minilm_path())


@pytest.fixture(params=["wordpiece", "llama", "own __call__", "own _encode_plus", "slow"])
def any_tokenizer(request, tokenizer, llama_tokenizer, slow_tokenizer):
    return {"wordpiece": tokenizer, "llama": llama_tokenizer, "own __call__": _as(tokenizer, AmenCall),
            "own _encode_plus": _as(tokenizer, AmenEncode), "slow": slow_tokenizer}[request.param]


two_cores = pytest.mark.skipif(workers.available_cores() < 2, reason="needs two cores")


@pytest.fixture
def no_pool_left():
    from dynabatch.data.workers import release_pool

    yield
    release_pool()


@two_cores
@pytest.mark.parametrize("threshold", [0, 10**6])  # both sides of the cost rule: workers join, or this thread alone
@pytest.mark.parametrize("parallelism", [None, "false"])  # the backend's own pool, or our threads / processes
def test_every_core_gives_the_ids_of_one_thread_on_tricky_texts(any_tokenizer, parallelism, threshold, monkeypatch,
                                                                texts, no_pool_left):
    items = TRICKY + texts[:40]
    expected = any_tokenizer(items, truncation=True, max_length=MAX_LEN)
    one = tokenize_texts(items, any_tokenizer, MAX_LEN, progress=False, tokenize_cores=1)
    monkeypatch.setattr(workers, "POOL_MIN_SECONDS", threshold)
    monkeypatch.setattr(workers, "_OWN_THREADS_SHARE", float("inf"))  # a call on the tokenizer's own threads, shared
    if parallelism is None:
        monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    else:
        monkeypatch.setenv("TOKENIZERS_PARALLELISM", parallelism)
    tokenize = ParallelTokenizer(any_tokenizer, MAX_LEN, {}, cores=2, chunk_size=16)
    many = tokenize(items)
    if fast_backend(any_tokenizer, {}) is not None:
        assert list(tokenize.mechanisms) == ["threads" if parallelism is None else "parallel calls"]
    else:  # its own call: this thread, joined by worker processes where they pay
        assert list(tokenize.mechanisms) == ["processes" if threshold == 0 else "one"]
    for store in (one, many):
        assert [store.row(i).tolist() for i in range(len(items))] == expected["input_ids"]
        assert sorted(store.extras) == sorted(k for k in ("token_type_ids",) if k in expected)
        if "token_type_ids" in expected:
            assert store.extras["token_type_ids"].tolist() == [v for row in expected["token_type_ids"] for v in row]
    assert one.lengths.max() == MAX_LEN


@two_cores
@pytest.mark.parametrize("parallelism, used", [(None, 0), ("false", 1)])  # its own threads measured, or off
def test_a_call_on_the_tokenizers_own_threads_keeps_them_and_starts_no_process(tokenizer, monkeypatch, texts,
                                                                             parallelism, used, no_pool_left):
    monkeypatch.setattr(workers, "POOL_MIN_SECONDS", 0)  # the rest pays for workers: the threads' share decides
    if parallelism is None:
        monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    else:
        monkeypatch.setenv("TOKENIZERS_PARALLELISM", parallelism)
    own = _as(tokenizer, AmenCall)
    items = texts[:256]
    pieces = workers.Pieces(_call_in_worker, own, [items[k : k + 64] for k in range(0, 256, 64)], cores=2)
    assert [len(rows) for rows in pieces] == [64] * 4 and pieces.used_workers == used


class CountedAmenCall(AmenCall):
    """:class:`AmenCall` noting the texts of each of its calls in this process."""

    calls: list[int] = []

    def __call__(self, text, *args, **kwargs):
        CountedAmenCall.calls.append(len(text))
        return super().__call__(text, *args, **kwargs)


@two_cores
@pytest.mark.parametrize("why", ["below the cost rule", "cannot be pickled"])
def test_a_call_no_worker_joins_runs_its_first_piece_then_whole_chunks(tokenizer, monkeypatch, texts, why,
                                                                       no_pool_left):
    monkeypatch.setattr(workers, "POOL_MIN_SECONDS", 10**6 if why == "below the cost rule" else 0)
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")  # its call on one thread: the share rule lets workers in
    cls = CountedAmenCall if why == "below the cost rule" else type("Local", (CountedAmenCall,), {})  # no import
    own, items = _as(tokenizer, cls), texts[:256]
    expected = own(items, truncation=True, max_length=MAX_LEN)["input_ids"]
    tokenize = ParallelTokenizer(own, MAX_LEN, {}, cores=2)
    CountedAmenCall.calls.clear()
    first = tokenize(items)
    assert CountedAmenCall.calls == [32, 224]  # the first piece (four a core) timed, then the rest as one chunk
    CountedAmenCall.calls.clear()
    second = tokenize(items)  # workers that could not be pickled are not tried again: no pieces
    assert CountedAmenCall.calls == ([32, 224] if why == "below the cost rule" else [256])
    assert tokenize.mechanisms == {"one": 2}
    for store in (first, second):
        assert [store.row(i).tolist() for i in range(len(items))] == expected


def _call_in_worker(tokenizer, piece):
    return tokenizer(piece, truncation=True, max_length=MAX_LEN)["input_ids"]


@two_cores
def test_no_process_starts_for_a_short_call_nor_on_one_core(tokenizer, monkeypatch, texts):
    import multiprocessing

    started = []
    monkeypatch.setattr(workers.WorkerPool, "__init__", lambda self, *a, **k: started.append(a))
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    own = _as(tokenizer, AmenCall)
    tokenize = ParallelTokenizer(own, MAX_LEN, {}, cores=2)
    tokenize(texts[:50])  # far below POOL_MIN_SECONDS of work
    assert tokenize.mechanisms == {"one": 1}
    monkeypatch.setattr(workers, "POOL_MIN_SECONDS", 0)
    tokenize_texts(texts * 10, own, MAX_LEN, progress=False, tokenize_cores=1)
    assert started == [] and multiprocessing.active_children() == []


@two_cores
def test_a_tokenizer_that_cannot_be_pickled_tokenizes_on_one_core(tokenizer, monkeypatch, caplog, texts,
                                                                  no_pool_left):
    local = type("Local", (AmenCall,), {})  # a class no worker can import
    monkeypatch.setattr(workers, "POOL_MIN_SECONDS", 0)
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")  # its call on one thread: workers are tried
    tokenize = ParallelTokenizer(_as(tokenizer, local), MAX_LEN, {}, cores=2, chunk_size=16)
    with caplog.at_level(logging.WARNING, logger="dynabatch.data.workers"):
        tokens = tokenize(texts[:40])
    assert tokenize.mechanisms == {"one": 1} and "cannot be pickled" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dynabatch.data.workers"):
        tokenize(texts[:40])  # it is not tried again
    assert tokenize.mechanisms == {"one": 2} and "cannot be pickled" not in caplog.text
    assert tokens.row(0).tolist() == _as(tokenizer, AmenCall)(texts[:1], truncation=True,
                                                               max_length=MAX_LEN)["input_ids"][0]


class Refusing(BertTokenizer):
    """A tokenizer whose call raises on a text holding "poison"."""

    def __call__(self, text, *args, **kwargs):
        if any("poison" in t for t in text):
            raise ValueError("poison in the texts")
        return super().__call__(text, *args, **kwargs)


@two_cores
def test_an_error_in_a_worker_is_raised_here(tokenizer, monkeypatch, texts, no_pool_left):
    monkeypatch.setattr(workers, "POOL_MIN_SECONDS", 0)
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")  # its call on one thread: workers join
    with pytest.raises(ValueError, match="^poison in the texts$"):  # the poison in the first piece a worker takes
        tokenize_texts([*texts[:8], "poison", *texts[:60]], _as(tokenizer, Refusing), MAX_LEN, progress=False,
                       chunk_size=8)


@two_cores
@pytest.mark.parametrize("n", [10, 200])  # one piece (one thread), and many
def test_with_its_pool_off_a_backend_is_called_from_a_thread_of_ours_per_core(tokenizer, monkeypatch, texts, n):
    from dynabatch._background import stage_seconds, timing_stages

    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    items = (texts * 5)[:n]
    expected = tokenizer(items, truncation=True, max_length=MAX_LEN)
    tokenize = ParallelTokenizer(tokenizer, MAX_LEN, {}, cores=2)
    with timing_stages():
        tokens = tokenize(items)
        assert stage_seconds()["dynabatch-tokenize-calls"][0] > 0  # the calls ran on our threads
    assert tokenize.mechanisms == {"parallel calls": 1}
    assert [tokens.row(i).tolist() for i in range(n)] == expected["input_ids"]
    assert tokens.extras["token_type_ids"].tolist() == [v for row in expected["token_type_ids"] for v in row]
    assert not any(t.name == "dynabatch-tokenize-calls" for t in threading.enumerate())  # ended with the call
    one = ParallelTokenizer(tokenizer, MAX_LEN, {}, cores=1)
    alone = one(items)
    assert [alone.row(i).tolist() for i in range(n)] == expected["input_ids"] and one.mechanisms == {"one": 1}


@two_cores
def test_an_error_in_a_backend_call_on_our_threads_is_raised_here_and_no_thread_is_left(tokenizer, monkeypatch,
                                                                                       texts):
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    real = tokenization._batch_encoder

    def refusing(backend):
        encode = real(backend)

        def call(chunk, **kwargs):
            if "poison" in chunk:
                raise ValueError("poison in the texts")
            return encode(chunk, **kwargs)

        return call

    monkeypatch.setattr(tokenization, "_batch_encoder", refusing)
    with pytest.raises(ValueError, match="^poison in the texts$"):
        tokenize_texts([*texts[:50], "poison", *texts[:100]], tokenizer, MAX_LEN, progress=False, chunk_size=16)
    assert not any(t.name == "dynabatch-tokenize-calls" for t in threading.enumerate())


def test_tokenize_cores_is_checked(tokenizer):
    with pytest.raises(ValueError, match=r"^tokenize_cores should be a positive integer, but got tokenize_cores=0$"):
        tokenize_texts(["a"], tokenizer, MAX_LEN, tokenize_cores=0)


_TEST_PROCESS = os.getpid()


class WorkersFirst(BertTokenizer):
    """A tokenizer whose call in a worker marks ``answered`` (a path set on it), and whose calls in the test's process
    past its first (which runs before any worker exists) wait until one has: a worker takes part however long the
    machine takes to start it."""

    def __call__(self, text, *args, **kwargs):
        if os.getpid() != _TEST_PROCESS:
            self.answered.touch()
        else:
            self.calls = getattr(self, "calls", 0) + 1
            deadline = time.monotonic() + 120
            while self.calls > 1 and not self.answered.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
        return super().__call__(text, *args, **kwargs)


def _workers_first(tokenizer, cls, answered):
    """A copy of ``tokenizer`` as ``cls`` (a :class:`WorkersFirst`), marking ``answered``."""
    other = _as(tokenizer, cls)
    other.answered = answered
    return other


@pytest.fixture
def sleeping_calls(monkeypatch):
    """Workers for any call: a call on one thread (``TOKENIZERS_PARALLELISM=false``) whose sleeps in the test's process
    must not read as time on threads of its own (another thread's few milliseconds would keep the workers out)."""
    monkeypatch.setattr(workers, "POOL_MIN_SECONDS", 0)
    monkeypatch.setattr(workers, "_OWN_THREADS_SHARE", 1.0)
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")


class DyingInWorkers(WorkersFirst):
    """A tokenizer whose call kills any process but the test's (a worker killed mid-call)."""

    def __call__(self, text, *args, **kwargs):
        if os.getpid() != _TEST_PROCESS:
            super().__call__(text, *args, **kwargs)
            os._exit(1)
        result = super().__call__(text, *args, **kwargs)
        # once a worker answered, this process goes on only when it is gone: else this process can end the call
        # before the death reaches it (a busy machine), and the call's warning and fallback go unseen
        deadline = time.monotonic() + 30
        while self.calls > 1 and time.monotonic() < deadline and any(
                p.name == "dynabatch-tokenizer" for p in multiprocessing.active_children()):
            time.sleep(0.01)
        return result


@two_cores
def test_workers_that_die_leave_the_call_to_this_process(tokenizer, caplog, texts, tmp_path, sleeping_calls,
                                                         no_pool_left):
    tokenize = ParallelTokenizer(_workers_first(tokenizer, DyingInWorkers, tmp_path / "answered"), MAX_LEN, {},
                                 cores=2, chunk_size=8)
    items = texts * 2
    expected = tokenizer(items, truncation=True, max_length=MAX_LEN)["input_ids"]
    with caplog.at_level(logging.WARNING, logger="dynabatch.data.workers"):
        tokens = tokenize(items)
    assert [tokens.row(i).tolist() for i in range(len(items))] == expected
    assert "worker processes failed" in caplog.text
    tokenize(items[:40])  # not tried again for this tokenizer
    assert tokenize.mechanisms == {"processes": 1, "one": 1}


class SlowHere(WorkersFirst):
    """A tokenizer whose own call takes 50 ms longer in the test's process than in a worker."""

    def __call__(self, text, *args, **kwargs):
        if os.getpid() == _TEST_PROCESS:
            time.sleep(0.05)
        return super().__call__(text, *args, **kwargs)


@two_cores
@pytest.mark.parametrize("lose_below, lost", [(float("inf"), True), (0.0, False)])  # both sides of the judgement
def test_workers_that_lose_are_dropped_and_a_pool_that_pays_serves_every_loader(tokenizer, monkeypatch, texts,
                                                                              tmp_path, sleeping_calls, lose_below,
                                                                              lost, no_pool_left):
    monkeypatch.setattr(workers, "WORKERS_LOSE_BELOW", lose_below)
    slow = _workers_first(tokenizer, SlowHere, tmp_path / "answered")
    items = texts[:96]
    expected = tokenizer(items, truncation=True, max_length=MAX_LEN)["input_ids"]
    first, second = (ParallelTokenizer(slow, MAX_LEN, {}, cores=2, chunk_size=8) for _ in range(2))  # two loaders'
    for tokenize in (first, first, second):
        tokens = tokenize(items)
        assert [tokens.row(i).tolist() for i in range(len(items))] == expected  # each text once, in order
    pids = workers.shared_pool(1).pids
    assert first.mechanisms == ({"processes": 1, "one": 1} if lost else {"processes": 2})
    assert second.mechanisms == {"processes": 1}  # another loader judges for itself, on the same pool
    assert workers.shared_pool(1).pids == pids


def _tokenize_in_daemon(tokenizer, items, answers):
    tokenize = ParallelTokenizer(tokenizer, MAX_LEN, {}, cores=2, chunk_size=8)
    tokens = tokenize(items)
    answers.put((dict(tokenize.mechanisms), [tokens.row(i).tolist() for i in range(len(items))]))


@two_cores
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_dataloader_worker_tokenizes_alone(tokenizer, monkeypatch, texts):
    import multiprocessing

    monkeypatch.setattr(workers, "POOL_MIN_SECONDS", 0)
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    context = multiprocessing.get_context("fork")
    answers = context.Queue()
    items = texts[:40]
    process = context.Process(target=_tokenize_in_daemon, args=(_as(tokenizer, AmenCall), items, answers),
                              daemon=True)  # as num_workers' processes are: no pool of its own
    process.start()
    mechanisms, rows = answers.get(timeout=60)
    process.join()
    assert mechanisms == {"one": 1}
    assert rows == _as(tokenizer, AmenCall)(items, truncation=True, max_length=MAX_LEN)["input_ids"]


@pytest.mark.parametrize("cores", [1, 2])
def test_a_text_with_a_lone_surrogate_is_named_by_its_position(tokenizer, cores):
    # The fast backend refuses it with "TypeError: TextEncodeInput must be Union[...]", naming no text
    texts = ["In the beginning", "And God said", "bad \udcff bytes", "Let there be light"] * 8
    with pytest.raises(ValueError, match=r"^texts\[2\] should be text that encodes as UTF-8, but got texts\[2\]="
                                         r"'bad \\udcff bytes' holding surrogates not allowed at character 4"):
        tokenize_texts(texts, tokenizer, 16, progress=False, tokenize_cores=cores)
