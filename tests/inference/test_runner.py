"""``run`` on real batches of real texts: rows in input order, OOM recovery, resumption, row extraction.

Models are real: MiniLM with its weights for forward passes, tiny random-weight
Llama (decoder-only, left padding) and Marian (encoder-decoder) for ``generate``.
Out-of-memory errors are raised for real by the CPU memory tracker with a
limit, or injected by wrapping a callable; nothing of dynabatch is mocked.
"""

import copy
import json
import logging
import os
import pickle
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from dynabatch import (
    Batch,
    BatchOutOfMemoryError,
    RunReport,
    RunResult,
    build_dynamic_batch_dataloader,
    restore_order,
    run,
    track_peak_memory,
)
from dynabatch.inference._rows import halves, split_rows, take_rows, to_json_value
from dynabatch.data.collate import TokenCollator
from dynabatch.data.tokenization import tokenize_texts

MAX_LEN = 48
NEW_TOKENS = 4


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def texts():
    from dynabatch.demo import kjv_passages, vary_lengths

    varied = vary_lengths(kjv_passages(), n=100, max_words=50, seed=7)
    return varied + [varied[3], "", "And God said"]  # a duplicate, an empty string


@pytest.fixture(scope="module")
def same_width_texts():
    # KJV passages mostly exceed 24 tokens: most batches are truncated to the same width, 24.
    from dynabatch.demo import kjv_passages

    return kjv_passages()[:120]


@pytest.fixture(scope="module")
def minilm():
    from transformers import AutoModel

    from dynabatch.demo import minilm_path

    return AutoModel.from_pretrained(minilm_path()).eval()


def _load(texts, tokenizer, **kwargs):
    kwargs.setdefault("batch_size", 4)
    kwargs.setdefault("max_input_token_length", MAX_LEN)
    kwargs.setdefault("num_workers", 0)
    return build_dynamic_batch_dataloader(texts, tokenizer, **kwargs)


def _lengths(batch):
    """A cheap deterministic per-row result: real tokens and the sum of real token ids."""
    mask = batch["attention_mask"]
    return torch.stack([mask.sum(1), (batch["input_ids"] * mask).sum(1)], dim=1).float()


def _oom_over(fn, max_rows, error=None):
    """``fn`` that raises an out-of-memory error for batches of more than ``max_rows`` rows; records calls."""

    def wrapped(batch):
        rows = len(batch["input_ids"])
        wrapped.calls.append((rows, batch["input_ids"].shape[1]))
        if rows > max_rows:
            raise error() if error else torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return fn(batch)

    wrapped.calls = []
    return wrapped


def _cpu_oom():
    return RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 123456789 bytes.")


# --- rows come back in input order --------------------------------------------------------------------


def test_forward_rows_equal_running_each_text_alone(tokenizer, minilm, texts):
    loader = _load(texts, tokenizer)
    with torch.no_grad():
        result = run(lambda b: minilm(**b).last_hidden_state[:, 0], loader, progress=False)
        assert isinstance(result, RunResult) and isinstance(result, list)
        assert len(result) == len(texts) and result.failed == []
        assert result.report.rows == len(texts) and result.report.batches == len(loader) > 3
        for p, text in enumerate(texts):
            alone = minilm(**tokenizer(text, truncation=True, max_length=MAX_LEN, return_tensors="pt"))
            assert result[p].shape == (384,) and not result[p].requires_grad
            torch.testing.assert_close(result[p], alone.last_hidden_state[0, 0], atol=1e-4, rtol=0)
    torch.testing.assert_close(result[len(texts) - 3], result[3])  # the duplicate, at its own position


def test_run_equals_the_manual_loop_with_restore_order(tokenizer, texts):
    loader = _load(texts, tokenizer)
    manual = restore_order([_lengths(b) for b in loader], [b.indices for b in loader])
    result = run(_lengths, loader, progress=False)
    assert all(torch.equal(a, b) for a, b in zip(result, manual))
    report = result.report
    assert [r.batch for r in report.records] == list(range(len(loader)))
    assert report.real_tokens == sum(int(b["attention_mask"].sum()) for b in loader)
    assert report.padded_tokens == sum(b["input_ids"].numel() for b in loader)
    assert report.peak_ratios == [None] * len(loader) and report.budget_bytes is None
    assert report.oom_events == report.oom_splits == report.pre_split_batches == 0


