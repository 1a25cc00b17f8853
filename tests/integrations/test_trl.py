"""dynabatch.integrations.trl: a dataset pre-packed by dynabatch trains through TRL's SFTTrainer (padding-free), every
sample once."""

from collections import Counter
from itertools import pairwise
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
import trl

from dynabatch.integrations.trl import pack_dataset

SEQ_LENGTH = 128


@pytest.fixture(scope="module")
def tokenizer():
    """The WordPiece tokenizer trained on the KJV (benchmarks/assets, 8,192 ids). The trainer's loss is TRL's fused LM
    head, float32 log-probabilities over the whole vocabulary: on the CPU an epoch costs a quarter of what MiniLM's
    30,522 ids cost (52 s)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(Path(__file__).resolve().parents[2] / "benchmarks" / "assets" / "kjv-wordpiece")


@pytest.fixture(scope="module")
def tokenized(tokenizer):
    """240 real KJV passages as token ids (3 to 128 tokens)."""
    from dynabatch.demo import kjv_passages

    ids = tokenizer(kjv_passages()[:240], truncation=True, max_length=SEQ_LENGTH)["input_ids"]
    return datasets.Dataset.from_dict({"input_ids": ids})


def _sequences(rows, seq_lengths):
    """The sequences of packed rows, split by their seq_lengths."""
    out = []
    for row, sizes in zip(rows, seq_lengths):
        assert sum(sizes) == len(row) <= SEQ_LENGTH
        bounds = np.cumsum([0, *sizes])
        out += [tuple(row[a:b]) for a, b in pairwise(bounds)]
    return out


def test_packed_rows_hold_every_example_once_in_trls_format(tokenized):
    packed = pack_dataset(tokenized, SEQ_LENGTH)
    reference = trl.pack_dataset(tokenized, SEQ_LENGTH, strategy="bfd")
    assert packed.column_names == reference.column_names == ["input_ids", "seq_lengths"]
    assert packed.features == reference.features
    inputs = Counter(tuple(x) for x in tokenized["input_ids"])
    assert Counter(_sequences(packed["input_ids"], packed["seq_lengths"])) == inputs
    assert Counter(_sequences(reference["input_ids"], reference["seq_lengths"])) == inputs
    assert len(packed) <= len(reference)  # at least as few rows as TRL's best-fit decreasing


def test_no_cap_on_sequences_per_row_unless_asked():
    tiny = datasets.Dataset.from_dict({"input_ids": [[7, 8]] * 600})  # 1,200 tokens: one row of 600 sequences
    assert pack_dataset(tiny, 2048)["seq_lengths"] == [[2] * 600]
    capped = pack_dataset(tiny, 2048, bin_size=200)["seq_lengths"]
    assert capped == [[2] * 200] * 3


def test_every_list_column_is_packed_alike_and_the_format_is_kept(tokenized):
    labelled = tokenized.map(lambda x: {"labels": [-100] + x["input_ids"][1:]}).with_format("torch")
    packed = pack_dataset(labelled, SEQ_LENGTH, bin_size=3, seed=1)
    assert packed.format["type"] == "torch" and isinstance(packed[0]["input_ids"], torch.Tensor)
    rows = packed.with_format(None)
    assert all(len(sizes) <= 3 for sizes in rows["seq_lengths"])
    pairs = Counter(zip(_sequences(rows["input_ids"], rows["seq_lengths"]),
                        _sequences(rows["labels"], rows["seq_lengths"])))
    assert pairs == Counter((tuple(x), (-100, *x[1:])) for x in tokenized["input_ids"])


def test_bad_input_is_named():
    data = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5, 6, 7, 8]], "text": ["a", "b"]})
    with pytest.raises(TypeError, match=r"dataset\['text'\] should be a list column"):
        pack_dataset(data, 8)
    with pytest.raises(ValueError, match=r"len\(dataset\['input_ids'\]\[1\]\) should be at most seq_length=4 tokens "
                                         r"\(pass oversized='truncate' to cut it\), but got len\(dataset\['input_ids'\]\[1\]\)=5"):
        pack_dataset(data.select_columns(["input_ids"]), 4)
    cut = pack_dataset(data.select_columns(["input_ids"]), 4, oversized="truncate", algorithm="ffd")
    assert cut[:] == {"input_ids": [[4, 5, 6, 7], [1, 2, 3]], "seq_lengths": [[4], [3]]}
    empty = datasets.Dataset.from_dict({"input_ids": [[1], []]})
    with pytest.raises(ValueError, match=r"len\(dataset\['input_ids'\]\[1\]\) should be a positive sequence length"):
        pack_dataset(empty, 4)
    with pytest.raises(ValueError, match=r"dataset\['input_ids'\]\[1\] should be a list of tokens, but got"):
        pack_dataset(datasets.Dataset.from_dict({"input_ids": [[1], None]}), 4)
    uneven = datasets.Dataset.from_dict({"input_ids": [[1, 2]], "labels": [[1]]})
    with pytest.raises(ValueError, match=r"len\(dataset\['labels'\]\[0\]\) should be len\(dataset\['input_ids'\]\[0\]\)"):
        pack_dataset(uneven, 4)
    with pytest.raises(TypeError, match="dataset should be a datasets.Dataset"):
        pack_dataset([[1, 2]], 4)
    with pytest.raises(ValueError, match="seq_length should be a positive integer, but got seq_length=0"):
        pack_dataset(empty, 0)
    packed = pack_dataset(data.select_columns(["input_ids"]), 8)
    with pytest.raises(ValueError, match=r"dataset.column_names should be without 'seq_lengths' \(a packed dataset's "
                       r"column: .*, but got dataset.column_names=\['input_ids', 'seq_lengths'\]"):
        pack_dataset(packed, 16)


def test_a_dataset_of_no_rows_packs_into_no_rows_with_seq_lengths():
    # datasets' map calls no function on no rows (TRL's own pack_dataset fails on it, naming seq_lengths)
    data = datasets.Dataset.from_dict({"input_ids": [[1, 2]], "labels": [[1, 2]]}).select([]).with_format("torch")
    packed = pack_dataset(data, 4)
    assert packed.num_rows == 0 and packed.column_names == ["input_ids", "labels", "seq_lengths"]
    assert packed.format["type"] == "torch"
    with pytest.raises(TypeError, match=r"dataset\['text'\] should be a list column"):
        pack_dataset(datasets.Dataset.from_dict({"input_ids": [[1]], "text": ["a"]}).select([]), 4)


def test_sft_trainer_trains_on_the_packed_rows_every_sample_once_per_epoch(tokenized, tokenizer, tmp_path, one_thread):
    from transformers import LlamaConfig, LlamaForCausalLM

    packed = pack_dataset(tokenized, SEQ_LENGTH, seed=3)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ_LENGTH)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config)
    args = trl.SFTConfig(
        output_dir=str(tmp_path), padding_free=True, max_length=None, dataset_kwargs={"skip_prepare_dataset": True},
        per_device_train_batch_size=2, num_train_epochs=1, learning_rate=3e-3, logging_steps=1, save_strategy="no",
        report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
    )
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=packed, processing_class=tokenizer)

    # One epoch of the trainer's own batches: every input sequence exactly once, each one row of restarting positions
    seen, first = [], None
    for batch in trainer.get_train_dataloader():
        first = first or batch
        ids, positions = batch["input_ids"][0].tolist(), batch["position_ids"][0].tolist()
        starts = [i for i, p in enumerate(positions) if p == 0] + [len(ids)]
        seen += [tuple(ids[a:b]) for a, b in pairwise(starts)]
    assert Counter(seen) == Counter(tuple(x) for x in tokenized["input_ids"])

    # The sequences of a packed batch do not see each other (sdpa, on CPU): its loss is theirs, run one by one
    model.eval()
    with torch.no_grad():
        packed_loss = model(**{k: v for k, v in first.items() if k != "seq_idx"}).loss
        ids, positions = first["input_ids"][0], first["position_ids"][0]
        starts = [*torch.nonzero(positions == 0).flatten().tolist(), len(ids)]
        total = count = 0
        for a, b in pairwise(starts):
            logits = model(input_ids=ids[a:b][None]).logits[0, :-1]
            total += torch.nn.functional.cross_entropy(logits, ids[a + 1 : b], reduction="sum")
            count += b - a - 1
    assert packed_loss.item() == pytest.approx((total / count).item(), rel=1e-4)
    model.train()

    result = trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert result.global_step == len(trainer.get_train_dataloader()) == -(-len(packed) // 2)
    assert all(np.isfinite(losses)) and all(torch.isfinite(p).all() for p in model.parameters())
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.5
