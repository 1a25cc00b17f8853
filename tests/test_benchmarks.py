"""benchmarks/inference.py, run as a user runs it (few texts, offline, one thread)."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "inference.py"
METHODS = ["plain DataLoader", "sorted, fixed batch size", "token budget", "dynabatch", "dynabatch + model shape",
           "dynabatch measured"]
KEPT = "## encoder (all-MiniLM-L6-v2 forward, max_length 256) on cuda\n\nkept from another machine\n"


def test_inference_benchmark_prints_every_method_and_keeps_other_sections(tmp_path):
    out = tmp_path / "RESULTS.md"
    out.write_text("# old title\n\n" + KEPT)  # a section of another device: a CPU rerun must keep it
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run([sys.executable, str(SCRIPT), "--n-texts", "40", "--threads", "1", "--out", str(out)],
                            check=False, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    for heading in ("## encoder (all-MiniLM-L6-v2 forward, max_length 256) on cpu", "## generate (Marian-shaped"):
        assert heading in result.stdout
    for method in METHODS:
        rows = re.findall(rf"^\| {re.escape(method)} \|.*\| (yes|no[^|]*|reference) \| "
                          r"(within the first batch's peak|exceeds it \(\d+ batch(es)?, max [\d.]+x\)) \|$",
                          result.stdout, re.MULTILINE)
        assert len(rows) == 2, (method, result.stdout)  # one row per workload, with a verdict
    assert "| reference |" in result.stdout and "Targets:" in result.stdout
    written = out.read_text()
    assert written.startswith("# dynabatch inference benchmark")
    assert KEPT.strip() in written and written.count("## ") == 3
    assert "## encoder (all-MiniLM-L6-v2 forward, max_length 256) on cpu" in written
