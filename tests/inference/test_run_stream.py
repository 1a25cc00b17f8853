"""run over a streaming loader: the first batch runs before the corpus is tokenized; rows as with the whole plan."""

import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import dynabatch
import dynabatch.data.streaming as token_streaming
from dynabatch.demo import kjv_passages, vary_lengths


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(token_streaming, "FIRST_CHUNK", 32)
    monkeypatch.setattr(token_streaming, "CHUNK_SIZE", 64)


@pytest.fixture(scope="module")
def texts():
    return vary_lengths(kjv_passages(), n=400, max_words=48, seed=9)


def _load(texts, tokenizer, **kwargs):
    kwargs.setdefault("stream", True)
    return dynabatch.build_dynamic_batch_dataloader(texts, tokenizer, 4, 64, num_workers=0, progress=False, **kwargs)


def _sums(batch):
    return (batch["input_ids"] * batch["attention_mask"]).sum(1)


@pytest.fixture(scope="module")
def expected(texts, tokenizer):
    loader = _load(texts, tokenizer, stream=False)
    return [int(x) for x in dynabatch.run(_sums, loader, progress=False)]


def test_the_first_batch_runs_when_only_the_first_chunk_is_tokenized(small_chunks, texts, tokenizer, expected,
                                                                       monkeypatch):
    gate = threading.Event()
    tokenize = token_streaming.TokenStream.tokenize

    def gated(stream, k, **kwargs):  # every chunk after the first waits until the first batch has run
        if k > 0 and not gate.wait(60):
            raise RuntimeError("the first batch never ran")
        return tokenize(stream, k, **kwargs)

    monkeypatch.setattr(token_streaming.TokenStream, "tokenize", gated)
    loader = _load(texts, tokenizer)
    chunks_at_first = []

    def fn(batch):
        if not chunks_at_first:
            chunks_at_first.append(int(loader.plan.stream.tokenizations.sum()))  # chunks tokenized by then
            gate.set()
        return _sums(batch)

    result = dynabatch.run(fn, loader, progress=False)
    assert chunks_at_first == [1] and loader.plan.stream.n_chunks > 3
    assert [int(x) for x in result] == expected


@pytest.mark.parametrize("kind", ["list", "generator", "arrow", "parquet", "dataset"])
def test_every_source_gives_the_rows_of_the_whole_plan(small_chunks, texts, tokenizer, expected, kind, tmp_path):
    import datasets

    if kind == "parquet":
        pq.write_table(pa.table({"text": texts}), tmp_path / "corpus.parquet", row_group_size=100)
    source = {"list": lambda: texts, "generator": lambda: (t for t in texts), "arrow": lambda: pa.array(texts),
              "parquet": lambda: dynabatch.read_texts(tmp_path / "corpus.parquet"),
              "dataset": lambda: datasets.Dataset.from_dict({"text": texts})}[kind]()
    loader = _load(source, tokenizer)
    result = dynabatch.run(_sums, loader, progress=False)
    assert [int(x) for x in result] == expected
    assert result.report.rows == len(texts)


def test_measured_mode_keeps_every_batch_under_the_first_peak(small_chunks, texts, tokenizer):
    embed = torch.nn.Embedding(len(tokenizer), 32)

    def fn(batch):
        with torch.no_grad():
            h = embed(batch["input_ids"])
            return ((h @ h.transpose(1, 2)).softmax(-1) @ h).sum((1, 2))

    report = dynabatch.run(fn, _load(texts, tokenizer), progress=False, memory="measured").report
    assert report.batches_over_budget == 0 and max(r.rows for r in report.records) > 4


def test_a_row_the_characters_ranked_too_low_runs_alone_in_measured_mode(tokenizer, monkeypatch):
    monkeypatch.setattr(token_streaming, "FIRST_CHUNK", 8)
    monkeypatch.setattr(token_streaming, "CHUNK_SIZE", 8)
    wide = ["x" + " " * 400 + "y"] * 16  # many characters, 4 tokens
    words = " ".join(["light"] * 40)  # fewer characters, 42 tokens
    texts = wide + [words] + ["a b"] * 15
    loader = dynabatch.build_dynamic_batch_dataloader(texts, tokenizer, 4, 64, num_workers=0, stream=True)
    result = dynabatch.run(_sums, loader, progress=False, memory="measured")
    assert [int(x) for x in result] == [int(_sums(loader.plan.collator([p]))) for p in range(len(texts))]
    record = next(r for r in result.report.records if r.width == 42)
    assert record.rows == 1
    assert loader.plan.stream.proxy_misses >= 1


