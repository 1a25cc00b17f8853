"""TokenStream: chunks longest by characters first, tokenized in the background, exactly as the eager store."""


import numpy as np
import pytest
import torch

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


def test_rows_of_a_chunk_not_tokenized_yet_are_tokenized_for_their_batch(tokenizer, texts):
    stream = TokenStream(TextSource(texts), tokenizer, 32, first_chunk=16, chunk_size=50)
    eager = tokenize_texts(texts, tokenizer, 32, progress=False)
    batch = stream.collate([0])
    assert batch["input_ids"][0].tolist() == eager.row(0).tolist() and stream.held_chunks == [stream.chunk_of[0]]


@pytest.mark.parametrize("tokenize_cores", [1, 2])
def test_texts_of_no_token_are_refused_or_planned_nowhere_as_their_chunk_is_tokenized(tokenizer, tokenize_cores):
    def stream(on_bad_input):
        return TokenStream(TextSource(["a b c", "", "  ", "d"]), tokenizer, 8, on_bad_input=on_bad_input,
                           first_chunk=2, chunk_size=2, tokenize_cores=tokenize_cores, add_special_tokens=False)

    skipping = stream("skip")
    feed = skipping.feed(iter(range(skipping.n_chunks)))
    assert [(p.tolist(), n.tolist()) for p, n in iter(feed.next, None)] == [([0], [3]), ([3], [1])]
    assert skipping.no_token.tolist() == [1, 2]
    skipping.consumed([0, 3])  # the rows of no token count as done: both chunks' tokens are freed
    assert skipping.held_chunks == []
    with pytest.raises(ValueError, match=r"^texts\[2\] should be at least one token .* texts\[2\]='  ', of no token; "
                                         r"1 of 2 texts of its chunk hold no token \(positions 2\)"):
        stream("raise").feed(iter([0])).next()


def test_skipped_rows_are_planned_nowhere_and_refused_in_a_batch(tokenizer):
    stream = TokenStream(TextSource(["a b", None, "c"]), tokenizer, 8, skip=[1])
    with pytest.raises(ValueError, match=r"^positions should be rows planned into batches, but got 1 skipped "
                                         r"inputs \(positions \[1\]\)$"):
        stream.collate([0, 1])


def test_a_chunk_is_freed_once_every_row_is_consumed_and_tokenized_again_when_collated(tokenizer, texts):
    stream = TokenStream(TextSource(texts), tokenizer, 32, first_chunk=16, chunk_size=50)
    feed = stream.feed(iter(range(stream.n_chunks)))
    while feed.next() is not None:
        pass
    assert stream.held_chunks == list(range(stream.n_chunks))
    first = stream.chunk_positions(0)
    before = stream.collate(first[:5])
    stream.consumed(first[:-1])
    stream.consumed(first[:3])  # consumed twice: counted once
    assert 0 in stream.held_chunks
    stream.consumed([first[-1], first[-1]])
    assert 0 not in stream.held_chunks and stream.token_bytes < sum(len(t) for t in texts) * 8
    again = stream.collate(first[:5])  # a second pass: tokenized again, the same rows
    assert all(torch.equal(again[k], before[k]) for k in before) and stream.tokenizations[0] == 2
    stream.consumed(first)  # and freed again once the second pass has consumed every row
    assert 0 not in stream.held_chunks


def test_input_hashes_are_the_eager_stores_and_hold_no_chunk(tokenizer, texts):
    from dynabatch.data.input_hashes import token_store_hashes

    items = list(texts[:60]) + [None]
    stream = TokenStream(TextSource(items), tokenizer, 32, first_chunk=16, chunk_size=16, skip=[60])
    eager = tokenize_texts([t or "" for t in items], tokenizer, 32, progress=False)
    positions = np.arange(61)[::-1]
    stream.tokenize(1)  # rows of one held chunk, the others tokenized for their hashes only
    hashes = stream.input_hashes(positions)
    assert hashes.dtype == np.uint64 and np.array_equal(hashes, token_store_hashes(eager)[positions])
    assert stream.held_chunks == [1]


def test_the_feed_tokenizes_in_the_background_and_counts_proxy_misses(tokenizer):
    # Spaces are characters, not tokens: the long-by-characters texts come first yet are the shortest in tokens.
    texts = ["x" + " " * 300 + "y"] * 4 + ["one two three four five six seven eight"] * 4
    stream = TokenStream(TextSource(texts), tokenizer, 64, first_chunk=4, chunk_size=4)
    feed = stream.feed(iter(range(stream.n_chunks)))
    first = feed.next()
    assert first[0].tolist() == [0, 1, 2, 3] and first[1].tolist() == [4] * 4
    second = feed.next()
    assert second[1].tolist() == [10] * 4 and feed.next() is None
    assert stream.proxy_misses == 4