def test_a_plain_iterable_of_batches_and_a_device(tokenizer, texts):
    loader = _load(texts, tokenizer)
    want = run(_lengths, loader, progress=False)
    seen = []

    def on_meta(batch):
        seen.append(batch["input_ids"].device.type)
        return torch.zeros(len(batch.indices))

    assert len(run(on_meta, list(loader), device="meta", progress=False)) == len(texts)
    assert set(seen) == {"meta"}
    got = run(_lengths, list(loader), progress=False)  # a list of Batches: no collator, no pad id
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_progress_bar_shows_rows_and_tokens_per_second(tokenizer, texts, capsys):
    run(_lengths, _load(texts[:20], tokenizer), progress=True)
    err = capsys.readouterr().err
    assert "row/s" in err and "tokens/s" in err and f"{20}/{20}" in err
    run(_lengths, _load(texts[:20], tokenizer), progress=False)
    assert capsys.readouterr().err == ""


def test_model_output_gives_one_dict_per_row(tokenizer, minilm, texts):
    loader = _load(texts[:12], tokenizer)
    with torch.no_grad():
        result = run(lambda b: minilm(**b, output_hidden_states=True), loader, progress=False)
        for p, text in enumerate(texts[:12]):
            row = result[p]
            assert sorted(row) == ["hidden_states", "last_hidden_state", "pooler_output"]
            assert isinstance(row["hidden_states"], tuple) and len(row["hidden_states"]) == 7
            alone = minilm(**tokenizer(text, truncation=True, max_length=MAX_LEN, return_tensors="pt"))
            torch.testing.assert_close(row["pooler_output"], alone.pooler_output[0], atol=1e-4, rtol=0)
            n = alone.last_hidden_state.shape[1]
            torch.testing.assert_close(row["last_hidden_state"][:n], alone.last_hidden_state[0], atol=1e-4, rtol=0)


# --- generate: per-row outputs without the batch's padding ----------------------------------------------


@pytest.fixture(scope="module")
def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=30522,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=0,
        bos_token_id=101,
        eos_token_id=102,
        attn_implementation="eager",
        initializer_range=0.3,
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return LlamaForCausalLM(config).eval()


def _greedy(model, **inputs):
    # The pad id is never generated, so no row of a batch ends in real pad tokens.
    return model.generate(
        **inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, suppress_tokens=[0]
    )


@pytest.fixture(scope="module")
def left(tokenizer):
    """The tokenizer padding on the left, as decoder-only generate needs."""
    left = copy.deepcopy(tokenizer)
    left.padding_side = "left"
    return left


def test_decoder_only_generate_rows_have_no_padding_and_equal_generating_alone(left, llama, texts):
    some = texts[:40]
    loader = _load(some, left, return_token_type_ids=False)
    with torch.no_grad():
        result = run(lambda b: _greedy(llama, **b), loader, progress=False)
        assert len({tuple(r.tolist()) for r in result}) > len(some) // 2  # outputs depend on the input
        widths = set()
        for p, text in enumerate(some):
            inputs = left(text, truncation=True, max_length=MAX_LEN, return_tensors="pt", return_token_type_ids=False)
            alone = _greedy(llama, **inputs)[0]
            assert 0 not in result[p].tolist()  # the echoed prompt's left padding is gone
            assert result[p].tolist() == alone.tolist(), f"text {p}: {text!r}"
            widths.add(len(result[p]))
        assert len(widths) > 5  # rows of one batch have their own lengths


def test_a_plain_iterable_of_generate_batches_takes_the_pad_id_from_the_caller(left, llama, texts):
    loader = _load(texts[:24], left, return_token_type_ids=False)
    with torch.no_grad():
        want = run(lambda b: _greedy(llama, **b), loader, progress=False)
        batches = list(loader)  # no collator to read the pad id from
        kept = run(lambda b: _greedy(llama, **b), batches, progress=False)
        got = run(lambda b: _greedy(llama, **b), batches, pad_token_id=left.pad_token_id, progress=False)
    assert [r.tolist() for r in got] == [r.tolist() for r in want]
    assert any(r[0] == left.pad_token_id for r in kept)  # without it, rows keep the batch's padding
    with pytest.raises(ValueError, match="pad_token_id should be a non-negative integer, but got pad_token_id=-1"):
        run(_lengths, batches, pad_token_id=-1, progress=False)
    with pytest.raises(TypeError, match="pad_token_id should be a non-negative integer, but got pad_token_id=0.0"):
        run(_lengths, batches, pad_token_id=0.0, progress=False)


