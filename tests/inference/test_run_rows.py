"""``run`` on real batches of real texts: rows come back in input order. Models are real (see conftest.py); nothing of dynabatch is mocked.
"""


import pytest
import torch
from runner_helpers import (
    MAX_LEN,
    _lengths,
    _load,
)

from dynabatch import RunResult, restore_order, run

pytestmark = pytest.mark.usefixtures("one_thread")


# --- rows come back in input order --------------------------------------------------------------------


def test_forward_rows_equal_running_each_text_alone(tokenizer, minilm, texts):
    loader = _load(texts, tokenizer)
    with torch.no_grad():
        result = run(lambda b: minilm(**b).last_hidden_state[:, 0], loader, memory="off", progress=False)
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
    result = run(_lengths, loader, memory="off", progress=False)  # the plan, as the plain loop runs it
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
    loader = _load(texts[:20], tokenizer, progress=False)
    run(_lengths, loader, progress=True)
    err = capsys.readouterr().err
    assert "texts/s" in err and "tokens/s" in err and f"{20}/{20}" in err
    run(_lengths, loader, progress=False)
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
