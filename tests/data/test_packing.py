import numpy as np
import pytest
import torch
from transformers import (
    DataCollatorWithFlattening,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

from dynabatch.data.packing import PackedCollator, PackedDataset, packed_dataloader
from dynabatch.sampling.multipack import MultipackBatchSampler

VOCAB = 97


def _sequences(n, seed=0, low=2, high=24):
    rng = np.random.default_rng(seed)
    return [{"input_ids": rng.integers(1, VOCAB, size=int(k)).tolist()} for k in rng.integers(low, high, size=n)]


@pytest.mark.parametrize("with_labels", [False, True])
def test_matches_transformers_flattening_collator(with_labels):
    examples = [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}, {"input_ids": [6, 7, 8, 9]}]
    if with_labels:
        examples = [{**e, "labels": [-100] + e["input_ids"][1:-1] + [-100]} for e in examples]
    ours = PackedCollator()(examples)  # a flat list of examples is one bin, as transformers takes it
    theirs = DataCollatorWithFlattening(return_flash_attn_kwargs=True)(examples)
    for key in ("input_ids", "labels", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k"):
        assert ours[key].tolist() == theirs[key].tolist(), key
        assert ours[key].dtype == theirs[key].dtype, key
    assert ours["max_length_q"] == theirs["max_length_q"] == ours["max_length_k"] == 4


def test_rows_padding_and_hf_dataset_bins():
    from datasets import Dataset

    data = Dataset.from_list([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}, {"input_ids": [6]}])
    batch = PackedCollator(pad_token_id=0, block_mask="bool", pad_to_multiple_of=4)([data[[0, 1]], data[[2]]])
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5, 0, 0, 0], [6, 0, 0, 0, 0, 0, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 2, 3, -100, 5, -100, -100, -100], [-100] * 8]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2], [0, 0, 1, 2, 3, 4, 5, 6]]
    assert batch["cu_seq_lens_k"].tolist() == [0, 3, 5, 8, 9, 16]
    mask = batch["attention_mask"]
    assert mask.shape == (2, 1, 8, 8) and mask.dtype == torch.bool
    assert mask[0, 0, 4].tolist() == [False, False, False, True, True, False, False, False]
    assert mask[0, 0, 2].tolist() == [True, True, True, False, False, False, False, False]


def test_truncation_and_bad_input():
    batch = PackedCollator(max_length=3)([[{"input_ids": [1, 2, 3, 4, 5], "labels": [9, 8, 7, 6, 5]}]])
    assert batch["input_ids"].tolist() == [[1, 2, 3]] and batch["labels"].tolist() == [[-100, 8, 7]]
    with pytest.raises(ValueError, match="block_mask should be None, 'float' or 'bool', but got block_mask='4d'"):
        PackedCollator(block_mask="4d")
    with pytest.raises(ValueError, match=r"features\[0\]\[0\]\['labels'\] should be as long as its input_ids \(2\)"):
        PackedCollator()([[{"input_ids": [1, 2], "labels": [1]}]])
    # a padded example's masked tokens would be packed as real ones, attended to and trained on
    padded = {"input_ids": [5, 6, 0, 0], "attention_mask": [1, 1, 0, 0]}
    with pytest.raises(ValueError, match=r"features\[0\]\[1\]\['attention_mask'\] should be all ones .*"
                                         r"tokenize without padding.*but got .*2 zeros"):
        PackedCollator()([[{"input_ids": [1, 2]}, padded]])
    with pytest.raises(ValueError, match=r"features\[0\]\[0\]\['attention_mask'\] should be all ones"):
        PackedCollator()([{k: [v] for k, v in padded.items()}])  # a bin as a dict of lists
    unpadded = PackedCollator()([[{"input_ids": [1, 2], "attention_mask": [1, 1]}]])
    assert unpadded["input_ids"].tolist() == [[1, 2]]
    with pytest.raises(TypeError, match=r"features\[1\] should be a bin"):
        PackedCollator()([[{"input_ids": [1]}], 5])
    with pytest.raises(TypeError, match="features should be a non-empty list of bins"):
        PackedCollator()([])


