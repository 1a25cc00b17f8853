"""The model's positions as a limit on row lengths: ``position_limit`` and ``check_position_limit``."""

import pytest
import torch

from dynabatch.memory.shape import check_position_limit, position_limit


def test_the_config_field_each_family_has_is_read_and_named():
    from transformers import BertConfig, GPT2Config, LlamaConfig, MarianConfig, T5Config

    assert position_limit(BertConfig(max_position_embeddings=128)) == ("max_position_embeddings", 128, 128)
    assert position_limit(GPT2Config(n_positions=256)) == ("n_positions", 256, 256)  # its alias resolved
    assert position_limit(LlamaConfig(max_position_embeddings=96)) == ("max_position_embeddings", 96, 96)
    assert position_limit(MarianConfig(max_position_embeddings=64)) == ("max_position_embeddings", 64, 64)
    assert position_limit(T5Config()) is None  # relative positions: no limit to check


def test_roberta_positions_reserved_before_the_first_token_are_not_usable():
    from transformers import RobertaConfig, RobertaModel

    config = RobertaConfig(max_position_embeddings=34, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=64, pad_token_id=1, vocab_size=100)
    with torch.random.fork_rng():
        model = RobertaModel(config)
    assert position_limit(model) == ("max_position_embeddings", 34, 32)
    check_position_limit(model, 32)
    with pytest.raises(ValueError, match=r"at most 32 \(the model's config.max_position_embeddings=34 positions, "
                       r"2 of them reserved before the first token\), but got max_input_token_length=33"):
        check_position_limit(model, 33)
    ids = torch.full((1, 33), 5)
    model(ids[:, :32], token_type_ids=torch.zeros_like(ids[:, :32]))  # what the check lets through runs
    with pytest.raises(IndexError, match="index out of range in self"):
        model(ids, token_type_ids=torch.zeros_like(ids))  # one more token does not


def test_generate_adds_its_new_tokens_to_a_decoder_only_prompt_only():
    from transformers import LlamaConfig, MarianConfig

    check_position_limit(LlamaConfig(max_position_embeddings=96), 64, max_new_tokens=32)
    with pytest.raises(ValueError, match=r"max_input_token_length should be at most 63 \(the model's "
                       r"config.max_position_embeddings=96 positions, less max_new_tokens=33 that generate adds\)"):
        check_position_limit(LlamaConfig(max_position_embeddings=96), 64, max_new_tokens=33)
    marian = MarianConfig(max_position_embeddings=64)
    check_position_limit(marian, 64, max_new_tokens=63)  # encoder and decoder positions apart
    with pytest.raises(ValueError, match=r"max_new_tokens should be at most 63 \(the model's "
                       r"config.max_position_embeddings=64 positions, one for the decoder start token\), "
                       r"but got max_new_tokens=64"):
        check_position_limit(marian, 8, max_new_tokens=64)
