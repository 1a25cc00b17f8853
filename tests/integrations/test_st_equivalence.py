"""sentence-transformers equivalence as a property: every way dynabatch runs a sentence-transformers model gives
``SentenceTransformer(folder).encode``'s vectors, at cosine >= 0.9999 on every text.

The ways (``PATHS``): ``dynabatch embed`` (the command, in this process), ``corpus_embedder`` with a list loader and
with a streaming one, and ``integrations.sentence_transformers.encode``. The models (``CASES``): the tiny
random-weight BERT saved as sentence-transformers folders over every ``Pooling`` mode, ``include_prompt`` true and
false (the instruction-model setting, where the prompt's tokens are left out of pooling), a default prompt, a prompt
by name and a prompt string, Dense, Normalize, and an edited max length; texts of 1 to 60 words, most longer than the
max length. Each way also runs on both sides of every threshold of the library (``THRESHOLDS``: tokenizing on the
calling thread alone or joined by worker processes, one streaming chunk or many, a list loader or a streaming one, one
batch or many), at thresholds lowered to a few dozen texts (each cell says which side it ran on) and, for the costly
ones, at the library's own values.
"""

from __future__ import annotations

import functools
import os
import time

import numpy as np
import pyarrow.dataset as ds
import pytest
import torch

import dynabatch
from dynabatch.cli import main
from dynabatch.data import streaming, tokenization, workers
from dynabatch.inference import loader as loader_module
from dynabatch.integrations import sentence_transformers as dst

pytestmark = pytest.mark.usefixtures("one_thread")

BAR = 0.9999
SLOW = pytest.mark.slow
PROMPTS = {"query": "query: represent this question for retrieving passages ", "document": "passage: "}
INSTRUCTION = {"include_prompt": False, "prompts": PROMPTS, "default_prompt_name": "query"}

# (folder's modules, the call's settings): every Pooling mode, include_prompt both ways, every kind of prompt, Dense,
# Normalize (the module and the call's), and an edited max length.
CASES = {
    "mean-instruction": ({"pooling": "mean", **INSTRUCTION}, {}),
    "cls-instruction-prompt-name": ({"pooling": "cls", **INSTRUCTION}, {"prompt_name": "document"}),
    "max-instruction-dense-normalize": ({"pooling": "max", "dense": True, "normalize": True, **INSTRUCTION}, {}),
    "weightedmean-prompt-string": ({"pooling": "weightedmean", "include_prompt": False, "prompts": PROMPTS},
                                   {"prompt": "Represent this sentence for searching relevant passages: "}),
    # 20: the query prompt and the special tokens take 12, so every text keeps 8 (at 12 it kept none: each vector the
    # same, which the command now refuses)
    "lasttoken-instruction-max-length": ({"pooling": "lasttoken", **INSTRUCTION}, {"max_length": 20}),
    "sqrt-instruction-dense": ({"pooling": "mean_sqrt_len_tokens", "dense": True, **INSTRUCTION},
                               {"prompt_name": "query", "normalize": True}),
    "mean-prompt-included": ({"pooling": "mean", "include_prompt": True, "prompts": PROMPTS,
                              "default_prompt_name": "query"}, {"normalize": True}),
    "cls-no-prompt-normalize-max-length": ({"pooling": "cls", "normalize": True}, {"max_length": 12}),
}
PATHS = ("cli", "embedder-list", "embedder-stream", "encode")


@pytest.fixture(scope="module")
def corpus():
    """2,100 texts of 1 to 60 words (most longer than a max length of 16 tokens)."""
    from dynabatch.demo import kjv_passages, vary_lengths

    return vary_lengths(kjv_passages()[10_000:], n=2_100, max_words=60, seed=5)


@pytest.fixture(scope="module")
def loaded():
    """``loaded(folder, max_length)``: the folder's ``SentenceTransformer`` on the CPU (its max length edited), once."""
    from sentence_transformers import SentenceTransformer

    models = {}

    def load(folder, max_length):
        if (folder, max_length) not in models:
            model = SentenceTransformer(str(folder), device="cpu")
            if max_length is not None:
                model.max_seq_length = max_length
            models[folder, max_length] = model
        return models[folder, max_length]

    return load


