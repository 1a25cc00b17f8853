"""Fixtures of the command-line tests: tiny random-weight model folders (made once per session), a corpus, and
subprocess runs of ``python -m dynabatch`` that can be stopped after their first stored shard (fresh interpreters),
or that run to their end (forks of ``tests/_warm.py``'s interpreter, without the imports' 15-20 s)."""

import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import _processes
import _warm
import pytest

REPO = Path(__file__).resolve().parents[2]

# Loaded by every Python process of a stalled run (a sitecustomize module on PYTHONPATH): a shard is committed every
# 8 rows, and once a shard of the process is in place its next write of rows stalls, so the process is surely mid-run
# when the test kills it.
STALL_HOOK = '''
import os
import time

from dynabatch.inference import store, store_writer

store_writer.COMMIT = store_writer.CommitPolicy(rows=8)
_replace, _write = os.replace, store.StoreWriter.write
_committed = []


def _replace_noting(src, dst, *args, **kwargs):
    _replace(src, dst, *args, **kwargs)
    if os.path.basename(os.fspath(dst)).startswith("part-"):
        _committed.append(dst)


def _stall_once_committed(self, *args, **kwargs):
    if _committed:  # stall until killed; a rank whose launcher (torchrun) was killed is orphaned: it exits then
        parent = os.getppid()
        while os.getppid() == parent:
            time.sleep(0.2)
        os._exit(1)
    return _write(self, *args, **kwargs)


os.replace = _replace_noting
store.StoreWriter.write = _stall_once_committed
'''


