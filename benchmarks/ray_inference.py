"""Ray Data inference: fixed-size ``map_batches`` (what users do today) against ``dynabatch.integrations.ray``, in
one run.

The same texts and the same model go through Ray Data on the same actor pool,
once per method, and the script prints one markdown table:

1. ``fixed``: ``ds.map_batches(FixedSize, batch_size=--batch-size,
   compute=ActorPoolStrategy(size=--actors))``: every call gets
   ``--batch-size`` rows in dataset order, tokenizes them with
   ``padding=True, truncation=True, max_length=--max-length`` and runs the
   model on them: what Ray Data's row-count batching gives;
2. ``dynabatch``: ``dynabatch.integrations.ray.map_texts(ds, Embed, batch_size=--batch-size,
   max_input_token_length=--max-length, window=--window, actors=--actors)``:
   windows of ``--window`` rows, each tokenized once, planned longest first into
   memory-safe batches and run with out-of-memory splitting; each actor carries
   its measured memory model from one window to the next;
3. ``dynabatch, sorted`` (``--sort``): the same with ``sort_by_length=True``:
   a global sort by text length before the windows are cut (the rows then
   reach the actors longest first, not in the dataset's order).

The model is the real all-MiniLM-L6-v2 (offline, from ``dynabatch.demo``),
``fn = model(**batch).last_hidden_state[:, 0]`` under ``torch.inference_mode()``;
the texts are ``dynabatch.demo.vary_lengths(kjv_passages(), --n-texts,
max_words=300, seed=--seed)``: real King James Bible text, 1-300 words
(log-uniform), in random order. Every model call's peak memory is measured
with ``dynabatch.track_peak_memory`` on ``--device`` (the CPU storage tracker,
whose per-op overhead every method pays, or CUDA's statistics).

Columns:

* wall s: the dataset's execution, actor start-up (model load) included;
  rows/s: rows over wall s; busy rows/s: rows over the time from the first
  model call's start to the last one's end, over all actors (start-up excluded);
  speed-up: the method's rows/s over fixed's, both ways of counting;
* batches, largest batch (rows), padding efficiency (real tokens over padded cells);
* max peak / ref and batches > ref: each batch's peak over the reference, the
  peak a fixed ``--batch-size`` needs on these texts: the largest measured peak,
  over every method, of a batch no larger (rows and width) than
  ``--batch-size`` x the longest padded length (the first batch dynabatch plans
  in every window). That batch's own peak is not always the largest of its
  shape: on the CPU a batch without padding skips MiniLM's attention mask;
* outputs = fixed: every row's embedding equals fixed's within ``atol=1e-4``
  (each row is checked by its ``id``).

Ray Data runs on a local Ray (``ray.init(num_cpus=--actors)``) unless
``--address`` names a cluster (``--address auto`` inside one; see
``docs/ray.md``): there every node needs dynabatch and its ``examples`` extra
installed. Locally, the workers get this checkout on ``PYTHONPATH``.

``--command`` compares the command line instead (the same texts as a Parquet
corpus with ids): ``dynabatch embed CORPUS STORE --id-column id`` on this
machine, against the same command with ``--ray ADDRESS`` on a local Ray cluster
started for it as its own processes (``ray start --head --num-cpus
--actors``; or ``--address``'s), one after the other in one run. Its table:
wall s (the command's process, start to end), rows/s over it, the summary's
running rows/s (its batches' time: on Ray, the busiest actor's), the ratio to
one machine, batches, padding efficiency, and whether the Ray store holds the
same ids with each vector at cosine >= 0.9999 of one machine's.
``--kills K`` then SIGKILLs the Ray command's driver K times at random points of
its progress (once it has stored 1 to half of the windows left, then 0-2 s: mid-job
whatever the machine's speed), reruns it to the end, and checks the store again:
every id once, vectors equal.

Run it with::

    python benchmarks/ray_inference.py                      # 2000 texts, 2 actors, 1 CPU each
    python benchmarks/ray_inference.py --n-texts 500 --window 256 --sort
    python benchmarks/ray_inference.py --address auto --actors 8 --device cuda --num-gpus 1 --n-texts 200000
    python benchmarks/ray_inference.py --command --n-texts 1000 --batch-size 64 --kills 5
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's dynabatch, as the local workers get it

from dynabatch.demo import kjv_passages, vary_lengths
from dynabatch.integrations.ray import DynamicBatchPredictor, map_texts

logger = logging.getLogger("benchmarks.ray_inference")

STATS = "_batch_stats"  # a column: one JSON document per window on its first row, "" on the others
MAX_WORDS = 300


def _minilm(device: str) -> tuple[Any, Any]:
    from transformers import AutoModel, AutoTokenizer

    from dynabatch.demo import minilm_path

    return AutoTokenizer.from_pretrained(minilm_path()), AutoModel.from_pretrained(minilm_path()).to(device).eval()


def _stats_column(n: int, document: dict[str, Any]) -> np.ndarray:
    column = np.full(n, "", dtype=object)
    if n:
        column[0] = json.dumps(document)
    return column


class FixedSize:
    """What users write today: one model call per Ray batch of ``batch_size`` rows, padded to its longest."""

    def __init__(self, max_length: int, device: str) -> None:
        import torch

        self.torch = torch
        self.max_length, self.device = max_length, device
        self.tokenizer, self.model = _minilm(device)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from dynabatch import track_peak_memory

        start = time.time()
        texts = batch["text"].tolist()
        inputs = self.tokenizer(texts, padding=True, truncation=True, max_length=self.max_length,
                                return_tensors="pt").to(self.device)
        with self.torch.inference_mode(), track_peak_memory(self.device) as peak:
            output = self.model(**inputs).last_hidden_state[:, 0]
        rows, width = inputs["input_ids"].shape
        end = time.time()
        record = {"rows": rows, "width": width, "real_tokens": int(inputs["attention_mask"].sum()),
                  "padded_tokens": rows * width, "peak_bytes": peak.peak_bytes}
        out = dict(batch)
        out["output"] = output.cpu().numpy()
        out[STATS] = _stats_column(len(texts), {"pid": os.getpid(), "start": start, "end": end,
                                                "batches": [record]})
        return out


class Embed(DynamicBatchPredictor):
    """The same model through dynabatch: each window's batch records go out in the stats column."""

    def setup(self) -> tuple[Any, Any]:
        self._window_stats: dict[str, Any] = {}
        tokenizer, model = _minilm(self.device or "cpu")
        return tokenizer, lambda b: model(**b).last_hidden_state[:, 0]

    def window_done(self, report: Any, plan: str) -> None:
        super().window_done(report, plan)
        self._window_stats = {
            "plan": plan, "replans": self.replans,
            "batches": [{"rows": r.rows, "width": r.width, "real_tokens": r.real_tokens,
                         "padded_tokens": r.padded_tokens, "peak_bytes": r.peak_bytes} for r in report.records]}

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        start = time.time()
        out = super().__call__(batch)
        out[STATS] = _stats_column(len(batch["text"]), dict(self._window_stats, pid=os.getpid(), start=start,
                                                            end=time.time()))
        return out