def test_a_streamed_store_resumes_and_refuses_other_inputs(small_chunks, texts, tokenizer, expected, tmp_path):
    first = dynabatch.run(_sums, _load(texts, tokenizer), output_path=tmp_path, key="sums", progress=False)
    assert [int(x) for x in first] == expected
    again = dynabatch.run(_sums, _load(texts, tokenizer), output_path=tmp_path, key="sums", progress=False)
    assert again.report.rows == 0 and [int(x) for x in again] == expected
    other = list(texts)
    other[5] = "Another text altogether at this position"
    with pytest.raises(ValueError, match=r"computed from other inputs \(positions 5\)"):
        dynabatch.run(_sums, _load(other, tokenizer), output_path=tmp_path, key="sums", progress=False)


def test_a_run_frees_every_chunk_as_its_rows_finish(small_chunks, texts, tokenizer, expected):
    loader = _load(texts, tokenizer)
    result = dynabatch.run(_sums, loader, progress=False)
    assert loader.plan.stream.held_chunks == [] and loader.plan.stream.token_bytes == 0
    again = dynabatch.run(_sums, loader, progress=False)  # a second run over the freed chunks tokenizes them again
    assert [int(x) for x in result] == [int(x) for x in again] == expected


def test_a_run_tokenizing_in_worker_processes_leaves_no_process_nor_thread(small_chunks, texts, tokenizer, expected,
                                                                           monkeypatch):
    import multiprocessing

    from dynabatch.data import tokenization, workers

    if workers.available_cores() < 2:
        pytest.skip("needs two cores")
    monkeypatch.setattr(workers, "POOL_MIN_SECONDS", 0)
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")  # the backend's threads off: chunks go to worker processes
    monkeypatch.setattr(tokenization, "fast_backend", lambda *args: None)  # its own call runs: processes share it
    loader = _load(texts, tokenizer)

    working = []

    def sums(batch):
        working.append(bool(multiprocessing.active_children()))
        return _sums(batch)

    assert [int(x) for x in dynabatch.run(sums, loader, progress=False)] == expected
    assert any(working)  # the workers ran beside the run
    assert multiprocessing.active_children() == []
    assert not [t.name for t in threading.enumerate() if t.name.startswith("dynabatch")]


def _rewriting(tokenizer, how):
    """A copy of ``tokenizer`` that reads URLs as ``[UNK]`` (in its ``__call__`` or its ``_encode_plus``), or that
    splits special tokens written in the text."""
    import copy
    import re

    def unk(texts):
        return [re.sub(r"https?://\S+", "[UNK]", t) for t in texts] if isinstance(texts, list) else texts

    class UrlsInCall(type(tokenizer)):
        def __call__(self, text=None, *args, **kwargs):
            return super().__call__(unk(text), *args, **kwargs)

    class UrlsInEncode(type(tokenizer)):
        def _encode_plus(self, text, *args, **kwargs):
            return super()._encode_plus(unk(text), *args, **kwargs)

    tok = copy.deepcopy(tokenizer)
    if how == "split_special_tokens":
        tok.split_special_tokens = True
    else:
        tok.__class__ = {"__call__": UrlsInCall, "_encode_plus": UrlsInEncode}[how]
    return tok


@pytest.mark.parametrize("how", ["__call__", "_encode_plus", "split_special_tokens"])
def test_a_tokenizer_that_rewrites_text_gives_the_same_rows_streamed_and_eager(small_chunks, texts, tokenizer, how):
    # The longest texts (the first chunks) have no URL and no special token written out; the short ones do.
    tok = _rewriting(tokenizer, how)
    corpus = list(texts[:200]) + [f"see https://example.org/{i} and [SEP] {i}" for i in range(60)]
    eager = _load(corpus, tok, stream=False).plan.collator.tokenized
    streamed = _load(corpus, tok).plan.stream.tokenized
    assert np.array_equal(streamed.offsets, eager.offsets) and np.array_equal(streamed.input_ids, eager.input_ids)
    expected = tok(corpus[-1:], truncation=True, max_length=64)["input_ids"][0]
    assert eager.row(len(corpus) - 1).tolist() == expected


def test_two_devices_share_one_stream(small_chunks, texts, tokenizer, expected):
    result = dynabatch.run(make_fn=lambda device: _sums, loader=_load(texts, tokenizer), devices=["cpu", "cpu"],
                           progress=False)
    assert [int(x) for x in result] == expected


def test_an_interrupted_run_on_two_devices_stores_exactly_the_rows_that_finished_and_a_rerun_the_rest(
        small_chunks, texts, tokenizer, expected, tmp_path):
    ids = [f"doc-{i}" for i in range(len(texts))]
    finished, calls, lock = [], [], threading.Lock()

    def make_fn(device):
        def fn(batch):  # interrupted once six calls, over both devices, have begun
            with lock:
                if len(calls) >= 6:
                    raise RuntimeError("interrupted")
                calls.append(1)
            rows = _sums(batch)
            with lock:
                finished.extend(batch.indices.tolist())
            return rows

        return fn

    path = tmp_path / "store"
    with pytest.raises(RuntimeError, match="interrupted"):
        dynabatch.run(make_fn=make_fn, loader=_load(texts, tokenizer, ids=ids), devices=["cpu", "cpu"],
                      output_path=path, progress=False)
    stored = pq.read_table(path, columns=["id"]).column("id").to_pylist()
    assert sorted(stored) == sorted(ids[p] for p in finished) and len(finished) < len(texts)
    again = dynabatch.run(_sums, _load(texts, tokenizer, ids=ids), output_path=path, progress=False)
    assert again.report.rows == len(texts) - len(finished) and [int(x) for x in again] == expected
    assert sorted(pq.read_table(path, columns=["id"]).column("id").to_pylist()) == sorted(ids)