def _model(kind, attn):
    torch.manual_seed(0)
    if kind == "llama":
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
        model = LlamaForCausalLM(config)
    else:
        config = GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256)
        model = GPT2LMHeadModel(config)
    model.config._attn_implementation = attn  # the same weights under both backends
    return model.eval()


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize(("attn", "block_mask"), [("eager", "float"), ("sdpa", "float"), ("sdpa", "bool")])
def test_packed_logits_and_loss_equal_unpacked(one_thread, kind, attn, block_mask):
    model = _model(kind, attn)
    examples = _sequences(14, seed=1)
    lengths = np.array([len(e["input_ids"]) for e in examples])
    sampler = MultipackBatchSampler(list(range(len(examples))), 3, 48, lengths, drop_last=False)
    collate = PackedCollator(pad_token_id=0, block_mask=block_mask)
    loader = packed_dataloader(examples, sampler, collate)
    worst, sums, targets = 0.0, 0.0, 0
    with torch.no_grad():
        alone = {}
        for i, e in enumerate(examples):
            ids = torch.tensor([e["input_ids"]])
            out = model(input_ids=ids, labels=ids)
            alone[i] = out.logits[0]
            sums += out.loss.item() * (ids.shape[1] - 1)
            targets += ids.shape[1] - 1
        packed_losses = []
        for bins, batch in zip(sampler, loader):
            inputs = {k: batch[k] for k in ("input_ids", "position_ids", "labels")}
            if "attention_mask" in batch:
                inputs["attention_mask"] = batch["attention_mask"]
            out = model(**inputs)
            packed_losses.append((out.loss.item(), int(batch["labels"][:, 1:].ne(-100).sum())))
            for r, b in enumerate(bins):
                at = 0
                for i in b:
                    n = lengths[i]
                    worst = max(worst, (out.logits[r, at : at + n] - alone[i]).abs().max().item())
                    at += n
    assert worst < 1e-5
    # the packed loss is the mean over real targets; over all batches, the token mean of the sequences
    packed_mean = sum(loss * n for loss, n in packed_losses) / sum(n for _, n in packed_losses)
    assert sum(n for _, n in packed_losses) == targets
    assert packed_mean == pytest.approx(sums / targets, abs=1e-5)


def test_packed_dataset_gives_bins_and_items():
    data = PackedDataset([{"input_ids": [1]}, {"input_ids": [2, 3]}])
    assert data[[1, 0]] == [{"input_ids": [2, 3]}, {"input_ids": [1]}]
    assert data[torch.tensor(1)] == {"input_ids": [2, 3]} and len(data) == 2
    with pytest.raises(TypeError, match="dataset should be an indexable dataset with a length"):
        PackedDataset(5)


# --------------------------------------------------------------------------- whether a model keeps packed rows apart


def _tiny_causal_lm(family, attention):
    """A random-weight one-layer causal LM of ``family`` with ``attention``, cache off as the HF Trainer sets it."""
    import transformers

    common = {"vocab_size": VOCAB, "use_cache": False}
    decoder = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
    configs = {
        "llama": ("LlamaForCausalLM", "LlamaConfig", {**decoder, "num_key_value_heads": 1}),
        "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", {**decoder, "num_key_value_heads": 1}),
        "mistral": ("MistralForCausalLM", "MistralConfig", {**decoder, "num_key_value_heads": 1}),
        "gpt_neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig", {**decoder, "max_position_embeddings": 64}),
        "gpt2": ("GPT2LMHeadModel", "GPT2Config", {"n_embd": 32, "n_layer": 1, "n_head": 2, "n_positions": 64}),
        "opt": ("OPTForCausalLM", "OPTConfig", {"hidden_size": 32, "ffn_dim": 64, "num_hidden_layers": 1,
                                                "num_attention_heads": 2, "word_embed_proj_dim": 32,
                                                "max_position_embeddings": 64}),
        "bloom": ("BloomForCausalLM", "BloomConfig", {"hidden_size": 32, "n_layer": 1, "n_head": 2}),
    }
    model_class, config_class, settings = configs[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**common, **settings, attn_implementation=attention)
    return getattr(transformers, model_class)(config)


