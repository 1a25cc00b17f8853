"""Fixtures of the command-line tests: tiny random-weight model folders (made once per session), a corpus, and
subprocess runs of ``python -m dynabatch`` that can be stopped after their first stored shard."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Loaded by every Python process of a stalled run (a sitecustomize module on PYTHONPATH): a shard is committed every
# 8 rows and the writer never commits a second one, so the process is surely mid-run when the test kills it.
STALL_HOOK = '''
from dynabatch.inference import store

store.SHARD_ROWS = 8
_commit = store.StoreWriter._commit
_written = []


def _stall_after_first(self, *args, **kwargs):
    if _written:  # stall until killed; a rank whose launcher (torchrun) was killed is orphaned: it exits then
        import os
        import time

        parent = os.getppid()
        while os.getppid() == parent:
            time.sleep(0.2)
        os._exit(1)
    _written.append(_commit(self, *args, **kwargs))


store.StoreWriter._commit = _stall_after_first
'''


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


def _environment(stall_in: Path | None = None) -> dict:
    """The environment of a command's subprocess: this checkout first, offline, one thread per process; with
    ``stall_in`` (a folder for the hook), runs stall after their first stored shard."""
    path = [str(REPO)] + ([str(stall_in)] if stall_in is not None else [])
    if stall_in is not None:
        (stall_in / "sitecustomize.py").write_text(STALL_HOOK)
    return dict(os.environ, PYTHONPATH=os.pathsep.join(path), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
                TOKENIZERS_PARALLELISM="false")


def _kill_after_first_shard(command: list[str], store: Path, hook: Path, timeout: float = 120) -> None:
    """Starts ``command`` stalling after its first stored shard, waits for that shard, and SIGKILLs its process
    group (a torchrun launcher and its ranks too)."""
    hook.mkdir(exist_ok=True)
    log = hook / "stalled.log"
    with open(log, "w") as out:
        process = subprocess.Popen(command, env=_environment(hook), stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    deadline = time.monotonic() + timeout
    try:
        while not list(store.glob("part-*.parquet")):
            assert process.poll() is None, f"the run ended before its first shard:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no shard within {timeout} s:\n{log.read_text()[-3000:]}"
            time.sleep(0.05)
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _run_command(command: list[str], timeout: float = 180) -> subprocess.CompletedProcess:
    """Runs ``command`` to its end; fails the test with its output unless it exits with 0."""
    done = subprocess.run(command, env=_environment(), capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
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
def run_command():
    """``run_command(command)``: a run to its end (exit status 0 asserted)."""
    return _run_command