def test_ctrl_c_in_a_streamed_run_waits_for_one_piece_of_the_tokenizer_and_a_rerun_stores_every_row_once(
        texts, tokenizer, expected, tmp_path, monkeypatch):
    # Ctrl-C (KeyboardInterrupt in fn, on the main thread) while the stream's thread tokenizes a chunk of four slow
    # pieces: run raises once the piece in progress is done, not the chunk (6 s)
    import copy
    import time

    from dynabatch.data import tokenization

    monkeypatch.setattr(token_streaming, "FIRST_CHUNK", 192)
    monkeypatch.setattr(tokenization, "TOKENS_PER_CALL", 64 * 64)  # pieces of 64 texts at 64 tokens
    delay, loaders = [1.5], []

    class Slow(type(tokenizer)):  # its own call (no fast backend): one call per piece, on the stream's thread slow
        def __call__(self, text=None, *args, **kwargs):  # from chunk 1 on (chunk 0's tokens are held)
            if threading.current_thread().name == "dynabatch-tokenize" and loaders[0].plan.stream.tokenizations[0]:
                time.sleep(delay[0])
            return super().__call__(text, *args, **kwargs)

    slow = copy.deepcopy(tokenizer)
    slow.__class__ = Slow
    ids, path, interrupted = [f"doc-{i}" for i in range(len(texts))], tmp_path / "store", []

    def fn(batch):  # the first batch runs as chunk 1 (208 texts, 4 pieces of 1.5 s) begins
        interrupted.append(time.monotonic())
        raise KeyboardInterrupt

    loaders.append(_load(texts, slow, ids=ids, tokenize_cores=1))
    assert np.diff(loaders[0].plan.stream.starts).tolist() == [192, 208]
    with pytest.raises(KeyboardInterrupt):
        dynabatch.run(fn, loaders[0], output_path=path, progress=False)
    waited = time.monotonic() - interrupted[0]
    assert waited < 3.0, f"run raised {waited:.1f} s after Ctrl-C: it waited for the chunk (6 s), not its piece (1.5 s)"
    assert not any(t.name == "dynabatch-tokenize" for t in threading.enumerate())
    delay[0] = 0.0
    again = dynabatch.run(_sums, _load(texts, slow, ids=ids, tokenize_cores=1), output_path=path, progress=False)
    assert again.report.rows == len(texts) and [int(x) for x in again] == expected
    assert sorted(pq.read_table(path, columns=["id"]).column("id").to_pylist()) == sorted(ids)


def test_plain_iteration_and_len(small_chunks, texts, tokenizer):
    loader = _load(texts, tokenizer)
    first = [b["input_ids"] for b in loader]
    assert loader.plan.stream.held_chunks == []  # a plain loop consumes each batch's rows as it builds it
    positions = np.concatenate([b.indices.numpy() for b in loader])
    assert sorted(positions.tolist()) == list(range(len(texts))) and len(loader) == len(first)
    assert all(torch.equal(a, b["input_ids"]) for a, b in zip(first, loader))  # each pass tokenizes again


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"stream": "yes"}, TypeError, r"^stream should be None \(auto\), True or False, but got stream='yes'"),
        ({"stream": True, "shuffle": True}, ValueError,
         r"^stream should be False or None with shuffle=True \(a shuffled order needs the whole plan\)"),
    ],
)
def test_bad_stream_arguments(texts, tokenizer, kwargs, error, match):
    with pytest.raises(error, match=match):
        dynabatch.build_dynamic_batch_dataloader(texts, tokenizer, 4, 64, num_workers=0, **kwargs)


def test_pre_tokenized_texts_do_not_stream(tokenizer):
    with pytest.raises(ValueError, match=r"^stream should be False or None for pre-tokenized texts"):
        dynabatch.build_dynamic_batch_dataloader([[101, 102]], tokenizer, 4, 64, num_workers=0, stream=True)


def test_null_texts_raise_or_are_skipped(small_chunks, tokenizer):
    with pytest.raises(TypeError, match=r"^texts should hold only str, but got 1 of 3 missing \(null\) texts "
                                        r"\(positions 1\)"):
        _load(pa.array(["a", None, "b"]), tokenizer)
    result = dynabatch.run(_sums, _load(pa.array(["a", None, "b"]), tokenizer, on_bad_input="skip"), progress=False)
    assert result[1] is None and result.failed == [1] and result[0] is not None
