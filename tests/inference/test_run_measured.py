"""``run`` on real batches of real texts: memory measurement and measured mode. Models are real (see conftest.py); nothing of dynabatch is mocked.
"""

import logging

import pytest
import torch
from runner_helpers import (
    NEW_TOKENS,
    _embed_under_a_real_limit,
    _lengths,
    _load,
)

from dynabatch import run, track_peak_memory

pytestmark = pytest.mark.usefixtures("one_thread")


# --- memory measurement ------------------------------------------------------------------------------


def test_record_mode_records_each_batch_against_the_first(tokenizer, texts):
    loader = _load(texts, tokenizer)

    def allocate(batch):
        hidden = torch.ones(*batch["input_ids"].shape, 64)
        return (hidden * batch["attention_mask"].unsqueeze(-1)).sum(1)

    result = run(allocate, loader, memory="record", progress=False)
    report = result.report
    peaks = [r.peak_bytes for r in report.records]
    assert all(p > 0 for p in peaks) and report.budget_bytes == peaks[0]
    assert report.peak_ratios[0] == 1.0
    assert report.max_peak_ratio == max(peaks) / peaks[0]
    assert report.batches_over_budget == sum(p > peaks[0] for p in peaks)




# --- measured mode: the plan corrected by measured peaks ---------------------------------------------------


@pytest.mark.slow
def test_measured_mode_grows_a_timid_plan_and_keeps_results(tokenizer, minilm):
    from dynabatch.demo import kjv_passages, vary_lengths

    texts = vary_lengths(kjv_passages(), n=300, max_words=120, seed=3)
    loader = _load(texts, tokenizer, batch_size=4, max_input_token_length=128)

    def embed(batch):
        return minilm(**batch).last_hidden_state[:, 0]

    with torch.no_grad():
        planned = run(embed, loader, memory="record", progress=False)  # the plan as it is
        measured = run(embed, loader, memory="measured", progress=False)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(planned, measured))
    report = measured.report
    assert report.budget_bytes == report.records[0].peak_bytes  # measured on the CPU tracker by default
    assert report.batches < planned.report.batches
    assert max(r.rows for r in report.records) > max(r.rows for r in planned.report.records)
    _later_batches_fit(report, batch_size=4)


def _later_batches_fit(report, batch_size):
    """After the first two batches (the plan's: nothing to fit yet), a batch grown past ``batch_size`` stays
    under the first batch's peak, and one of ``batch_size`` rows (the floor, at nearly the first batch's
    width) within 2% of it: real peaks of equal shapes differ a little with the content. On the CPU only the
    calls whose peak could let later batches grow are measured (the tracker's cost): those are checked."""
    assert sum(r.peak_bytes is not None for r in report.records) > 2
    for r in [r for r in report.records[2:] if r.peak_bytes is not None]:
        assert r.peak_bytes <= report.budget_bytes * (1.0 if r.rows > batch_size else 1.02), r


def test_measured_mode_shrinks_batches_whose_rows_cost_more_than_their_tokens(tokenizer, marian, texts):
    # Greedy generate over a 30k vocabulary with a 32-wide model: the logits of every row dwarf its hidden
    # states, so rows cost about the same whatever their length. Measured mode keeps every batch fitted
    # after the first two under the first batch's peak.
    loader = _load(texts, tokenizer, batch_size=4, return_token_type_ids=False, threshold=1.0)

    def generate(batch):
        return marian.generate(**batch, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)

    with torch.no_grad():
        planned = run(generate, loader, memory="record", progress=False)
        measured = run(generate, loader, memory="measured", progress=False)
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
        got = run(limited, loader, memory="measured", progress=False)
        want = run(lambda b: minilm(**b).last_hidden_state[:, 0], loader, progress=False)
    report = got.report
    assert report.records[0].oom_splits == 1 and report.budget_bytes < limited.limit  # what fitted is the budget
    assert report.oom_events == 1 and report.pre_split_batches == 0 and got.failed == []
    assert {r.rows for r in report.records[1:]} <= {1, 2}
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def test_measured_mode_needs_a_dynabatch_loader(tokenizer, texts):
    batches = list(_load(texts[:10], tokenizer))
    with pytest.raises(ValueError, match=r"memory should be 'guarded', 'record' or 'off' here \(a loader that is "
                                         r"not a dynabatch DataLoader has no plan to re-size\), but got "
                                         r"memory='measured'"):
        run(_lengths, batches, memory="measured", progress=False)


