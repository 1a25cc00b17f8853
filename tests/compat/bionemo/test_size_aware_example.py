"""examples/size_aware_training.py, run as a user runs it (small sizes, offline; in a fork of ``tests/_warm.py``'s
interpreter, without the imports' 15-20 s)."""

import os
import re
import sys
from pathlib import Path

import _warm
import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "examples" / "size_aware_training.py"


def _run(warm, *args):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return _warm.run(warm, [sys.executable, str(SCRIPT), *args], text=True, env=env, cwd=ROOT, timeout=300)


@pytest.mark.slow
def test_example_fits_the_memory_model_and_trains_under_the_budget(warm):
    result = _run(warm, "--n-texts", "100", "--steps", "3")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert re.search(r"largest leave-one-probe-out error: \d+\.\d% over 18 probes", out), out
    steps = re.findall(r"^\s+(\d+)\s+(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", out, re.MULTILINE)
    assert len(steps) == 3, out
    for _, rows, length, predicted, measured, ratio, loss in steps:
        assert int(rows) >= 1 and 13 <= int(length) <= 64
        assert float(ratio) <= 1.02  # measured peak within the budget (the fit is exact to 0.1% here)
        assert float(loss) > 0
    assert re.search(r"3 steps, \d+ rows; largest measured peak / budget = [\d.]+ \(allowed .*: OK\)", out), out


def test_example_help_documents_its_options():
    result = _run(None, "--help")  # a fresh interpreter: the script starts on its own imports
    assert result.returncode == 0, result.stderr
    for option in ("--n-texts", "--max-length", "--budget-rows", "--steps", "--threads", "--seed"):
        assert option in result.stdout
