"""``dynabatch.integrations.sentence_transformers``: ``encode`` equals ``model.encode``, on real MiniLM and on every
pooling mode.

The held-out texts are KJV passages past the first 10,000 with their lengths varied; the models are the real
all-MiniLM-L6-v2 and random-weight BERTs saved with MiniLM's tokenizer and assembled from sentence-transformers'
own modules. Nothing of dynabatch or sentence-transformers is mocked.
"""

import copy
import logging

import numpy as np
import pytest
import torch

from dynabatch.integrations import sentence_transformers as dst

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = 1e-5


@pytest.fixture(scope="module")
def texts():
    from dynabatch.demo import kjv_passages, vary_lengths

    return vary_lengths(kjv_passages()[10_000:], n=64, max_words=80, seed=11)


@pytest.fixture(scope="module")
def minilm():
    from sentence_transformers import SentenceTransformer

    from dynabatch.demo import minilm_path

    return SentenceTransformer(minilm_path(), device="cpu", prompts={"query": "query: "})


@pytest.mark.parametrize("normalize", [False, True])
def test_vectors_type_shape_and_dtype_equal_model_encode(minilm, texts, normalize):
    want = minilm.encode(texts, batch_size=32, normalize_embeddings=normalize)
    got = dst.encode(minilm, texts, batch_size=32, normalize_embeddings=normalize)
    assert type(got) is type(want) and got.shape == want.shape and got.dtype == want.dtype
    assert np.abs(got - want).max() < TOL
    as_tensor = dst.encode(minilm, texts, batch_size=32, normalize_embeddings=normalize, convert_to_tensor=True)
    assert isinstance(as_tensor, torch.Tensor) and as_tensor.shape == want.shape and as_tensor.dtype == torch.float32
    rows = dst.encode(minilm, texts, batch_size=32, normalize_embeddings=normalize, convert_to_numpy=False)
    assert type(rows) is list and len(rows) == len(texts) and rows[0].shape == (384,)
    assert float((torch.stack(rows) - as_tensor).abs().max()) == 0.0


def test_a_single_string_prompts_and_truncate_dim_as_model_encode(minilm, texts):
    one = dst.encode(minilm, texts[0])
    assert one.shape == (384,) and np.abs(one - minilm.encode(texts[0])).max() < TOL
    for options in ({"prompt_name": "query"}, {"prompt": "passage: "}, {"truncate_dim": 64}):
        want = minilm.encode(texts[:40], batch_size=8, **options)
        got = dst.encode(minilm, texts[:40], batch_size=8, **options)
        assert got.shape == want.shape and np.abs(got - want).max() < TOL, options
    with pytest.raises(ValueError, match=r"prompt_name should be one of the model's prompts \['document', 'query'\], but got "
                       r"prompt_name='nope'"):
        dst.encode(minilm, texts[:2], prompt_name="nope")


def test_token_embeddings_and_all_outputs_are_cut_to_each_row(minilm, texts):
    some = texts[:30]
    want = minilm.encode(some, batch_size=8, output_value="token_embeddings")
    got = dst.encode(minilm, some, batch_size=8, output_value="token_embeddings")
    assert type(got) is list and len(got) == len(some)
    for a, b in zip(got, want):  # right padding: encode's cut at the last real token is the row's tokens
        assert a.shape == b.shape and float((a - b).abs().max()) < TOL
    every = dst.encode(minilm, some, batch_size=8, output_value=None)
    assert {"token_embeddings", "sentence_embedding", "input_ids", "attention_mask"} <= set(every[0])
    alone = minilm.tokenizer(some[5], truncation=True, max_length=minilm.max_seq_length)["input_ids"]
    assert every[5]["input_ids"].tolist() == alone and every[5]["attention_mask"].all()
    assert float((every[5]["token_embeddings"] - want[5]).abs().max()) < TOL