def _probed(minilm, scale=1.0):
    """A memory model of a few measured probes of the real model (each peak times ``scale``)."""
    from dynabatch.memory.model import MemoryModel

    mm = MemoryModel(device="cpu")
    with torch.no_grad():
        for rows, length in [(2, 8), (2, 48), (8, 16), (4, 32), (16, 4), (8, 48), (64, 4)]:
            ids = torch.randint(1000, 2000, (rows, length), generator=torch.Generator().manual_seed(rows * length))
            with track_peak_memory("cpu") as mem:
                minilm(input_ids=ids, attention_mask=torch.ones_like(ids))
            mm.observe(rows, length, scale * mem.peak_bytes)
    return mm


def _fitted(mm):
    return mm.coef_.tobytes(), repr(mm.probes_)


@pytest.mark.parametrize("refit", [False, True])
def test_a_run_leaves_the_memory_model_as_built_and_runs_again_with_the_same_plan(tokenizer, minilm, texts, refit):
    # A memory model three times too generous: measured mode learns from the run's peaks, and the learning
    # changes the next run's plan. Without refit_memory_model the caller's model is not written and the loader
    # runs again with the same plan; with it, the model is refitted in place and the second run starts from it.
    mm = _probed(minilm, scale=1 / 3)
    before = _fitted(mm)
    loader = _load(texts, tokenizer, batch_size=4, memory_model=mm, refit_memory_model=refit)
    plans = []
    for _ in range(2):
        calls = []

        def embed(batch, calls=calls):
            calls.append(batch.indices.tolist())
            return minilm(**batch).last_hidden_state[:, 0]

        with torch.no_grad():
            result = run(embed, loader, memory="measured", progress=False)
        assert result.report.rows == len(texts) and result.failed == []
        plans.append(calls)
    assert (_fitted(mm) == before) is not refit
    assert (plans[0] == plans[1]) is not refit


@pytest.mark.parametrize("memory", ["guarded", "record", "off"])
def test_refit_memory_model_outside_measured_mode_is_warned_of(tokenizer, minilm, texts, memory, caplog):
    # Only measured mode's planner refits the loader's memory model; another mode left it as built, silently.
    mm = _probed(minilm, scale=1 / 3)
    before = _fitted(mm)
    loader = _load(texts[:12], tokenizer, batch_size=4, memory_model=mm, refit_memory_model=True)
    with caplog.at_level(logging.WARNING, logger="dynabatch.inference"):
        result = run(_lengths, loader, memory=memory, progress=False)
    assert result.failed == [] and _fitted(mm) == before
    assert f"refit_memory_model=True, but memory='{memory}': only measured mode refits" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dynabatch.inference"):
        run(_lengths, loader, memory="measured", progress=False)
    assert "refit_memory_model" not in caplog.text


def test_refit_memory_model_is_a_bool_with_a_memory_model(tokenizer, texts):
    with pytest.raises(TypeError, match=r"refit_memory_model should be a bool, but got refit_memory_model=1"):
        _load(texts, tokenizer, refit_memory_model=1)
    with pytest.raises(ValueError, match=r"refit_memory_model should be False without a memory_model \(there is "
                                         r"no model of yours to refit\), but got refit_memory_model=True"):
        _load(texts, tokenizer, refit_memory_model=True)


def test_measured_mode_refines_a_memory_model_that_can_be_saved(tokenizer, minilm, texts, tmp_path):
    # The memory model comes from a few measured probes of the real model; run(memory="measured") adds every batch
    # it measures (refit_memory_model=True: to the caller's model), and the refined model is saved for the next job.
    from dynabatch.memory.model import MemoryModel

    mm = _probed(minilm)
    probes = len(mm.probes_)
    loader = _load(texts, tokenizer, batch_size=4, memory_model=mm, refit_memory_model=True)
    embed = lambda b: minilm(**b).last_hidden_state[:, 0]  # noqa: E731
    with torch.no_grad():
        got = run(embed, loader, memory="measured", progress=False)
        want = run(embed, loader, progress=False)
    assert len(mm.probes_) > probes  # refined from the peaks measured
    assert got.report.rows == len(texts) and got.failed == []
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    budget = got.report.budget_bytes
    assert max(r.peak_bytes for r in got.report.records if r.peak_bytes is not None) <= 1.02 * budget
    mm.save(tmp_path / "mm.json")
    loaded = MemoryModel.load(tmp_path / "mm.json")
    assert len(loaded.probes_) == len(mm.probes_)
    assert float(loaded.predict(8, 32)) == pytest.approx(float(mm.predict(8, 32)))


