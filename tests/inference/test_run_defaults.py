"""``run(fn, loader)`` with its defaults keeps every batch under the first batch's peak.

Real models with random weights whose ``generate`` memory grows with rows (a 30k vocabulary's logits per row),
real texts; every call the defaults made is measured again afterwards with the CPU tracker (the defaults
themselves measure only some of them).
"""

import pytest
import torch

from dynabatch import build_dynamic_batch_dataloader, run, track_peak_memory

pytestmark = pytest.mark.usefixtures("one_thread")

BATCH = 4
NEW = 4


@pytest.fixture(scope="module")
def long_texts():
    from dynabatch.demo import kjv_passages, vary_lengths

    return vary_lengths(kjv_passages(), n=160, max_words=128, seed=3)


def _seq2seq():
    from transformers import MarianConfig, MarianMTModel

    config = MarianConfig(vocab_size=30522, d_model=256, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                          decoder_attention_heads=2, encoder_ffn_dim=512, decoder_ffn_dim=512,
                          max_position_embeddings=256, pad_token_id=0, decoder_start_token_id=0, eos_token_id=102,
                          forced_eos_token_id=None)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return MarianMTModel(config).eval()


def _decoder():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=30522, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256, pad_token_id=0,
                         bos_token_id=101, eos_token_id=102)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return LlamaForCausalLM(config).eval()


class Recorder:
    """``generate`` on every batch, each batch kept to be measured again afterwards."""

    def __init__(self, model):
        self.model = model
        self.calls = []

    def generate(self, batch):
        return self.model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                   max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)

    def __call__(self, batch):
        self.calls.append(batch)
        return self.generate(batch)

    def peaks(self):
        """Each recorded call's peak, measured again now, over the first call's."""
        peaks = []
        for batch in self.calls:
            with track_peak_memory("cpu") as mem:
                self.generate(batch)
            peaks.append(mem.peak_bytes)
        return [p / peaks[0] for p in peaks]


def _loader(texts, tokenizer, **kwargs):
    return build_dynamic_batch_dataloader(texts, tokenizer, BATCH, 128, num_workers=0, progress=False,
                                          return_token_type_ids=False, **kwargs)


def _within_first_peak(calls, ratios):
    """Grown calls at or under the first call's peak; calls of at most its rows within 2% (real peaks of one
    shape differ a little with the content: a first batch without padding builds no attention mask)."""
    for batch, ratio in zip(calls, ratios):
        rows = len(batch.indices)
        assert ratio <= (1.0 if rows > BATCH else 1.02), (rows, batch["input_ids"].shape[1], ratio)


@pytest.fixture(scope="module")
def seq2seq_runs(tokenizer, long_texts, one_thread):
    model = _seq2seq()
    loader = _loader(long_texts, tokenizer)
    with torch.no_grad():
        plan = run(Recorder(model).generate, loader, memory="record", progress=False)
        defaults = Recorder(model)
        result = run(defaults, loader, progress=False)
        ratios = defaults.peaks()
    return model, loader, plan, defaults, result, ratios


def test_defaults_keep_an_encoder_decoder_generate_under_the_first_batch_and_grow(seq2seq_runs):
    _, loader, plan, defaults, result, ratios = seq2seq_runs
    assert plan.report.max_peak_ratio > 1.03  # the classifier's plan goes over on this model
    _within_first_peak(defaults.calls, ratios)
    assert max(len(b.indices) for b in defaults.calls) > BATCH  # batches still grow as texts get shorter
    assert [r.tolist() for r in result] == [r.tolist() for r in plan]  # every row, in input order, the same tokens
    assert result.report.rows == len(loader.plan.collator.tokenized)


def test_on_the_cpu_the_defaults_measure_few_batches(seq2seq_runs):
    result = seq2seq_runs[4]
    records = result.report.records
    measured = [r for r in records if r.peak_bytes is not None]
    assert records[0].peak_bytes == result.report.budget_bytes  # the first batch is the budget
    assert 1 < len(measured) <= len(records) // 3


def test_defaults_keep_a_decoder_generate_under_the_first_batch(tokenizer, long_texts):
    from transformers import AutoTokenizer

    from dynabatch.demo import minilm_path

    left = AutoTokenizer.from_pretrained(minilm_path(), padding_side="left")
    defaults = Recorder(_decoder())
    with torch.no_grad():
        result = run(defaults, _loader(long_texts, left), progress=False)
        ratios = defaults.peaks()
    _within_first_peak(defaults.calls, ratios)
    assert max(len(b.indices) for b in defaults.calls) > BATCH
    assert result.report.rows == len(long_texts) and result.failed == []


@pytest.mark.parametrize("kind", ["plain iterable", "shuffled loader"])
def test_guarded_defaults_split_batches_the_measured_peaks_bound_above_the_first(seq2seq_runs, tokenizer,
                                                                                long_texts, kind, caplog):
    model, loader, plan, *_ = seq2seq_runs
    batches = list(loader) if kind == "plain iterable" else _loader(long_texts, tokenizer, shuffle=True, seed=1)
    order = [b.indices.tolist() for b in batches]
    guarded = Recorder(model)
    with torch.no_grad(), caplog.at_level("INFO", logger="dynabatch.inference"):
        result = run(guarded, batches, progress=False)
        ratios = guarded.peaks()
    assert "memory='guarded'" in caplog.text
    _within_first_peak(guarded.calls, ratios)
    assert result.report.pre_split_batches > 0  # some batches were split before they ran
    ran = [p for b in guarded.calls for p in b.indices.tolist()]
    assert ran == [p for b in order for p in b]  # the batches' own order: split, never re-planned
    assert [r.tolist() for r in result] == [r.tolist() for r in plan]


def test_memory_off_keeps_the_plan_unmeasured(seq2seq_runs):
    model, loader, plan, *_ = seq2seq_runs
    with torch.no_grad():
        got = run(Recorder(model).generate, loader, progress=False, memory="off")
    assert got.report.batches == len(loader) and got.report.budget_bytes is None
    assert [r.rows for r in got.report.records] == [r.rows for r in plan.report.records]


def test_with_a_model_on_cuda_every_batch_is_measured_there(tokenizer, long_texts, monkeypatch):
    # No GPU here: CUDA "in use" (a model holds memory) is simulated; the measurements themselves are the CPU
    # tracker's, so the batches are real.
    from dynabatch.memory import device as devices
    from dynabatch.memory import oom

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 1 << 20)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    asked = []

    cpu = devices.backend_of(torch.device("cpu"))

    class MeasuredOnTheCpu:  # where run asks to measure is recorded; the CPU tracker measures it
        def peak_tracker(self, device, limit_bytes=None):
            return cpu.peak_tracker(torch.device("cpu"), limit_bytes)

    def on_cuda(device):
        asked.append(str(device))
        return MeasuredOnTheCpu()

    monkeypatch.setattr(oom, "backend_of", on_cuda)
    loader = _loader(long_texts[:60], tokenizer)
    result = run(lambda b: b["input_ids"].float().cumsum(1)[:, -1], loader, progress=False)
    assert result.report.batches == len(asked) and set(asked) == {"cuda:0"}  # every batch, on the device in use
    assert all(r.peak_bytes is not None for r in result.report.records)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)  # CUDA without a model: the CPU
    asked.clear()
    run(lambda b: b["input_ids"].float().cumsum(1)[:, -1], loader, progress=False)
    assert set(asked) == {"cpu"} and len(asked) < result.report.batches