@pytest.fixture(scope="module")
def marian():
    from transformers import MarianConfig, MarianMTModel

    config = MarianConfig(
        vocab_size=30522,
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=128,
        pad_token_id=0,
        decoder_start_token_id=0,
        eos_token_id=102,
        forced_eos_token_id=None,
        init_std=1.0,
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return MarianMTModel(config).eval()


def test_encoder_decoder_generate_keeps_the_decoder_start_token(tokenizer, marian, texts):
    some = texts[:30]
    loader = _load(some, tokenizer, return_token_type_ids=False)

    def generate(batch, eos_token_id=102):
        return marian.generate(
            **batch, max_new_tokens=NEW_TOKENS, do_sample=False, suppress_tokens=[0], eos_token_id=eos_token_id
        )

    with torch.no_grad():
        # A token the random model often generates serves as EOS, so that rows of a batch stop at different
        # steps and the batch output has trailing padding.
        tokens = torch.cat([generate(b)[:, 2:].flatten() for b in loader])
        eos = int(tokens.bincount().argmax())
        generate.__defaults__ = (eos,)
        result = run(generate, loader, progress=False)
        assert 1 < sum(len(r) < 1 + NEW_TOKENS for r in result) < len(some)
        for p, text in enumerate(some):
            inputs = tokenizer(
                text, truncation=True, max_length=MAX_LEN, return_tensors="pt", return_token_type_ids=False
            )
            alone = generate(inputs)[0]
            assert result[p][0] == 0  # the decoder start token is the pad id, and it stays
            assert result[p].tolist() == alone.tolist(), f"text {p}: {text!r}"


# --- row extraction --------------------------------------------------------------------------------------


def _batch(ids, mask, indices=None):
    ids, mask = torch.tensor(ids), torch.tensor(mask)
    return Batch(
        {"input_ids": ids, "attention_mask": mask},
        indices=torch.tensor(indices if indices is not None else range(len(ids))),
    )


def test_split_rows_strips_the_echoed_left_padding_and_trailing_pads_only():
    batch = _batch([[0, 0, 5, 6], [7, 0, 8, 9]], [[0, 0, 1, 1], [1, 1, 1, 1]])  # row 1: an inner pad id
    generated = torch.tensor([[0, 0, 5, 6, 3, 0, 0], [7, 0, 8, 9, 0, 4, 0]])
    rows = split_rows(generated, batch, pad_token_id=0)
    assert [r.tolist() for r in rows] == [[5, 6, 3], [7, 0, 8, 9, 0, 4]]
    # Not an echo of the prompt (an encoder-decoder output): a leading pad id is the decoder start token.
    rows = split_rows(torch.tensor([[0, 3, 4, 0], [0, 5, 0, 0]]), batch, pad_token_id=0)
    assert [r.tolist() for r in rows] == [[0, 3, 4], [0, 5]]
    # Without a pad id, and for float tensors, rows are kept whole.
    assert [r.tolist() for r in split_rows(generated, batch)] == generated.tolist()
    floats = torch.zeros(2, 3)
    assert [r.shape for r in split_rows(floats, batch, pad_token_id=0)] == [(3,), (3,)]


def test_split_rows_of_each_output_kind():
    batch = _batch([[1, 2], [3, 0], [4, 0]], [[1, 1], [1, 0], [1, 0]], indices=[5, 0, 2])
    hidden = torch.arange(3 * 2 * 4, dtype=torch.float32).reshape(3, 2, 4)
    assert split_rows(None, batch) == [None, None, None]
    assert split_rows(["a", "b", "c"], batch) == ["a", "b", "c"]
    # A tuple of batched tensors of another length than the rows (return_dict=False): one tuple per row.
    pairs = split_rows((hidden, hidden[:, 0]), batch)
    assert len(pairs) == 3 and torch.equal(pairs[1][0], hidden[1]) and torch.equal(pairs[1][1], hidden[1, 0])
    output = {"logits": hidden, "loss": torch.tensor(1.5), "hidden_states": (hidden, hidden + 1), "cache": object()}
    rows = split_rows(output, batch)
    assert [sorted(r) for r in rows] == [["hidden_states", "logits"]] * 3  # no per-row loss or cache
    assert torch.equal(rows[2]["hidden_states"][1], hidden[2] + 1)
    # Rows are detached, on the CPU, and do not keep the whole batch output alive.
    big = torch.randn(3, 1000, requires_grad=True) * 2
    (row, *_) = split_rows(big[:, :2], batch)
    assert not row.requires_grad and row.untyped_storage().nbytes() <= 3 * 2 * 4
    with pytest.raises(ValueError, match=r"fn\(batch\)\.shape should be a batch dimension first \(3 rows"):
        split_rows(torch.zeros(2, 5), batch)
    with pytest.raises(ValueError, match=r"len\(fn\(batch\)\) should be 3 \(one item per batch row\)"):
        split_rows(["a", "b"], batch)
    with pytest.raises(TypeError, match=r"fn\(batch\) should be a tensor with a batch dimension.* of type str"):
        split_rows("abc", batch)


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("multiple", [None, 8])
def test_halves_equal_collating_each_half(tokenizer, texts, side, multiple):
    tokenized = tokenize_texts(texts[:40], tokenizer, MAX_LEN)
    collate = TokenCollator(tokenized, pad_token_id=0, padding_side=side, pad_to_multiple_of=multiple, texts=texts[:40])
    positions = [7, 3, 30, 12, 5, 39, 0]
    batch = collate(positions)
    for got, want in zip(
        halves(batch, padding_side=side, pad_to_multiple_of=multiple), (collate(positions[:3]), collate(positions[3:]))
    ):
        assert sorted(got) == sorted(want) and got.texts == want.texts
        assert torch.equal(got.indices, want.indices)
        assert all(torch.equal(got[k], want[k]) for k in want), side
    # The padding side is inferred from the mask when not given.
    first, _ = halves(batch, pad_to_multiple_of=multiple)
    assert torch.equal(first["input_ids"], collate(positions[:3])["input_ids"])
    picked = take_rows(batch, [4, 1], padding_side=side, pad_to_multiple_of=multiple)
    assert torch.equal(picked["input_ids"], collate([5, 3])["input_ids"])


def test_to_json_value():
    value = {"ids": torch.tensor([1, 2]), "score": torch.tensor(0.5), "pair": (1, "a"), "none": None}
    assert to_json_value(value) == {"ids": [1, 2], "score": 0.5, "pair": [1, "a"], "none": None}
    with pytest.raises(TypeError, match="result should be JSON-storable.*of type object"):
        to_json_value(object())


# --- out-of-memory recovery --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def same_width(tokenizer, same_width_texts):
    """A loader whose first batches all have one shape, and its results without out-of-memory errors."""
    loader = _load(same_width_texts, tokenizer, max_input_token_length=24)
    return loader, run(_lengths, loader, progress=False)


@pytest.mark.parametrize(
    ("max_rows", "error"), [(1, None), (2, _cpu_oom), (3, None)], ids=["1-cuda-oom", "2-cpu-allocator", "3-cuda-oom"]
)
def test_out_of_memory_batches_are_split_and_later_ones_pre_split(
    same_width, same_width_texts, max_rows, error, caplog
):
    loader, want = same_width
    shapes = [(len(b.indices), b["input_ids"].shape[1]) for b in loader]
    would_fail = sum(rows > max_rows for rows, _ in shapes)
    fn = _oom_over(_lengths, max_rows, error)
    with caplog.at_level(logging.INFO, logger="dynabatch.inference.runner"):
        got = run(fn, loader, progress=False)
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    assert got.failed == []
    report = got.report
    assert report.oom_events == sum(rows > max_rows for rows, _ in fn.calls)  # every failed call counted
    assert report.oom_splits == report.oom_events  # each was split (none was a single row)
    # The plan learns: batches as large as a failed shape are split before they are tried.
    assert shapes.count(shapes[0]) > 10 and report.pre_split_batches >= shapes.count(shapes[0]) - 1
    assert report.oom_events < would_fail
    assert fn.calls.count(shapes[0]) == 1  # only the first batch of that shape was tried whole
    assert [r.pre_split for r in report.records][1 : shapes.count(shapes[0])] == [True] * (shapes.count(shapes[0]) - 1)
    assert report.rows == len(same_width_texts)
    logged = caplog.text
    assert "ran out of memory" in logged and "before trying it" in logged


def test_split_batches_give_the_same_model_outputs(tokenizer, minilm, texts):
    loader = _load(texts[:60], tokenizer)
    with torch.no_grad():
        want = run(lambda b: minilm(**b).last_hidden_state[:, 0], loader, progress=False)
        fn = _oom_over(lambda b: minilm(**b).last_hidden_state[:, 0], 2)
        got = run(fn, loader, progress=False)
    assert got.report.oom_events > 0
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    # Halves are trimmed to their longest row, never wider than the batch they came from.
    assert max(w for _, w in fn.calls) == MAX_LEN and len({w for r, w in fn.calls if r <= 2}) > 3


def _embed_under_a_real_limit(minilm, loader):
    """MiniLM's first-token embedding under a CPU tracker limit that 2 rows of the first batch fit and 4 do not."""
    first = next(iter(loader))
    peaks = {}
    with torch.no_grad():
        for rows in (2, 4):
            with track_peak_memory("cpu") as mem:
                minilm(**take_rows(first, range(rows)))
            peaks[rows] = mem.peak_bytes
    limit = (peaks[2] + peaks[4]) // 2

    def limited(batch):
        with track_peak_memory("cpu", limit_bytes=limit):
            return minilm(**batch).last_hidden_state[:, 0]

    limited.limit = limit
    return limited


def test_a_genuine_cpu_out_of_memory_is_recovered(tokenizer, minilm, same_width_texts):
    loader = _load(same_width_texts[:60], tokenizer, max_input_token_length=24)
    limited = _embed_under_a_real_limit(minilm, loader)
    with torch.no_grad():
        got = run(limited, loader, progress=False)
        want = run(lambda b: minilm(**b).last_hidden_state[:, 0], loader, progress=False)
    assert got.report.oom_events >= 1 and got.report.pre_split_batches >= 1 and got.failed == []
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def _fails_at(fn, position):
    def wrapped(batch):
        if position in batch.indices.tolist():
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return fn(batch)

    return wrapped


def test_a_single_row_that_fails_raises_with_the_partial_result(tokenizer, texts):
    loader = _load(texts, tokenizer)
    want = run(_lengths, loader, progress=False)
    position = int(loader.batch_sampler.batches[2][1])  # in the third batch
    with pytest.raises(BatchOutOfMemoryError, match=rf"input position {position} ran out of memory") as info:
        run(_fails_at(_lengths, position), loader, progress=False)
    error = info.value
    assert isinstance(error, RuntimeError) and error.position == position
    assert isinstance(error.__cause__, torch.OutOfMemoryError)
    partial = error.partial
    assert isinstance(partial, RunResult) and len(partial) == len(texts) and partial[position] is None
    finished = [p for p, r in enumerate(partial) if r is not None]
    first_two = sorted(int(p) for b in loader.batch_sampler.batches[:2] for p in b)
    assert set(first_two) < set(finished)  # the batches before it, and the rows of its batch that ran
    assert all(torch.equal(partial[p], want[p]) for p in finished)


def test_a_single_row_that_fails_is_skipped(tokenizer, texts, caplog):
    loader = _load(texts, tokenizer)
    want = run(_lengths, loader, progress=False)
    position = int(loader.batch_sampler.batches[1][0])
    with caplog.at_level(logging.WARNING, logger="dynabatch.inference.runner"):
        got = run(_fails_at(_lengths, position), loader, on_oom="skip", progress=False)
    assert got.failed == [position] and got[position] is None
    assert all(torch.equal(got[p], want[p]) for p in range(len(texts)) if p != position)
    assert got.report.failed_rows == 1 and got.report.oom_events == got.report.oom_splits + 1
    assert f"input position {position} ran out of memory on its own" in caplog.text


# --- memory measurement ------------------------------------------------------------------------------


def test_measure_memory_records_each_batch_against_the_first(tokenizer, texts):
    loader = _load(texts, tokenizer)

    def allocate(batch):
        hidden = torch.ones(*batch["input_ids"].shape, 64)
        return (hidden * batch["attention_mask"].unsqueeze(-1)).sum(1)

    result = run(allocate, loader, measure_memory=True, progress=False)
    report = result.report
    peaks = [r.peak_bytes for r in report.records]
    assert all(p > 0 for p in peaks) and report.budget_bytes == peaks[0]
    assert report.peak_ratios[0] == 1.0
    assert report.max_peak_ratio == max(peaks) / peaks[0]
    assert report.batches_over_budget == sum(p > peaks[0] for p in peaks)


# --- argument checks ---------------------------------------------------------------------------------


def test_bad_arguments_are_named(tokenizer, texts):
    loader = _load(texts[:10], tokenizer)
    with pytest.raises(TypeError, match="fn should be a callable taking a batch, but got fn='model' of type str"):
        run("model", loader)
    with pytest.raises(ValueError, match=r"on_oom should be one of \('raise', 'skip'\), but got on_oom='ignore'"):
        run(_lengths, loader, on_oom="ignore")
    with pytest.raises(TypeError, match="output_path should be None, a str or an os.PathLike.*of type int"):
        run(_lengths, loader, output_path=3)
    with pytest.raises(TypeError, match="progress should be a bool"):
        run(_lengths, loader, progress="yes")
    plain = [{"input_ids": torch.ones(2, 3, dtype=torch.long)}]
    with pytest.raises(
        TypeError,
        match=r"loader should be a dynabatch DataLoader or an iterable of dynabatch Batches"
        r".*but got loader=\[\{'input_ids': tensor.* yielding a batch of type dict",
    ):
        run(_lengths, plain, progress=False)
    with pytest.raises(TypeError, match="loader should be"):
        run(_lengths, 42, progress=False)


def test_run_result_pickles_with_its_report(tokenizer, texts):
    result = run(_lengths, _load(texts[:10], tokenizer), progress=False)
    again = pickle.loads(pickle.dumps(result))
    assert isinstance(again, RunResult) and isinstance(again.report, RunReport)
    assert again.report.rows == 10 and again.failed == []


# --- resuming from output_path -----------------------------------------------------------------------


def _summary(batch):
    """JSON-storable rows: a dict per row."""
    mask = batch["attention_mask"]
    return {"length": mask.sum(1), "mean_id": (batch["input_ids"] * mask).sum(1) / mask.sum(1)}


def _file_positions(path):
    with open(path) as f:
        lines = f.read().splitlines()
    header = json.loads(lines[0])
    return header, [p for line in lines[1:] for p in json.loads(line)["positions"]]


_KILLED_RUN = """
import os, signal, sys
os.environ["HF_HUB_OFFLINE"] = "1"
import torch
from transformers import AutoTokenizer
from dynabatch import build_dynamic_batch_dataloader, run
from dynabatch.demo import kjv_passages, minilm_path

tokenizer = AutoTokenizer.from_pretrained(minilm_path())
texts = kjv_passages()[300:500]
loader = build_dynamic_batch_dataloader(texts, tokenizer, batch_size=4, max_input_token_length=32, num_workers=0)
calls = []

def fn(batch):
    calls.append(1)
    if len(calls) == 4:
        os.kill(os.getpid(), signal.SIGKILL)  # killed in the middle of the run, as by the OOM killer
    mask = batch["attention_mask"]
    return {"length": mask.sum(1), "mean_id": (batch["input_ids"] * mask).sum(1) / mask.sum(1)}

run(fn, loader, output_path=sys.argv[1], progress=False)
"""


def test_a_killed_run_resumes_where_it_stopped(tokenizer, tmp_path):
    from dynabatch.demo import kjv_passages

    texts = kjv_passages()[300:500]
    path = tmp_path / "results.jsonl"
    script = tmp_path / "killed.py"
    script.write_text(textwrap.dedent(_KILLED_RUN))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, str(script), str(path)], env=env, capture_output=True, timeout=120, check=False
    )
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-2000:]
    header, positions = _file_positions(path)
    loader = _load(texts, tokenizer, max_input_token_length=32)
    planned = loader.batch_sampler.batches
    assert header["n_inputs"] == len(texts) and len(positions) == sum(len(b) for b in planned[:3])

    calls = []
    resumed = run(lambda b: calls.append(len(b.indices)) or _summary(b), loader, output_path=path, progress=False)
    assert len(calls) == len(planned) - 3  # only the batches not in the file ran
    clean = run(_summary, loader, output_path=tmp_path / "clean.jsonl", progress=False)
    assert resumed == clean  # JSON values for every row, resumed or not
    assert sorted(_file_positions(path)[1]) == list(range(len(texts)))  # every position exactly once
    assert resumed[0]["length"] == len(tokenizer(texts[0], truncation=True, max_length=32)["input_ids"])


