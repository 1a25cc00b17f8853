"""The examples and the planning benchmark, run as a user runs them (small sizes, offline)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EMBED = ROOT / "examples" / "embed_kjv.py"
SEQ2SEQ = ROOT / "examples" / "seq2seq_generate.py"
PLAN_SPEED = ROOT / "benchmarks" / "plan_speed.py"
COMMON = ROOT / "examples" / "_common.py"  # options both examples share

# One thread: the runs are small and CI machines are often shared, where two
# OpenMP threads fighting other processes for two cores are several times slower.
# Each method is warmed up, then timed in --repeats rounds (default 3) that interleave the two methods' batches;
# the fastest round of each counts.
TIMED_RUNS = (r"timed rounds \(after a warm-up of each; batches of the two methods interleaved\): plain( [\d.]+s \([\d.]+s CPU\),?){{{n}}}; "
              r"dynabatch( [\d.]+s \([\d.]+s CPU\),?){{{n}}};")
SPEED_UP = r"speed-up of dynabatch over the plain loader: [\d.]+x in wall time, [\d.]+x in CPU time"
COMPARISON_HEADER = r"method\s+batches\s+largest batch\s+padding eff\.\s+wall time\s+texts/s\s+CPU time"
RUNS = {
    "embed_kjv": (EMBED, ["--n-texts", "300", "--max-length", "48", "--threads", "1", "--repeats", "1"],
                  [TIMED_RUNS.format(n=1), COMPARISON_HEADER, r"\ndynabatch\s+\d+", SPEED_UP,
                   r"max abs difference \S+ \(OK"]),
    "seq2seq_generate": (SEQ2SEQ, ["--n-texts", "60", "--max-length", "48", "--threads", "1", "--repeats", "2"],
                         [TIMED_RUNS.format(n=2), COMPARISON_HEADER, r"\ndynabatch\s+\d+", SPEED_UP,
                          r"\b60/60 rows equal \(OK"]),
    "plan_speed": (PLAN_SPEED, ["--n-texts", "2000", "--n-lengths", "20000", "--repeats", "1", "--cold-texts", "400",
                                "--cold-repeats", "1"],
                   [r"\| stage \| size \| time \| texts/s \| note \|", r"machine: ",
                    r"\| `plan_batches`, `batch_size=16` \| 20,000 lengths \|", r"\| `plan_batches`, `batch_size=64` \|",
                    r"the ~4,300 texts/s quoted"]),
}


def _run(script, *args):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=300)


def _options(script):
    """The options the script declares, with the shared ones when it imports examples/_common.py."""
    text = script.read_text()
    if re.search(r"^import _common\b", text, re.MULTILINE):
        text += COMMON.read_text()
    return sorted(set(re.findall(r'add_argument\(\s*"(--[a-z-]+)"', text)))


@pytest.mark.parametrize("name", sorted(RUNS))
def test_script_runs_and_prints_its_table(name):
    script, args, patterns = RUNS[name]
    result = _run(script, *args)
    assert result.returncode == 0, result.stdout + result.stderr
    for pattern in patterns:
        assert re.search(pattern, result.stdout), (pattern, result.stdout)


@pytest.mark.parametrize("script", [EMBED, SEQ2SEQ, PLAN_SPEED], ids=lambda p: p.name)
def test_help_documents_every_option(script):
    result = _run(script, "--help")
    assert result.returncode == 0, result.stderr
    options = _options(script)
    assert len(options) >= 4
    for option in options:
        assert option in result.stdout, option


CORPUS = ROOT / "examples" / "embed_corpus.py"


def test_embed_corpus_on_two_torchrun_ranks_stores_every_id_once_and_resumes(tmp_path):
    import numpy as np
    import pyarrow as pa
    import pyarrow.dataset as ds
    import pyarrow.parquet as pq

    from dynabatch.demo import kjv_passages, vary_lengths

    texts = vary_lengths(kjv_passages(), n=240, max_words=40, seed=13)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for part in range(2):
        rows = slice(part * 120, (part + 1) * 120)
        pq.write_table(pa.table({"id": [f"doc-{i}" for i in range(240)][rows], "text": texts[rows]}),
                       corpus / f"part-{part}.parquet")
    out = tmp_path / "embeddings"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(CORPUS),
               str(corpus), str(out), "--batch-size", "8", "--max-length", "48"]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    first = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, check=False)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "240 texts in" in first.stdout
    table = ds.dataset(out, format="parquet").to_table().sort_by("position")
    assert table.column("id").to_pylist() == [f"doc-{i}" for i in range(240)]
    vectors = np.stack(table.column("output").to_numpy(zero_copy_only=False))
    assert vectors.shape == (240, 384) and np.isfinite(vectors).all()
    import torch
    from transformers import AutoModel, AutoTokenizer

    from dynabatch.demo import minilm_path

    tokenizer, model = AutoTokenizer.from_pretrained(minilm_path()), AutoModel.from_pretrained(minilm_path()).eval()
    for i in (0, 117, 239):  # each row is its own text's embedding, whichever rank and batch ran it
        encoded = tokenizer(texts[i], truncation=True, max_length=48, return_tensors="pt")
        with torch.no_grad():
            expected = model(**encoded).last_hidden_state.mean(1)[0].numpy()
        assert np.allclose(vectors[i], expected, atol=1e-4), i
    again = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, check=False)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "this process ran 0 rows" in again.stdout  # resumed: nothing left to run
