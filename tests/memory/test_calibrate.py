"""calibrate(): probes built like loader batches, peaks measured for real, out-of-memory as data, the fit."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import dynabatch
from dynabatch import TokenCollator, calibrate, tokenize_texts
from dynabatch.memory.calibrate import probe_lengths

pytestmark = pytest.mark.usefixtures("one_thread")


def _blocks(nbytes):
    return -(-nbytes // 512) * 512


def known_work(batch):
    """Allocations that follow a known formula: a prefill phase, then a decode phase (as in generate)."""
    rows, length = batch["input_ids"].shape
    hidden = torch.ones(rows, length, 64)  # rows * length * 256 bytes
    scores = torch.ones(rows, length, length)  # rows * length^2 * 4 bytes
    del hidden, scores
    logits = torch.ones(rows, 2000)  # rows * 8000 bytes
    cache = torch.ones(rows, length, 8)  # rows * length * 32 bytes
    return logits, cache


def known_peak(rows, length):
    prefill = _blocks(rows * length * 256) + _blocks(rows * length * length * 4)
    decode = _blocks(rows * 8000) + _blocks(rows * length * 32)
    return max(prefill, decode)


def test_fit_recovers_a_known_memory_function_within_2_percent(tokenizer):
    mm = calibrate(known_work, tokenizer, batch_size=8, max_input_token_length=128, progress=False)
    assert mm.device == "cpu"
    measured = [p for p in mm.probes_ if not p["out_of_memory"]]
    assert all(p["peak_bytes"] == known_peak(p["rows"], p["padded_length"]) for p in measured)  # real bytes
    assert {p["padded_length"] for p in measured} >= set(probe_lengths(128))
    assert mm.loo_error_ < 0.05  # leaving out a probe near the phase change moves the fit there most
    # Wherever the planner looks: batch_size rows, and the rows it would plan under the first batch's peak.
    budget = 0.9 * float(mm.predict(8, 128))
    for length in range(4, 129):
        for rows in (8, int(mm.max_rows(length, budget))):
            assert float(mm.predict(rows, length)) == pytest.approx(known_peak(rows, length), rel=0.02)
    assert "LOO error" in mm.report() and mm.metadata["batch_size"] == 8


def test_probes_look_like_loader_batches(tokenizer):
    left = copy.deepcopy(tokenizer)
    left.padding_side = "left"
    seen = []

    def work(batch):
        assert isinstance(batch, dynabatch.Batch)
        seen.append({k: v.clone() for k, v in batch.items()})
        return torch.ones(batch["input_ids"].shape[0], 100).sum()

    texts = ["Beautiful is better than ugly.", "Explicit is better than implicit.", "Simple is better."]
    mm = calibrate(work, left, batch_size=4, max_input_token_length=32, texts=texts, progress=False)
    allowed = set(left(texts)["input_ids"][0] + left(texts)["input_ids"][1] + left(texts)["input_ids"][2])
    for batch in seen:
        mask = batch["attention_mask"]
        assert set(batch) == {"input_ids", "attention_mask", "token_type_ids"}
        assert mask[:, -1].all() and not mask.all()  # left padded, and padded
        assert set(batch["input_ids"][mask.bool()].tolist()) <= allowed
    widths = sorted({p["padded_length"] for p in mm.probes_})
    assert widths[0] == 4 and widths[-1] == 32


def test_short_texts_are_joined_to_the_longest_probe(tokenizer):
    # Texts were joined 4 rounds at most: one text of two words made probes of 10 tokens at most for a
    # max_input_token_length of 64, and the model fitted there warned only when the loader's batches of 64 tokens
    # came, saying to calibrate with a larger max_input_token_length (it was 64 already).
    calls = []

    def work(batch):
        calls.append(batch["input_ids"].shape)
        return known_work(batch)

    mm = calibrate(work, tokenizer, batch_size=4, max_input_token_length=64, texts=["hello world"], progress=False)
    assert mm.measured_length_ == 64 and {p["padded_length"] for p in mm.probes_} >= set(probe_lengths(64))
    calls.clear()
    with pytest.raises(ValueError, match=r"^texts should be texts that, joined, reach max_input_token_length=64 "
                                         r"tokens \(the longest probe; 4 of them joined made 2\): give longer "
                                         r"texts, or texts=None to draw token ids from the vocabulary, but got "
                                         r"texts='<2 texts>'$"):
        calibrate(work, tokenizer, batch_size=4, max_input_token_length=64, texts=["", "  "], progress=False)
    assert calls == []  # refused before any probe
    # texts that reach it, most of them blank: a bound of one token a text refused them (168 joined made 19)
    mm = calibrate(work, tokenizer, batch_size=4, max_input_token_length=64, texts=[""] * 9 + ["word"],
                   progress=False)
    assert mm.measured_length_ == 64


def test_out_of_memory_probes_are_data_not_a_crash(tokenizer):
    limit = known_peak(8, 64) + 512  # the (8 rows, 128 tokens) probe cannot fit: a smaller simulated device
    mm = calibrate(known_work, tokenizer, batch_size=8, max_input_token_length=128, limit_bytes=limit,
                   progress=False)
    failed = [p for p in mm.probes_ if p["out_of_memory"]]
    assert failed and all(p["peak_bytes"] == limit for p in failed)  # the limit it exceeded: a lower bound
    assert all(p["peak_bytes"] <= limit for p in mm.probes_ if not p["out_of_memory"])
    assert int(mm.max_rows(128, 1e12)) < 8  # the failed shape caps the rows at its length
    assert float(mm.predict(8, 128)) >= limit * 0.999


def test_an_injected_out_of_memory_error_is_recorded(tokenizer):
    def work(batch):
        rows, length = batch["input_ids"].shape
        if rows * length > 600:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return known_work(batch)

    mm = calibrate(work, tokenizer, batch_size=4, max_input_token_length=256, progress=False)
    failed = [(p["rows"], p["padded_length"]) for p in mm.probes_ if p["out_of_memory"]]
    assert failed and all(r * length > 600 for r, length in failed)
    assert all(p["peak_bytes"] is None for p in mm.probes_ if p["out_of_memory"])
    assert not any(r >= 4 and length >= 256 for r, length in [(p["rows"], p["padded_length"]) for p in mm.probes_
                                                              if not p["out_of_memory"]])


def test_work_that_fails_on_every_probe(tokenizer):
    def broken(batch):
        raise ValueError("no such argument: token_type_ids")

    with pytest.raises(RuntimeError, match=r"work raised ValueError on a probe batch of 2 rows x 4 tokens: no such"):
        calibrate(broken, tokenizer, batch_size=4, max_input_token_length=16, progress=False)
    with pytest.raises(RuntimeError, match=r"work ran out of memory on every probe, even 4 rows x 4 tokens"):
        calibrate(known_work, tokenizer, batch_size=4, max_input_token_length=16, limit_bytes=512, progress=False)
    with pytest.raises(ValueError, match="measure_memory should be the device work runs on"):
        calibrate(lambda batch: None, tokenizer, batch_size=4, max_input_token_length=16, progress=False)


def test_bad_arguments(tokenizer):
    kwargs = dict(batch_size=4, max_input_token_length=16, progress=False)
    with pytest.raises(TypeError, match="work should be a callable"):
        calibrate("model", tokenizer, **kwargs)
    with pytest.raises(ValueError, match="batch_size should be a positive integer, but got batch_size=0"):
        calibrate(known_work, tokenizer, batch_size=0, max_input_token_length=16)
    with pytest.raises(ValueError, match=r"memory_margin should be a number in \[0, 1\), but got memory_margin=1"):
        calibrate(known_work, tokenizer, memory_margin=1, **kwargs)
    with pytest.raises(ValueError, match="lengths should be at most max_input_token_length=16"):
        calibrate(known_work, tokenizer, lengths=[4, 32], **kwargs)
    with pytest.raises(TypeError, match="measure_memory should be 'auto' or a device"):
        calibrate(known_work, tokenizer, measure_memory=3, **kwargs)
    with pytest.raises(ValueError, match="budget_bytes should be None or a finite positive number of bytes, but got "
                                         "budget_bytes=inf"):
        calibrate(known_work, tokenizer, budget_bytes=float("inf"), **kwargs)
    # numpy's own refusal named no argument ("expected non-negative integer"), and took a bool
    with pytest.raises(ValueError, match="seed should be a non-negative integer, but got seed=-1"):
        calibrate(known_work, tokenizer, seed=-1, **kwargs)
    with pytest.raises(TypeError, match="seed should be a non-negative integer, but got seed=True of type bool"):
        calibrate(known_work, tokenizer, seed=True, **kwargs)


def test_real_minilm_forward_calibrates_in_seconds(tokenizer):
    from transformers import AutoModel

    from dynabatch.demo import minilm_path

    model = AutoModel.from_pretrained(minilm_path()).eval()

    def work(batch):
        with torch.inference_mode():
            return model(**batch).last_hidden_state[:, 0]

    mm = calibrate(work, tokenizer, batch_size=4, max_input_token_length=64, model=model, max_probes=20,
                   progress=False)
    assert mm.metadata["seconds"] < 30
    assert mm.loo_error_ < 0.05
    assert mm.model_info["class"] == "BertModel" and mm.model_info["parameters"] > 20_000_000


def test_tiny_encoder_decoder_generate_calibrates(tokenizer):
    from transformers import MarianConfig, MarianMTModel

    config = MarianConfig(vocab_size=tokenizer.vocab_size, d_model=32, encoder_layers=1, decoder_layers=1,
                          encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                          max_position_embeddings=128, pad_token_id=0, decoder_start_token_id=0, eos_token_id=102,
                          forced_eos_token_id=None)
    torch.manual_seed(0)
    model = MarianMTModel(config).eval()

    def work(batch):
        with torch.inference_mode():
            return model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                  max_new_tokens=4, min_new_tokens=4, do_sample=False)

    mm = calibrate(work, tokenizer, batch_size=4, max_input_token_length=64, model=model, max_probes=20,
                   progress=False)
    assert mm.loo_error_ < 0.05
    # Generating rows carry their logits: the per-row cost dominates at short lengths.
    assert float(mm.predict(8, 4)) > 1.8 * float(mm.predict(4, 4))


# --- generate: a few decoding steps measured, the rest extrapolated --------------------------------------


@pytest.fixture(scope="module")
def tiny_gpt2(tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=tokenizer.vocab_size, n_embd=32, n_layer=2, n_head=2, n_positions=128,
                        pad_token_id=0, eos_token_id=102, bos_token_id=101)
    model = GPT2LMHeadModel(config).eval()
    left = copy.deepcopy(tokenizer)
    left.padding_side = "left"
    return model, left


def _generate(model, new_tokens):
    def work(batch):
        with torch.inference_mode():
            return model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                  max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return work


def test_generate_probes_run_a_few_steps_and_still_bound_whole_calls(tiny_gpt2):
    from dynabatch.memory._probes import _cut, vocabulary_texts
    from dynabatch.memory.measure import track_peak_memory

    model, tokenizer = tiny_gpt2
    new_tokens = 40
    forwards = []
    hook = model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    try:
        mm = calibrate(_generate(model, new_tokens), tokenizer, batch_size=4, max_input_token_length=64,
                       max_new_tokens=new_tokens, model=model, max_probes=16, progress=False)
    finally:
        hook.remove()
    probes = len(mm.probes_)
    # The warm-up and every probe but the first (run whole, to check the extrapolation) stop after 3 forward
    # calls, at the fourth's pre-hook (which this counter sees first).
    assert mm.metadata["forward_calls_measured"] == 3
    assert len(forwards) == 4 + new_tokens + 4 * (probes - 1)
    assert mm.loo_error_ < 0.05

    # Whole calls (all 40 steps) at probed shapes and at shapes never probed: never above the prediction.
    rng = np.random.default_rng(1)
    store = tokenize_texts(vocabulary_texts(tokenizer, 140, rng), tokenizer, 64, progress=False)
    probed = [(p["rows"], p["padded_length"]) for p in mm.probes_[1:4]]
    budget = 0.9 * float(mm.predict(4, 64))
    held_out = [(3, 37), (int(mm.max_rows(21, budget)), 21), (int(mm.max_rows(50, budget)), 50), (6, 59)]
    for rows, length in probed + held_out:
        batch = TokenCollator.from_tokenizer(_cut(store, length, 1), tokenizer)(np.arange(rows) % len(store))
        with track_peak_memory("cpu") as mem:
            _generate(model, new_tokens)(batch)
        width = int(batch["input_ids"].shape[1])
        predicted = float(mm.predict(rows, width))
        assert mem.peak_bytes * 0.999 <= predicted <= mem.peak_bytes * 1.15, (rows, width)
        if (rows, width) in probed:  # the extrapolated peak: the whole call's, high by the 512-byte blocks' rounding
            recorded = next(p["peak_bytes"] for p in mm.probes_ if (p["rows"], p["padded_length"]) == (rows, width))
            assert mem.peak_bytes <= recorded <= mem.peak_bytes * 1.02


def test_max_new_tokens_below_the_steps_work_runs(tiny_gpt2):
    model, tokenizer = tiny_gpt2
    with pytest.raises(ValueError, match=r"max_new_tokens should be at least the decoding steps of work \(model's "
                                         r"forward ran 12 times .*, but got max_new_tokens=8"):
        calibrate(_generate(model, 12), tokenizer, batch_size=2, max_input_token_length=16, max_new_tokens=8,
                  model=model, progress=False)


def test_work_whose_peak_comes_after_its_decoding_steps_runs_every_probe_whole(tiny_gpt2):
    model, tokenizer = tiny_gpt2
    generate = _generate(model, 12)

    def work(batch):  # generates, then holds more than any decoding step did: no line of steps reaches it
        tokens = generate(batch)
        return tokens, torch.ones(len(tokens), 2_000_000)

    mm = calibrate(work, tokenizer, batch_size=2, max_input_token_length=16, max_new_tokens=12, model=model,
                   max_probes=8, progress=False)
    assert mm.metadata["forward_calls_measured"] is None  # the first probe's check found the late peak
    assert all(p["peak_bytes"] >= p["rows"] * 8_000_000 for p in mm.probes_)


# --- bad inputs fail before the first probe ---------------------------------------------------------------


def test_bad_inputs_fail_before_any_probe(tokenizer, tiny_gpt2, monkeypatch):
    import time

    model, left = tiny_gpt2
    calls = []

    def work(batch):
        calls.append(batch["input_ids"].shape)

    kwargs = dict(batch_size=4, max_input_token_length=16, progress=False)
    cases = [
        (TypeError, r"tokenizer should be a tokenizer object .*, but got tokenizer=None of type NoneType",
         dict(tokenizer=None)),
        (ValueError, r"measure_memory should be a valid torch device such as 'cpu' or 'cuda:0', but got "
                     r"measure_memory='gpu'", dict(measure_memory="gpu")),
        (ValueError, r"lengths\[1\] should be a positive integer, but got lengths\[1\]=-3", dict(lengths=[4, -3])),
        (ValueError, r"max_input_token_length should be at most the tokenizer's model_max_length=512 .*, but got "
                     r"max_input_token_length=1000000", dict(max_input_token_length=10**6)),
        (ValueError, r"max_input_token_length should be at most 96: the model's max_position_embeddings=128 "
                     r"positions hold the prompt and the max_new_tokens=32 new tokens, but got "
                     r"max_input_token_length=100", dict(max_input_token_length=100, max_new_tokens=32, model=model,
                                                         tokenizer=left)),
        (ValueError, r"max_new_tokens should be less than the model's max_position_embeddings=128 .*, but got "
                     r"max_new_tokens=128", dict(max_new_tokens=128, model=model, tokenizer=left)),
        (TypeError, r"texts should be a list of str .*; of a mapping, pass its texts "
                    r"\(e.g. list\(texts.values\(\)\)\), but got texts=<dict of 2000 items: .*> of type dict",
         dict(texts={f"t{i}": "word " * 80 for i in range(2000)})),
        # A wrong type was a ValueError, a numpy float32 tolerance refused, a truthy progress="no" showed the bar,
        # tokenizer_kwargs other than a dict failed in dict(), and a misspelt tokenizer keyword vanished into the
        # tokenizer call (the loader refuses it, so the probes were not tokenized as its batches)
        (TypeError, r"memory_margin should be a number in \[0, 1\), but got memory_margin='0.1' of type str",
         dict(memory_margin="0.1")),
        (TypeError, r"budget_bytes should be None or a finite positive number of bytes, but got budget_bytes='1GB' "
                    r"of type str", dict(budget_bytes="1GB")),
        (TypeError, r"tolerance should be a positive number, but got tolerance='0.1' of type str",
         dict(tolerance="0.1")),
        (ValueError, r"tolerance should be a positive number, but got tolerance=np.float32\(0.0\)",
         dict(tolerance=np.float32(0))),
        (TypeError, r"progress should be a bool, but got progress='no' of type str", dict(progress="no")),
        (TypeError, r"tokenizer_kwargs should be None or a dict of the tokenizer's keywords, as given to the loader, "
                    r"but got tokenizer_kwargs='x' of type str", dict(tokenizer_kwargs="x")),
        (TypeError, r"calibrate\(\) got an unexpected keyword argument 'add_special_token' \(did you mean "
                    r"'add_special_tokens'\?\)", dict(tokenizer_kwargs={"add_special_token": False})),
    ]
    for error, match, changes in cases:
        arguments = {**kwargs, **changes}
        start = time.perf_counter()
        with pytest.raises(error, match=match) as info:
            calibrate(work, arguments.pop("tokenizer", tokenizer), **arguments)
        assert time.perf_counter() - start < 5 and len(str(info.value)) < 600
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in ("device", "measure_memory"):
        with pytest.raises(ValueError, match=rf"{name} should be an available device \(torch.cuda.is_available\(\) "
                                             rf"is False.*, but got {name}='cuda:0'"):
            calibrate(work, tokenizer, **{name: "cuda:0"}, **kwargs)
    assert calls == []  # work never ran
    calibrate(known_work, tokenizer, tolerance=np.float32(0.5), **kwargs)  # a numpy float is a number


_NO_BAR = """
import torch
from transformers import AutoTokenizer

from dynabatch import calibrate
from dynabatch.demo import minilm_path

calibrate(lambda batch: torch.ones(batch["input_ids"].numel(), 8).sum(), AutoTokenizer.from_pretrained(minilm_path()),
          batch_size=2, max_input_token_length=16, max_probes=8, progress=False)
"""


def test_no_progress_bar_leaves_no_thread_of_tqdm(threads_left):
    # a disabled bar was made where progress=False: tqdm starts its monitor thread with its first bar, a disabled one
    # too, and keeps it for the process's life (as tokenizing did, eb72896). A fresh interpreter, as no bar ran there
    assert threads_left(_NO_BAR) == ["MainThread"]
