"""The README's commands and snippets run as written."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _blocks(section: str) -> list[str]:
    text = README.read_text(encoding="utf-8")
    start = text.index(f"## {section}")
    end = text.find("\n## ", start + 1)
    return re.findall(r"```python\n(.*?)```", text[start:end if end > 0 else None], re.S)


@pytest.fixture(scope="module")
def quick_start():
    """The inference Quick Start, run as written: its namespace."""
    namespace: dict = {}
    exec(compile(_blocks("Quick Start: inference")[0], str(README), "exec"), namespace)
    return namespace


def test_quick_start_runs_and_gives_one_embedding_per_text(quick_start):
    assert quick_start["embeddings"].shape == (1000, 384)
    report = quick_start["rows"].report
    assert report.rows == 1000 and report.batches < 1000 // 32  # batches grew beyond batch_size
    assert report.max_peak_ratio is not None and report.max_peak_ratio <= 1.02  # measured: none above the first


def test_quick_start_embeddings_are_the_models_own_sentence_transformers_vectors(quick_start):
    import numpy as np
    from sentence_transformers import SentenceTransformer

    from dynabatch.demo import minilm_path

    sample = np.random.default_rng(0).choice(1000, size=120, replace=False)
    texts = [quick_start["texts"][i] for i in sample]
    want = SentenceTransformer(minilm_path(), device="cpu").encode(texts, batch_size=32, convert_to_tensor=True)
    cosine = (quick_start["embeddings"][sample] * want).sum(1) / want.norm(dim=1)
    assert float(cosine.min()) >= 0.9999


def test_the_generate_snippet_runs_with_a_generative_model(tokenizer):
    import copy

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from dynabatch.demo import kjv_passages

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2,
                                       n_positions=320)).eval()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    namespace = {"model": model, "tokenizer": copy.deepcopy(tokenizer), "texts": kjv_passages()[:40],
                 "torch": torch, "dynabatch": __import__("dynabatch")}
    exec(compile(_blocks("Quick Start: inference")[1], str(README), "exec"), namespace)
    assert len(namespace["replies"]) == 40 and all(isinstance(r, str) for r in namespace["replies"])


def test_the_training_quick_start_trains_every_text_once(tokenizer, tmp_path, monkeypatch, one_thread):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from dynabatch.demo import kjv_passages

    monkeypatch.chdir(tmp_path)  # the snippet writes to ./out
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2, n_positions=512))
    namespace = {"model": model, "tokenizer": tokenizer, "train_texts": kjv_passages()[:48]}
    code = _blocks("Quick Start: training")[0].replace('TrainingArguments("out", num_train_epochs=1)',
                                                        'TrainingArguments("out", num_train_epochs=1, use_cpu=True, '
                                                        'report_to=[], save_strategy="no", disable_tqdm=True)')
    exec(compile(code, str(README), "exec"), namespace)
    trainer, sampler = namespace["trainer"], namespace["sampler"]
    assert trainer.state.global_step == len(sampler)
    assert sorted(i for batch in sampler for i in batch) == list(range(48))


def test_the_readme_starts_with_the_demo_and_test_commands():
    text = README.read_text(encoding="utf-8")
    commands = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    assert "python examples/embed_kjv.py" in commands
    assert "python -m pytest" in commands
    ci = (README.parent / ".ci" / "run").read_text(encoding="utf-8")
    test_command = next(line for line in commands.splitlines() if line.endswith("python -m pytest"))
    assert test_command.replace("pip install", "pip install -q") in ci


def test_the_readme_is_a_front_door():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 300
    for word in ("issue", "seed 0", "this machine", "2-core", "load average", "target"):
        assert word not in text.lower(), word