# Bloom has eager attention only. These random weights move a packed sequence's logits by 0.05 (OPT) and 1.4e-3
# (Bloom; in bf16 2e-3, one rounding step) when the sequence before it changes; the others keep them bit for bit.
_FAMILIES = [(family, attention, "float32", keeps_apart)
             for family, keeps_apart in (("llama", True), ("qwen2", True), ("mistral", True), ("gpt2", True),
                                         ("gpt_neox", True), ("opt", False), ("bloom", False))
             for attention in ("sdpa", "eager") if (family, attention) != ("bloom", "sdpa")]
_FAMILIES += [("llama", "sdpa", "bfloat16", True), ("bloom", "eager", "bfloat16", False)]


@pytest.mark.parametrize(("family", "attention", "dtype", "keeps_apart"), _FAMILIES)
def test_check_sequences_apart_tells_the_models_that_keep_packed_sequences_apart(family, attention, dtype,
                                                                               keeps_apart):
    model = _tiny_causal_lm(family, attention).to(getattr(torch, dtype))
    name = type(model).__name__
    if keeps_apart:
        PackedCollator().check_sequences_apart(model)
    else:
        with pytest.raises(ValueError, match=rf"^block_mask should be 'float' \(eager or sdpa attention\) or 'bool' "
                                             rf"\(sdpa\) for {name}: without a block mask the sequences packed into "
                                             r"one row would attend to each other \(the logits of a packed sequence "
                                             r"moved by [0-9.e-]+ when the sequence before it in the row changed\)\. "
                                             r"Pass PackedCollator\(block_mask='float'\) .*flash_attention_2.*or do "
                                             r"not pack, but got block_mask=None$"):
            PackedCollator().check_sequences_apart(model)


def test_check_sequences_apart_restores_the_mode_and_names_a_cache_as_the_cause():
    model = _tiny_causal_lm("llama", "sdpa").train()
    model.model.norm.eval()  # a submodule the user put in eval mode stays so
    PackedCollator(max_length=4, pad_to_multiple_of=16).check_sequences_apart(model)  # rows of 4 + 4 + padding
    assert model.training and model.model.layers[0].training and not model.model.norm.training
    # Built with a cache, Llama's mask no longer splits the row at its restarting position_ids
    model.config.use_cache = True
    with pytest.raises(ValueError, match=r"for LlamaForCausalLM: .*; its config has use_cache=True, and transformers "
                                         r"splits a row .*: set model.config.use_cache = False, as the HF Trainer"):
        PackedCollator().check_sequences_apart(model)
    assert model.training and model.model.layers[0].training and not model.model.norm.training
    with pytest.raises(TypeError, match=r"^model should be a model with get_input_embeddings\(\) or "
                                        r"config.vocab_size .*but got model=.*Linear"):
        PackedCollator().check_sequences_apart(torch.nn.Linear(2, 2))


def test_a_block_mask_keeps_packed_sequences_apart_without_a_check():
    model = _tiny_causal_lm("opt", "sdpa").eval()
    forwards = []
    model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    collate = PackedCollator(block_mask="float")
    collate.check_sequences_apart(model)
    assert forwards == []  # nothing to check: the mask keeps them apart
    shared = [5, 6, 7]
    with torch.no_grad():
        logits = [model(**{k: v for k, v in collate([[{"input_ids": first}, {"input_ids": shared}]]).items()
                           if k != "labels"}).logits[0, 3:]
                  for first in ([1, 2, 3], [8, 9, 10])]
    assert torch.equal(logits[0], logits[1])
