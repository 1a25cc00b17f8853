"""DynamicBatchingTrainer under DDP: two gloo processes on CPU, launched like torchrun (``run_two_ranks``)."""

import math
import textwrap

_WORKER = textwrap.dedent(
    """
    import hashlib, json, os, sys

    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel, TrainingArguments

    from dynabatch import DynamicBatchingTrainer, MultiTaskDataset
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
        "before": before, "after": {"weights": weights(trained), "loss": data_loss(trained)},
    }
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    """
)


def test_two_gloo_ranks_train_disjoint_full_steps_in_lockstep_with_synced_weights(tmp_path, run_two_ranks):
    rank0, rank1 = run_two_ranks(_WORKER, tmp_path)
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
    assert rank0["after"]["loss"] == rank1["after"]["loss"] < rank0["before"]["loss"] - 0.1
