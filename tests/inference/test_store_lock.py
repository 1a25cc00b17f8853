"""One job per results store (dynabatch/inference/store_lock.py, through open_store): a second job is refused at once,
naming the holder; the processes of one job share the store; a lock left by a killed job or a lost host never blocks
a rerun."""

import json
import os
import signal
import subprocess
import sys
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


def test_a_job_whose_lock_was_taken_over_writes_no_more(tmp_path, monkeypatch):
    monkeypatch.setattr(store_lock, "HEARTBEAT_SECONDS", 0.05)
    store = open_store(tmp_path, key="k", n=4)
    for name in _records(tmp_path):  # what another job does to a record it finds dead
        os.remove(os.path.join(tmp_path, name))
    with store_lock._WAKE:  # the heartbeat thread may be waiting out an earlier, longer interval: beat now
        store_lock._WAKE.notify_all()
    time.sleep(0.3)  # a heartbeat finds it gone
    writer = store.writer("0")
    writer.write(np.arange(2), [torch.ones(2)] * 2, np.arange(2, dtype=np.uint64))
    with pytest.raises(StoreBusyError, match=r"should be held by this job while it writes, but another job took it "
                       r"over"):
        writer.close()
    assert not list(tmp_path.glob("part-*")) and writer.sealed  # nothing written; the rows still held
    store.close()