def test_quantized_precisions_have_model_encode_type_and_values(minilm, texts):
    from sentence_transformers.util import quantize_embeddings

    floats = dst.encode(minilm, texts, batch_size=32, convert_to_tensor=True)
    want_floats = minilm.encode(texts, batch_size=32, convert_to_tensor=True)
    unquantized = dst.encode(minilm, texts, batch_size=32, convert_to_tensor=True, precision=None)  # model.encode's
    assert torch.equal(unquantized, floats) and torch.allclose(unquantized, want_floats, atol=TOL)
    for precision in ("int8", "ubinary"):
        want = minilm.encode(texts[:4], batch_size=32, precision=precision)
        got = dst.encode(minilm, texts, batch_size=32, precision=precision)
        assert got.dtype == want.dtype and got.shape[1:] == want.shape[1:] and len(got) == len(texts)
        assert np.array_equal(got, quantize_embeddings(floats, precision=precision))  # ST's own quantization
        near = quantize_embeddings(want_floats, precision=precision).astype(np.int64)
        assert np.abs(got.astype(np.int64) - near).max() <= 1  # float rounding at a bucket's edge at most


@pytest.mark.parametrize("precision", ["int8", "uint8", "binary", "ubinary"])
def test_token_embeddings_are_quantized_as_model_encode_quantizes_them(minilm, texts, precision):
    # precision was dropped for token_embeddings (float32 rows, where model.encode gives one quantized numpy array a
    # row, calibrated over every token of every row)
    some = texts[:30]
    want = minilm.encode(some, batch_size=8, output_value="token_embeddings", precision=precision)
    got = dst.encode(minilm, some, batch_size=8, output_value="token_embeddings", precision=precision)
    assert type(got) is list and len(got) == len(want)
    for a, b in zip(got, want):
        assert isinstance(a, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
        assert np.abs(a.astype(np.int64) - b.astype(np.int64)).max() <= 1  # float rounding at a bucket's edge
    one = dst.encode(minilm, some[3], output_value="token_embeddings", precision=precision)
    assert isinstance(one, np.ndarray) and one.dtype == want[3].dtype and one.shape == want[3].shape


def test_a_precision_with_output_value_none_is_refused_before_any_batch_runs(minilm, texts, monkeypatch):
    # model.encode raises once every batch ran (quantize_embeddings takes no dicts); the precision was dropped
    monkeypatch.setattr(minilm, "forward", None)  # refused before any batch runs
    with pytest.raises(ValueError, match=r"^precision should be 'float32' or None with output_value=None "
                       r"\(sentence-transformers' quantize_embeddings takes no per-row dicts: model.encode raises on "
                       r"them\), but got precision='int8'$"):
        dst.encode(minilm, texts[:4], output_value=None, precision="int8")


@pytest.mark.parametrize("mode", ["cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken"])
def test_every_pooling_mode_of_the_model_gives_model_encode_vectors(bert_dir, texts, mode):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    body = Transformer(str(bert_dir), max_seq_length=64)
    model = SentenceTransformer(modules=[body, Pooling(32, pooling_mode=mode, include_prompt=False)], device="cpu")
    for normalize in (False, True):
        want = model.encode(texts, batch_size=16, normalize_embeddings=normalize, prompt="query: ")
        got = dst.encode(model, texts, batch_size=16, normalize_embeddings=normalize, prompt="query: ")
        assert got.shape == want.shape == (len(texts), 32) and got.dtype == want.dtype
        assert np.abs(got - want).max() < TOL, (mode, normalize)


def test_make_dynamic_runs_the_model_own_encode_on_growing_batches(bert_dir, texts, caplog):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(bert_dir), device="cpu")  # a Transformer and mean pooling, from the folder
    want = model.encode(texts, batch_size=8)
    query = model.encode_query(texts[:10], batch_size=8)
    widths = []
    model[0].register_forward_hook(lambda module, args, out: widths.append(tuple(args[0]["input_ids"].shape)))
    dst.make_dynamic(model)
    got = model.encode(texts, batch_size=8)
    assert np.abs(got - want).max() < TOL
    assert len(widths) < -(-len(texts) // 8) and max(rows for rows, _ in widths) > 8  # batches grew past 8
    assert np.abs(model.encode_query(texts[:10], batch_size=8) - query).max() < TOL
    assert model.encode.original.__self__ is model
    twin = copy.deepcopy(model)  # a copy stays dynamic, on its own weights
    with torch.no_grad():
        twin[0].auto_model.embeddings.word_embeddings.weight.mul_(2.0)
    assert isinstance(twin.encode, type(model.encode)) and twin.encode.model is twin
    assert np.abs(twin.encode(texts[:4]) - twin.encode.original(texts[:4])).max() < TOL
    assert np.abs(twin.encode(texts[:4]) - got[:4]).max() > 1e-3
    with caplog.at_level(logging.WARNING, logger="dynabatch.integrations.sentence_transformers"):
        pairs = model.encode([("a question", "an answer")] * 2)  # pairs: the original encode, warned once
        model.encode([("a question", "an answer")])
    assert pairs.shape == (2, 32)
    assert [r.message for r in caplog.records] == ["model.encode runs on fixed batches here, since inputs[0] is a "
                                                   "tuple, not a str"]


def test_what_does_not_run_on_dynamic_batches_is_refused_naming_why(minilm, texts):
    with pytest.raises(ValueError, match=r"device should be None, a device, or a list of at least one device"):
        dst.encode(minilm, texts[:2], device=[])
    with pytest.raises(ValueError, match="pool should be None"):
        dst.encode(minilm, texts[:2], pool={"processes": []})
    for inputs in (texts[:2], []):  # refused, not dropped: sentence-transformers sends a worker process its chunks
        with pytest.raises(ValueError, match=r"^chunk_size should be None \(sentence-transformers' inputs sent to a "
                           r"worker process at a time; dynabatch runs no worker process: every device takes the next "
                           r"batch as it ends one, so pass no chunk_size\), but got chunk_size=16$"):
            dst.encode(minilm, inputs, device=["cpu", "cpu"], chunk_size=16)
    with pytest.raises(ValueError, match=r"precision should be one of \('float32', 'int8', 'uint8', 'binary', "
                       r"'ubinary', None\), but got precision='int4'"):
        dst.encode(minilm, texts[:2], precision="int4")
    with pytest.raises(ValueError, match=r"model should run its inputs on dynamic batches, but inputs\[1\] is a "
                       r"tuple, not a str: call model.encode for it"):
        dst.encode(minilm, ["a", ("b", "c")])
    empty = dst.encode(minilm, [])
    assert isinstance(empty, np.ndarray) and empty.size == 0


def test_a_keyword_neither_encode_nor_the_model_takes_is_refused_naming_it(minilm, texts, monkeypatch):
    # model.encode refuses it too; passed on to preprocess, it was dropped and the vectors left unnormalized
    monkeypatch.setattr(minilm, "forward", None)  # refused before any batch runs
    for inputs in (texts[:2], []):
        with pytest.raises(TypeError, match=r"encode\(\) got an unexpected keyword argument 'normalise_embeddings' "
                           r"\(did you mean 'normalize_embeddings'\?\): it is no argument of encode and no keyword of "
                           r"the model \(\['processing_kwargs', 'task'\]\); but got normalise_embeddings=True"):
            dst.encode(minilm, inputs, normalise_embeddings=True)


def test_tokenize_cores_reaches_the_loader_and_keeps_model_encode_vectors(minilm, texts, monkeypatch):
    built = []
    real = dst.build_dynamic_batch_dataloader

    def loader(*args, **kwargs):  # the real loader, its tokenize_cores noted
        built.append(kwargs.get("tokenize_cores"))
        return real(*args, **kwargs)

    monkeypatch.setattr(dst, "build_dynamic_batch_dataloader", loader)
    want = minilm.encode(texts[:40], batch_size=8)
    for cores in (1, 2, None):
        got = dst.encode(minilm, texts[:40], batch_size=8, tokenize_cores=cores)
        assert np.abs(got - want).max() < TOL, cores
    assert built == [1, 2, None]
    dynamic = dst.make_dynamic(copy.deepcopy(minilm), tokenize_cores=1)  # every call's option
    assert np.abs(dynamic.encode(texts[:40], batch_size=8) - want).max() < TOL and built[-1] == 1
    for inputs in (texts[:2], []):  # the loader's rule, before the model moves or an empty list returns
        with pytest.raises(ValueError, match=r"^tokenize_cores should be a positive integer, but got "
                           r"tokenize_cores=0$"):
            dst.encode(minilm, inputs, tokenize_cores=0)
    with pytest.raises(TypeError, match=r"^make_dynamic\(\) got unexpected keyword arguments \['cores'\]: it "
                       r"takes on_oom, memory and tokenize_cores$"):
        dst.make_dynamic(minilm, cores=1)


def test_a_list_of_devices_gives_model_encode_vectors(minilm, texts):
    expected = minilm.encode(texts[:40], batch_size=8)
    got = dst.encode(minilm, texts[:40], batch_size=8, device=["cpu", "cpu"])
    assert type(got) is type(expected) and got.shape == expected.shape and got.dtype == expected.dtype
    np.testing.assert_allclose(got, expected, atol=1e-5)


@pytest.mark.parametrize("show", [True, False])
def test_show_progress_bar_turns_the_bar_on_and_off(minilm, texts, show, capsys):
    from dynabatch.integrations.sentence_transformers import encode

    encode(minilm, texts[:8], batch_size=4, show_progress_bar=show)
    bar = "dynabatch" in capsys.readouterr().err  # tqdm writes its bar, named after the run, to stderr
    assert bar is show


def test_sentence_transformers_other_kinds_of_model_are_refused_naming_what_to_call(bert_dir, texts):
    # a SparseEncoder raised AttributeError (no truncate_dim) and, made dynamic, lost its encode; a MultiVectorEncoder
    # ran its first batch and raised KeyError 'sentence_embedding'; a CrossEncoder's texts were one "pair"
    from sentence_transformers import CrossEncoder, MultiVectorEncoder, SparseEncoder
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sparse_encoder.modules import SpladePooling

    sparse = SparseEncoder(modules=[Transformer(str(bert_dir), transformer_task="fill-mask", max_seq_length=16),
                                    SpladePooling("max")], device="cpu")
    models = (sparse, MultiVectorEncoder(modules=[Transformer(str(bert_dir), max_seq_length=16)], device="cpu"),
              CrossEncoder(str(bert_dir), device="cpu", num_labels=1))
    for model in models:
        name = type(model).__name__
        rule = (r"^model should be a sentence_transformers.SentenceTransformer \(dynabatch runs its dense sentence "
                r"embeddings; call model.encode for a SparseEncoder or a MultiVectorEncoder, model.predict or "
                rf"model.rank for a CrossEncoder\), but got model=<{name}.* of type {name}$")
        for call in (lambda: dst.encode(model, texts[:4]), lambda: dst.corpus_embedder(model),
                     lambda: dst.make_dynamic(model)):
            with pytest.raises(TypeError, match=rule):
                call()
        assert "encode" not in vars(model)  # make_dynamic left it as it was
    want = sparse.encode(texts[:4])
    assert want.is_sparse and torch.equal(sparse.encode(texts[:4]).to_dense(), want.to_dense())


def test_a_max_length_above_the_models_positions_is_refused_naming_the_setting_it_came_from(bert_dir, texts,
                                                                                            monkeypatch):
    # the loader refused it naming its own max_input_token_length, which encode takes no argument of (corpus_embedder
    # returns the limit its caller passes the loader as max_input_token_length: named so there)
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(bert_dir), device="cpu")  # 64 positions
    monkeypatch.setattr(model, "forward", None)  # refused before any batch runs
    model.max_seq_length = 100
    rule = r"should be at most 64 \(the model's config.max_position_embeddings=64 positions\), but got "
    with pytest.raises(ValueError, match=rf"^model.max_seq_length {rule}model.max_seq_length=100$"):
        dst.encode(model, texts[:4])
    model.max_seq_length = 32
    with pytest.raises(ValueError, match=rf"^processing_kwargs\['text'\]\['max_length'\] {rule}"
                       r"processing_kwargs\['text'\]\['max_length'\]=80$"):
        dst.encode(model, texts[:4], processing_kwargs={"text": {"max_length": 80}})


@pytest.mark.parametrize("length", [8, 40])
def test_a_transformer_cutting_at_its_own_max_length_gives_model_encode_vectors(bert_dir, texts, length):
    # a Transformer's processing_kwargs (or query_length, for task="query") cut rows at their own max_length, not at
    # max_seq_length=16: above it the loader refused the rows ('lengths should be at most max_input_token_length=16')
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    for setting, call in (({"processing_kwargs": {"text": {"max_length": length}}}, {}),
                          ({"query_length": length}, {"task": "query"})):
        body = Transformer(str(bert_dir), max_seq_length=16, **setting)
        model = SentenceTransformer(modules=[body, Pooling(32, pooling_mode="mean")], device="cpu")
        want = model.encode(texts, batch_size=64, **call)
        got = dst.encode(model, texts, batch_size=8, **call)
        assert np.abs(got - want).max() < TOL, setting
        if not call:
            assert dst.corpus_embedder(model)[1] == length
