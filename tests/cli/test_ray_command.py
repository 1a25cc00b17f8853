"""``dynabatch embed --ray``: the command's job on a Ray cluster, into the same store as on one machine.

In the default run, one Ray for the module (``ray.init(num_cpus=2)`` in this process: ``--ray auto`` finds it) and
the command run in this process; marked ``slow``, a real local cluster started as its own processes (``ray start
--head``), the command given its address, its driver SIGKILLed at random points and rerun. Every store is compared
with the single-machine command's on the same corpus and model: the same ids, the same input hashes, vectors at
cosine >= 0.9999. Nothing of dynabatch or Ray is mocked.
"""

import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.dataset as ds
import pytest

from dynabatch.cli import main

pytest.importorskip("ray")

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ray_session():
    """One Ray for the module, started in this process as ``--ray auto`` would start one (2 CPUs, no dashboard)."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": {
        "PYTHONPATH": os.pathsep.join(p for p in [str(REPO), os.environ.get("PYTHONPATH", "")] if p),
        "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}})
    yield ray
    ray.shutdown()


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


def _embed(capsys, *argv):
    assert main(["embed", *map(str, argv), "--batch-size", "4", "--no-progress"]) == 0
    return capsys.readouterr().out


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


def test_a_second_job_or_a_bad_input_is_refused_before_ray_is_reached(corpora, bert_dir, tmp_path, capsys):
    from dynabatch.inference.store_lock import JobLock

    store = tmp_path / "held"
    store.mkdir()
    other = JobLock(str(store), "another job")
    try:
        for argv, message in [
            ([corpora / "whole", store, "--id-column", "id"], "output should be a store no other job is writing, "
             f"but got output={str(store)!r}: output_path={str(store)!r} should be written by one job at a time, "
             f"but another job is writing it (host {socket.gethostname()}"),
            ([corpora / "whole", tmp_path / "new", "--text-column", "body"],
             "--text-column should be a column of the input ['id', 'text'], but got --text-column='body'"),
            ([corpora / "whole", tmp_path / "new", "--devices", "cpu"], "--devices should be left out with --ray "
             "(Ray places one actor per GPU, or per CPU without GPUs), but got --devices='cpu'"),
            ([corpora / "whole", tmp_path / "new", "--max-memory", "2GB"], "--max-memory should be auto with --ray"),
        ]:
            with pytest.raises(SystemExit) as info:
                main(["embed", *map(str, argv), "--model", str(bert_dir), "--ray", "auto"])
            err = capsys.readouterr().err
            assert info.value.code == 2 and len(err.strip().splitlines()) == 1, err
            assert err.startswith(f"dynabatch embed: error: {message}"), err
    finally:
        other.release()
    with pytest.raises(SystemExit) as info:
        main(["generate", str(corpora / "whole"), str(tmp_path / "new"), "--model", str(bert_dir), "--ray"])
    assert info.value.code == 2 and capsys.readouterr().err == (
        "dynabatch generate: error: --ray should be left out of dynabatch generate (on a Ray cluster: dynabatch "
        "embed, for now), but got --ray='auto'\n")
    import ray

    assert not ray.is_initialized()  # refused before Ray was reached (this module's Ray starts after this test)
    assert not (tmp_path / "new").exists()


def test_on_ray_the_same_rows_are_stored_and_a_store_resumes_on_one_machine_and_the_reverse(
        ray_session, corpora, bert_dir, tmp_path, capsys):
    whole, half, n = corpora / "whole", corpora / "half", 120
    reference = tmp_path / "one"
    _embed(capsys, whole, reference, "--model", bert_dir)  # keyed by position: no --id-column
    want = _rows(reference, "position")[0]

    # Half on one machine, then the whole corpus on Ray: only what the store lacks runs there.
    store = tmp_path / "store"
    _embed(capsys, half, store, "--model", bert_dir)
    out = _embed(capsys, whole, store, "--model", bert_dir, "--ray", "auto")
    assert f"{n} of {n} texts stored in {store} (60 run now, 60 stored before)" in out
    assert "on Ray cluster auto (1 nodes, 2 CPUs, 0 GPUs): 2 actors, a CPU each" in out
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


# --- a real local cluster, started as its own processes ----------------------------------------------------------


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """``ray start --head --num-cpus 2`` as its own processes (this checkout on its workers' path); ``ray stop``
    after. Its address."""
    port, temp = _free_port(), tmp_path_factory.mktemp("ray-cluster")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [str(REPO), os.environ.get("PYTHONPATH", "")] if p),
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1",
               RAY_AUTH_MODE="disabled")  # a test cluster of this machine: no token to share between processes
    ray = str(Path(sys.executable).with_name("ray"))
    subprocess.run([ray, "start", "--head", "--num-cpus", "2", "--port", str(port), "--include-dashboard", "false",
                    "--disable-usage-stats"], env=env, check=True, capture_output=True, timeout=180)
    try:
        yield f"127.0.0.1:{port}", env
    finally:
        subprocess.run([ray, "stop", "--force"], env=env, capture_output=True, timeout=120, check=False)


def _command(corpus, store, model, address):
    return [sys.executable, "-m", "dynabatch", "embed", str(corpus), str(store), "--model", str(model),
            "--id-column", "id", "--batch-size", "4", "--no-progress", "--ray", address]


def _until_admitted(command, env, timeout=240):
    """Runs ``command`` to its end; a rerun refused while the killed driver's actors still hold the store (Ray stops
    them once it sees the driver gone) is tried again."""
    deadline = time.monotonic() + timeout
    while True:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 2 or "no other job is writing" not in done.stderr or time.monotonic() > deadline:
            assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
            return done.stdout
        time.sleep(2)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("DYNABATCH_TEST_RAY_CLUSTER") != "1",
                    reason="starts and stops a Ray cluster of its own processes, which ended the pytest worker that "
                    "runs it beside other Ray tests: run it alone, DYNABATCH_TEST_RAY_CLUSTER=1 python -m pytest -n 0 "
                    "tests/cli/test_ray_command.py")
def test_on_a_local_cluster_a_driver_killed_five_times_at_random_then_rerun_stores_every_id_once(
        cluster, corpora, bert_dir, tmp_path, capsys):
    address, env = cluster
    reference = tmp_path / "one"
    _embed(capsys, corpora / "whole", reference, "--model", bert_dir, "--id-column", "id")
    store, pick = tmp_path / "store", random.Random(48)
    command = _command(corpora / "whole", store, bert_dir, address)
    for _ in range(5):
        driver = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  start_new_session=True)
        try:
            driver.wait(timeout=pick.uniform(5, 60))
        except subprocess.TimeoutExpired:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()
    held = _rows(store)[1] if list(store.glob("part-*.parquet")) else 0
    out = _until_admitted(command, env)
    assert f"120 of 120 texts stored in {store} ({120 - held} run now, {held} stored before)" in out
    assert f"on Ray cluster {address} (1 nodes, 2 CPUs, 0 GPUs): 2 actors" in out
    _same(_rows(store), _rows(reference)[0])