def test_resume_ignores_a_cut_line_and_runs_only_missing_rows(tokenizer, texts, tmp_path):
    loader = _load(texts, tokenizer)
    path = tmp_path / "out.jsonl"
    clean = run(_summary, loader, output_path=path, progress=False)
    lines = path.read_text().splitlines()
    # Batch 0 kept for two of its rows only; the last batch's line cut off mid-write.
    first = json.loads(lines[1])
    first = {"positions": first["positions"][:2], "results": first["results"][:2]}
    path.write_text("\n".join([lines[0], json.dumps(first), *lines[2:-1], lines[-1][:-7]]))
    calls = []
    again = run(lambda b: calls.append(b.indices.tolist()) or _summary(b), loader, output_path=path, progress=False)
    planned = loader.batch_sampler.batches
    assert calls == [planned[0][2:].tolist(), planned[-1].tolist()]
    assert again == clean
    assert sorted(_file_positions(path)[1]) == list(range(len(texts)))
    # Everything done: nothing runs, the results are read back.
    calls.clear()
    assert run(lambda b: calls.append(1) or _summary(b), loader, output_path=path, progress=False) == clean
    assert calls == []


def test_resume_with_a_plain_iterable_of_batches(tokenizer, texts, tmp_path):
    batches = list(_load(texts[:30], tokenizer))
    path = tmp_path / "plain.jsonl"
    clean = run(_summary, batches, output_path=path, progress=False)
    lines = path.read_text().splitlines()
    first = json.loads(lines[1])
    first = {"positions": first["positions"][:1], "results": first["results"][:1]}
    path.write_text("\n".join([lines[0], json.dumps(first), *lines[2:-1]]) + "\n")
    calls = []
    again = run(
        lambda b: calls.append(b.indices.tolist()) or _summary(b),
        iter(batches),  # a one-shot iterator: read whole for the fingerprint
        output_path=path,
        progress=False,
    )
    assert calls == [batches[0].indices[1:].tolist(), batches[-1].indices.tolist()]
    assert again == clean