def _by_encode(model, folder, texts, call, batch_size, tmp_path):
    return dst.encode(model, texts, batch_size=batch_size, prompt_name=call.get("prompt_name"),
                      prompt=call.get("prompt"), normalize_embeddings=call.get("normalize", False))


def _by_embedder(stream):
    def embed(model, folder, texts, call, batch_size, tmp_path):
        tokenizer, limit, make_fn = dst.corpus_embedder(model, prompt_name=call.get("prompt_name"),
                                                        prompt=call.get("prompt"),
                                                        normalize_embeddings=call.get("normalize", False))
        loader = dynabatch.build_dynamic_batch_dataloader(texts, tokenizer, batch_size, limit, num_workers=0,
                                                          progress=False, stream=stream)
        return dynabatch.run(make_fn(model.device), loader, token_outputs="whole", progress=False).numpy()

    return embed


def _by_cli(model, folder, texts, call, batch_size, tmp_path):
    (tmp_path / "docs.txt").write_text("\n".join(texts) + "\n", encoding="utf-8")
    out = tmp_path / "store"
    argv = ["embed", str(tmp_path / "docs.txt"), str(out), "--model", str(folder), "--batch-size", str(batch_size),
            "--no-progress"]
    for key, flag in (("prompt_name", "--prompt-name"), ("prompt", "--prompt"), ("max_length", "--max-length")):
        if call.get(key) is not None:
            argv += [flag, str(call[key])]
    argv += ["--normalize"] if call.get("normalize") else []
    assert main(argv) == 0
    table = ds.dataset(out).to_table().sort_by("position")
    assert table.column("position").to_pylist() == list(range(len(texts)))
    return np.stack(table.column("output").to_numpy(zero_copy_only=False))


RUNS = {"cli": _by_cli, "embedder-list": _by_embedder(False), "embedder-stream": _by_embedder(True),
        "encode": _by_encode}


def _equivalent(st_model_folder, loaded, path, case, texts, tmp_path, batch_size=8, seen=None):
    """Runs ``texts`` the ``path`` way on the ``case``'s model, and checks every vector against ``model.encode``'s
    (``seen``, when given, records that run alone)."""
    modules, call = CASES[case]
    folder = st_model_folder(**modules)
    model = loaded(folder, call.get("max_length"))
    want = model.encode(texts, batch_size=32, prompt_name=call.get("prompt_name"), prompt=call.get("prompt"),
                        normalize_embeddings=call.get("normalize", False))
    if seen is not None:
        seen.update(calls=[], streams=0, batches=[], pieces=[])
    got = RUNS[path](model, folder, texts, call, batch_size, tmp_path)
    assert got.shape == want.shape, (path, case)
    cosines = torch.nn.functional.cosine_similarity(torch.tensor(got), torch.tensor(want), dim=-1)
    assert float(cosines.min()) >= BAR, (path, case, int(cosines.argmin()), float(cosines.min()))
    return model


# The command costs a few seconds a run: the default run takes it on the models that differ in how it passes them on
# (a default prompt left out of pooling, --max-length, --prompt-name with --normalize); CI runs every cell (slow).
QUICK_CLI = ("mean-instruction", "lasttoken-instruction-max-length", "sqrt-instruction-dense")


@pytest.mark.parametrize(("case", "path"), [
    pytest.param(case, path, marks=[SLOW] if path == "cli" and case not in QUICK_CLI else [])
    for case in CASES for path in PATHS])
def test_every_way_gives_model_encode_vectors_for_every_model(st_model_folder, loaded, corpus, tmp_path, path, case):
    texts = corpus[:40]
    model = _equivalent(st_model_folder, loaded, path, case, texts, tmp_path)
    lengths = [len(model.tokenizer(t)["input_ids"]) for t in texts]
    assert sum(n > model.max_seq_length for n in lengths) >= len(texts) // 4 and min(lengths) < model.max_seq_length


