"""Real tokenizer, real (small) models: dynabatch's batches give what running each text alone gives.

Outputs are collected per batch, put back in input order with ``restore_order``,
and compared row by row with the same model run on one text at a time (no
padding at all), so a wrong row order, a wrong padding side, a wrong attention
mask or a planning/collating mismatch in shapes shows up as a difference.
"""

import copy

import pytest
import torch

from dynabatch import build_dynamic_batch_dataloader, restore_order

MAX_LEN = 64
NEW_TOKENS = 5


pytestmark = pytest.mark.usefixtures("one_thread")


def _texts(n, max_words, seed):
    from dynabatch.demo import kjv_passages, vary_lengths

    texts = vary_lengths(kjv_passages(), n=n, max_words=max_words, seed=seed)
    return texts + [texts[0], ""]  # a duplicate and an empty string


def _alone(tokenizer, text, **kwargs):
    return tokenizer(text, truncation=True, max_length=MAX_LEN, return_tensors="pt", **kwargs)


# --- 1. MiniLM forward, real weights ----------------------------------------------------------------


def test_minilm_embeddings_equal_running_each_text_alone(tokenizer):
    from transformers import AutoModel

    from dynabatch.demo import minilm_path

    model = AutoModel.from_pretrained(minilm_path()).eval()
    texts = _texts(60, 80, seed=1)
    loader = build_dynamic_batch_dataloader(texts, tokenizer, batch_size=4, max_input_token_length=MAX_LEN,
                                            num_workers=0)
    cls, mean, indices, widths = [], [], [], []
    with torch.no_grad():
        for batch in loader:
            hidden = model(**batch).last_hidden_state  # the batch goes in as it is
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            cls.append(hidden[:, 0])
            mean.append((hidden * mask).sum(1) / mask.sum(1))
            indices.append(batch.indices)
            widths.append(hidden.shape[1])
        assert len(indices) > 3 and max(widths) == MAX_LEN and min(widths) < MAX_LEN // 2
        cls, mean = restore_order(cls, indices), restore_order(mean, indices)
        assert len(cls) == len(mean) == len(texts)
        for p, text in enumerate(texts):
            alone = model(**_alone(tokenizer, text)).last_hidden_state[0]
            torch.testing.assert_close(cls[p], alone[0], atol=1e-4, rtol=0, msg=lambda m: f"text {p}: {m}")
            torch.testing.assert_close(mean[p], alone.mean(0), atol=1e-4, rtol=0, msg=lambda m: f"text {p}: {m}")
    # The duplicate gets the same vector as its original, at its own position.
    torch.testing.assert_close(cls[len(texts) - 2], cls[0], atol=1e-4, rtol=0)


# --- 2. encoder-decoder, random weights, right padding ----------------------------------------------


