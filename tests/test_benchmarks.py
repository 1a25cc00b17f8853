"""The benchmark scripts, run as a user runs them (few texts, offline, one thread; in forks of ``tests/_warm.py``'s
interpreter, without the imports' 15-20 s), and benchmarks/gpu.sh's plan."""

import gzip
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import _warm

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "inference.py"
METHODS = ["plain DataLoader", "sorted, fixed batch size", "token budget", "dynabatch", "dynabatch plan, memory='record'",
           "dynabatch plan + model shape, memory='record'"]
KEPT = "## encoder (all-MiniLM-L6-v2 forward, max_length 256) on cuda\n\nkept from another machine\n"


def test_inference_benchmark_prints_every_method_and_keeps_other_sections(warm, tmp_path):
    out = tmp_path / "RESULTS.md"
    out.write_text("# old title\n\n" + KEPT)  # a section of another device: a CPU rerun must keep it
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = _warm.run(warm, [sys.executable, str(SCRIPT), "--n-texts", "12", "--threads", "1", "--output", str(out)],
                            check=False, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    for heading in ("## encoder (all-MiniLM-L6-v2 forward, max_length 256) on cpu", "## generate (Marian-shaped"):
        assert heading in result.stdout
    for method in METHODS:
        rows = re.findall(rf"^\| {re.escape(method)} \|.*\| (yes|no[^|]*|reference) \| "
                          r"(within the first batch's peak|exceeds it \(\d+ batch(es)?, max [\d.]+x\)) \|$",
                          result.stdout, re.MULTILINE)
        assert len(rows) == 2, (method, result.stdout)  # one row per workload, with a verdict
    assert "| reference |" in result.stdout and "Summary:" in result.stdout
    written = out.read_text()
    assert written.startswith("# dynabatch inference benchmark")
    assert KEPT.strip() in written and written.count("## ") == 3
    assert "## encoder (all-MiniLM-L6-v2 forward, max_length 256) on cpu" in written


def test_repeats_report_the_median_and_spread_and_nothing_is_written_unless_asked(warm, tmp_path):
    # A copy of the script beside a committed benchmarks/RESULTS.md of its own, run from an empty directory,
    # without --output: the tables go to stdout only, no file is written or changed.
    (tmp_path / "benchmarks").mkdir()
    script = tmp_path / "benchmarks" / "inference.py"
    script.write_text(SCRIPT.read_text())
    committed = tmp_path / "benchmarks" / "RESULTS.md"
    committed.write_text("results\n")
    (tmp_path / "work").mkdir()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "DYNABATCH_BENCH_ASSETS": "repo",  # the text, tokenizer and encoder that travel with the repository
           "PYTHONPATH": os.pathsep.join([str(ROOT / "examples"), str(ROOT / "benchmarks"),
                                          os.environ.get("PYTHONPATH", "")])}
    args = ["--workloads", "encoder", "--methods", "plain,dynabatch", "--repeats", "3", "--n-texts", "8",
            "--threads", "1"]
    result = _warm.run(warm, [sys.executable, str(script), *args], check=False, capture_output=True, text=True,
                            env=env, cwd=tmp_path / "work", timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file() and "__pycache__" not in str(p))
    assert written == ["benchmarks/RESULTS.md", "benchmarks/inference.py"]
    assert committed.read_text() == "results\n"
    assert "- wall s: the median of 3 runs per method" in result.stdout
    assert "## encoder (random-weight MiniLM-shaped BERT forward, max_length 256) on cpu" in result.stdout
    assert "KJV WordPiece (8,192 tokens) tokenizer" in result.stdout
    for method in ("plain DataLoader", "dynabatch"):
        match = re.search(rf"^\| {re.escape(method)} \| ([\d.]+) \(([\d.]+)-([\d.]+)\) \|", result.stdout,
                          re.MULTILINE)
        assert match, result.stdout
        median, low, high = map(float, match.groups())
        assert low <= median <= high
    assert result.stderr.count("(round ") == 6, result.stderr  # each method once per round


def _benchmark_module():
    import importlib.util

    sys.path.insert(0, str(ROOT / "examples"))  # the script imports examples/seq2seq_generate.py, as when run
    try:
        spec = importlib.util.spec_from_file_location("benchmark_inference", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look their module up
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "examples"))
    return module