def test_resume_refuses_another_runs_file_and_unstorable_results(tokenizer, texts, tmp_path):
    path = tmp_path / "out.jsonl"
    run(_summary, _load(texts[:20], tokenizer), output_path=str(path), progress=False)
    with pytest.raises(
        ValueError,
        match=r"output_path should be a new file or the results file of these same inputs"
        r".*output_path='.*out\.jsonl'",
    ):
        run(_summary, _load(texts[:21], tokenizer), output_path=path, progress=False)
    with pytest.raises(TypeError, match="result should be JSON-storable.*of type object"):
        run(
            lambda b: [object()] * len(b.indices),
            _load(texts[:20], tokenizer),
            output_path=tmp_path / "x.jsonl",
            progress=False,
        )
    (tmp_path / "junk.jsonl").write_text('{"format": "dynabatch.run/1"}\n')
    with pytest.raises(ValueError, match="output_path should be a new file"):
        run(_summary, _load(texts[:20], tokenizer), output_path=tmp_path / "junk.jsonl", progress=False)


def test_output_path_results_are_json_values(tokenizer, texts, tmp_path):
    loader = _load(texts[:20], tokenizer)
    result = run(
        lambda b: (b["attention_mask"].sum(1) > 5).tolist(), loader, output_path=tmp_path / "a.jsonl", progress=False
    )
    assert all(isinstance(r, bool) for r in result)
    rows = run(_lengths, loader, output_path=tmp_path / "b.jsonl", progress=False)
    assert all(isinstance(r, list) and len(r) == 2 for r in rows)
    # skipped rows are not saved, so a rerun tries them again
    position = int(loader.batch_sampler.batches[0][0])
    skipped = run(
        _fails_at(_lengths, position), loader, output_path=tmp_path / "c.jsonl", on_oom="skip", progress=False
    )
    assert skipped.failed == [position] and position not in _file_positions(tmp_path / "c.jsonl")[1]
    retried = run(_lengths, loader, output_path=tmp_path / "c.jsonl", progress=False)
    assert retried == rows and retried.report.rows == 1