@dataclass
class Result:
    method: str
    wall: float
    rows: int
    windows: list[dict[str, Any]]
    outputs: dict[int, np.ndarray]

    @property
    def batches(self) -> list[dict[str, Any]]:
        return [b for w in self.windows for b in w["batches"]]

    @property
    def busy(self) -> float:
        return max(w["end"] for w in self.windows) - min(w["start"] for w in self.windows)


def _collect(method: str, ds: Any, started: float) -> Result:
    rows = ds.take_all()
    wall = time.perf_counter() - started
    windows = [json.loads(r[STATS]) for r in rows if r[STATS]]
    return Result(method, wall, len(rows), windows, {int(r["id"]): np.asarray(r["output"]) for r in rows})


def run_fixed(ray: Any, ds: Any, args: argparse.Namespace) -> Result:
    started = time.perf_counter()
    remote = {"num_gpus": args.num_gpus} if args.num_gpus else {}
    out = ds.map_batches(FixedSize, fn_constructor_kwargs={"max_length": args.max_length, "device": args.device},
                         batch_size=args.batch_size, compute=ray.data.ActorPoolStrategy(size=args.actors), **remote)
    return _collect("fixed map_batches", out, started)


def run_dynabatch(ds: Any, args: argparse.Namespace, *, sort: bool) -> Result:
    started = time.perf_counter()
    out = map_texts(ds, Embed, batch_size=args.batch_size, max_input_token_length=args.max_length,
                    window=args.window, actors=args.actors, num_gpus=args.num_gpus, sort_by_length=sort,
                    device=args.device)
    return _collect("dynabatch, sorted" if sort else "dynabatch", out, started)