_HERE: list[list[int]] = []  # per call shared by pieces: the calls and texts the calling process tokenized
_WORKERS_WAIT = 60.0  # seconds the calling thread waits at most for a worker's first piece (see _tokenize_piece)


def _tokenize_piece(function, caller, marks, wait, state, piece):
    """``function(state, piece)``, marked by whoever ran it: the calling process counts it in ``_HERE``, a worker
    process leaves a file in ``marks`` (named with the piece's texts) once it tokenized the piece. With ``wait``, the calling thread past a call's
    first piece waits for a worker's file first: the workers then tokenize pieces whatever their start costs (a fork,
    the tokenizer unpickled) on a busy machine, where the calling thread would otherwise tokenize every piece before a
    worker answers (it takes over the piece of a worker that has not answered yet: the library's rule)."""
    if os.getpid() != caller:
        out = function(state, piece)
        (marks / f"{os.getpid()}-{time.monotonic_ns()}-{len(piece)}").touch()
        return out
    _HERE[-1][0] += 1
    _HERE[-1][1] += len(piece)
    deadline = time.monotonic() + _WORKERS_WAIT
    while wait and _HERE[-1][0] > 1 and not any(marks.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return function(state, piece)


@pytest.fixture
def seen(monkeypatch, tmp_path):
    """What each run did: its tokenizer calls (texts and mechanism), whether it streamed, its batches' rows, and per
    call shared by pieces (``workers.Pieces``) its pieces, their texts, and the texts the calling process and worker
    processes tokenized (``wait_for_workers``: see ``_tokenize_piece``)."""
    from sentence_transformers import SentenceTransformer

    record = {}
    call, forward, stream = tokenization.ParallelTokenizer.__call__, SentenceTransformer.forward, streaming.TokenStream

    def tokenize(self, items, **kwargs):
        before = self.mechanisms.copy()
        out = call(self, items, **kwargs)
        record.setdefault("calls", []).append((len(items), *(self.mechanisms - before)))
        return out

    def forward_counted(self, features, *args, **kwargs):
        record.setdefault("batches", []).append(int(features["input_ids"].shape[0]))
        return forward(self, features, *args, **kwargs)

    class Counted(stream):
        def __init__(self, *args, **kwargs):
            record["streams"] = record.get("streams", 0) + 1
            super().__init__(*args, **kwargs)

    marks = tmp_path / "pieces-by-workers"
    marks.mkdir()

    class CountedPieces(workers.Pieces):  # its function travels to the workers pickled: a top-level one, by name
        def __init__(self, function, state, pieces, **kwargs):
            wait = record.get("wait_for_workers", False)
            super().__init__(functools.partial(_tokenize_piece, function, os.getpid(), marks, wait), state, pieces,
                             **kwargs)

        def __iter__(self):
            _HERE.append([0, 0])
            before = set(marks.iterdir())
            yield from super().__iter__()
            by_workers = sum(int(mark.name.rsplit("-", 1)[1]) for mark in set(marks.iterdir()) - before)
            record.setdefault("pieces", []).append((len(self.pieces), sum(map(len, self.pieces)), _HERE[-1][1],
                                                    by_workers))

    monkeypatch.setattr(tokenization.ParallelTokenizer, "__call__", tokenize)
    monkeypatch.setattr(tokenization, "Pieces", CountedPieces)
    monkeypatch.setattr(SentenceTransformer, "forward", forward_counted)
    monkeypatch.setattr(loader_module, "TokenStream", Counted)
    return record


def _needs_two_cores():
    if workers.available_cores() < 2:
        pytest.skip("worker processes tokenize on two cores or more")


WORKER_TEXTS = 96  # six pieces of 16 texts: the first timed on the calling thread, five to share


def _cost_rule_side(monkeypatch, seen, side):
    """Worker processes join a call where the rest of it, at its first piece's speed, would take one thread at least
    ``workers.POOL_MIN_SECONDS``, and that first piece kept no more than one core and a half busy. With
    ``TOKENIZERS_PARALLELISM=false`` the tokenizer's own threads stay off (the first piece keeps one core busy), so the
    seconds decide: never below (infinite), always above (zero)."""
    monkeypatch.setenv(workers.ENV_VARIABLE, "false")
    monkeypatch.setattr(workers, "POOL_MIN_SECONDS", 0.0 if side == "above" else float("inf"))
    seen["wait_for_workers"] = side == "above"


# threshold: (the paths it applies to, {module attribute: lowered value}, texts below, texts above); the worker
# processes' rule weighs seconds, not texts: its sides are settings of the same texts (_cost_rule_side).
THRESHOLDS = {
    "worker-processes": (PATHS, {}, WORKER_TEXTS, WORKER_TEXTS),
    "streaming-chunks": (("cli", "embedder-stream"), {(streaming, "FIRST_CHUNK"): 32, (streaming, "CHUNK_SIZE"): 32},
                         32, 33),
    "stream-above": (("encode",), {(loader_module, "STREAM_ABOVE"): 40}, 40, 41),
    "batches": (PATHS, {}, 8, 9),
}
# The command's sides that other default cells take already (one worker mechanism, one chunk, many batches) are slow.
SLOW_CLI = {("worker-processes", "below"), ("streaming-chunks", "below"), ("batches", "above")}
CELLS = [pytest.param(name, path, side, marks=[SLOW] if path == "cli" and (name, side) in SLOW_CLI else [])
         for name, (paths, _, _, _) in THRESHOLDS.items() for path in paths for side in ("below", "above")]


def _check_side(name, side, seen, n):
    above = side == "above"
    if name == "worker-processes":
        assert {mechanism for _, mechanism in seen["calls"]} == ({"processes"} if above else {"one"}), seen["calls"]
        pieces, texts, here, by_workers = (sum(counts) for counts in zip(*seen["pieces"]))  # texts, each once at least
        assert pieces > 1 and here + by_workers >= texts and (by_workers > 0) == above, seen["pieces"]
    elif name == "streaming-chunks":
        assert len(seen["calls"]) == (2 if above else 1), seen["calls"]
    elif name == "stream-above":
        assert seen["streams"] == int(above)
    else:
        assert sum(seen["batches"]) == n and (len(seen["batches"]) > 1) == above, seen["batches"]


@pytest.mark.parametrize(("name", "path", "side"), CELLS)
def test_every_way_gives_model_encode_vectors_on_both_sides_of_every_threshold(
        st_model_folder, loaded, corpus, tmp_path, monkeypatch, seen, name, path, side):
    _, lowered, below, above = THRESHOLDS[name]
    if name == "worker-processes":
        _needs_two_cores()
        _cost_rule_side(monkeypatch, seen, side)
    for (module, attribute), value in lowered.items():
        monkeypatch.setattr(module, attribute, value)
    n = above if side == "above" else below
    _equivalent(st_model_folder, loaded, path, "mean-instruction", corpus[-n:], tmp_path, seen=seen)
    _check_side(name, side, seen, n)


@SLOW
def test_many_streaming_chunks_at_the_library_chunk_size_give_model_encode_vectors(st_model_folder, loaded, corpus,
                                                                                  tmp_path, seen):
    texts = corpus[: streaming.FIRST_CHUNK + 1]
    _equivalent(st_model_folder, loaded, "embedder-stream", "mean-instruction", texts, tmp_path, batch_size=32,
                seen=seen)
    assert [n for n, _ in seen["calls"]] == [streaming.FIRST_CHUNK, 1]


@SLOW
def test_encode_streaming_above_the_library_threshold_gives_model_encode_vectors(st_model_folder, loaded, tmp_path,
                                                                                 seen):
    from dynabatch.demo import kjv_passages, vary_lengths

    texts = vary_lengths(kjv_passages(), n=loader_module.STREAM_ABOVE + 1, max_words=30, seed=7)
    _equivalent(st_model_folder, loaded, "encode", "mean-instruction", texts, tmp_path, batch_size=64, seen=seen)
    assert seen["streams"] == 1 and len(seen["calls"]) > 1


class _Widths:
    """A preprocess whose value besides rows differs per batch (its widest row): no value the model call can share."""

    def __init__(self, model, after=0):
        self.model, self.after, self.calls = model, after, 0

    def __call__(self, texts, **kwargs):
        out = self.original(texts, **kwargs)
        self.calls += 1
        if self.calls > self.after:
            out["widest"] = max(map(len, out["input_ids"]))
        return out


def test_a_value_besides_rows_that_differs_per_batch_is_refused_naming_it(st_model_folder, corpus, monkeypatch):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(st_model_folder(pooling="mean", **INSTRUCTION)), device="cpu")
    widths = _Widths(model)
    widths.original = model.preprocess
    monkeypatch.setattr(model, "preprocess", widths)
    with pytest.raises(ValueError, match=r"model should give the same \['widest'\] for every batch from its "
                       r"preprocess .*call model.encode for it"):
        dst.encode(model, corpus[:20])
    with pytest.raises(ValueError, match=r"model should give the same \['widest'\]"):
        dst.corpus_embedder(model)
    late = _Widths(model, after=2)  # the probes agree: the first batch that differs is refused
    late.original = widths.original
    monkeypatch.setattr(model, "preprocess", late)
    with pytest.raises(ValueError, match=r"model.preprocess\(texts\)\['widest'\] should be the same for every batch, "
                       r"but got \d+ where a probe gave None: call model.encode for it"):
        dst.encode(model, corpus[:20])