def test_overlapping_ranges_are_called_out_in_the_summary():
    bench = _benchmark_module()

    def row(method, seconds, spread, over=0):
        return bench.Row(method=method, seconds=seconds, rows_per_s=1.0, speedup=2.5, batches=1, largest=1,
                         padding_efficiency=1.0, max_ratio=1.0, over=over, over_no_larger=0, same_as_plain="yes",
                         spread=spread)

    plain = row("plain DataLoader", 50.0, (49.0, 51.0))
    sorted_ = row("sorted, fixed batch size", 22.7, (22.3, 22.8))
    close = bench.summary_line(row("dynabatch", 22.5, (21.8, 22.6)), plain, [sorted_])
    assert ("22.50 s against 22.70 s for the fastest baseline within the peak (sorted, fixed batch size, 1.01x; "
            "their min-max ranges overlap)") in close
    clear = bench.summary_line(row("dynabatch", 20.0, (19.5, 20.5)), plain, [sorted_])
    assert "(sorted, fixed batch size, 1.14x)" in clear and "overlap" not in clear
    one_run = bench.summary_line(row("dynabatch", 22.5, None), plain, [row("sorted, fixed batch size", 22.7, None)])
    assert "overlap" not in one_run


# --- benchmarks/plan_speed.py ----------------------------------------------------------------------

PLAN_SPEED = ROOT / "benchmarks" / "plan_speed.py"


