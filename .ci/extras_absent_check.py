"""The bare package (no extra) as a user without an extra meets it: every module of the wheel imports (what needs
an extra imports it lazily), and each call that needs an extra, made here, fails naming the extra to install
(``pip install 'torch-dynabatch[ray]'``), not with a bare ModuleNotFoundError from inside dynabatch; each command's
``--help`` runs, and a command line needing an extra refuses in one line naming it, not a traceback. Run by
.ci/wheel_check.sh in the bare install's clean virtual environment, before any extra is added."""

import importlib
import os
import pkgutil
import re
import tempfile

import dynabatch

modules = [m.name for m in pkgutil.walk_packages(dynabatch.__path__, "dynabatch.") if not m.name.endswith("__main__")]
for name in modules:
    importlib.import_module(name)  # raises, naming the module, where an optional package is imported at the top
print(f"imported all {len(modules)} modules of dynabatch without an extra")

from dynabatch import demo  # noqa: E402
from dynabatch.compat.multitask import BatchMetrics, DynamicBatchingMonitor  # noqa: E402
from dynabatch.inference.report import RunReport  # noqa: E402
from dynabatch.integrations import ray as dray  # noqa: E402
from dynabatch.integrations.trl import pack_dataset  # noqa: E402

folder = tempfile.mkdtemp()
os.environ["DYNABATCH_CACHE_DIR"] = folder  # the demo's Llama-2 tokenizer is made, not read from a cache


def monitor_plots():
    monitor = DynamicBatchingMonitor(output_dir=folder)
    monitor.record_batch(BatchMetrics(batch_idx=0, timestamp=0.0, task_types=["T"], batch_size=1, loss=1.0,
                                      per_task_loss={"T": 1.0}, memory_allocated_mb=1.0, predicted_memory_mb=1.0))
    monitor.plot_training_curves()


calls = {  # each call, and the extra that installs what it needs
    "dynabatch.demo.kjv_passages()": (demo.kjv_passages, "examples"),
    "dynabatch.demo.minilm_path()": (demo.minilm_path, "examples"),
    "dynabatch.demo.joke_texts()": (demo.joke_texts, "examples"),
    "dynabatch.demo.llama2_tokenizer_path()": (demo.llama2_tokenizer_path, "examples"),
    "map_texts": (lambda: dray.map_texts([], dray.DynamicBatchPredictor, batch_size=4, max_input_token_length=8),
                  "ray"),
    "stored_results": (lambda: dray.stored_results(folder, key="k"), "ray"),
    "pack_dataset": (lambda: pack_dataset([{"input_ids": [1]}], seq_length=4), "trl"),
    "tokenize_source": (lambda: dynabatch.tokenize_source(["a b"], str.split), "train"),
    "RunReport.plot": (lambda: RunReport([]).plot(os.path.join(folder, "run.png")), "plot"),
    "the multi-task monitor's plots": (monitor_plots, "train"),
}
for what, (call, extra) in calls.items():
    try:
        call()
    except ModuleNotFoundError as exc:
        rule = rf"needs \w+, which is not installed: pip install 'torch-dynabatch\[{extra}\]'$"
        assert re.search(rule, str(exc)), f"{what} without the {extra} extra: {exc!r} does not say how to install it"
        print(f"{what}: {exc}")
    else:
        raise AssertionError(f"{what} ran without the {extra} extra: is it installed in the bare environment?")

# The command lines as a user without an extra meets them: each command's --help, from the console script the wheel
# installs; and each command that needs an extra refuses in one line naming it (exit status 2, no traceback).
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

script = str(Path(sys.executable).with_name("dynabatch"))
for command in ([script], [script, "embed"], [script, "generate"], [script, "calibrate"],
                [sys.executable, "-m", "dynabatch.demo"]):
    done = subprocess.run([*command, "--help"], capture_output=True, text=True, cwd=folder)
    assert done.returncode == 0 and done.stdout.startswith("usage: "), f"{command} --help: {done.stderr[-2000:]}"
print("dynabatch, dynabatch embed|generate|calibrate and python -m dynabatch.demo: --help")
Path(folder, "corpus").mkdir()
Path(folder, "corpus", "part.csv").write_text("id,text\n1,in the beginning\n", encoding="utf-8")
Path(folder, "model").mkdir()  # a folder the store does not lie in (its files are the model's identity)
refusals = {  # each command line, and the extra its refusal names
    "python -m dynabatch.demo corpus corpus/ --rows 100": ([sys.executable, "-m", "dynabatch.demo", "corpus",
                                                             "demo-corpus/", "--rows", "100"], "examples"),
    "python -m dynabatch.demo chat-model my-model": ([sys.executable, "-m", "dynabatch.demo", "chat-model",
                                                       "my-model"], "examples"),
    "dynabatch embed (the demo's model)": ([script, "embed", "corpus/", "embeddings/", "--id-column", "id"],
                                           "examples"),
    "dynabatch embed --plot": ([script, "embed", "corpus/", "embeddings/", "--model", "model", "--plot", "b.png"],
                               "plot"),
    "dynabatch embed --ray": ([script, "embed", "corpus/", "embeddings/", "--model", "model", "--ray", "auto"], "ray"),
}
for what, (command, extra) in refusals.items():
    done = subprocess.run(command, capture_output=True, text=True, cwd=folder)
    said = done.stderr.strip().splitlines()
    assert done.returncode == 2 and "Traceback" not in done.stderr and f"torch-dynabatch[{extra}]" in said[-1], (
        f"{what} without the {extra} extra: exit status {done.returncode}, {done.stderr[-2000:]!r}")
    print(f"{what}: {said[-1]}")