def reference_peak(results: list[Result], batch_size: int) -> tuple[int, int]:
    """The reference peak and the longest padded length: the largest peak of a batch no larger than
    ``batch_size`` rows x the longest padded length, over every method."""
    width = max(b["width"] for r in results for b in r.batches)
    peaks = [b["peak_bytes"] for r in results for b in r.batches
             if b["rows"] <= batch_size and b["width"] <= width and b["peak_bytes"] is not None]
    return max(peaks), width


def table(results: list[Result], batch_size: int) -> list[str]:
    reference, width = reference_peak(results, batch_size)
    fixed = results[0]
    lines = [("| method | wall s | rows/s | busy rows/s | speed-up (wall / busy) | batches | largest batch | "
              "padding efficiency | max peak / ref | batches > ref | outputs = fixed |"),
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        batches = r.batches
        real = sum(b["real_tokens"] for b in batches)
        padded = sum(b["padded_tokens"] for b in batches)
        ratios = [b["peak_bytes"] / reference for b in batches if b["peak_bytes"] is not None]
        same = all(np.allclose(r.outputs[i], fixed.outputs[i], atol=1e-4, rtol=0) for i in fixed.outputs) \
            and sorted(r.outputs) == sorted(fixed.outputs)
        rate, busy = r.rows / r.wall, r.rows / r.busy
        lines.append(
            f"| {r.method} | {r.wall:.1f} | {rate:.1f} | {busy:.1f} | {rate / (fixed.rows / fixed.wall):.2f}x / "
            f"{busy / (fixed.rows / fixed.busy):.2f}x | {len(batches)} | {max(b['rows'] for b in batches)} | "
            f"{real / padded:.1%} | {max(ratios):.3f} | {sum(x > 1.0 for x in ratios)} | "
            f"{'yes' if same else 'NO'} |")
    lines.append("")
    lines.append(f"Reference peak: {reference / 2**20:.1f} MiB ({batch_size} rows x {width} tokens or fewer).")
    for r in results[1:]:
        plans = [w.get("plan") for w in r.windows]
        counts = {p: plans.count(p) for p in dict.fromkeys(plans)}
        replans = max((w.get("replans", 0) for w in r.windows), default=0)
        per_actor: dict[int, list[int]] = {}
        for w in sorted(r.windows, key=lambda w: w["start"]):
            per_actor.setdefault(w["pid"], []).append(sum(b["rows"] for b in w["batches"]))
        lines.append(f"{r.method}: {len(r.windows)} windows planned {counts}, rows per window by actor "
                     f"{list(per_actor.values())}; at most {replans} replanned per actor (a window with longer "
                     "texts than measured).")
    return lines


def machine(args: argparse.Namespace) -> str:
    import torch

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = f", load average {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
    where = f"Ray cluster at {args.address}" if args.address else f"local Ray, num_cpus={args.actors}"
    return (f"{platform.platform()}, {platform.machine()}, {cpus} CPUs{load}; python {platform.python_version()}, "
            f"torch {torch.__version__}; {where}; {args.actors} actors, {args.num_gpus or 0} GPU(s) each, "
            f"device {args.device}")


# The command as ``python -m dynabatch`` runs it, its Ray path logging its phases (connect, windows, actors' loads).
_LOGGED = ("import logging, sys; from dynabatch.cli import main; "
           "logging.getLogger('dynabatch.cli.on_ray').setLevel(logging.INFO); sys.exit(main(sys.argv[1:]))")


def _command_run(command: list[str], env: dict[str, str], report: Path) -> dict[str, Any]:
    """Runs a ``dynabatch embed`` command to its end; its wall time, its report (every batch) and its stderr."""
    import subprocess

    assert command[1:3] == ["-m", "dynabatch"]
    started = time.perf_counter()
    done = subprocess.run([command[0], "-c", _LOGGED, *command[3:], "--report", str(report)], env=env,
                          capture_output=True, text=True, check=False)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    data = json.loads(report.read_text())
    return {"wall": wall, "summary": data["summary"], "stdout": done.stdout, "stderr": done.stderr}


def _number(pattern: str, text: str) -> float:
    import re

    found = re.search(pattern, text)
    return float(found.group(1)) if found else float("nan")


def ray_phases(on_ray: dict[str, Any], one: dict[str, Any]) -> str:
    """Where the ``--ray`` command's wall went, from its log: the driver's checks before Ray (one machine does them
    too), connecting, the windows until the first came back (the actors' start: a process each, imports, the
    model's load; then a window), the rest of the windows, and what followed (summary, Ray's shutdown); beside one
    machine's wall and its batches' seconds."""
    log = on_ray["stderr"]
    before = _number(r"Ray connected ([\d.]+) s after", log)
    connect = _number(r"after the command started, in ([\d.]+) s", log)
    first = _number(r"the first back ([\d.]+) s", log)
    last = _number(r"the last ([\d.]+) s", log)
    busiest = _number(r"busiest actor's windows took ([\d.]+) s", log)
    loads = _number(r"began loading their model ([\d.]+)", log), _number(r"loading took ([\d.]+)", log)
    after = on_ray["wall"] - before - connect - last
    return (f"Where the --ray wall went ({on_ray['wall']:.1f} s): the driver's checks before Ray {before:.1f} s, "
            f"connecting {connect:.1f} s, the first window back after {first:.1f} s (the first actor began loading "
            f"its model {loads[0]:.1f} s after the windows were sent, and loaded it in {loads[1]:.1f} s), the "
            f"other windows {last - first:.1f} s more (the busiest actor's windows: {busiest:.1f} s), then "
            f"{after:.1f} s (summary, Ray's shutdown). One machine: {one['wall']:.1f} s in all, "
            f"{one['summary']['seconds']:.1f} s running its batches.")


def _store(path: Path) -> dict[str, np.ndarray]:
    import pyarrow.dataset as pds

    table = pds.dataset(path, format="parquet").to_table(columns=["id", "output"])
    ids = table.column("id").to_pylist()
    assert len(ids) == len(set(ids)), "an id stored twice"
    return dict(zip(ids, table.column("output").to_numpy(zero_copy_only=False)))


def _same_store(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> tuple[bool, float]:
    """Whether ``got`` holds the ids of ``want``, each once; the lowest cosine of a vector to its own in ``want``."""
    if sorted(got) != sorted(want):
        return False, float("nan")
    cosines = [float(np.dot(got[k], want[k]) / (np.linalg.norm(got[k]) * np.linalg.norm(want[k]))) for k in want]
    return True, min(cosines)


def _stored(path: Path) -> int:
    import pyarrow.dataset as pds

    return pds.dataset(path, format="parquet").count_rows() if list(path.glob("part-*.parquet")) else 0


def _kill_and_rerun(command: list[str], env: dict[str, str], kills: int, windows: int, seed: int) -> list[int]:
    """SIGKILLs the command ``kills`` times, each at a random point of its progress (once it has stored a random
    number of new windows, 1 to half of those left, then after a random 0-2 s: mid-job whatever the machine's
    speed), then reruns it to its end (a rerun refused while the killed driver's actors still hold the store is
    tried again); the rows stored after each kill, then those the rerun found stored."""
    import random
    import re
    import signal
    import subprocess

    pick, held, store = random.Random(seed), [], Path(command[5])  # python -m dynabatch embed CORPUS STORE ...
    for _ in range(kills):
        shards = len(list(store.glob("part-w*.parquet")))
        target = shards + pick.randint(1, max(1, (windows - shards) // 2))
        driver = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  start_new_session=True)
        while driver.poll() is None and len(list(store.glob("part-w*.parquet"))) < target:
            time.sleep(0.1)
        time.sleep(pick.uniform(0, 2))
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
        driver.wait()
        held.append(_stored(store))
    while True:
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        if done.returncode == 2 and "no other job is writing" in done.stderr:
            time.sleep(2)
            continue
        if done.returncode != 0:
            raise SystemExit(f"the rerun failed ({done.returncode}):\n{done.stderr[-2000:]}")
        return [*held, int(re.search(r"run now, ([\d,]+) stored before", done.stdout).group(1).replace(",", ""))]


def command_table(args: argparse.Namespace, texts: list[str]) -> list[str]:
    """The command on this machine against the same command with ``--ray`` (see the module): the table is printed
    as soon as both have run, the kills' line after it (returned)."""
    import socket
    import subprocess
    import tempfile

    import pyarrow as pa
    import pyarrow.parquet as pq

    work = Path(tempfile.mkdtemp(prefix="dynabatch-ray-command-"))
    (work / "corpus").mkdir()
    pq.write_table(pa.table({"id": [f"doc-{i}" for i in range(len(texts))], "text": texts}),
                   work / "corpus" / "part-0.parquet")
    path = os.pathsep.join(p for p in [str(ROOT), os.environ.get("PYTHONPATH", "")] if p)
    env = dict(os.environ, PYTHONPATH=path, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               RAY_AUTH_MODE="disabled")  # the local cluster of this run: no token to share between its processes
    base = [sys.executable, "-m", "dynabatch", "embed", str(work / "corpus")]
    options = ["--id-column", "id", "--batch-size", str(args.batch_size), "--max-length", str(args.max_length),
               "--no-progress"]
    address, ray_cli = args.address, str(Path(sys.executable).with_name("ray"))
    if address is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        subprocess.run([ray_cli, "start", "--head", "--num-cpus", str(args.actors), "--port", str(port),
                        "--include-dashboard", "false", "--disable-usage-stats"], env=env, check=True,
                       capture_output=True)
        address = f"127.0.0.1:{port}"
    try:
        one = _command_run([*base, str(work / "one"), *options], env, work / "one.json")
        on_ray = _command_run([*base, str(work / "ray"), *options, "--ray", address], env, work / "ray.json")
        want = _store(work / "one")
        same, cosine = _same_store(_store(work / "ray"), want)
        print("\n".join(_comparison(one, on_ray, len(texts), same, cosine)), flush=True)
        print("\n" + ray_phases(on_ray, one) + "\n", flush=True)
        if not args.kills:
            return []
        command = [*base, str(work / "killed"), *options, "--ray", address]
        from dynabatch.cli.on_ray import window_rows

        held = _kill_and_rerun(command, env, args.kills,
                               -(-len(texts) // window_rows(len(texts), args.actors, args.batch_size)), args.seed)
        same_k, cosine_k = _same_store(_store(work / "killed"), want)
    finally:
        if args.address is None:
            subprocess.run([ray_cli, "stop", "--force"], env=env, capture_output=True, check=False)
    return [f"Driver SIGKILLed {args.kills} times at random points of its progress (after 1 to half of the "
            f"windows left were stored, then 0-2 s): rows stored after each kill "
            f"{', '.join(f'{h:,}' for h in held[:-1])}; the rerun "
            f"found {held[-1]:,} of {len(texts):,} rows stored and ran the rest; every id once: "
            f"{'yes' if same_k else 'NO'}; min cosine to one machine's: {cosine_k:.6f}."]


def _comparison(one: dict[str, Any], on_ray: dict[str, Any], n: int, same: bool, cosine: float) -> list[str]:
    """The table of the command on one machine and on Ray."""
    lines = ["| method | wall s | rows/s | running rows/s | ratio to one machine (wall / running) | batches | "
             "padding efficiency | ids = one machine | min cosine |", "|---|---|---|---|---|---|---|---|---|"]
    for name, run in (("dynabatch embed", one), ("dynabatch embed --ray ADDRESS", on_ray)):
        summary = run["summary"]
        rate, running = n / run["wall"], summary["rows_per_s"]
        ratio = (f"{rate / (n / one['wall']):.2f}x / {running / one['summary']['rows_per_s']:.2f}x")
        check = ("yes", f"{cosine:.6f}") if run is on_ray else ("reference", "1")
        if run is on_ray and not same:
            check = ("NO", "-")
        lines.append(f"| {name} | {run['wall']:.1f} | {rate:.1f} | {running:.1f} | {ratio} | {summary['batches']} | "
                     f"{summary['padding_efficiency']:.1%} | {check[0]} | {check[1]} |")
    lines.append("")
    lines.append("The --ray summary's model line: "
                 + next(line.split(" on ", 1)[1] for line in on_ray["stdout"].splitlines() if "  model " in line))
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n-texts", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--window", type=int, default=1024,
                        help="rows per dynabatch window (map_texts' default for batch_size 16)")
    parser.add_argument("--actors", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--num-gpus", type=float, default=0, help="GPUs per actor")
    parser.add_argument("--address", default=None, help="a Ray cluster's address ('auto' inside one)")
    parser.add_argument("--sort", action="store_true", help="also run dynabatch with sort_by_length=True")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--command", action="store_true",
                        help="compare dynabatch embed on this machine with dynabatch embed --ray (see the module)")
    parser.add_argument("--kills", type=int, default=0, help="with --command: SIGKILL the --ray driver K times")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    command = "python benchmarks/ray_inference.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.command:
        texts = vary_lengths(kjv_passages(), args.n_texts, max_words=MAX_WORDS, seed=args.seed)
        print(f"## dynabatch embed (all-MiniLM-L6-v2) on one machine and on Ray: {args.n_texts} texts, batch_size "
              f"{args.batch_size}, max_length {args.max_length}\n")
        print(f"`{command.strip()}`\n")
        print(f"Machine: {machine(args)}.\n", flush=True)
        print("\n".join(command_table(args, texts)))
        return

    import ray

    if args.address:
        ray.init(address=args.address)
    else:
        path = os.pathsep.join(p for p in [str(ROOT), os.environ.get("PYTHONPATH", "")] if p)
        ray.init(num_cpus=args.actors, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": {
            "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}})
    ray.data.DataContext.get_current().enable_progress_bars = False

    texts = vary_lengths(kjv_passages(), args.n_texts, max_words=MAX_WORDS, seed=args.seed)
    ds = ray.data.from_items([{"id": i, "text": t} for i, t in enumerate(texts)])
    results = [run_fixed(ray, ds, args), run_dynabatch(ds, args, sort=False)]
    if args.sort:
        results.append(run_dynabatch(ds, args, sort=True))
    ray.shutdown()

    print(f"## all-MiniLM-L6-v2 embeddings through Ray Data: {args.n_texts} texts, batch_size {args.batch_size}, "
          f"max_length {args.max_length}, windows of {args.window} rows\n")
    print(f"`{command.strip()}`\n")
    print(f"Machine: {machine(args)}.\n")
    print("\n".join(table(results, args.batch_size)))


if __name__ == "__main__":
    main()
