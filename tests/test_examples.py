"""The examples, and the planning benchmark's ``--help``, run as a user runs them (small sizes, offline): ``--help``
in a fresh interpreter, the runs in a fork of ``tests/_warm.py``'s (without the imports' 15-20 s)."""

import os
import re
import sys
from pathlib import Path

import _warm
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
}  # benchmarks/plan_speed.py runs in tests/test_benchmarks.py


def _run(script, *args, warm=None):
    """``python script *args`` from the repository's root: a fresh interpreter, or with ``warm`` a fork of it."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return _warm.run(warm, [sys.executable, str(script), *args], text=True, env=env, cwd=ROOT, timeout=300)


def _options(script):
    """The options the script declares, with the shared ones when it imports examples/_common.py."""
    text = script.read_text()
    if re.search(r"^import _common\b", text, re.MULTILINE):
        text += COMMON.read_text()
    return sorted(set(re.findall(r'add_argument\(\s*"(--[a-z-]+)"', text)))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(RUNS))
def test_script_runs_and_prints_its_table(name, warm):
    script, args, patterns = RUNS[name]
    result = _run(script, *args, warm=warm)
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