def test_batch_out_of_memory_error_pickles(tokenizer, texts):
    partial = RunResult([1, None], report=RunReport())
    error = pickle.loads(pickle.dumps(BatchOutOfMemoryError("input position 1 ran out", position=1, partial=partial)))
    assert str(error) == "input position 1 ran out" and error.position == 1 and error.partial == [1, None]


# --- measured mode: the plan corrected by measured peaks ---------------------------------------------------


def test_measured_mode_grows_a_timid_plan_and_keeps_results(tokenizer, minilm):
    from dynabatch.demo import kjv_passages, vary_lengths

    texts = vary_lengths(kjv_passages(), n=300, max_words=120, seed=3)
    loader = _load(texts, tokenizer, batch_size=4, max_input_token_length=128)

    def embed(batch):
        return minilm(**batch).last_hidden_state[:, 0]

    with torch.no_grad():
        planned = run(embed, loader, measure_memory=True, progress=False)
        measured = run(embed, loader, adapt=True, progress=False)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(planned, measured))
    report = measured.report
    assert report.budget_bytes == report.records[0].peak_bytes  # measured on the CPU tracker by default
    assert report.batches < planned.report.batches
    assert max(r.rows for r in report.records) > max(r.rows for r in planned.report.records)
    _later_batches_fit(report, batch_size=4)