@pytest.fixture(scope="module")
def marian():
    from transformers import MarianConfig, MarianMTModel

    config = MarianConfig(
        vocab_size=30522, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=128,
        pad_token_id=0, decoder_start_token_id=0, eos_token_id=102,
        # With the default init (std 0.02) a 1-layer random model generates the same tokens for every input,
        # which would make the comparison blind to row order; std 1.0 makes the output depend on the input.
        init_std=1.0,
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return MarianMTModel(config).eval()


def test_encoder_decoder_generation_equals_generating_each_text_alone(tokenizer, marian):
    assert tokenizer.padding_side == "right"
    texts = _texts(40, 60, seed=3)
    # A Marian tokenizer gives no token_type_ids, and generate refuses unused keys: drop them at tokenization.
    loader = build_dynamic_batch_dataloader(texts, tokenizer, batch_size=4, max_input_token_length=MAX_LEN,
                                            num_workers=0, return_token_type_ids=False)
    generated, encoded, indices = [], [], []
    with torch.no_grad():
        for batch in loader:
            assert sorted(batch) == ["attention_mask", "input_ids"]
            out = marian.generate(**batch, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
            assert out.shape == (len(batch.indices), 1 + NEW_TOKENS)
            generated.append(out)
            hidden = marian.get_encoder()(**batch).last_hidden_state
            encoded.append([h[m.bool()] for h, m in zip(hidden, batch["attention_mask"])])  # real tokens only
            start = torch.zeros(len(batch.indices), 1, dtype=torch.long)
            assert marian(**batch, decoder_input_ids=start).logits.shape == (len(batch.indices), 1, 30522)
            indices.append(batch.indices)
        assert len(indices) > 3
        generated, encoded = restore_order(generated, indices), restore_order(encoded, indices)
        assert len({tuple(g.tolist()) for g in generated}) > len(texts) // 2  # outputs depend on the input
        for p, text in enumerate(texts):
            inputs = _alone(tokenizer, text, return_token_type_ids=False)
            alone = marian.generate(**inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)[0]
            # min_new_tokens == max_new_tokens: no row stops early, so no row is padded at the end.
            assert generated[p].tolist() == alone.tolist(), f"text {p}: {text!r}"
            torch.testing.assert_close(encoded[p], marian.get_encoder()(**inputs).last_hidden_state[0], atol=1e-5,
                                       rtol=0)


# --- 3. decoder-only, random weights, left padding --------------------------------------------------


@pytest.fixture(scope="module")
def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=30522, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=101, eos_token_id=102,
        # Eager attention adds the dtype's minimum to masked scores, so padded keys get a weight of exactly 0 in
        # fp32; generate derives position ids from the attention mask, so left padding shifts no position.
        attn_implementation="eager",
        initializer_range=0.3,  # larger than the default 0.02, so the continuation depends on the whole input
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return LlamaForCausalLM(config).eval()


def test_decoder_only_generation_with_left_padding_equals_generating_each_text_alone(tokenizer, llama):
    left = copy.deepcopy(tokenizer)
    left.padding_side = "left"
    texts = _texts(40, 60, seed=4)
    loader = build_dynamic_batch_dataloader(texts, left, batch_size=4, max_input_token_length=MAX_LEN,
                                            num_workers=0, return_token_type_ids=False)
    continuations, indices = [], []
    with torch.no_grad():
        for batch in loader:
            assert sorted(batch) == ["attention_mask", "input_ids"]
            mask = batch["attention_mask"]
            assert bool(mask[:, -1].all())  # left padding: every row ends at the last column
            width = batch["input_ids"].shape[1]
            assert llama(**batch).logits.shape == (len(batch.indices), width, 30522)
            out = llama.generate(**batch, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
            assert torch.equal(out[:, :width], batch["input_ids"])
            continuations.append(out[:, width:])
            indices.append(batch.indices)
        assert len(indices) > 3
        continuations = restore_order(continuations, indices)
        assert len({tuple(c.tolist()) for c in continuations}) > len(texts) // 2  # outputs depend on the input
        for p, text in enumerate(texts):
            inputs = _alone(left, text, return_token_type_ids=False)
            alone = llama.generate(**inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
            assert continuations[p].tolist() == alone[0, inputs["input_ids"].shape[1] :].tolist(), f"text {p}: {text!r}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_that_runs_out_of_memory_every_row_equals_the_run_with_memory_to_spare():
    # A real encoder on CUDA whose call also takes scratch memory in proportion to its padded cells; the process is
    # capped (set_per_process_memory_fraction) so that the first batches run out of CUDA memory for real. run splits
    # them, learns the limit, and every row equals the uncapped run's, in input order. Repository assets only: the
    # GPU machine has no PyPI demo assets.
    import gzip
    from pathlib import Path

    from transformers import AutoTokenizer, BertConfig, BertModel

    from dynabatch import run

    assets = Path(__file__).resolve().parents[1] / "benchmarks" / "assets"
    tokenizer = AutoTokenizer.from_pretrained(assets / "kjv-wordpiece")
    with gzip.open(assets / "kjv.txt.gz", "rt", encoding="utf-8") as f:
        texts = [next(f).strip() for _ in range(80)]
    torch.manual_seed(0)
    model = BertModel(BertConfig(vocab_size=len(tokenizer), hidden_size=96, num_hidden_layers=2, num_attention_heads=2,
                                 intermediate_size=128, max_position_embeddings=128)).cuda().eval()
    scratch_per_cell = 2**19  # 512 KiB a padded cell: 16 rows x 64 tokens take 512 MiB

    def fn(batch):
        scratch = torch.empty(batch["input_ids"].numel() * scratch_per_cell, dtype=torch.uint8, device="cuda")
        del scratch
        return model(**batch).last_hidden_state[:, 0]

    def embed():
        loader = build_dynamic_batch_dataloader(texts, tokenizer, 16, 64, num_workers=0, progress=False)
        with torch.inference_mode():
            return run(fn, loader, device="cuda", progress=False)

    spare = embed()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + 2**28) / total)  # 256 MiB to spare
    try:
        capped = embed()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert capped.report.oom_events > 0 and len(capped) == len(spare) == len(texts)
    for a, b in zip(capped, spare):
        assert torch.allclose(a, b, atol=1e-4)
