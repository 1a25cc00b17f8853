"""DynamicBatchingTrainer under DDP: two gloo processes on CPU, launched like torchrun (``run_two_ranks``)."""

import math
import textwrap

import pytest

_WORKER = textwrap.dedent(
    """
    import copy, hashlib, json, os, sys

    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel, TrainingArguments

    from dynabatch.compat.multitask import DynamicBatchingTrainer, MultiTaskDataset
    from dynabatch.demo import kjv_passages, minilm_path

    rank, out = int(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    verses = kjv_passages()
    data = MultiTaskDataset.from_texts(  # 27 samples of two tasks and lengths 4..32
        tokenizer, {"verse": verses[:14], "passage": [" ".join(verses[i:i + 3]) for i in range(20, 33)]},
        max_length=32)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(
        vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=2, n_positions=32, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=tokenizer.pad_token_id))

    def weights(m):
        return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in m.parameters())).hexdigest()

    def data_loss(m):  # mean token loss over the whole dataset, one sample at a time
        with torch.no_grad():
            return sum(float(m(input_ids=torch.tensor([s["input_ids"]]), labels=torch.tensor([s["input_ids"]])).loss)
                       for s in data.samples) / len(data)

    before = {"weights": weights(model), "loss": data_loss(model)}
    args = TrainingArguments(output_dir=out, use_cpu=True, report_to=[], remove_unused_columns=False,
                             num_train_epochs=2, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                             learning_rate=5e-3, save_strategy="no", disable_tqdm=True, logging_steps=1, seed=0)
    trainer = DynamicBatchingTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer,
                                     measure_memory=False)
    trainer.train()
    trained = trainer.accelerator.unwrap_model(trainer.model)
    report = {
        "world": [args.process_index, args.world_size], "n": len(data), "target": trainer.target_batch_size,
        "global_step": trainer.state.global_step, "steps": trainer.trained_indices,
        "logged": [e["loss"] for e in trainer.state.log_history if "loss" in e],
        "task_logged": [{k: v for k, v in e.items() if k.startswith("loss_")} for e in trainer.state.log_history
                        if "loss" in e],
        "before": before, "after": {"weights": weights(trained), "loss": data_loss(trained)},
    }

    # one SGD step (no momentum: the update is -lr * gradient), then the same step with an out-of-memory error
    # injected into rank 1's backward of its last micro-batch (the guard splits it: that rank runs more backwards)
    def sgd_step(inject):
        torch.manual_seed(0)
        m = GPT2LMHeadModel(model.config)
        start = copy.deepcopy(m)
        a = TrainingArguments(output_dir=out, use_cpu=True, report_to=[], remove_unused_columns=False, max_steps=1,
                              per_device_train_batch_size=4, gradient_accumulation_steps=2, learning_rate=LR,
                              max_grad_norm=0.0, lr_scheduler_type="constant", save_strategy="no",
                              disable_tqdm=True, logging_steps=1, seed=1)
        t = DynamicBatchingTrainer(model=m, args=a, train_dataset=data, processing_class=tokenizer,
                                   measure_memory=False, optimizers=(torch.optim.SGD(m.parameters(), lr=LR), None))
        calls = []

        def fail_in_last_micro_batch(grad):
            calls.append(1)
            if len(calls) == 2:
                raise torch.OutOfMemoryError("injected: out of memory in the backward")
            return grad

        handle = m.transformer.h[0].mlp.c_fc.weight.register_hook(fail_in_last_micro_batch) if inject and rank == 1 else None
        t.train()
        if handle is not None:
            handle.remove()
        return start, t.accelerator.unwrap_model(t.model), t, len(calls)

    LR = 0.5
    start, plain, t, _ = sgd_step(inject=False)
    _, split, t_split, backwards = sgd_step(inject=True)
    both = [None, None]
    torch.distributed.all_gather_object(both, t.trained_indices[0])
    tokens = [sum(len(data.samples[i]["input_ids"]) - 1 for i in step) for step in both]

    def reference(per_rank):  # one process: the loss over both ranks' samples, then w -= LR * grad
        ref = copy.deepcopy(start)
        sums = [sum(ref(input_ids=torch.tensor([data.samples[i]["input_ids"]]),
                        labels=torch.tensor([data.samples[i]["input_ids"]])).loss * (len(data.samples[i]["input_ids"]) - 1)
                    for i in step) for step in both]
        loss = sum(s / n for s, n in zip(sums, tokens)) / 2 if per_rank else sum(sums) / sum(tokens)
        loss.backward()
        with torch.no_grad():
            for p in ref.parameters():
                p -= LR * p.grad
        return ref

    def gap(m1, m2):
        return max(float((p - q).abs().max()) for p, q in zip(m1.parameters(), m2.parameters()))

    report["sgd"] = {
        "tokens": tokens, "weights": weights(plain), "split_weights": weights(split),
        "split_gap": gap(split, plain), "moved": gap(plain, start),
        "backwards": backwards,
        "logged": [e["loss"] for e in t.state.log_history if "loss" in e],
        "logged_split": [e["loss"] for e in t_split.state.log_history if "loss" in e],
    }
    if rank == 0:
        token_mean, rank_mean = reference(per_rank=False), reference(per_rank=True)
        report["sgd"].update(gap_token_mean=gap(plain, token_mean), gap_rank_mean=gap(plain, rank_mean))
        with torch.no_grad():
            union = [data.samples[i]["input_ids"] for step in both for i in step]
            report["sgd"]["union_loss"] = sum(float(start(input_ids=torch.tensor([ids]), labels=torch.tensor([ids])).loss)
                                              * (len(ids) - 1) for ids in union) / sum(tokens)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    """
)


