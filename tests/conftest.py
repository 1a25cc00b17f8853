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
