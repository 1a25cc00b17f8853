"""One job per results store (dynabatch/inference/store_lock.py, through open_store): a second job is refused at once,
naming the holder; the processes of one job share the store; a lock left by a killed job or a lost host never blocks
a rerun."""

import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from dynabatch import StoreBusyError
from dynabatch.inference import store_lock
from dynabatch.inference.store import open_store

# A process holding the store as open_store does (its lock alone: the module loaded from its file, so the process
# starts in a blink, without torch).
_HOLD = """
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("store_lock", sys.argv[1])
store_lock = sys.modules["store_lock"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(store_lock)
store_lock.JobLock(sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)
print("held", flush=True)
time.sleep(120)
"""


@pytest.fixture
def holder(tmp_path):
    """Starts a process holding the store at ``tmp_path`` (for ``job``); stops it at the end."""
    started = []

    def start(job=None):
        process = subprocess.Popen([sys.executable, "-c", _HOLD, store_lock.__file__, str(tmp_path),
                                    *([job] if job else [])], stdout=subprocess.PIPE, text=True)
        started.append(process)
        assert process.stdout.readline().strip() == "held"
        return process

    yield start
    for process in started:
        process.kill()
        process.wait()


def _records(path):
    return [name for name in os.listdir(path) if name.startswith(store_lock.PREFIX)]


def test_a_second_job_on_a_store_another_live_job_writes_is_refused_at_once_naming_it(tmp_path, holder):
    process = holder()
    started = time.monotonic()
    with pytest.raises(StoreBusyError, match=rf"^output_path='{tmp_path}' should be written by one job at a time, but "
                       rf"another job is writing it \(host {os.uname().nodename}, process {process.pid} started "
                       r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d, job 'process .*'\): wait for it to end or stop it, or use "
                       r"another output_path; a job that was killed holds it no longer than its process runs \(on "
                       r"another host: 60 s after its last heartbeat\)") as refused:
        open_store(tmp_path, key="k", n=4)
    assert time.monotonic() - started < 5 and refused.value.holder["pid"] == process.pid
    assert isinstance(refused.value, RuntimeError) and len(_records(tmp_path)) == 1  # the refused left no record


def test_the_processes_of_one_job_share_the_store(tmp_path, holder):
    holder(job="torchrun 1f3a")  # rank 0, say
    store = open_store(tmp_path, key="k", n=4, job="torchrun 1f3a")  # rank 1 of the same job
    writer = store.writer("rank1")
    writer.write(np.arange(2), [torch.ones(2)] * 2, np.arange(2, dtype=np.uint64))
    writer.close()
    store.close()
    assert len(_records(tmp_path)) == 1  # rank 0's is left: it still holds the store
    with pytest.raises(StoreBusyError):
        open_store(tmp_path, key="k", n=4, job="another job")


def test_a_store_held_by_a_killed_job_is_taken_over_by_the_rerun(tmp_path, holder, caplog):
    process = holder()
    process.send_signal(signal.SIGKILL)  # no clean-up: its record stays in the store
    process.wait()
    assert len(_records(tmp_path)) == 1
    store = open_store(tmp_path, key="k", n=4)
    assert f"taking over the lock of a job that is gone (host {os.uname().nodename}, process {process.pid}" in caplog.text
    store.close()
    assert not _records(tmp_path)  # taken over, then released


