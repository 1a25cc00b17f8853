"""Footprint (memory/footprint.py): what a batch holds, from the model's config, against the CPU tracker's peaks."""

import copy

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dynabatch.memory.footprint import CALL_BYTES, SCALE_FLOOR, Footprint, ModelDims
from dynabatch.memory.measure import track_peak_memory

pytestmark = pytest.mark.usefixtures("one_thread")

SHAPES = [(4, 64), (16, 16), (16, 128), (64, 8), (8, 256)]


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=8000, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=512,
                         tie_word_embeddings=False, pad_token_id=0)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config).eval()
    model.generation_config.update(do_sample=False, eos_token_id=None, pad_token_id=0, bos_token_id=None)
    return model


def _bert():
    from transformers import BertConfig, BertModel

    with torch.random.fork_rng():
        torch.manual_seed(0)
        return BertModel(BertConfig(vocab_size=8000, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                    intermediate_size=512)).eval()


def _peak(model, rows, width, new):
    ids = torch.randint(3, 7999, (rows, width), generator=torch.Generator().manual_seed(rows * width))
    mask = torch.ones(rows, width, dtype=torch.long)
    mask[0, : width // 2] = 0  # padded, as a batch of varied lengths is
    with torch.inference_mode(), track_peak_memory("cpu") as mem:
        if new:
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new)
        else:
            model(input_ids=ids, attention_mask=mask)
    return mem.peak_bytes


@pytest.fixture(scope="module")
def measured():
    """Measured peaks of a Qwen2-shaped generate (8 new tokens) and a BERT-shaped forward, at every shape."""
    qwen, bert = _qwen2(), _bert()
    return {"generate": (qwen, 8, {s: _peak(qwen, *s, 8) for s in SHAPES}),
            "forward": (bert, 0, {s: _peak(bert, *s, 0) for s in SHAPES})}


@pytest.mark.parametrize("call", ["generate", "forward"])
def test_the_prior_errs_high_and_one_measured_batch_brings_every_shape_near_its_peak(measured, call):
    model, new, peaks = measured[call]
    prior = Footprint.from_model(model, max_new_tokens=new)
    ratios = [peaks[s] / float(prior.predict(*s)) for s in SHAPES]
    assert max(ratios) <= 1.0 and min(ratios) >= 0.6  # never under its peak, never far above it
    for seen in SHAPES:
        refined = copy.deepcopy(prior).observe(*seen, peaks[seen])
        worst = max(peaks[s] / float(refined.predict(*s)) for s in SHAPES)
        assert worst <= 1.05  # within the budget's margin of every other shape's peak
    assert Footprint.from_model(model, max_new_tokens=new).key() == prior.key()


def test_the_dimensions_are_read_from_the_config_and_the_modules():
    qwen = ModelDims.from_model(_qwen2())
    assert (qwen.hidden, qwen.intermediate, qwen.layers, qwen.heads, qwen.kv_heads, qwen.head_dim, qwen.vocab) == (
        128, 352, 2, 4, 1, 32, 8000)
    assert qwen.gated and not qwen.eager and qwen.dtype_bytes == 4 and qwen.kv_bytes() == 2 * 2 * 32 * 4
    bert = ModelDims.from_model(_bert(), dtype="bfloat16")
    # the larger of the feed-forward (3 hidden + 2 intermediate) and the attention (2 hidden + 5 (q + kv)), 2 bytes each
    assert not bert.gated and bert.dtype_bytes == 2 and bert.token_bytes() == 2 * max(3 * 128 + 2 * 512, 2 * 128 + 5 * 256)
    from transformers import GPT2Config

    gpt2 = ModelDims.from_model(GPT2Config(n_embd=64, n_layer=2, n_head=4))  # gelu_new: several ops
    assert gpt2.composed_activation and gpt2.intermediate == 256
    with pytest.raises(TypeError, match=r"^model should be a transformers model or config with a hidden size, layers, "
                                        r"attention heads and a vocabulary \(missing: hidden, layers, heads, vocab\)"):
        ModelDims.from_model(object())
    with pytest.raises(ValueError, match=r"^dtype should be None or a floating torch dtype"):
        ModelDims.from_model(GPT2Config(), dtype="int8")


def test_beams_multiply_the_rows_the_decoder_holds_and_out_of_memory_caps_wider_shapes():
    from transformers import GPT2Config

    config = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=5000)
    one = Footprint.from_model(config, max_new_tokens=16)
    four = Footprint.from_model(config, max_new_tokens=16, num_beams=4)
    assert float(four.predict(8, 32)) == pytest.approx(CALL_BYTES + 4 * (float(one.predict(8, 32)) - CALL_BYTES))
    assert int(one.max_rows(32, 10**9)) > 100
    one.observe(100, 32, out_of_memory=True)
    assert int(one.max_rows(32, 10**9)) == 99 and int(one.max_rows(64, 10**9)) <= 99  # at that width and wider
    assert int(one.max_rows(16, 10**9)) > 100  # narrower shapes are not capped
    one.observe(4, 8, 0)  # a call that allocated nothing here says nothing
    assert one.scales_ == [1.0, 1.0]
    one.observe(50, 64, 0.1 * float(one.predict(50, 64)))  # far below the prior: scaled down to the floor at most
    assert min(one.scales_) == SCALE_FLOOR


@settings(max_examples=60, deadline=None)
@given(width=st.integers(1, 4096), budget=st.floats(1e5, 1e12), new=st.sampled_from([0, 1, 64]),
       scale=st.floats(0.5, 3.0))
def test_max_rows_is_the_most_rows_predicted_within_the_budget(width, budget, new, scale):
    from transformers import LlamaConfig

    fp = Footprint.from_model(LlamaConfig(hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=32000),
                              max_new_tokens=new)
    rows = int(fp.max_rows(width, 10 * float(fp.predict(1, width)) * scale))  # refined or not, the same rule
    fp.observe(10, width, 10 * float(fp.predict(10, width)) * scale)
    rows = int(fp.max_rows(width, budget))
    if rows:
        assert float(fp.predict(rows, width)) <= budget
    assert float(fp.predict(rows + 1, width)) > budget
    assert np.all(np.diff(fp.predict(5, np.array([1, 8, 64, 512, 4096]))) > 0)  # more tokens never cost less