def test_the_command_refuses_such_a_model_in_one_line_before_its_weights_load(st_model_folder, corpus, tmp_path,
                                                                             monkeypatch, capsys):
    import sentence_transformers

    read, preprocess = sentence_transformers.SentenceTransformer, sentence_transformers.SentenceTransformer.preprocess

    def widest(self, texts, **kwargs):
        out = preprocess(self, texts, **kwargs)
        return {**out, "widest": max(map(len, out["input_ids"]))}

    def weightless_only(*args, **kwargs):
        assert (kwargs.get("model_kwargs") or {}).get("device_map") == "meta", "weights loaded before the refusal"
        return read(*args, **kwargs)

    monkeypatch.setattr(read, "preprocess", widest)
    monkeypatch.setattr(sentence_transformers, "SentenceTransformer", weightless_only)
    (tmp_path / "docs.txt").write_text("\n".join(corpus[:8]) + "\n", encoding="utf-8")
    folder = str(st_model_folder(pooling="mean", **INSTRUCTION))
    capsys.readouterr()  # what making the folder printed (transformers' bars for loading and writing weights)
    with pytest.raises(SystemExit) as info:
        main(["embed", str(tmp_path / "docs.txt"), str(tmp_path / "store"), "--model", folder, "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"dynabatch embed: error: --model should be a sentence-transformers model that runs on "
                          f"dynamic batches (or be given --pooling mean, cls or last), but got --model={folder!r}: "
                          "model should give the same ['widest'] for every batch"), err


def test_a_copy_or_a_pickle_of_the_tokenizer_carries_no_weights(st_model_folder, loaded):
    import copy
    import pickle

    model = loaded(st_model_folder(pooling="mean", **INSTRUCTION), None)
    tokenizer, _, _ = dst.corpus_embedder(model)
    for clone in (copy.deepcopy(tokenizer), pickle.loads(pickle.dumps(tokenizer))):
        assert {p.device.type for p in clone.model.parameters()} == {"meta"}
        assert clone.constants == tokenizer.constants == {"modality": "text", "prompt_length": 11}
        assert clone(["In the beginning"]) == tokenizer(["In the beginning"])
    assert {p.device.type for p in model.parameters()} == {"cpu"}
