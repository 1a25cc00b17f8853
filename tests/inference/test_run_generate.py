"""``run`` on real batches of real texts: generate, per-row outputs without the batch's padding. Models are real (see conftest.py); nothing of dynabatch is mocked.
"""

import copy

import pytest
import torch
from runner_helpers import (
    MAX_LEN,
    NEW_TOKENS,
    _lengths,
    _load,
)

from dynabatch import run

pytestmark = pytest.mark.usefixtures("one_thread")


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
        whole = run(generate, loader, progress=False)  # not an echo of input_ids: rows as the batch padded them
        result = run(generate, loader, token_outputs="generated", progress=False)  # declared: padding stripped
        assert sum(len(w) > len(r) for w, r in zip(whole, result)) > 1
        assert 1 < sum(len(r) < 1 + NEW_TOKENS for r in result) < len(some)
        for p, text in enumerate(some):
            inputs = tokenizer(
                text, truncation=True, max_length=MAX_LEN, return_tensors="pt", return_token_type_ids=False
            )
            alone = generate(inputs)[0]
            assert result[p][0] == 0  # the decoder start token is the pad id, and it stays
            assert result[p].tolist() == alone.tolist(), f"text {p}: {text!r}"