def test_max_tokens_caps_every_batch_of_the_plan_and_of_measured_mode(tokenizer):
    # Eager attention: a row's memory grows with the square of its width, so once the two 256-token texts
    # have run, measured mode (allowed to grow 8x a step) would put more tokens in a batch of short texts than
    # the first batch held. max_tokens keeps every batch, planned or re-sized, at 512 padded tokens.
    from transformers import AutoModel

    from dynabatch.demo import kjv_passages, minilm_path, vary_lengths

    model = AutoModel.from_pretrained(minilm_path(), attn_implementation="eager").eval()
    texts = [" ".join(kjv_passages()[i : i + 12]) for i in (0, 12)] + vary_lengths(kjv_passages(), n=300,
                                                                                   max_words=6, seed=1)
    options = {"batch_size": 2, "max_input_token_length": 256, "max_growth": 8.0}
    capped = _load(texts, tokenizer, max_tokens=512, **options)
    plan = capped.plan.planner
    assert max(len(b) * int(plan.lengths[b].max()) for b in plan.batches()) <= 512

    def embed(batch):
        return model(**batch).last_hidden_state[:, 0]

    with torch.no_grad():
        measured = run(embed, capped, progress=False)  # measured mode re-sizes batches: the cap holds there too
        uncapped = run(embed, _load(texts, tokenizer, **options), progress=False)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(measured, uncapped))
    assert max(r.rows * r.width for r in measured.report.records) <= 512
    assert max(r.rows * r.width for r in uncapped.report.records) > 512  # the cap did bind


# --- an absolute budget: max_memory, read on the run's device when it starts --------------------------------------


def test_a_share_of_a_devices_free_memory_is_read_when_the_run_starts_and_fills_it(tokenizer, minilm):
    # The CPU as a device of a declared size: "60%" of what is free when run starts, not when the loader is built.
    from dynabatch.demo import kjv_passages, vary_lengths
    from dynabatch.memory.device import simulated_memory

    texts = vary_lengths(kjv_passages(), n=400, max_words=100, seed=5)
    embed = lambda b: minilm(**b).last_hidden_state[:, 0]  # noqa: E731
    with torch.no_grad():
        relative = run(embed, _load(texts, tokenizer, batch_size=4, max_input_token_length=128), progress=False)
        free = int(8 * relative.report.budget_bytes)  # eight times the first batch's peak
        with simulated_memory(total=4 * free, free=2 * free):
            loader = _load(texts, tokenizer, batch_size=4, max_input_token_length=128, max_memory="60%",
                           model=minilm)  # batches sized by the model's footprint
            held = torch.ones(free // 4)  # what a model loaded after the loader holds: half of the free memory
            result = run(embed, loader, progress=False)
            del held
    budget = 0.6 * (2 * free - free)  # 60% of what was free when run started
    report = result.report
    assert report.oom_events == 0 and result.failed == []
    assert max(r.peak_bytes for r in report.records if r.peak_bytes is not None) <= budget
    assert report.records[0].rows > 4 and report.batches < relative.report.batches / 3  # filled from the first batch
    for a, b in zip(result, relative):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def test_an_absolute_budget_above_what_the_device_holds_is_split_and_learned_and_nothing_is_lost(tokenizer, minilm):
    # max_memory says three times what the simulated device has free: the first batches run out of memory for real,
    # are split and retried, and the limit they show sizes the later batches; every row equals the relative run's.
    from dynabatch.demo import kjv_passages, vary_lengths
    from dynabatch.memory.device import simulated_memory

    texts = vary_lengths(kjv_passages(), n=200, max_words=60, seed=9)
    embed = lambda b: minilm(**b).last_hidden_state[:, 0]  # noqa: E731
    with torch.no_grad():
        relative = run(embed, _load(texts, tokenizer, batch_size=4, max_input_token_length=64), progress=False)
        free = int(4 * relative.report.budget_bytes)
        with simulated_memory(total=2 * free, free=free):
            result = run(embed, _load(texts, tokenizer, batch_size=4, max_input_token_length=64,
                                      max_memory=3 * free, model=minilm), progress=False)
    report = result.report
    assert report.oom_events >= 1 and report.oom_splits >= 1 and result.failed == []
    assert report.oom_events <= 6  # learned: later batches are sized under what failed
    assert len(result) == len(texts)
    for a, b in zip(result, relative):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
