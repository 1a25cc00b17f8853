"""``dynabatch embed --ray`` and ``dynabatch generate --ray``: the commands' jobs on a Ray cluster, into the same
store as on one machine.

One real local Ray cluster for the module, started as its own processes (``ray start --head --num-cpus 2``) and
given to the commands by its address: the commands run in this process (their input read by the driver or by Ray's
CSV reader, rows keyed by ``--id-column``; an actor killed as it starts, another after committing its window), and
as their own processes, SIGKILLed and rerun; these take minutes and run where ``DYNABATCH_TEST_RAY_CLUSTER=1`` asks
for them. In the default run: the refusals before Ray is reached, and ``generate --ray auto`` with
``RAY_ADDRESS=local``, which starts a local Ray for its job, as on a laptop (its first actor killed as it starts).
Every store is compared with the single-machine command's on the same corpus and model: the same ids, the same
input hashes, vectors at cosine >= 0.9999, the same replies; a store of one machine resumes on Ray and the reverse.
The actors are killed by a hook the Ray workers load (a ``sitecustomize`` module), armed by files.
"""

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.dataset as ds
import pytest

import _processes
from dynabatch.cli import main

pytest.importorskip("ray")

REPO = Path(__file__).resolve().parents[2]


# Loaded by every Python process of the module's Ray, acting in its workers alone (Ray's own processes, such as its
# agents, must start within Ray's timeouts), and only as the predictor's modules are imported (a worker registers
# with Ray before it imports them: importing torch here would hold every worker's start). Armed by files:
# DYNABATCH_TEST_DIE: the first actor to commit a window's shard claims it (a rename: one actor, once) and dies
# before its window returns, so Ray restarts it and runs that window again; DYNABATCH_TEST_DIE + ".start": the first
# actor to start claims it and dies as it starts, so Ray Data replaces it; + ".slow": the first actor to start then
# claims it and takes 10 minutes to start, so the other actors run every window and the job ends while it starts.
DIE_HOOK = """
import importlib.abc
import importlib.machinery
import os
import sys
import time

_die = os.environ.get("DYNABATCH_TEST_DIE")


def _claim(path):
    try:
        os.rename(path, path + ".claimed")
    except OSError:
        return False
    return True


def _arm(module):
    if module.__name__ == "dynabatch.integrations.ray._store":
        _write = module.WindowStore.write

        def _write_then_die(self, *args, **kwargs):
            written = _write(self, *args, **kwargs)
            if _claim(_die):
                with open(_die + ".claimed", "w") as f:
                    f.write(str(written))
                os._exit(1)
            return written

        module.WindowStore.write = _write_then_die
    else:
        _init = module.DynamicBatchPredictor.__init__

        def _die_then_init(self, *args, **kwargs):
            if _claim(_die + ".start"):
                os._exit(1)
            if _claim(_die + ".slow"):
                time.sleep(600)
            _init(self, *args, **kwargs)

        module.DynamicBatchPredictor.__init__ = _die_then_init


class _ArmOnImport(importlib.abc.MetaPathFinder):
    names = ("dynabatch.integrations.ray._store", "dynabatch.integrations.ray.predictor")

    def find_spec(self, name, path, target=None):
        if name not in self.names:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _arm(module)

        spec.loader.exec_module = exec_module
        return spec


if _die and any(arg.endswith("default_worker.py") for arg in sys.orig_argv):  # a worker: not Ray's own processes
    sys.meta_path.insert(0, _ArmOnImport())
"""


# The tests on the real cluster take about 4 minutes on two cores, Ray's start-ups most of it: asked for, as the
# SIGKILLs are (`DYNABATCH_TEST_RAY_CLUSTER=1 python -m pytest -n 0 tests/cli/test_ray_command.py`). The default run
# keeps the in-process cases: the refusals before Ray, and generate on a local Ray started by the command.
on_cluster = pytest.mark.skipif(os.environ.get("DYNABATCH_TEST_RAY_CLUSTER") != "1",
                                reason="a real local Ray cluster as its own processes, about 4 minutes: "
                                       "DYNABATCH_TEST_RAY_CLUSTER=1 runs it")