@pytest.fixture(scope="session")
def gpt2_dir(tmp_path_factory, tokenizer):
    """A tiny random-weight GPT-2 (64 positions) with the MiniLM tokenizer (pad 0, EOS 102), saved once."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tmp_path_factory.mktemp("tiny-gpt2")
    with torch.random.fork_rng():
        torch.manual_seed(0)
        config = GPT2Config(vocab_size=tokenizer.vocab_size, n_embd=32, n_layer=1, n_head=2, n_positions=64,
                            pad_token_id=0, eos_token_id=102, bos_token_id=101)
        GPT2LMHeadModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def no_bos_llama_dir(tmp_path_factory, llama_tokenizer):
    """A tiny random-weight Llama (hidden size 32, 64 positions) whose Llama-2 tokenizer adds no BOS (nor any special
    token): an empty text is no token. Saved once."""
    import copy

    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny-llama-no-bos")
    with torch.random.fork_rng():
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(vocab_size=len(llama_tokenizer), hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=64)
                         ).save_pretrained(folder)
    no_bos = copy.deepcopy(llama_tokenizer)
    no_bos.add_bos_token = False
    no_bos.save_pretrained(folder)
    assert AutoTokenizer.from_pretrained(folder)([""])["input_ids"] == [[]]  # the reload keeps it
    return folder


@pytest.fixture(scope="session")
def no_special_bert_dir(tmp_path_factory, bert_dir, tokenizer):
    """The tiny BERT whose tokenizer (MiniLM's WordPiece and BERT normalizer) adds no special token: a tokenizer.json
    without a post-processor, read back as a plain fast tokenizer. Its normalizer drops control, zero-width and
    combining characters, so a text of those alone is no token. Saved once."""
    import copy

    from tokenizers import processors
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("tiny-bert-no-special")
    for name in ("config.json", "model.safetensors"):
        shutil.copy(bert_dir / name, folder / name)
    plain = copy.deepcopy(tokenizer)
    plain.backend_tokenizer.post_processor = processors.Sequence([])
    plain.save_pretrained(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"  # BertTokenizer would rebuild [CLS] ... [SEP] on load
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert AutoTokenizer.from_pretrained(folder)(["", "a"])["input_ids"] == [[], [1037]]  # the reload keeps it
    return folder


# How sentence-transformers versions 2 to 5 saved a folder (the files each wrote; version 6 is the installed one, which
# saves its own). Each layout pools its own way, so that pooling and Normalize are read from the folder too.
_POOLING_MODES = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens", "lasttoken")
ST_LAYOUTS = {
    "2.2.2": {"pooling": "mean_tokens", "normalize": True, "config": {}},
    "3.0.1": {"pooling": "cls_token", "normalize": False,
              "config": {"prompts": {}, "default_prompt_name": None, "similarity_fn_name": None}},
    "4.1.0": {"pooling": "max_tokens", "normalize": True,
              "config": {"prompts": {"query": "query: "}, "default_prompt_name": "query", "similarity_fn_name": "cosine"}},
    "5.0.0": {"pooling": "lasttoken", "normalize": False,
              "config": {"model_type": "SentenceTransformer", "prompts": {"query": "query: ", "document": "passage: "},
                         "default_prompt_name": None, "similarity_fn_name": "cosine"}},
}


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))


def _sentence_transformers_folder(bert_dir: Path, folder: Path, version: str, max_seq_length: int) -> Path:
    """``bert_dir`` saved as sentence-transformers ``version`` (2.x to 5.0) saved a model at ``max_seq_length``: 2.x
    kept it in sentence_bert_config.json alone, 3.x to 5.0 there and in the tokenizer's model_max_length."""
    layout = ST_LAYOUTS[version]
    shutil.copytree(bert_dir, folder)
    if not version.startswith("2."):  # loaded with model_max_length=max_seq_length, saved so
        tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
        _write_json(folder / "tokenizer_config.json", {**tokenizer_config, "model_max_length": max_seq_length})
    _write_json(folder / "sentence_bert_config.json", {"max_seq_length": max_seq_length, "do_lower_case": False})
    versions = {"sentence_transformers": version, "transformers": "4.41.2", "pytorch": "2.3.0"}
    _write_json(folder / "config_sentence_transformers.json", {"__version__": versions, **layout["config"]})
    modes = _POOLING_MODES[:4] if version.startswith("2.") else _POOLING_MODES
    _write_json(folder / "1_Pooling" / "config.json", {
        "word_embedding_dimension": 32, **{f"pooling_mode_{m}": m == layout["pooling"] for m in modes},
        **({} if version.startswith("2.") else {"include_prompt": True})})
    kinds = ["Transformer", "Pooling"] + (["Normalize"] if layout["normalize"] else [])
    _write_json(folder / "modules.json", [
        {"idx": i, "name": str(i), "path": "" if i == 0 else f"{i}_{kind}", "type": f"sentence_transformers.models.{kind}"}
        for i, kind in enumerate(kinds)])
    if layout["normalize"]:
        (folder / "2_Normalize").mkdir()
    return folder


@pytest.fixture(scope="session")
def st_folder(bert_dir, st_model_folder, tmp_path_factory):
    """``st_folder(version, max_seq_length=16)``: the tiny BERT saved as that sentence-transformers version did (6.x:
    the installed version's own ``save``, which keeps the length in the tokenizer's model_max_length alone)."""

    def make(version: str, max_seq_length: int = 16) -> Path:
        if version.startswith("6."):
            prompts = {"query": "query: ", "document": "passage: "}
            return st_model_folder(normalize=True, max_seq_length=max_seq_length, prompts=prompts,
                                   default_prompt_name="document")
        return _sentence_transformers_folder(bert_dir, tmp_path_factory.mktemp(f"st-{version}") / "model", version,
                                             max_seq_length)

    return make


@pytest.fixture(scope="session")
def texts():
    """120 real texts of 1 to 40 words."""
    from dynabatch.demo import kjv_passages, vary_lengths

    return vary_lengths(kjv_passages(), n=120, max_words=40, seed=13)


def _write_corpus(folder: Path, texts: list[str], ids: list) -> Path:
    """The texts and ids as two Parquet files (half each) in ``folder/corpus``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    corpus = folder / "corpus"
    corpus.mkdir()
    half = len(texts) // 2
    for part, rows in enumerate((slice(0, half), slice(half, None))):
        pq.write_table(pa.table({"id": ids[rows], "text": texts[rows]}), corpus / f"part-{part}.parquet")
    return corpus


def _environment(hook_in: Path | None = None, hook: str = STALL_HOOK) -> dict:
    """The environment of a command's subprocess: this checkout first, offline, one thread per process; with
    ``hook_in`` (a folder for it), ``hook`` is loaded by every Python process as a sitecustomize module (by default
    runs stall after their first stored shard)."""
    path = [str(REPO)] + ([str(hook_in)] if hook_in is not None else [])
    if hook_in is not None:
        hook_in.mkdir(exist_ok=True)
        (hook_in / "sitecustomize.py").write_text(hook)
    return dict(os.environ, PYTHONPATH=os.pathsep.join(path), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
                TOKENIZERS_PARALLELISM="false")


def _kill_after_first_shard(command: list[str], store: Path, hook: Path, timeout: float = 120,
                            while_stalled: Callable[[], None] | None = None) -> None:
    """Starts ``command`` stalling after its first stored shard, waits for that shard, calls ``while_stalled()``
    (if given) and SIGKILLs its process group and every process it started (torchrun starts each rank in a session
    of its own), then waits until they have all ended."""
    log = hook.parent / f"{hook.name}.log"
    with open(log, "w") as out:
        process = subprocess.Popen(command, env=_environment(hook), stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    deadline = time.monotonic() + timeout
    try:
        while not list(store.glob("part-*.parquet")):
            assert process.poll() is None, f"the run ended before its first shard:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no shard within {timeout} s:\n{log.read_text()[-3000:]}"
            time.sleep(0.05)
        if while_stalled is not None:
            while_stalled()
    finally:
        descendants = _processes.descendants([process.pid])  # torchrun's ranks: sessions of their own
        os.killpg(process.pid, signal.SIGKILL)
        for pid in descendants:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        process.wait()
        _processes.wait_until_ended(descendants)


def _run_command(command: list[str], timeout: float = 180, *, hook: str | None = None, hook_in: Path | None = None,
                 status: int = 0, warm: _warm.Server | None = None) -> subprocess.CompletedProcess:
    """Runs ``command`` to its end (with ``hook`` loaded from the folder ``hook_in``, as :func:`_environment` does;
    in a fork of ``warm`` when given); fails the test with its output unless it exits with ``status``."""
    env = _environment(hook_in, hook) if hook is not None else _environment()
    done = _warm.run(warm, command, env=env, text=True, timeout=timeout)
    assert done.returncode == status, done.stdout[-3000:] + done.stderr[-3000:]
    return done


@pytest.fixture(scope="session")
def cli():
    """``python -m dynabatch`` as a command list."""
    return [sys.executable, "-m", "dynabatch"]


@pytest.fixture(scope="session")
def write_corpus():
    """``write_corpus(folder, texts, ids)``: two Parquet files in ``folder/corpus``."""
    return _write_corpus


@pytest.fixture(scope="session")
def kill_after_first_shard():
    """``kill_after_first_shard(command, store, hook_folder)``: a run SIGKILLed after its first stored shard."""
    return _kill_after_first_shard


@pytest.fixture(scope="session")
def command_environment():
    """``command_environment(hook_in=None, hook=STALL_HOOK)``: the environment of a command's subprocess."""
    return _environment


@pytest.fixture(scope="session")
def run_command(warm):
    """``run_command(command, hook=None, hook_in=None, status=0)``: a run to its end, its exit status asserted (a
    ``python`` command in a fork of ``warm``; what the tests kill runs in a fresh interpreter, by
    ``kill_after_first_shard``)."""
    return functools.partial(_run_command, warm=warm)


@pytest.fixture()
def no_model_loads(monkeypatch):
    """Loading any weights fails the test: a bad input must be refused before (a sentence-transformers folder read
    with its weights on the meta device reads none)."""
    import sentence_transformers
    import transformers

    def refused(load):
        def loaded(*args, **kwargs):
            if "meta" in (kwargs.get("device_map"), (kwargs.get("model_kwargs") or {}).get("device_map")):
                return load(*args, **kwargs)  # sentence-transformers reading the folder, its modules on meta
            raise AssertionError("a model loaded before the bad input was refused")

        return loaded

    for auto in (transformers.AutoModel, transformers.AutoModelForCausalLM, transformers.AutoModelForSeq2SeqLM):
        monkeypatch.setattr(auto, "from_pretrained", refused(auto.from_pretrained))
    monkeypatch.setattr(sentence_transformers, "SentenceTransformer", refused(sentence_transformers.SentenceTransformer))


@pytest.fixture()
def no_model_read(monkeypatch):
    """Reading anything of a model's folder (its config, its tokenizer, its modules on the meta device) fails the
    test: a bad option or corpus must be refused before (the imports and reads take seconds)."""
    import sentence_transformers
    import transformers

    def refused(*args, **kwargs):
        raise AssertionError("the model's folder was read before the bad input was refused")

    for auto in (transformers.AutoConfig, transformers.AutoTokenizer):
        monkeypatch.setattr(auto, "from_pretrained", refused)
    monkeypatch.setattr(sentence_transformers, "SentenceTransformer", refused)