def test_a_chunk_weighs_the_chunks_still_to_come_by_characters(tokenizer):
    stream = TokenStream(TextSource(["a" * 8, "b" * 4, "c" * 2, "d"]), tokenizer, 8, first_chunk=1, chunk_size=2)
    assert stream.n_chunks == 3  # ["a"*8], ["b"*4, "c"*2], ["d"]
    assert stream.later_work(0) == (6 + 1) / 8 and stream.later_work(1) == (8 + 1) / 6
    stream.tokenize(0)
    assert stream.later_work(1) == 1 / 6 and stream.later_work(2) == 6.0


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
    assert stream.held_chunks == [] and not stream.tokenizations.any()


@pytest.mark.parametrize("special", [True, False])
def test_streamed_with_the_backends_pool_off_on_our_threads_equals_one_thread(tokenizer, monkeypatch, texts, special):
    import multiprocessing
    import threading

    from dynabatch.data import workers

    if workers.available_cores() < 2:
        pytest.skip("needs two cores")
    items = ["", " \t\r\n", "e\u0301 \U0001f389 [SEP] </s> \x00\x07", "word " * 300, *texts]
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")  # the backend's pool off: a thread of ours per core calls it
    one = TokenStream(TextSource(items), tokenizer, 32, first_chunk=64, chunk_size=64, tokenize_cores=1,
                      add_special_tokens=special).tokenized
    stream = TokenStream(TextSource(items), tokenizer, 32, first_chunk=64, chunk_size=64, tokenize_cores=2,
                         add_special_tokens=special)
    many = stream.tokenized
    stream.pause()
    assert stream._tokenize.mechanisms == {"parallel calls": stream.n_chunks}
    assert multiprocessing.active_children() == []
    assert not any(t.name == "dynabatch-tokenize-calls" for t in threading.enumerate())
    assert np.array_equal(many.offsets, one.offsets) and np.array_equal(many.input_ids, one.input_ids)
    assert np.array_equal(many.extras["token_type_ids"], one.extras["token_type_ids"])
    expected = tokenizer(items, truncation=True, max_length=32, add_special_tokens=special)["input_ids"]
    assert [one.row(i).tolist() for i in range(len(items))] == expected


def test_streamed_on_every_core_equals_one_thread_and_leaves_no_process(tokenizer, monkeypatch, texts):
    import multiprocessing

    from dynabatch.data import tokenization, workers

    if workers.available_cores() < 2:
        pytest.skip("needs two cores")
    tricky = ["", " \t\r\n", "e\u0301 \U0001f389 \u05e9\u05dc\u05d5\u05dd [SEP] </s> \x00\x07", "word " * 300]
    items = tricky + texts
    monkeypatch.setattr(workers, "POOL_MIN_SECONDS", 0)
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")  # the backend's threads off: worker processes
    monkeypatch.setattr(tokenization, "fast_backend", lambda *args: None)  # its own call runs: processes share it
    one = TokenStream(TextSource(items), tokenizer, 32, first_chunk=64, chunk_size=64, tokenize_cores=1).tokenized
    stream = TokenStream(TextSource(items), tokenizer, 32, first_chunk=64, chunk_size=64, tokenize_cores=2)
    feed = stream.feed(iter(range(stream.n_chunks)))
    feed.next()
    assert multiprocessing.active_children()  # the chunks are tokenized by worker processes
    while feed.next() is not None:
        pass
    assert multiprocessing.active_children() == []  # every chunk tokenized: the workers ended
    many = stream.tokenized  # the freed chunks tokenized again, on every core, until the stream is paused
    stream.pause()
    assert multiprocessing.active_children() == []
    assert np.array_equal(many.offsets, one.offsets) and np.array_equal(many.input_ids, one.input_ids)
    assert np.array_equal(many.extras["token_type_ids"], one.extras["token_type_ids"])


def test_a_feed_dropped_part_way_ends_its_thread_frees_the_stream_and_leaves_no_process(tokenizer, monkeypatch,
                                                                                       texts):
    # A plain loop that breaks out of a streaming loader, then drops it: nothing of the stream may stay behind.
    import gc
    import multiprocessing
    import threading
    import time
    import weakref

    from dynabatch.data import tokenization, workers

    monkeypatch.setattr(workers, "POOL_MIN_SECONDS", 0)
    monkeypatch.setattr(workers, "IDLE_CORE", -1.0)  # a busy machine: workers still join
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    monkeypatch.setattr(tokenization, "fast_backend", lambda *args: None)  # its own call: processes where 2 cores
    stream = TokenStream(TextSource(texts), tokenizer, 32, first_chunk=64, chunk_size=64, tokenize_cores=2)
    feed = stream.feed(iter(range(stream.n_chunks)), ahead=1)
    feed.next()
    if workers.available_cores() >= 2:
        assert multiprocessing.active_children()  # the chunks are tokenized by worker processes
    alive = weakref.ref(stream)
    del stream, feed
    gc.collect()
    deadline = time.monotonic() + 5.0
    while (alive() is not None or any(t.name == "dynabatch-tokenize" for t in threading.enumerate())
           or multiprocessing.active_children()) and time.monotonic() < deadline:
        time.sleep(0.05)
        gc.collect()
    assert alive() is None, "the dropped feed's thread keeps its stream (tokenizer copy, tokens) alive"
    assert not any(t.name == "dynabatch-tokenize" for t in threading.enumerate())
    assert multiprocessing.active_children() == []


