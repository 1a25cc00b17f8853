"""The Trainer hook's out-of-memory guard: the README's training Quick Start on a device smaller than its plan.

The device is simulated by a forward pre-hook that raises a real ``torch.OutOfMemoryError`` when a
micro-batch holds more than ``CELLS`` padded tokens (rows x width): the plan (``TokenBudget(2048, 64)``)
assumed far more. The Quick Start's own model, tokenizer and texts give way to the test's. Models have no dropout, so a run's weights depend only on its batches.
"""

import re
import textwrap
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[2] / "README.md"
N_TEXTS = 80
CELLS = 600  # the simulated device holds at most this many padded tokens per micro-batch


def quick_start() -> str:
    """The README's training Quick Start, with the arguments a test machine needs (CPU, no saving, no output)."""
    text = README.read_text(encoding="utf-8")
    start = text.index("## Quick Start: training")
    code = re.findall(r"```python\n(.*?)```", text[start:text.find("\n## ", start + 1)], re.S)[0]
    code = re.sub(r"^(tokenizer|model|train_texts) = .*\n", "", code, flags=re.MULTILINE)  # the test gives these
    return code.replace('TrainingArguments("out", num_train_epochs=1)',
                        'TrainingArguments("out", num_train_epochs=1, use_cpu=True, report_to=[], save_strategy="no", '
                        'disable_tqdm=True, log_level="error")')


_RUN = textwrap.dedent(
    """
    import copy

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from dynabatch.demo import kjv_passages


    def run_quick_start(code, tokenizer, n_texts, cells=None, edits=None):
        '''Runs the Quick Start on a tiny GPT-2 without dropout; a micro-batch above `cells` padded tokens runs
        out of memory. Returns the model, its weights before training, the (rows x width) shapes that ran out of
        memory, the token ids of every row that went through a training forward (padding dropped) and the
        namespace.'''
        for old, new in (edits or {}).items():
            code = code.replace(old, new)
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2,
                                           n_positions=512, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
        initial, errors, trained = copy.deepcopy(model), [], []

        def device(module, args, kwargs):
            ids, mask = kwargs["input_ids"], kwargs["attention_mask"]
            if cells is not None and ids.numel() > cells:
                errors.append(list(ids.shape))
                raise torch.OutOfMemoryError("injected: the micro-batch holds more than the device")
            if torch.is_grad_enabled():  # a training forward (the guard may run a row without gradients)
                trained.extend(tuple(row[m.bool()].tolist()) for row, m in zip(ids, mask))

        model.register_forward_pre_hook(device, with_kwargs=True)
        namespace = {"model": model, "tokenizer": tokenizer, "train_texts": kjv_passages()[:n_texts]}
        exec(compile(code, "README.md", "exec"), namespace)
        return model, initial, errors, trained, namespace


    @torch.no_grad()
    def gap(model, reference):
        '''The largest weight difference, relative to the largest weight.'''
        diff = max(float((p - q).abs().max()) for p, q in zip(model.parameters(), reference.parameters()))
        return diff / max(float(q.abs().max()) for q in reference.parameters())
    """
)


@pytest.fixture(scope="module")
def runner():
    namespace: dict = {}
    exec(_RUN, namespace)
    return namespace


@pytest.mark.slow
def test_the_quick_start_on_a_smaller_device_trains_every_sample_once_as_without_errors(tokenizer, runner, tmp_path,
                                                                                        monkeypatch, one_thread):
    monkeypatch.chdir(tmp_path)
    code = quick_start()
    reference, initial, none, ran, _ = runner["run_quick_start"](code, tokenizer, N_TEXTS)
    model, _, errors, trained, ns = runner["run_quick_start"](code, tokenizer, N_TEXTS, cells=CELLS)
    sampler, lengths = ns["sampler"], ns["tokens"].lengths["input_ids"]
    assert none == [] and max(len(b) * lengths[b].max() for b in sampler) > 2 * CELLS  # the plan assumed more
    assert 1 <= len(errors) <= 5 and ns["trainer"].oom_guardian.num_out_of_memory == len(errors)
    assert ns["trainer"].state.global_step == len(sampler)  # the plan's steps, unchanged
    rows = [tuple(ids) for ids in ns["tokens"].dataset["input_ids"]]
    assert sorted(trained) == sorted(ran) == sorted(rows)  # every sample trained once
    # the weights of the run without errors, within float tolerance, though training moved them far more
    assert runner["gap"](model, reference) <= 1e-4 and runner["gap"](reference, initial) > 100 * runner["gap"](model, reference)


def test_an_error_ends_the_run_when_the_guard_is_off(tokenizer, runner, tmp_path, monkeypatch, one_thread):
    monkeypatch.chdir(tmp_path)
    code = quick_start().replace("data_collator=TrainingCollator(", "split_on_oom=False, data_collator=TrainingCollator(")
    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        runner["run_quick_start"](code, tokenizer, 40, cells=CELLS)


