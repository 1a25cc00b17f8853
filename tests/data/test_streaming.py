"""TokenStream: chunks longest by characters first, tokenized in the background, exactly as the eager store."""


import numpy as np
import pytest

from dynabatch.data.streaming import TokenStream
from dynabatch.data.text_source import TextSource
from dynabatch.data.tokenization import tokenize_texts
from dynabatch.demo import kjv_passages, vary_lengths


@pytest.fixture(scope="module")
def texts():
    return vary_lengths(kjv_passages(), n=300, max_words=48, seed=5)


def test_chunks_cover_every_text_once_longest_by_characters_first(tokenizer, texts):
    stream = TokenStream(TextSource(texts), tokenizer, 64, first_chunk=20, chunk_size=70)
    sizes = np.diff(stream.starts).tolist()
    assert sizes[:3] == [20, 40, 70] and max(sizes) == 70 and sum(sizes) == len(texts)
    chars = np.array([len(t) for t in texts])
    assert np.all(np.diff(chars[stream.order]) <= 0)
    assert sorted(stream.order.tolist()) == list(range(len(texts)))


def test_the_streamed_store_equals_the_eager_one(tokenizer, texts):
    stream = TokenStream(TextSource(texts), tokenizer, 32, first_chunk=16, chunk_size=50)
    eager = tokenize_texts(texts, tokenizer, 32, progress=False)
    whole = stream.tokenized
    assert np.array_equal(whole.offsets, eager.offsets) and np.array_equal(whole.input_ids, eager.input_ids)
    assert np.array_equal(whole.extras["token_type_ids"], eager.extras["token_type_ids"])
    batch = stream.collate([7, 3, 250])
    assert batch.indices.tolist() == [7, 3, 250] and batch.texts == [texts[7], texts[3], texts[250]]
    assert batch["attention_mask"].sum(1).tolist() == eager.lengths[[7, 3, 250]].tolist()


def test_a_batch_of_rows_not_tokenized_is_refused(tokenizer, texts):
    stream = TokenStream(TextSource(texts), tokenizer, 32, first_chunk=16, chunk_size=50)
    with pytest.raises(ValueError, match=r"^positions should be rows of tokenized chunks, but got 1 rows not "
                                         r"tokenized yet \(positions \[0\]\)$"):
        stream.collate([0])


def test_the_feed_tokenizes_in_the_background_and_counts_proxy_misses(tokenizer):
    # Spaces are characters, not tokens: the long-by-characters texts come first yet are the shortest in tokens.
    texts = ["x" + " " * 300 + "y"] * 4 + ["one two three four five six seven eight"] * 4
    stream = TokenStream(TextSource(texts), tokenizer, 64, first_chunk=4, chunk_size=4)
    feed = stream.feed(iter(range(stream.n_chunks)))
    first = feed.next()
    assert first[0].tolist() == [0, 1, 2, 3] and first[1].tolist() == [4] * 4
    second = feed.next()
    assert second[1].tolist() == [10] * 4 and feed.next() is None
    assert feed.proxy_misses == 4


def test_an_error_in_the_thread_is_raised_by_the_consumer(tokenizer):
    class Broken:
        pad_token_id, padding_side = 0, "right"

        def __call__(self, texts, **kwargs):
            raise RuntimeError("tokenizer broke")

    stream = TokenStream(TextSource(["a", "b"]), Broken(), 8)
    with pytest.raises(RuntimeError, match="^tokenizer broke$"):
        stream.feed(iter([0])).next()


def test_a_feed_no_one_reads_tokenizes_nothing(tokenizer, texts):
    stream = TokenStream(TextSource(texts), tokenizer, 32, first_chunk=16, chunk_size=50)
    stream.feed(iter(range(stream.n_chunks)))
    assert not stream._collators


@pytest.mark.parametrize("which", ["wordpiece", "llama"])
def test_the_backend_path_is_taken_only_when_it_gives_the_tokenizers_tokens(which, tokenizer, llama_tokenizer, texts):
    import copy

    tok = tokenizer if which == "wordpiece" else copy.deepcopy(llama_tokenizer)
    if tok.pad_token is None:
        tok.pad_token = tok.unk_token
    stream = TokenStream(TextSource(texts), tok, 40, first_chunk=16, chunk_size=50)
    eager = tokenize_texts(texts, tok, 40, progress=False)
    whole = stream.tokenized
    assert np.array_equal(whole.offsets, eager.offsets) and np.array_equal(whole.input_ids, eager.input_ids)
    assert stream._direct is not None
    other = TokenStream(TextSource(texts[:40]), tok, 40, first_chunk=16, chunk_size=16, return_length=True)
    other.tokenized
    assert other._direct is False  # an argument only the tokenizer's call knows: its call, every chunk