def test_a_text_with_a_lone_surrogate_is_named_by_its_input_position_not_its_row_in_the_chunk(tokenizer):
    texts = ["a b c"] * 5 + ["d \ud800"] + ["e f g h i j k"] * 3
    stream = TokenStream(TextSource(texts), tokenizer, 16, first_chunk=4, chunk_size=8)
    with pytest.raises(ValueError, match=r"^texts\[5\] should be text that encodes as UTF-8"):
        stream.tokenized


def test_a_paused_feed_collected_while_this_thread_tokenizes_for_its_stream_does_not_deadlock(tokenizer, texts):
    # Its generator's finally releases the workers under the stream's tokenizing lock, on the collecting thread
    import gc
    import threading

    stream = TokenStream(TextSource(texts), tokenizer, 32, first_chunk=64, chunk_size=64)
    feed = stream.feed(iter(range(stream.n_chunks)), ahead=1)
    feed.next()
    stream.pause()
    feed.cycle = feed  # left to the cyclic collector, which may run on any allocation
    del feed
    encode = stream._encode

    def collecting(*args, **kwargs):
        gc.collect()
        return encode(*args, **kwargs)

    stream._encode = collecting
    thread = threading.Thread(target=lambda: stream.tokenized, daemon=True)
    thread.start()
    thread.join(20)
    assert not thread.is_alive(), "the collected feed's generator waited for the lock its own thread holds"


def test_a_pause_part_way_through_a_chunk_waits_for_one_piece_and_the_chunk_is_tokenized_again_on_resume(
        tokenizer, monkeypatch):
    # Ctrl-C in a run pauses its stream: its thread stops between the tokenizer's pieces, not at the end of a chunk
    # of thousands of texts (seconds with a slow tokenizer), and the chunk dropped part-way keeps its claim
    import copy
    import threading
    import time

    from dynabatch.data import tokenization

    monkeypatch.setattr(tokenization, "TOKENS_PER_CALL", 64 * 32)  # pieces of 64 texts at 32 tokens
    delay, started, handed = [0.0], threading.Event(), []

    class Slow(type(tokenizer)):  # its own call (no fast backend): one call per piece, on the stream's thread
        def __call__(self, text=None, *args, **kwargs):
            if threading.current_thread().name == "dynabatch-tokenize" and delay[0]:
                started.set()
                time.sleep(delay[0])
            return super().__call__(text, *args, **kwargs)

    def claims():  # as a counter shared by ranks hands them out; chunk 2's four pieces take 1.5 s each
        for k in (0, 2, 1, 3):
            delay[0] = 1.5 if k == 2 else delay[0]
            handed.append(k)
            yield k

    slow = copy.deepcopy(tokenizer)
    slow.__class__ = Slow
    texts = vary_lengths(kjv_passages(), n=600, max_words=48, seed=5)
    stream = TokenStream(TextSource(texts), slow, 32, first_chunk=64, chunk_size=256, tokenize_cores=1)
    assert np.diff(stream.starts).tolist() == [64, 128, 256, 152]
    feed = stream.feed(claims(), ahead=1)
    assert feed.next()[0].tolist() == stream.chunk_positions(0).tolist()
    assert started.wait(10)  # chunk 2's first piece is being tokenized
    begun = time.monotonic()
    stream.pause()
    waited = time.monotonic() - begun
    assert waited < 3.0, f"the pause waited {waited:.1f} s: for the whole chunk (6 s), not its piece (1.5 s)"
    assert handed == [0, 2] and stream.tokenizations.tolist() == [1, 0, 0, 0]  # chunk 2 claimed, nothing of it kept
    delay[0] = 0.0
    rest = [(p.tolist(), n.tolist()) for p, n in iter(feed.next, None)]  # the feed goes on from chunk 2, each once
    eager = tokenize_texts(texts, tokenizer, 32, progress=False)
    assert rest == [(stream.chunk_positions(k).tolist(), eager.lengths[stream.chunk_positions(k)].tolist())
                    for k in (2, 1, 3)]
    assert handed == [0, 2, 1, 3] and stream.tokenizations.tolist() == [1, 1, 1, 1]