def _later_batches_fit(report, batch_size):
    """After the first two batches (the plan's: nothing to fit yet), a batch grown past ``batch_size`` stays
    under the first batch's peak, and one of ``batch_size`` rows (the floor, at nearly the first batch's
    width) within 2% of it: real peaks of equal shapes differ a little with the content."""
    for r in report.records[2:]:
        assert r.peak_bytes <= report.budget_bytes * (1.0 if r.rows > batch_size else 1.02), r


def test_measured_mode_shrinks_batches_whose_rows_cost_more_than_their_tokens(tokenizer, marian, texts):
    # Greedy generate over a 30k vocabulary with a 32-wide model: the logits of every row dwarf its hidden
    # states, so rows cost about the same whatever their length. Measured mode keeps every batch fitted
    # after the first two under the first batch's peak.
    loader = _load(texts, tokenizer, batch_size=4, return_token_type_ids=False, threshold=1.0)

    def generate(batch):
        return marian.generate(**batch, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)

    with torch.no_grad():
        planned = run(generate, loader, measure_memory=True, progress=False)
        measured = run(generate, loader, adapt=True, progress=False)
    budget = planned.report.budget_bytes
    assert max(r.peak_bytes for r in planned.report.records) > budget  # threshold=1.0: the plan overshoots
    _later_batches_fit(measured.report, batch_size=4)
    assert [r.tolist() for r in measured] == [r.tolist() for r in planned]