@pytest.fixture(scope="module")
def reports(tmp_path_factory, run_two_ranks):
    """One launch of the two ranks: their reports (both tests below read them)."""
    return run_two_ranks(_WORKER, tmp_path_factory.mktemp("ddp"))


@pytest.mark.slow
def test_two_gloo_ranks_train_disjoint_full_steps_in_lockstep_with_synced_weights(reports):
    rank0, rank1 = reports
    assert [rank0["world"], rank1["world"]] == [[0, 2], [1, 2]]
    n, target = rank0["n"], rank0["target"]
    assert (n, target) == (27, 8)
    # the same number of optimizer steps on both ranks (a DDP all-reduce each: a mismatch would hang)
    assert rank0["global_step"] == rank1["global_step"] == len(rank0["steps"]) == len(rank1["steps"]) > 0
    per_epoch = rank0["global_step"] // 2
    epochs = []
    for e in range(2):
        shares = [[i for step in r["steps"][e * per_epoch:(e + 1) * per_epoch] for i in step] for r in (rank0, rank1)]
        assert not set(shares[0]) & set(shares[1])  # disjoint ...
        assert sorted(shares[0] + shares[1]) == list(range(n))  # ... and every sample once per epoch
        sizes = [len(step) for r in (rank0, rank1) for step in r["steps"][e * per_epoch:(e + 1) * per_epoch]]
        assert sum(size < target for size in sizes) <= 1  # steps of >= target_batch_size samples but the last
        epochs.append(shares)
    assert epochs[0] != epochs[1]  # reshuffled each epoch
    # DDP: identical weights on both ranks, moved by training; the loss is finite and went down
    assert rank0["before"]["weights"] == rank1["before"]["weights"]
    assert rank0["after"]["weights"] == rank1["after"]["weights"] != rank0["before"]["weights"]
    assert rank0["logged"] == rank1["logged"] and all(math.isfinite(v) for v in rank0["logged"])
    # per-task losses are over both ranks' tokens too: the same on both ranks
    assert rank0["task_logged"] == rank1["task_logged"]
    assert all(set(e) <= {"loss_verse", "loss_passage"} and e for e in rank0["task_logged"])
    assert rank0["after"]["loss"] == rank1["after"]["loss"] < rank0["before"]["loss"] - 0.1


def test_ddp_step_is_the_token_mean_over_all_ranks_and_one_reduction_even_after_an_oom_split(reports):
    # one SGD step where the ranks' token counts differ: the gradient is that of the mean over ALL the step's
    # target tokens (one process on the union of both ranks' samples), not the mean of each rank's own mean
    sgd = [report["sgd"] for report in reports]
    assert sgd[0]["tokens"] == sgd[1]["tokens"] and sgd[0]["tokens"][0] != sgd[0]["tokens"][1]
    assert sgd[0]["weights"] == sgd[1]["weights"] and sgd[0]["moved"] > 1e-2
    assert sgd[0]["gap_token_mean"] <= 1e-6
    assert sgd[0]["gap_rank_mean"] > 1e-4  # the old rule (mean of the ranks' means) is far from it
    # the logged loss is that token mean over both ranks (the same on both)
    assert sgd[0]["logged"] == sgd[1]["logged"] == [pytest.approx(sgd[0]["union_loss"], rel=1e-5)]
    # an out-of-memory split on rank 1 only (more backward passes there): both finish with identical
    # weights, those of the run without the error
    assert sgd[1]["backwards"] == 4 and sgd[0]["backwards"] == 0
    assert sgd[0]["split_weights"] == sgd[1]["split_weights"]
    assert sgd[0]["split_gap"] <= 1e-6 and sgd[1]["split_gap"] <= 1e-6
    assert sgd[0]["logged_split"] == [pytest.approx(sgd[0]["logged"][0], rel=1e-6)]