def test_plan_speed_prints_cold_start_and_planning_rows_and_writes_only_where_asked(warm, tmp_path):
    # The script runs from a copy beside a README.md and a benchmarks/RESULTS.md of its own, in an empty working
    # directory: whatever it wrote, relative to itself or to the working directory, would show.
    (tmp_path / "benchmarks").mkdir()
    script = tmp_path / "benchmarks" / "plan_speed.py"
    script.write_text(PLAN_SPEED.read_text())
    committed = {tmp_path / "README.md": "readme\n", tmp_path / "benchmarks" / "RESULTS.md": "results\n"}
    for path, text in committed.items():
        path.write_text(text)
    (tmp_path / "work").mkdir()
    out = tmp_path / "plan_speed.md"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    args = ["--n-texts", "300", "--n-lengths", "3000", "--batch-sizes", "4,16,64", "--repeats", "1",
            "--cold-texts", "400", "--cold-repeats", "1", "--output", str(out)]
    result = _warm.run(warm, [sys.executable, str(script), *args], check=False, capture_output=True, text=True,
                            env=env, cwd=tmp_path / "work", timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    table = result.stdout
    assert re.search(r"^\| `import dynabatch` after them \| 2 fresh processes \| [\d.]+ s \([\d.]+-[\d.]+\) \| - \| "
                     r"target <= 0.3 s: (OK|MISSED) \|$", table, re.MULTILINE), table
    # the first build in a fresh process, against the first raw call in another, on the same 400 passages;
    # the bundled classifier comes from its compiled trees: scikit-learn is never imported
    assert re.search(r"^\| first `build_dynamic_batch_dataloader\(texts, tokenizer, 16, 256\)` \| 400 KJV passages \| "
                     r"[\d.]+ s \| [\d,]+ \| [\d.]+x the raw call, target <= 1.3x: (OK|MISSED); scikit-learn not "
                     r"imported \|$", table, re.MULTILINE), table
    assert "| first raw `tokenizer(texts, truncation=True, max_length=256)` | 400 KJV passages |" in table
    for batch_size in (4, 16, 64):
        assert re.search(rf"^\| `plan_batches`, `batch_size={batch_size}` \| 3,000 lengths \| [\d.]+ s \| [\d,]+ \| "
                         r"[\d,]+ batches, largest \d+; target <= 0.5 s is for 1,000,000 lengths \|$", table,
                         re.MULTILINE), table
    assert re.search(r"^\| `tokenize_texts` \(length stage \+ flat token store\) \| 300 texts \| .* target <= 1.3x: "
                     r"(OK|MISSED) \|$", table, re.MULTILINE)
    assert "| stage | size | time | texts/s | note |" in table and "machine: " in table
    assert "the ~4,300 texts/s quoted" in table
    assert "`python benchmarks/plan_speed.py --n-texts 300" in table  # the command that made it
    assert out.read_text() == table.strip("\n") + "\n"  # --output writes what was printed
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert written == ["README.md", "benchmarks/RESULTS.md", "benchmarks/plan_speed.py", "plan_speed.md"]  # nothing else
    assert {path: path.read_text() for path in committed} == committed


# --- benchmarks/packing.py -------------------------------------------------------------------------

PACKING = ROOT / "benchmarks" / "packing.py"
PACKING_METHODS = ["dynabatch MultipackBatchSampler", 'dynabatch FFD (algorithm="ffd")',
                   "shuffled first fit (axolotl re-impl.)", "dynabatch.integrations.trl.pack_dataset",
                   "TRL pack_dataset (bfd)"]
PACKING_DISTRIBUTIONS = ["lognormal (median 300)", "real short text (KJV)", "many very short", "near capacity",
                         "bimodal", "long tail (Pareto)"]


def test_packing_benchmark_prints_one_table_of_every_method_on_every_distribution_and_the_cold_start(warm):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = _warm.run(warm, [sys.executable, str(PACKING), "--n", "3000", "--cold-n", "20000"], check=False,
                            capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    for distribution in PACKING_DISTRIBUTIONS:
        effs = {}
        for method in PACKING_METHODS:
            row = re.search(rf"^\| {re.escape(distribution)} \| {re.escape(method)} \| ([\d,]+) \| ([\d.]+) \| "
                            r"([\d,]+) \| [\d.]+ \|$", out, re.MULTILINE)
            assert row, (distribution, method, out)
            effs[method] = float(row.group(2))
        assert effs["dynabatch MultipackBatchSampler"] >= effs['dynabatch FFD (algorithm="ffd")']  # never more bins
        assert re.search(rf"^\| {re.escape(distribution)} \| [+-][\d.]+ \(best peer: .*\) \| [\d.]+x \| [\d.]+x \|$",
                         out, re.MULTILINE), out
    assert re.search(r"^Target: at or above the best efficiency on every distribution .*: (OK|MISSED)$", out, re.MULTILINE)
    for call in ("pack_parallel(lengths, 4096, 100000, 200)", "MultipackBatchSampler(...).generate_batches()"):
        assert re.search(rf"^- `{re.escape(call)}`: [\d.]+ / [\d.]+ s \(warm [\d.]+ s\); target <= 1.5 s: (OK|MISSED)$",
                         out, re.MULTILINE), out
    assert "`python benchmarks/packing.py --n 3000 --cold-n 20000`" in out


def _run_script(warm, name, *args, timeout=120):
    """``benchmarks/<name>`` run offline from the repository root; its result, after checking it succeeded."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = _warm.run(warm, [sys.executable, str(ROOT / "benchmarks" / name), *args], check=False,
                            capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def test_host_builds_give_each_rows_median_over_fresh_processes_with_the_cold_ratios_spread(warm):
    # A tokenizer with its own __call__, as a class the build processes import by name from the script; the parent's
    # TOKENIZERS_PARALLELISM is dropped (each configuration sets its own)
    result = _run_script(warm, "host.py", "--builds", "--sizes", "40", "--configurations", "custom", "--corpora", "kjv",
                         "--repeats", "2", timeout=300)
    rows = re.findall(r"^\| custom \| kjv \| 40 \| [\d.]+ \| [\d.]+ \| ([\d.]+) \(([\d.]+)-([\d.]+)\)x \| [\d.]+x \| "
                      r"[\d.]+x \| one \|", result.stdout, re.MULTILINE)
    assert len(rows) == 1, result.stdout
    median, low, high = map(float, rows[0])
    assert low <= median <= high and median == pytest.approx((low + high) / 2, abs=0.011), rows  # two: their mean
    assert result.stderr.count("custom, kjv, 40: ") == 2  # one fresh process a repeat
    assert result.stderr.count("custom, kjv, 40, call first: ") == 2  # and one whose call runs first
    assert re.search(r"^\| custom \| kjv \| 40 \| .* \| [\d.]+x \|$", result.stdout, re.MULTILINE), result.stdout


def test_default_overhead_benchmark_times_the_defaults_against_the_plan(warm):
    result = _run_script(warm, "default_overhead.py", "--workloads", "encoder", "--n-texts", "24", "--rounds", "1")
    assert result.stdout.startswith("Command: `python benchmarks/default_overhead.py --workloads encoder")
    for way in ("defaults", "plan, unmeasured", "defaults' batches, unmeasured"):
        assert re.search(rf"^\| {re.escape(way)} \| \d+ \| [\d.]+ \([\d.]+-[\d.]+\) \| [\d.]+ \([\d.]+-[\d.]+\) \| "
                         r"[+-][\d.]+% / [+-][\d.]+% \|", result.stdout, re.MULTILINE), (way, result.stdout)


def test_embeddings_benchmark_prints_model_encode_and_dynabatch_side_by_side(warm):
    result = _run_script(warm, "embeddings.py", "--n", "24", "--repeats", "1", "--threads", "1", timeout=180)
    assert "## all-MiniLM-L6-v2 on 24 held-out texts (1-300 words), batch_size=32, cpu, 1 threads" in result.stdout
    assert re.search(r"^\| model\.encode \| [\d.]+ \| [\d,]+ \| 1\.00x \| 0\.0e\+00 \|$", result.stdout, re.MULTILINE)
    ours = re.search(r"^\| dynabatch encode \| [\d.]+ \| [\d,]+ \| [\d.]+x \| ([\d.e+-]+) \|$", result.stdout,
                     re.MULTILINE)
    assert ours and float(ours.group(1)) < 1e-5, result.stdout  # the same vectors
    assert "Same vectors (max abs diff <= 0.0001): ok" in result.stdout


def test_generation_benchmark_prints_every_engine_against_generating_alone(warm, tmp_path):
    # The tiny configuration of benchmarks/gpu.sh --rehearse; on the GPU the same script runs at full size in bf16.
    out = tmp_path / "generation.md"
    args = ["--device", "cpu", "--n-prompts", "12", "--max-words", "40", "--max-new-tokens", "12", "--hidden", "64",
            "--layers", "2", "--check", "6", "--threads", "1", "--rounds", "2", "--warmup-cap", "0.5",
            "--output", str(out)]
    result = _run_script(warm, "generation.py", *args, timeout=240)
    table = result.stdout
    assert out.read_text() == table
    for workload in ("benchmark", "long-tail"):
        section = table.split(f"### {workload}: ")[1].split("\n### ")[0]
        spread = re.search(r"replies of (\d+)-12 tokens \(quartiles \d+/(\d+)/\d+\), \d+ of 12 ran to the limit", section)
        assert spread and int(spread.group(1)) < 12, section  # the scaled EOS row ends replies at varied lengths
        for engine in ("dynabatch.generate", "dynabatch.generate, relative", "fixed batches of 16, input order"):
            # every round's time, the calls and forwards; greedy float32 replies equal generating each alone
            assert re.search(rf"^\| {re.escape(engine)} \| [\d.]+ \([\d.]+/[\d.]+\) \| \d+( \([\d, ]+ rows\))? \| \d+ "
                             r"\| [\d,]+ \| - \| 6/6 \|$", section, re.MULTILINE), (engine, section)
        assert re.search(r"^\| generate_batch, cache sized to the budget \| [\d.]+ \([\d.]+/[\d.]+\) \| - \| \d+ \| "
                         r"[\d,]+ \| - \| \d/6 \|$", section, re.MULTILINE), section
        assert re.search(r"^\| continuous batching, ideal \(computed\), \d+ rows at a time \| - \| - \| \d+ \|", section,
                         re.MULTILINE), section
        assert "Verdict: ok" in section
    assert "every engine warmed until its last calls agreed within 10%" in table


def test_encoder_curve_prints_each_shapes_throughput_against_batch_tokens_and_its_knee(warm):
    result = _run_script(warm, "encoder_curve.py", "--tiny", "--tokens", "256,512", "--calls", "1", "--threads", "1",
                         "--shapes", "minilm,decoder-0.5b", timeout=180)
    table = result.stdout
    for shape in ("minilm", "decoder-0.5b"):
        section = table.split(f"### {shape}: ")[1].split("\n### ")[0]
        for tokens, rows in (("256", 1), ("512", 2)):  # every round's median in brackets
            assert re.search(rf"^\| {tokens} \| {rows} \| [\d.]+ \([\d.]+/[\d.]+\) \| [\d,]+ \| \d+% \|$", section,
                             re.MULTILINE), section
        assert re.search(r"^knee: (256|512) batch tokens$", section, re.MULTILINE), section
    assert "dynabatch embed's default --max-batch-tokens is 16,384" in table
    assert "warm-up minilm:" in result.stderr  # warmed until stable before any point was timed


def test_overlap_benchmark_prints_each_setting_against_device_and_host_time(warm):
    result = _run_script(warm, "overlap.py", "--n-texts", "300", "--ns-per-cell", "200", timeout=180)
    assert "300 texts, 200 ns per padded cell, host time" in result.stdout
    for setting in ("one device, tokenized whole first, built in turn (stream=False, prefetch=0)",
                    "one device, the defaults (streamed, built ahead)", "two devices (devices=['cpu', 'cpu'])"):
        assert re.search(rf"^\| {re.escape(setting)} \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+x \|$",
                         result.stdout, re.MULTILINE), (setting, result.stdout)
    first = _run_script(warm, "overlap.py", "--first-call", "--n-texts", "300", timeout=180)
    assert re.search(r"^300 texts: the first device call [\d.]+ s after the loader's build began$", first.stdout,
                     re.MULTILINE), first.stdout


# --- benchmarks/gpu.sh and what it runs -------------------------------------------------------------------------

GPU_SH = ROOT / "benchmarks" / "gpu.sh"


def test_gpu_sh_dry_run_says_what_it_would_run_and_runs_nothing(tmp_path):
    out = tmp_path / "out"
    result = subprocess.run(["bash", str(GPU_SH), "--dry-run", "--out", str(out)], check=False, capture_output=True,
                            text=True, cwd=tmp_path, timeout=60)
    assert result.returncode == 0, result.stderr
    planned = re.findall(r"^run   (\S+) +\(at most +(\d+)s\): (.*)$", result.stdout, re.MULTILINE)
    assert [name for name, _, _ in planned] == ["install", "preflight", "gpu-tests", "inference", "generation",
                                               "embeddings", "encoder-curve", "memory-model", "train-step", "overlap",
                                               "training"]
    assert sum(int(limit) for name, limit, _ in planned if name != "install") <= 540 + 300  # the budget binds
    commands = {name: command for name, _, command in planned}
    assert commands["install"].endswith("-m pip install --no-deps --no-build-isolation --no-input "
                                        "--disable-pip-version-check -e .")
    assert "assert torch.cuda.is_available()" in commands["preflight"]
    gpu_tests = commands["gpu-tests"]
    assert "-m pytest -q -rfEs -p no:cacheprovider -o addopts=--import-mode=importlib -m gpu " in gpu_tests  # no xdist
    assert {"tests/memory/test_measure.py", "tests/memory/test_device.py", "tests/data/test_collate.py"} <= set(gpu_tests.split())
    for name, script in (("inference", "inference"), ("generation", "generation"), ("embeddings", "embeddings"),
                         ("encoder-curve", "encoder_curve"), ("memory-model", "memory_model"),
                         ("train-step", "train_step"), ("overlap", "overlap")):
        assert f"benchmarks/{script}.py --device cuda" in commands[name]
        assert f"--output <work>/{script}.md" in commands[name]  # a table in a work folder, gathered in summary.md
    assert "a budget of 540 s" in result.stdout  # the run never outlasts it, whatever each step's limit
    assert f"then: {out}/summary.md (every step and table) and {out}/logs.txt (every step's output)" in result.stdout
    assert "nvidia-smi --query-gpu=name" in result.stdout and "DYNABATCH_BENCH_ASSETS=repo" in result.stdout
    assert not out.exists()  # nothing ran
    skipped = subprocess.run(["bash", str(GPU_SH), "--dry-run", "--no-install", "--rehearse", "--budget", "600"],
                             check=False, capture_output=True, text=True, timeout=60)
    assert "skip  install (--no-install)" in skipped.stdout and "run   install" not in skipped.stdout
    assert "a budget of 600 s" in skipped.stdout and "--device cuda" not in skipped.stdout  # rehearsed on the CPU
    bad = subprocess.run(["bash", str(GPU_SH), "--bogus"], check=False, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown option --bogus" in bad.stderr
    bad = subprocess.run(["bash", str(GPU_SH), "--budget", "soon"], check=False, capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "--budget should be a whole number of seconds, but got --budget=soon" in bad.stderr


def test_gpu_sh_leaves_two_files_and_goes_on_past_a_failed_step(tmp_path):
    # The device tool brings back at most 8 files: the run leaves summary.md and logs.txt, whatever failed. Here
    # the preflight passes on the CPU (--rehearse) and every later step fails at once: python is a stand-in that
    # runs the preflight's -c and exits 3 on anything else.
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\nif [ "$1" = "-c" ]; then exec {sys.executable} "$@"; fi\necho "cannot run $*"; exit 3\n')
    fake.chmod(0o755)
    out = tmp_path / "out"
    result = subprocess.run(["bash", str(GPU_SH), "--no-install", "--rehearse", "--out", str(out)], check=False,
                            capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHON": str(fake)})
    assert result.returncode == 1, result.stderr
    assert sorted(p.name for p in out.rglob("*")) == ["logs.txt", "summary.md"]
    summary = (out / "summary.md").read_text()
    assert summary == result.stdout
    assert "| install | skipped (--no-install) | 0 | |" in summary
    assert re.search(r"^\| preflight \| ok \| \d+ \| rehearsal on the CPU \|$", summary, re.MULTILINE)
    for name in ("gpu-tests", "inference", "generation", "embeddings", "encoder-curve", "memory-model", "train-step",
                 "overlap", "training"):
        assert re.search(rf"^\| {name} \| FAILED \(exit 3\) \| \d+ \| ", summary, re.MULTILINE), (name, summary)
    logs = (out / "logs.txt").read_text()
    assert logs.count("\n===== ") == 10 and "cannot run benchmarks/overlap.py --device cpu --n-texts 300" in logs


def test_the_repositorys_assets_are_the_kjv_and_a_tokenizer_trained_on_it():
    from transformers import AutoTokenizer

    from dynabatch.demo import kjv_passages

    with gzip.open(ROOT / "benchmarks" / "assets" / "kjv.txt.gz", "rt", encoding="utf-8") as f:
        assert f.read().splitlines() == kjv_passages()  # the very text dynabatch.demo reads
    tokenizer = AutoTokenizer.from_pretrained(ROOT / "benchmarks" / "assets" / "kjv-wordpiece")
    assert tokenizer.pad_token_id == 0 and len(tokenizer) == 8192
    ids = tokenizer("In the beginning God created the heaven and the earth.")["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "in the beginning god created the heaven and the earth."
    assert tokenizer.unk_token_id not in ids  # its own text needs no unknown token


def test_the_packed_training_step_runs_and_checks_packed_against_padded_on_the_cpu(warm, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "DYNABATCH_BENCH_ASSETS": "repo"}
    out = tmp_path / "train_step.md"
    args = ["--device", "cpu", "--steps", "3", "--hidden", "32", "--layers", "1", "--capacity", "128",
            "--n-texts", "200", "--threads", "1", "--output", str(out)]
    result = _warm.run(warm, [sys.executable, str(ROOT / "benchmarks" / "train_step.py"), *args], check=False,
                            capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    text = out.read_text()
    assert text.startswith("## Packed training steps on cpu")
    for check in ("packed loss = padded loss", "every loss finite", "loss went down"):
        assert f"| {check} | ok |" in text
    assert re.search(r"\| peak memory of one step \| [\d,.]+ MiB \|", text)


def test_oom_learning_benchmark_prints_both_modes(warm):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    script = ROOT / "benchmarks" / "oom_learning.py"
    result = _warm.run(warm, [sys.executable, str(script), "--n-texts", "120"], check=False, capture_output=True,
                            text=True, env=env, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    for mode in ("measured (a dynabatch loader)", "guarded (batches of 40 rows)"):
        assert re.search(rf"^\| {re.escape(mode)} \| \d+ \| \d+ \| \d+ \| \d+ \| (\d+|-) \| [\d.e+-]+ \| [\d.]+ \|$",
                         result.stdout, re.MULTILINE), result.stdout


def test_scale_benchmark_prints_every_method_and_the_three_targets(warm):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    script = ROOT / "benchmarks" / "scale.py"
    result = _warm.run(warm, [sys.executable, str(script), "--sizes", "300", "--threads", "1", "--flat-repeats", "1"],
                            check=False, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    for method, disk in (("run", r"-"), ("run, output_path", r"[\d.]+"),
                         ("by hand (sentence-transformers' way)", r"-")):
        assert re.search(rf"^\| 300 \| {re.escape(method)} \| [\d.]+ \| [\d,]+ \| -?[\d,]+ \| {disk} \|$", result.stdout,
                         re.MULTILINE), (method, result.stdout)
    assert re.search(r"^- 300 texts: output_path / run wall time [\d.]+x \(target <= 1.10: (met|missed)\); RSS growth "
                     r"with output_path [\d,]+ MB vs token store [\d,]+ MB \+ 300 MB \(target: (met|missed)\); store / "
                     r"raw tensor bytes [\d.]+x \(target <= 1.15: (met|missed)\)$", result.stdout, re.MULTILINE)
    assert re.search(r"^- 300 texts: the job lock [\d.,]+ ms and the store's accounting read [\d.,]+ ms: [\d.]+% of "
                     r"the run's wall \(target <= 2%: (met|missed)\)$", result.stdout, re.MULTILINE), result.stdout
    for merged in ("yes", "no"):  # a store of small shards, merged or not
        assert re.search(rf"^\| 300 \| {merged} \| \d+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \|$",
                         result.stdout,
                         re.MULTILINE), result.stdout