def test_measured_mode_learns_from_the_halves_of_a_batch_that_ran_out_of_memory(
    tokenizer, minilm, same_width_texts
):
    # A real CPU out-of-memory error: 2 rows fit under the limit, the first batch's 4 rows do not. The halves'
    # peaks are measured, so measured mode sizes every later batch to fit instead of splitting each one.
    loader = _load(same_width_texts[:60], tokenizer, max_input_token_length=24)
    limited = _embed_under_a_real_limit(minilm, loader)
    with torch.no_grad():
        got = run(limited, loader, adapt=True, progress=False)
        want = run(lambda b: minilm(**b).last_hidden_state[:, 0], loader, progress=False)
    report = got.report
    assert report.records[0].oom_splits == 1 and report.budget_bytes < limited.limit  # what fitted is the budget
    assert report.oom_events == 1 and report.pre_split_batches == 0 and got.failed == []
    assert {r.rows for r in report.records[1:]} <= {1, 2}
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def test_measured_mode_needs_a_dynabatch_loader(tokenizer, texts):
    batches = list(_load(texts[:10], tokenizer))
    with pytest.raises(ValueError, match=r"adapt should be False for a loader that is not a dynabatch DataLoader"):
        run(_lengths, batches, adapt=True, progress=False)
    with pytest.raises(TypeError, match="adapt should be a bool, but got adapt='yes'"):
        run(_lengths, batches, adapt="yes", progress=False)