_WORKER = textwrap.dedent(
    """
    import hashlib, json, os, sys

    import torch
    from transformers import AutoTokenizer

    from dynabatch.demo import minilm_path

    rank, out = int(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    exec(open(os.path.join(out, "run.py")).read())
    code = open(os.path.join(out, "quick_start.py")).read()
    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    dealt = {"seed=0)": "seed=0, num_replicas=2, shard=False)"}  # accelerate deals the batches to the ranks
    n, cells = int(sys.argv[3]), int(sys.argv[4])
    os.chdir(out)
    reference, initial, _, _, _ = run_quick_start(code, tokenizer, n, edits=dealt)
    model, _, errors, trained, ns = run_quick_start(code, tokenizer, n, cells=cells if rank == 1 else None, edits=dealt)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"errors": errors, "trained": trained, "steps": ns["trainer"].state.global_step,
                   "rows": [list(ids) for ids in ns["tokens"].dataset["input_ids"]],
                   "weights": hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest(),
                   "gap": gap(model, reference), "moved": gap(reference, initial)}, f)
    """
)


@pytest.mark.slow
def test_two_gloo_ranks_where_one_alone_runs_out_of_memory_stay_in_step(tmp_path, run_two_ranks):
    (tmp_path / "run.py").write_text(_RUN)
    (tmp_path / "quick_start.py").write_text(quick_start())
    reports = run_two_ranks(_WORKER, tmp_path, args=[str(2 * N_TEXTS), str(CELLS)])
    assert reports[0]["errors"] == [] and 1 <= len(reports[1]["errors"]) <= 5  # rank 1 alone ran out of memory
    assert reports[0]["steps"] == reports[1]["steps"] >= 2 and reports[0]["weights"] == reports[1]["weights"]
    trained = sorted(tuple(row) for r in reports for row in r["trained"])
    assert trained == sorted(tuple(row) for row in reports[0]["rows"])  # every sample once, over both ranks
    for r in reports:  # the weights of the run without errors
        assert r["gap"] <= 1e-4 and r["moved"] > 100 * r["gap"]


def _classifier(tokenizer):
    from transformers import BertConfig, BertForSequenceClassification, TrainingArguments

    from dynabatch import BatchSamplerTrainer, tokenize_source
    from dynabatch.demo import kjv_passages

    rows = [{"text": t, "label": i % 3} for i, t in enumerate(kjv_passages()[:48])]
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return (tokenize_source(rows, tokenizer, max_length=64, keep=["label"], progress=False),
            lambda: BertForSequenceClassification(config), BatchSamplerTrainer, TrainingArguments, 640)


def _translator(tokenizer, marian):
    import copy

    from transformers import MarianMTModel, Seq2SeqTrainingArguments

    from dynabatch import tokenize_source
    from dynabatch.demo import kjv_passages
    from dynabatch.training.hf import Seq2SeqBatchSamplerTrainer

    verses = kjv_passages()[:24]
    pairs = [{"source": a, "target": b} for a, b in zip(verses, verses[1:] + verses[:1])]
    config = copy.deepcopy(marian.config)
    config.dropout = 0.0
    return (tokenize_source(pairs, tokenizer, fields={"input_ids": "source", "labels": "target"}, max_length=48,
                            progress=False),
            lambda: MarianMTModel(config), Seq2SeqBatchSamplerTrainer, Seq2SeqTrainingArguments, 800)


@pytest.mark.parametrize("task", ["classifier", "seq2seq"])
def test_a_mean_loss_split_in_parts_gives_the_step_of_the_whole_micro_batch(task, tokenizer, marian, tmp_path,
                                                                            one_thread):
    # A classifier's and Marian's losses are their own means over the micro-batch (they ignore the Trainer's
    # num_items_in_batch): each part carries its share. SGD, two micro-batches a step for the classifier.
    from dynabatch import SmartBatchSampler, TokenBudget, TrainingCollator

    tokens, make, trainer_class, arguments, max_tokens = (_classifier(tokenizer) if task == "classifier"
                                                          else _translator(tokenizer, marian))

    def train(cells):
        torch.manual_seed(0)
        model = make().train()
        errors = []

        def device(module, args, kwargs):
            ids = kwargs.get("input_ids")
            if cells is not None and ids is not None and ids.numel() > cells and torch.is_grad_enabled():
                errors.append(tuple(ids.shape))
                raise torch.OutOfMemoryError("injected")

        model.register_forward_pre_hook(device, with_kwargs=True)
        args = arguments(str(tmp_path), max_steps=2, gradient_accumulation_steps=2 if task == "classifier" else 1,
                         learning_rate=0.5, max_grad_norm=0.0, lr_scheduler_type="constant", use_cpu=True,
                         report_to=[], save_strategy="no", disable_tqdm=True, log_level="error", logging_steps=1)
        trainer = trainer_class(model=model, args=args, train_dataset=tokens.dataset,
                                data_collator=TrainingCollator(tokenizer),
                                train_batch_sampler=SmartBatchSampler(tokens.lengths, TokenBudget(max_tokens), seed=0),
                                optimizers=(torch.optim.SGD(model.parameters(), lr=0.5), None))
        trainer.train()
        return model, errors, [h["loss"] for h in trainer.state.log_history if "loss" in h]

    reference, _, losses = train(None)
    model, errors, split_losses = train(200)
    assert errors and len(losses) == 2 and split_losses == pytest.approx(losses, rel=1e-5)
    with torch.no_grad():  # within float tolerance of the largest weight
        gap = max(float((p - q).abs().max()) for p, q in zip(model.parameters(), reference.parameters()))
        assert gap <= 1e-5 * max(float(q.abs().max()) for q in reference.parameters())