def test_a_killed_holder_its_parent_has_not_reaped_yet_holds_nothing(tmp_path, holder, caplog):
    process = holder()  # a torchrun rank, say, whose launcher was killed with it: a zombie until someone reaps it
    process.send_signal(signal.SIGKILL)
    os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOWAIT)  # dead, and left unreaped
    assert open(f"/proc/{process.pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
    open_store(tmp_path, key="k", n=4).close()
    assert f"taking over the lock of a job that is gone (host {os.uname().nodename}, process {process.pid}" in caplog.text


def _record(path, name, mtime=None, **fields):
    record = {"host": "node-7", "pid": 1234, "started": "2026-11-28 08:00:00", "ticks": 1, "boot": "other",
              "namespace": None, "job": "the other job", **fields}
    file = os.path.join(path, f"{store_lock.PREFIX}{name}.json")
    with open(file, "w") as f:
        json.dump(record, f)
    if mtime is not None:
        os.utime(file, (mtime, mtime))
    return file


def test_another_hosts_job_holds_the_store_while_its_heartbeat_is_fresh(tmp_path, caplog):
    live = _record(tmp_path, "live")
    with pytest.raises(StoreBusyError, match=r"another job is writing it \(host node-7, process 1234 started "
                       r"2026-11-28 08:00:00, job 'the other job'\)"):
        open_store(tmp_path, key="k", n=4)
    stale = time.time() - store_lock.LEASE_SECONDS - 5  # a lost node: no heartbeat for longer than the lease
    os.utime(live, (stale, stale))
    store = open_store(tmp_path, key="k", n=4)
    assert "taking over the lock of a job that is gone (host node-7, process 1234" in caplog.text
    assert not os.path.exists(live)
    store.close()


def test_a_process_id_now_running_another_process_is_a_dead_holder(tmp_path, caplog):
    me = store_lock._process()
    _record(tmp_path, "reused", **{**me, "ticks": (me["ticks"] or 0) + 1, "job": "an old job"})  # same pid, other start
    open_store(tmp_path, key="k", n=4).close()
    assert "taking over the lock of a job that is gone" in caplog.text


def test_the_heartbeat_ticks_while_a_store_is_held_and_stops_with_the_last_hold(tmp_path, monkeypatch):
    gc.collect()  # a store an earlier test of this process dropped unclosed, in a reference cycle: released now
    assert not store_lock._BEATING, "a store of an earlier test is still held"
    monkeypatch.setattr(store_lock, "HEARTBEAT_SECONDS", 0.05)
    lock = store_lock.JobLock(str(tmp_path), "job-a")
    record = os.path.join(tmp_path, _records(tmp_path)[0])
    os.utime(record, (time.time() - 30, time.time() - 30))
    time.sleep(0.5)
    assert time.time() - os.stat(record).st_mtime < 5  # refreshed by the ticking heartbeat
    lock.release()
    assert not store_lock._BEATING and "dynabatch-lock-heartbeat" not in {t.name for t in threading.enumerate()}


def test_a_job_whose_lock_was_taken_over_writes_no_more(tmp_path, monkeypatch):
    store = open_store(tmp_path, key="k", n=4)
    for name in _records(tmp_path):  # what another job does to a record it finds dead
        os.remove(os.path.join(tmp_path, name))
    store_lock._beat()  # a heartbeat finds it gone (the ticking one may be waiting out an earlier, longer interval)
    writer = store.writer("0")
    writer.write(np.arange(2), [torch.ones(2)] * 2, np.arange(2, dtype=np.uint64))
    with pytest.raises(StoreBusyError, match=r"should be held by this job while it writes, but another job took it "
                       r"over"):
        writer.close()
    assert not list(tmp_path.glob("part-*")) and writer.sealed  # nothing written; the rows still held
    store.close()


@pytest.mark.parametrize("text", ["not json {", "", "[]", '"a string"', "5", "{}", '{"host": "node-7", "pid": 1234}',
                                  '{"host": "node-7", "pid": "1234", "job": "j"}',
                                  '{"host": "node-7", "pid": true, "job": "j"}',
                                  '{"host": null, "pid": 1234, "job": "j"}',
                                  '{"host": "node-7", "pid": 1234, "job": 5}',
                                  '{"host": "node-7", "pid": 1234, "job": "j", "ticks": "x"}',
                                  '{"host": "node-7", "pid": 1234, "job": "j", "boot": 3}'])
def test_a_lock_file_that_is_not_a_record_holds_nothing_and_is_removed_naming_it(tmp_path, caplog, text):
    bad = tmp_path / f"{store_lock.PREFIX}bad.json"
    bad.write_text(text)
    store = open_store(tmp_path, key="k", n=4)  # admitted: the file is no one's lock
    assert f"removing {bad.name}, not a lock record (a JSON object with host, pid, job)" in caplog.text
    assert not bad.exists()
    store.close()
    held = store_lock.JobLock(str(tmp_path), "ray job 01")
    bad.write_text(text)
    held.release_job()  # reads every record of the store: the file is skipped, not an AttributeError
    assert bad.exists()


def test_a_second_run_in_the_same_process_is_another_job_and_is_refused(tmp_path):
    first = open_store(tmp_path, key="k", n=4)  # a run, in this thread or another
    with pytest.raises(StoreBusyError, match=rf"another job is writing it \(host {os.uname().nodename}, process "
                       rf"{os.getpid()} started .*, job 'process .* run [0-9a-f]+' of this process: a run in another "
                       r"thread, or a store opened and not closed\)"):
        open_store(tmp_path, key="k", n=4)
    assert len(_records(tmp_path)) == 1  # the refused left nothing
    first.close()
    open_store(tmp_path, key="k", n=4).close()  # the first run ended: the next is admitted


def test_two_runs_at_once_in_two_threads_store_every_id_once(tmp_path, tokenizer, texts):
    import pandas as pd

    from dynabatch import build_dynamic_batch_dataloader, run

    ids = [f"doc-{i}" for i in range(12)]
    for attempt in range(4):
        path = tmp_path / f"store-{attempt}"
        barrier, refused = threading.Barrier(2), threading.Event()
        outcomes = []

        def one_run():
            loader = build_dynamic_batch_dataloader(texts[:12], tokenizer, 4, 64, ids=ids, num_workers=0,
                                                    progress=False)
            barrier.wait()
            try:  # the admitted run waits in fn until the other is refused: both hold it at once, or try to
                outcomes.append(run(lambda b: refused.wait(30) and b["attention_mask"].sum(dim=1), loader,
                                    output_path=path, key="k", progress=False))
            except StoreBusyError as exc:
                outcomes.append(exc)
                refused.set()

        threads = [threading.Thread(target=one_run) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert sorted(type(o).__name__ for o in outcomes) == ["StoreBusyError", "StoredRunResult"]
        frame = pd.read_parquet(path)
        assert sorted(frame["id"]) == sorted(ids)  # each id once


# Two jobs released together, in both orders, many times: the store's lock alone, loaded from its file (a process
# starts in a blink). Each process takes the store of each round, says whether it holds it, and holds it until told.
_RACE = """
import importlib.util, os, sys, time
spec = importlib.util.spec_from_file_location("store_lock", sys.argv[1])
store_lock = sys.modules["store_lock"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(store_lock)
root, me, rounds = sys.argv[2], sys.argv[3], int(sys.argv[4])

def wait(name, pause):
    while not os.path.exists(os.path.join(root, name)):
        time.sleep(pause)

for k in range(rounds):
    wait(f"go-{k}-{me}", 0)  # spinning: both start within microseconds, as two jobs submitted at once may
    try:
        held = store_lock.JobLock(os.path.join(root, f"store-{k}"))
    except store_lock.StoreBusyError:
        held = None
    with open(os.path.join(root, f"said-{k}-{me}.tmp"), "w") as f:
        f.write("held" if held else "busy")
    os.replace(os.path.join(root, f"said-{k}-{me}.tmp"), os.path.join(root, f"said-{k}-{me}"))
    if held:
        wait(f"done-{k}", 0.001)
        held.release()
"""


def test_two_jobs_started_at_the_same_instant_leave_exactly_one_holding(tmp_path):
    rounds = 40  # the old lock (no gate) had both refused in about one round of 30
    processes = [subprocess.Popen([sys.executable, "-c", _RACE, store_lock.__file__, str(tmp_path), name,
                                   str(rounds)]) for name in ("a", "b")]
    try:
        for k in range(rounds):
            (tmp_path / f"store-{k}").mkdir()
            for name in ("a", "b") if k % 2 else ("b", "a"):  # released back to back, in both orders
                (tmp_path / f"go-{k}-{name}").touch()
            said = [tmp_path / f"said-{k}-{name}" for name in ("a", "b")]
            deadline = time.monotonic() + 60
            while not all(f.exists() for f in said) and time.monotonic() < deadline:
                time.sleep(0.005)
            assert sorted(f.read_text() for f in said) == ["busy", "held"], f"round {k}"
            assert len(_records(tmp_path / f"store-{k}")) == 1  # the holder's; the refused left nothing
            (tmp_path / f"done-{k}").touch()
        assert [p.wait(60) for p in processes] == [0, 0]
        assert not any(_records(tmp_path / f"store-{k}") for k in range(rounds))
    finally:
        for process in processes:
            process.kill()
            process.wait()


def test_a_gate_left_by_a_killed_process_is_broken(tmp_path, caplog):
    dead = subprocess.Popen(["true"])
    dead.wait()
    gate = tmp_path / store_lock.GATE
    gate.write_text(json.dumps({**store_lock._process(), "pid": dead.pid, "job": "gate", "nonce": "x"}))
    started = time.monotonic()
    open_store(tmp_path, key="k", n=4).close()  # its process is gone: broken at once
    assert time.monotonic() - started < 5 and "breaking the lock gate left by" in caplog.text
    assert not gate.exists() and not list(tmp_path.iterdir())