# A test cluster of this machine: no token to share between processes; Ray's memory monitor off, as it judges the
# node by the memory of every process of the machine (the other pytest worker's, the wheel check's) and kills this
# cluster's workers for it.
TEST_RAY = {"RAY_AUTH_MODE": "disabled", "RAY_memory_monitor_refresh_ms": "0"}


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _processes_under(folder: str) -> list[int]:
    """The processes whose command line names ``folder`` (a cluster's own: its temporary folder is theirs alone)
    and every process they started: that cluster's processes, and no other Ray's."""
    named = [pid for pid in _processes.stats() if folder in _processes.command_line(pid)]
    return sorted(set(named) | set(_processes.descendants(named)))


@pytest.fixture(scope="module")
def die_hook(tmp_path_factory):
    """A folder holding :data:`DIE_HOOK` as ``sitecustomize.py``: on ``PYTHONPATH`` with ``DYNABATCH_TEST_DIE``
    naming a file of it, the Ray workers started with that environment load the hook."""
    hook = tmp_path_factory.mktemp("ray-hook")
    (hook / "sitecustomize.py").write_text(DIE_HOOK)
    return hook


@pytest.fixture(scope="module")
def cluster(die_hook):
    """A real local Ray cluster for the module, started as its own processes (``ray start --head --num-cpus 2``,
    its own temporary folder); its workers load :data:`DIE_HOOK`. Stopped after by killing its own processes alone
    (``ray stop`` stops every Ray of the machine: another pytest worker's too). ``(address, the environment of a
    driver process, the file that arms the hook)``."""
    hook = die_hook
    temp = tempfile.mkdtemp(prefix="ray-")  # short: Ray's socket paths live under it
    base = dict(TEST_RAY, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    driver = dict(os.environ, **base,
                  PYTHONPATH=os.pathsep.join(p for p in [str(REPO), os.environ.get("PYTHONPATH", "")] if p))
    workers = dict(driver, DYNABATCH_TEST_DIE=str(hook / "die"),
                   PYTHONPATH=os.pathsep.join([str(hook), driver["PYTHONPATH"]]))
    port, before = _free_port(), {k: os.environ.get(k) for k in base}
    try:
        subprocess.run([str(Path(sys.executable).with_name("ray")), "start", "--head", "--num-cpus", "2", "--port",
                        str(port), "--include-dashboard", "false", "--disable-usage-stats", "--temp-dir", temp],
                       env=workers, check=True, capture_output=True, timeout=180)
        os.environ.update(base)  # this process's drivers too
        yield f"127.0.0.1:{port}", driver, hook / "die"
    finally:
        for pid in _processes_under(temp):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(temp, ignore_errors=True)


def _rows(store, key="id"):
    """The store read as any Parquet reader reads it: ``{id or position: (vector, input hash)}``, and how many rows."""
    table = ds.dataset(store, format="parquet").to_table()
    keys = table.column(key).to_pylist()
    vectors = np.stack(table.column("output").to_numpy(zero_copy_only=False))
    return dict(zip(keys, zip(vectors, table.column("input_hash").to_pylist()))), len(keys)


def _same(got, want):
    """The same keys, each once, with the same input hash and a vector at cosine >= 0.9999."""
    rows, n = got
    assert sorted(rows, key=str) == sorted(want, key=str) and n == len(want)  # every row once
    for key, (vector, digest) in rows.items():
        other, other_digest = want[key]
        assert digest == other_digest, key
        cosine = float(vector @ other / (np.linalg.norm(vector) * np.linalg.norm(other)))
        assert cosine >= 0.9999, (key, cosine)


def _ran(capsys, argv):
    """The command ``argv`` run in this process: its output; its error's last lines fail the test."""
    try:
        status = main(argv)
    except SystemExit as exc:
        status = exc.code
    out, err = capsys.readouterr()
    assert status == 0, "\n".join(err.strip().splitlines()[-30:])
    return out


def _embed(capsys, *argv):
    return _ran(capsys, ["embed", *map(str, argv), "--batch-size", "4", "--no-progress"])


@pytest.fixture(scope="module")
def corpora(tmp_path_factory, texts):
    """The corpus (Parquet, ids ``doc-i``), its first half, and the single-machine command's store of it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path_factory.mktemp("ray-command")
    ids = [f"doc-{i}" for i in range(len(texts))]
    for name, rows in (("whole", slice(None)), ("half", slice(0, len(texts) // 2))):
        (folder / name).mkdir()
        pq.write_table(pa.table({"id": ids[rows], "text": texts[rows]}), folder / name / "part-0.parquet")
    return folder


@pytest.fixture(scope="module")
def reference(corpora, bert_dir, tmp_path_factory):
    """The single-machine command's store of the whole corpus, keyed by id, read: ``({id: (vector, input hash)},
    rows)``."""
    store = tmp_path_factory.mktemp("ray-reference") / "one"
    assert main(["embed", str(corpora / "whole"), str(store), "--model", str(bert_dir), "--id-column", "id",
                 "--batch-size", "4", "--no-progress"]) == 0
    return _rows(store)


def test_a_second_job_or_a_bad_input_is_refused_before_ray_is_reached(corpora, bert_dir, tmp_path, capsys):
    from dynabatch.inference.store_lock import JobLock

    import pyarrow as pa
    import pyarrow.parquet as pq

    store = tmp_path / "held"
    store.mkdir()
    (tmp_path / "repeated").mkdir()  # an id given to two rows: refused as on one machine, before any actor runs
    pq.write_table(pa.table({"id": ["doc-0", "doc-1", "doc-0"], "text": ["a", "b", "c"]}),
                   tmp_path / "repeated" / "part-0.parquet")
    other = JobLock(str(store), "another job")
    try:
        for argv, message in [
            ([tmp_path / "repeated", tmp_path / "new", "--id-column", "id"], "--id-column='id': ids should be unique "
             "(one stable id per text), but got 1 id given to several texts (first: 'doc-0' at positions 0, 2)"),
            ([corpora / "whole", store, "--id-column", "id"], "output should be a store no other job is writing, "
             f"but got output={str(store)!r}: output_path={str(store)!r} should be written by one job at a time, "
             f"but another job is writing it (host {socket.gethostname()}"),
            ([corpora / "whole", tmp_path / "new", "--text-column", "body"],
             "--text-column should be a column of the input ['id', 'text'], but got --text-column='body'"),
            ([corpora / "whole", tmp_path / "new", "--devices", "cpu"], "--devices should be left out with --ray "
             "(Ray places one actor per GPU, or per CPU without GPUs), but got --devices='cpu'"),
            ([corpora / "whole", tmp_path / "new", "--max-memory", "2GB"], "--max-memory should be auto with --ray"),
            ([corpora / "whole", tmp_path / "new", "--max-memory", "80%"], "--max-memory should be auto with --ray"),
        ]:
            with pytest.raises(SystemExit) as info:
                main(["embed", *map(str, argv), "--model", str(bert_dir), "--ray", "auto"])
            err = capsys.readouterr().err
            assert info.value.code == 2 and len(err.strip().splitlines()) == 1, err
            assert err.startswith(f"dynabatch embed: error: {message}"), err
    finally:
        other.release()
    with pytest.raises(SystemExit) as info:
        main(["generate", str(corpora / "whole"), str(tmp_path / "new"), "--model", str(bert_dir), "--ray",
              "--id-column", "missing"])
    assert info.value.code == 2 and capsys.readouterr().err == (
        "dynabatch generate: error: --id-column should be a column of the input ['id', 'text'], but got "
        "--id-column='missing'\n")
    # An address where nothing answers: refused at once (ray.init waits minutes there), the store left unmade.
    port = _free_port()
    with pytest.raises(SystemExit) as info:
        main(["embed", str(corpora / "whole"), str(tmp_path / "new"), "--model", str(bert_dir), "--ray",
              f"127.0.0.1:{port}"])
    assert info.value.code == 2 and capsys.readouterr().err.startswith(
        f"dynabatch embed: error: --ray should be auto or the address of a running Ray cluster, but got "
        f"--ray='127.0.0.1:{port}': ConnectionError: nothing answers at 127.0.0.1:{port} (ConnectionRefusedError")
    import ray

    assert not ray.is_initialized()  # refused before Ray was reached (this module's Ray starts after this test)
    assert not (tmp_path / "new").exists()


def test_a_finished_jobs_rerun_on_ray_starts_no_ray_and_says_nothing_was_left(corpora, bert_dir, gpt2_dir, tmp_path,
                                                                               capsys, monkeypatch):
    # it started Ray (a local cluster, or a connection) and its actors, each loading the model, to run no window
    import ray

    def refused(*args, **kwargs):
        raise AssertionError("Ray was started for a job with nothing to run")

    for command, model, what in (("embed", bert_dir, "texts"), ("generate", gpt2_dir, "replies")):
        argv = [command, str(corpora / "half"), str(tmp_path / command), "--model", str(model), "--id-column", "id",
                "--batch-size", "4", "--no-progress", *(["--max-new-tokens", "2"] if command == "generate" else [])]
        assert main(argv) == 0  # on one machine: every input stored
        capsys.readouterr()
        with monkeypatch.context() as patched:
            patched.setattr(ray, "init", refused)
            assert main([*argv, "--ray", "auto"]) == 0
        said = capsys.readouterr().out
        assert f"60 of 60 {what} stored in {tmp_path / command} (0 run now, 60 stored before)" in said, said
        assert "nothing to run: every one was stored before" in said and "on no Ray started (--ray='auto')" in said
        assert not ray.is_initialized() and not list((tmp_path / command).glob(".lock-*"))


def _by_position(rows):
    """A store keyed by ids ``doc-i`` read as keyed by position ``i``."""
    return {int(key.removeprefix("doc-")): value for key, value in rows[0].items()}, rows[1]


@on_cluster
def test_on_ray_the_same_rows_are_stored_and_a_store_of_one_machine_resumes_there(
        cluster, corpora, bert_dir, reference, tmp_path, capsys):
    address, _, die = cluster
    whole, half, n = corpora / "whole", corpora / "half", 120
    want = _by_position(reference)[0]  # this store is keyed by position: no --id-column

    # Half on one machine, then the whole corpus on Ray: only what the store lacks runs there; an actor that dies
    # as it starts is replaced.
    store = tmp_path / "store"
    _embed(capsys, half, store, "--model", bert_dir)
    start = die.with_name("die.start")
    start.write_text("")
    out = _embed(capsys, whole, store, "--model", bert_dir, "--ray", address)
    assert not start.exists() and start.with_name("die.start.claimed").exists()  # an actor died as it started
    assert f"{n} of {n} texts stored in {store} (60 run now, 60 stored before)" in out
    assert f"on Ray cluster {address} (1 nodes, 2 CPUs, 0 GPUs): 2 actors, a CPU each" in out
    assert "texts/s" in out and "tokens/s" in out and "one row per input: position, output" in out
    _same(_rows(store, "position"), want)
    assert not list(store.glob(".lock-*"))  # the job's holds, the actors' too, are given up

    # The rows Ray wrote alone (one machine's shards removed), resumed on one machine.
    for shard in store.glob("part-*.parquet"):
        if not shard.name.startswith("part-w"):  # a window's shard is named after its rows
            shard.unlink()
    assert _rows(store, "position")[1] == 60
    out = _embed(capsys, whole, store, "--model", bert_dir)
    assert f"{n} of {n} texts stored in {store} (60 run now, 60 stored before)" in out
    _same(_rows(store, "position"), want)

    # A text changed under a stored row, on Ray: the command's one line and exit status 2, as on one machine (not
    # Ray's task error, exit 1, saying to run it again); the store as it was.
    import pyarrow.parquet as pq

    table = pq.read_table(whole)
    (tmp_path / "changed").mkdir()
    pq.write_table(table.set_column(1, "text", [["another text"] + table.column("text").to_pylist()[1:]]),
                   tmp_path / "changed" / "part-0.parquet")
    with pytest.raises(SystemExit) as info:
        main(["embed", str(tmp_path / "changed"), str(store), "--model", str(bert_dir), "--ray", address,
              "--batch-size", "4", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and err[-1].startswith(f"dynabatch embed: error: output={str(store)!r} should hold "
                                                       "results of these inputs at their positions, but got 1 stored "
                                                       "rows computed from other inputs (positions 0)"), err[-3:]
    _same(_rows(store, "position"), want)

    # A corpus of one row: one window, so one actor (not an actor per CPU, the others loading the model for
    # nothing); its vector one machine's.
    (tmp_path / "one").mkdir()
    pq.write_table(table.slice(0, 1), tmp_path / "one" / "part-0.parquet")
    out = _embed(capsys, tmp_path / "one", tmp_path / "one-store", "--model", bert_dir, "--ray", address)
    assert "1 of 1 texts stored" in out and f"on Ray cluster {address} (1 nodes, 2 CPUs, 0 GPUs): 1 actor, a CPU " \
                                            "each" in out
    _same(_rows(tmp_path / "one-store", "position"), {0: want[0]})


@on_cluster
def test_read_by_rays_readers_an_actor_killed_after_committing_its_window_stores_nothing_twice(
        cluster, corpora, bert_dir, reference, tmp_path, capsys):
    import pyarrow.parquet as pq
    from pyarrow import csv

    address, _, die = cluster
    table = pq.read_table(corpora / "whole")
    csv.write_csv(table, tmp_path / "corpus.csv")  # a CSV: its ids read as strings, as the command reads them
    store = tmp_path / "store"
    die.write_text("")  # the first actor to commit a window dies before returning it
    out = _embed(capsys, tmp_path / "corpus.csv", store, "--model", bert_dir, "--id-column", "id", "--ray", address)
    assert not die.exists() and die.with_name("die.claimed").read_text() not in ("", "0")  # it died, once
    assert f"120 of 120 texts stored in {store} (120 run now, 0 stored before)" in out
    assert "one row per input: id, output" in out
    _same(_rows(store), reference[0])  # every id once, the window run again


def _generate(capsys, *argv):
    return _ran(capsys, ["generate", *map(str, argv), "--max-new-tokens", "6", "--batch-size", "4", "--no-progress"])


def _replies(store, key):
    table = ds.dataset(store, format="parquet").to_table()
    keys = table.column(key).to_pylist()
    assert len(set(keys)) == len(keys)  # every row once
    return dict(zip(keys, table.column("output").to_pylist()))


def test_generate_on_ray_stores_the_same_replies_and_its_store_resumes_on_one_machine(
        gpt2_dir, texts, die_hook, tmp_path, capsys, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    # --ray auto joins any Ray running on this machine (the module's cluster too, Ray's rule); RAY_ADDRESS=local
    # makes it start a local Ray for the job, as on a laptop without a cluster. Its workers start with this
    # environment: they load the hook, and the first actor dies as it starts (Ray Data replaces it).
    monkeypatch.setenv("RAY_ADDRESS", "local")
    for name, value in TEST_RAY.items():
        monkeypatch.setenv(name, value)
    die = tmp_path / "die"
    monkeypatch.setenv("DYNABATCH_TEST_DIE", str(die))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in [str(die_hook), str(REPO),
                                                                  os.environ.get("PYTHONPATH", "")] if p))
    prompts = [" ".join(t.split()[:10]) for t in texts[:40]]
    for name, rows in (("whole", slice(None)), ("half", slice(0, 20))):
        (tmp_path / name).mkdir()
        pq.write_table(pa.table({"id": [f"p{i}" for i in range(40)][rows], "text": prompts[rows]}),
                       tmp_path / name / "part-0.parquet")
    model = ("--model", gpt2_dir, "--id-column", "id")
    _generate(capsys, tmp_path / "whole", tmp_path / "one", *model)
    want = _replies(tmp_path / "one", "id")

    # Half on Ray, resumed on one machine (a store of one machine resumed on Ray: the embedding test above). One
    # actor dies as it starts (Ray Data replaces it), another is still starting when the job ends (Ray drops it):
    # the job is whole, as the store says. The command runs as its own process, as users run it: in a process that
    # ran Ray before and shut it down (this pytest worker may have run tests/integrations/test_ray.py), Ray 2.60
    # loses a new job's actors before they start ("cancelled before it started running"; docs/ray.md).
    die.with_name("die.start").write_text("")
    die.with_name("die.slow").write_text("")
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "dynabatch", "generate", str(tmp_path / "half"), str(tmp_path / "ids"),
                           *map(str, model), "--ray", "auto", "--max-new-tokens", "6", "--batch-size", "4",
                           "--no-progress", "--report", str(tmp_path / "report.json")], capture_output=True, text=True,
                          timeout=600, check=False)
    took = time.perf_counter() - began
    assert done.returncode == 0, done.stderr[-3000:]
    # The job's report: its wall the driver's (null before), its batches numbered and timed on the job's clock.
    report = json.loads((tmp_path / "report.json").read_text())
    wall, batches = report["summary"]["wall_seconds"], report["batches"]
    assert 0 < wall < took and report["summary"]["accounting_seconds"] > 0
    assert sorted(b["batch"] for b in batches) == list(range(len(batches))) and sum(b["rows"] for b in batches) == 20
    assert all(0 < b["finished"] <= wall for b in batches)
    out = done.stdout
    assert not die.with_name("die.start").exists() and not die.with_name("die.slow").exists()
    assert "20 of 20 replies stored" in out and "on Ray cluster auto (1 nodes" in out and "greedy" in out
    assert "replies/s" in out and "tokens/s" in out
    assert _replies(tmp_path / "ids", "id") == {k: v for k, v in want.items() if int(k[1:]) < 20}
    out = _generate(capsys, tmp_path / "whole", tmp_path / "ids", *model)
    assert f"40 of 40 replies stored in {tmp_path / 'ids'} (20 run now, 20 stored before)" in out
    assert _replies(tmp_path / "ids", "id") == want




@on_cluster
def test_a_job_on_ray_sigtermed_stops_as_on_one_machine_saying_what_the_store_kept(cluster, bert_dir, texts, tmp_path):
    """SIGTERM (a scheduler's stop) stops a --ray job as it stops one machine's: one line of what the store kept, exit
    status 143. ray.init set its own SIGTERM handler (sys.exit(15)) over the command's: the job ended with exit status
    15 (-6 on a local Ray) and no line (found by a probe SIGTERMing the driver on a local 2-CPU cluster)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    address, env, die = cluster
    pq.write_table(pa.table({"id": [f"doc-{i}" for i in range(8)], "text": texts[:8]}), tmp_path / "corpus.parquet")
    store = tmp_path / "store"
    die.with_name("die.slow").write_text("")  # the job's one actor takes 10 minutes to start: the driver waits on it
    driver = subprocess.Popen(_command(tmp_path / "corpus.parquet", store, bert_dir, address), env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not die.with_name("die.slow.claimed").exists() and driver.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        driver.send_signal(signal.SIGTERM)
        _, err = driver.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(driver.pid, signal.SIGKILL)
        with contextlib.suppress(FileNotFoundError):
            die.with_name("die.slow.claimed").unlink()
    assert driver.returncode == 143, err[-3000:]
    assert f"embed: stopped (SIGTERM): 0 of 8 texts stored in {store}; the same command resumes" in err, err[-3000:]

def _command(corpus, store, model, address):
    return [sys.executable, "-m", "dynabatch", "embed", str(corpus), str(store), "--model", str(model),
            "--id-column", "id", "--batch-size", "4", "--no-progress", "--ray", address]


def _kill(command, env, store, pick, seconds, times):
    """Starts ``command`` ``times`` times, each SIGKILLed (with its process group) after a random wait in
    ``seconds`` unless it ended first; once (``times`` 1), as soon as its first window's shard is in ``store``."""
    for _ in range(times):
        driver = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  start_new_session=True)
        deadline = time.monotonic() + (300 if times == 1 else pick.uniform(*seconds))
        while driver.poll() is None and time.monotonic() < deadline:
            if times == 1 and list(store.glob("part-w*.parquet")):
                break
            time.sleep(0.2)
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()


def _until_admitted(capsys, argv, timeout=300):
    """Runs the command ``argv`` in this process to its end; a rerun refused while a killed driver's actors still
    hold the store (Ray stops them once it sees the driver gone) is tried again. Its output."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return _embed(capsys, *argv)
        except AssertionError as exc:  # _ran: the command's last error lines
            if "no other job is writing" not in str(exc) or time.monotonic() > deadline:
                raise
        time.sleep(2)


# Five SIGKILLs at random points take minutes: the default run kills one driver once its first window is stored.
_KILLS = int(os.environ.get("DYNABATCH_TEST_RAY_KILLS", "1"))


@on_cluster
def test_a_driver_process_sigkilled_at_random_then_rerun_stores_every_id_once(
        cluster, corpora, bert_dir, reference, tmp_path, capsys):
    """The command as its own process on the cluster, SIGKILLed as its first window is stored, or
    ``DYNABATCH_TEST_RAY_KILLS`` times at random points (``DYNABATCH_TEST_RAY_KILLS=5 python -m pytest -n 0
    tests/cli/test_ray_command.py -k sigkilled``), then rerun: every id once, vectors equal."""
    address, env, _ = cluster
    store, pick = tmp_path / "store", random.Random(48)
    command = _command(corpora / "whole", store, bert_dir, address)
    _kill(command, env, store, pick, (10, 60), _KILLS)
    held = _rows(store)[1] if list(store.glob("part-*.parquet")) else 0
    assert _KILLS > 1 or 0 < held < 120, held  # killed once, mid-job: some windows stored
    out = _until_admitted(capsys, command[4:])  # the rerun: this process, the same command
    assert f"120 of 120 texts stored in {store} ({120 - held} run now, {held} stored before)" in out
    assert f"on Ray cluster {address} (1 nodes, 2 CPUs, 0 GPUs): 2 actors" in out
    _same(_rows(store), reference[0])


def test_a_job_stopped_for_an_actor_whose_process_ended_runs_its_windows_once_more(monkeypatch, caplog):
    """Ray Data stops a job for an actor it cannot restart (its node lost, say): the windows run once more (the
    store's rows checked, not run again); an actor whose start raised stops the job at once."""
    from dynabatch.cli import on_ray

    windows = on_ray.Windows({}, actors=2, gpus=0.0, window=16, n=20, before=0)
    calls = []

    def windows_stopped_once(ds, windows, *, progress):
        calls.append((ds, windows.actors))
        if len(calls) == 1:
            raise on_ray.DeadActorError("an actor of the job died: cancelled before it started running")
        return "result"

    monkeypatch.setattr(on_ray, "_run_windows", windows_stopped_once)
    with caplog.at_level("WARNING", logger="dynabatch.cli.on_ray"):
        assert on_ray._run_job("ds", windows, progress=False) == "result" and calls == [("ds", 2), ("ds", 2)]
    assert "cancelled before it started running; the job's windows run again (the rows" in caplog.text

    def always_stopped(ds, windows, *, progress):
        calls.append((ds, windows.actors))
        raise on_ray.DeadActorError("an actor of the job died: its node was lost")

    calls.clear()
    monkeypatch.setattr(on_ray, "_run_windows", always_stopped)
    with pytest.raises(on_ray.DeadActorError, match="^an actor of the job died: its node was lost$"):
        on_ray._run_job("ds", windows, progress=False)
    assert len(calls) == on_ray.JOB_RUNS == 2

    def start_raised(ds, windows, *, progress):
        calls.append((ds, windows.actors))
        raise on_ray.DeadActorError("an actor of the job failed as it started, 3 times in a row: OSError: no model",
                                    at_start=True)

    calls.clear()
    monkeypatch.setattr(on_ray, "_run_windows", start_raised)
    with pytest.raises(on_ray.DeadActorError, match="OSError: no model$"):
        on_ray._run_job("ds", windows, progress=False)
    assert len(calls) == 1


def test_the_job_report_holds_the_driver_wall_and_the_windows_figures_on_the_job_clock():
    """The job's report was the windows' batches and actors' walls alone: wall_seconds null (the summary's figures
    read from it), each window's batches numbered from 0 and timed from its own start (a plot drew every window at
    the job's start), and the windows' budgets, background stages, skipped inputs, rebuilt batches and accounting
    seconds dropped. Three windows of two actors, their figures chosen to add up exactly."""
    from dynabatch.cli import on_ray
    from dynabatch.inference.report import BatchRecord, RunReport

    sent = 1000.0

    def window(actor, finished, budget, wall, began, run_wall, background, **figures):
        records = [BatchRecord(batch=i, rows=2, width=4, real_tokens=6, padded_tokens=8, seconds=0.5,
                               finished=f, device=actor) for i, f in enumerate(finished)]
        workers = {actor: {"wall": wall, "stages": {"device": wall}, "began": sent + began}}
        return RunReport(records, budget_bytes=budget, workers=workers, wall_seconds=run_wall, background=background,
                         **figures)

    reports = [window("a", [1.0, 2.0], 100, 4.0, 10.0, 2.5, {"tokenize": 0.4}, skipped_inputs=1, rebuilt_batches=2,
                      accounting_seconds=0.1),
               window("b", [0.5], 300, 2.0, 11.0, 2.0, {"tokenize": 0.5, "store": 0.25}, accounting_seconds=0.2),
               window("a", [1.5], 200, 4.0, 20.0, 4.0, {"tokenize": 0.25}, accounting_seconds=0.1)]
    job = on_ray._job_report(reports, wall_seconds=25.0, sent=sent, accounting=0.05)
    assert job.wall_seconds == 25.0  # the driver's: sending the windows to the last one back
    assert [(r.batch, r.finished, r.device) for r in job.records] == [(0, 11.0, "a"), (1, 12.0, "a"), (2, 11.5, "b"),
                                                                       (3, 21.5, "a")]
    assert job.budget_bytes == 100 and job.device_budgets == {"a": 100, "b": 300}  # each actor's first peak
    # Each actor's background seconds (share x its run's wall) over its wall, averaged over the actors: a's
    # tokenizing 1 + 1 s of 8 s, b's 1 s of 2 s and its store 0.5 s of 2 s.
    assert job.background == pytest.approx({"tokenize": (2 / 8 + 1 / 2) / 2, "store": 0.5 / 2 / 2})
    assert job.workers == {"a": {"wall": 8.0, "stages": {"device": 8.0}}, "b": {"wall": 2.0, "stages": {"device": 2.0}}}
    assert (job.skipped_inputs, job.rebuilt_batches) == (1, 2)
    assert job.accounting_seconds == pytest.approx(0.45)  # the windows' and the driver's


def test_generate_on_ray_counts_the_prompts_truncated_past_max_length_as_one_machine_does(gpt2_dir, texts, tokenizer):
    """The actors ran reply_function alone: prompts cut to --max-length were not counted (0, and no summary line),
    where dynabatch.generate counts them. Here: an actor's predictor (no cluster) on two windows of prompts, some
    longer than the limit of 12 tokens, counts each window's own; the job's report sums the windows'."""
    from transformers import AutoTokenizer

    from dynabatch.cli import on_ray

    pad = AutoTokenizer.from_pretrained(gpt2_dir)
    limit = 12
    model = on_ray.GenerateModel(str(gpt2_dir), None, pad, limit, {"max_new_tokens": 2, "do_sample": False,
                                                                 "pad_token_id": pad.pad_token_id}, False, 0)
    reports = []

    class Predictor(on_ray.CommandPredictor):
        def window_done(self, report, plan):
            super().window_done(report, plan)
            reports.append(report)

    predictor = Predictor(model=model, batch_size=4, max_input_token_length=1)
    lengths = [len(ids) for ids in tokenizer(texts[:40])["input_ids"]]
    for window in (texts[:20], texts[20:40]):
        predictor({"text": np.array(window, dtype=object)})
    want = [sum(n > limit for n in lengths[:20]), sum(n > limit for n in lengths[20:])]
    assert 0 < min(want) and max(lengths) > limit >= min(lengths)  # both sides of the limit in each window
    assert [r.truncated_inputs for r in reports] == want
    assert on_ray._job_report(reports, wall_seconds=1.0, sent=0.0, accounting=0.0).truncated_inputs == sum(want)
