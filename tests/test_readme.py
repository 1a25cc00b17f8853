"""The README: its set-up commands are CI's, it stays a front door, and what its blocks print is what it says.

Every block of the README runs as written in ``tests/test_docs.py::test_chain_runs``; the tests here read
back what those runs left (each chain runs once a session: ``docs_runner`` keeps its result).
"""

import re

import _docs_blocks
import pytest

README = _docs_blocks.ROOT / "README.md"
CHAINS = [c for c in _docs_blocks.chains([README])[0]]


def _chain(code: str):
    """The README's chain with a block holding ``code``."""
    return next(c for c in CHAINS if any(code in b.code for b in c.blocks))


@pytest.mark.slow
def test_quick_start_gives_one_sentence_transformers_vector_per_text_on_growing_batches(docs_runner):
    import numpy as np
    from sentence_transformers import SentenceTransformer

    from dynabatch.demo import minilm_path

    result = docs_runner(_chain("embeddings = torch.stack(rows)"))
    assert result.status == 0, result.output[-3000:]
    texts, embeddings = result.values["texts"], result.values["embeddings"]
    assert embeddings.shape == (len(texts), 384)
    batches = int(re.search(r"^(\d+) batches;", result.output, re.MULTILINE).group(1))
    assert batches < len(texts) / 32  # batches grew beyond batch_size
    sample = np.random.default_rng(0).choice(len(texts), size=60, replace=False)
    want = SentenceTransformer(minilm_path(), device="cpu").encode([texts[i] for i in sample], convert_to_tensor=True)
    cosine = (embeddings[sample] * want).sum(1) / want.norm(dim=1)
    assert float(cosine.min()) >= 0.9999
    assert len(result.values["replies"]) == len(texts) and all(isinstance(r, str) for r in result.values["replies"])


@pytest.mark.slow
def test_the_corpus_job_commands_store_every_text_and_every_reply(docs_runner):
    result = docs_runner(_chain("dynabatch generate chats.jsonl"))
    assert result.status == 0, result.output[-3000:]
    assert result.output.count("100 of 100 texts stored in embeddings/") == 2  # embed, then torchrun: resumed
    assert "dynabatch generate: 16 of 16 replies stored in replies/" in result.output


def test_the_readme_starts_with_the_demo_and_test_commands():
    text = README.read_text(encoding="utf-8")
    commands = re.search(r"```bash\n(.*?)```", text, re.DOTALL).group(1)
    assert "python examples/embed_kjv.py" in commands
    assert "python -m pytest" in commands
    ci = (README.parent / ".ci" / "run").read_text(encoding="utf-8")
    test_command = next(line for line in commands.splitlines() if line.endswith("python -m pytest"))
    assert test_command.replace("pip install", "pip install -q") in ci


def test_the_readme_is_a_front_door():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 300
    for word in ("issue", "seed 0", "this machine", "load average", "target"):
        assert word not in text.lower(), word
