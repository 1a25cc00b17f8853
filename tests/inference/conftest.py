"""Fixtures of the ``run`` tests: real texts, real MiniLM (the tiny Marian is in tests/conftest.py).

The helpers the test modules share live in ``runner_helpers.py`` beside this file; its folder is
put on ``sys.path`` here, since tests are imported with ``--import-mode=importlib``.
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="module")
def texts():
    from dynabatch.demo import kjv_passages, vary_lengths

    varied = vary_lengths(kjv_passages(), n=100, max_words=50, seed=7)
    return varied + [varied[3], "", "And God said"]  # a duplicate, an empty string


@pytest.fixture(scope="module")
def same_width_texts():
    # KJV passages mostly exceed 24 tokens: most batches are truncated to the same width, 24.
    from dynabatch.demo import kjv_passages

    return kjv_passages()[:120]


@pytest.fixture(scope="module")
def minilm():
    from transformers import AutoModel

    from dynabatch.demo import minilm_path

    return AutoModel.from_pretrained(minilm_path()).eval()
