"""``run`` names the likely cause of an embedding lookup out of range (a real model, rows too long for it)."""

import pytest
import torch
from runner_helpers import _load

from dynabatch import run

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def short_gpt2(tokenizer):
    from transformers import GPT2Config, GPT2Model

    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2, n_positions=16)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return GPT2Model(config).eval()


def test_rows_longer_than_the_model_positions_fail_naming_the_likely_cause(short_gpt2, tokenizer, texts):
    loader = _load(texts, tokenizer, max_input_token_length=32)  # no model=: nothing to check it against
    with torch.no_grad(), pytest.raises(IndexError, match=r"fn\(batch\) failed in an embedding lookup \(index out "
                                        r"of range in self\) on a batch of 1 row x 32 tokens whose largest token "
                                        r"id is \d+: most likely max_input_token_length is above the model's "
                                        r"position embeddings") as caught:
        run(lambda batch: short_gpt2(**batch).last_hidden_state[:, 0], loader, progress=False)
    assert isinstance(caught.value.__cause__, IndexError)  # chained from torch's own error
    assert str(caught.value.__cause__) == "index out of range in self"
    with torch.no_grad():  # rows the model can embed run
        rows = run(lambda batch: short_gpt2(**batch).last_hidden_state[:, 0], _load(texts, tokenizer,
                   max_input_token_length=16), progress=False)
    assert len(rows) == len(texts)


def test_other_index_errors_propagate_as_they_are_with_a_note_naming_the_row(tokenizer, texts):
    def fn(batch):
        return batch.texts[len(batch.texts)]

    with pytest.raises(IndexError, match=r"^list index out of range\ndynabatch.run: fn\(batch\) raised on input "
                                         r"position \d+, alone \(a row of batch 0\)"):
        run(fn, _load(texts[:8], tokenizer), progress=False)
