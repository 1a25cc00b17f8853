"""How many cores, which mechanism, the user's TOKENIZERS_PARALLELISM, forks, and the worker pool."""

import logging
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from dynabatch.data import workers
from dynabatch.data.workers import (Pieces, WorkerPool, available_cores, choose_mechanism, guard_forks, release_pool,
                                    tokenizers_parallelism)


REPO = Path(__file__).resolve().parents[2]


def test_cores_are_the_affinity_capped_by_the_argument():
    assert available_cores() == len(os.sched_getaffinity(0))
    assert available_cores(1) == 1 and available_cores(10**6) == available_cores()
    with pytest.raises(ValueError, match=r"^tokenize_cores should be a positive integer, but got tokenize_cores=0$"):
        available_cores(0)


@pytest.mark.parametrize("value, parsed", [(None, None), ("false", False), ("0", False), ("OFF", False),
                                           ("", False), ("true", True), ("1", True)])
def test_the_environment_variable_is_read_as_tokenizers_reads_it(monkeypatch, value, parsed):
    if value is None:
        monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    else:
        monkeypatch.setenv("TOKENIZERS_PARALLELISM", value)
    assert tokenizers_parallelism() is parsed


def test_the_mechanism(monkeypatch, caplog):
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    monkeypatch.setattr(workers, "available_cores", lambda limit=None: 4 if limit is None else min(4, limit))
    assert choose_mechanism(backend=True, cores=4) == "threads"
    assert choose_mechanism(backend=True, cores=2) == "shared"  # a cap below the process's cores
    assert choose_mechanism(backend=False, cores=4) == "shared"
    assert choose_mechanism(backend=True, cores=1) == "one"
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")  # the user's: the backend's threads stay off
    workers._explain_parallelism_off.cache_clear()
    with caplog.at_level(logging.INFO, logger="dynabatch.data.workers"):
        assert choose_mechanism(backend=True, cores=4) == "parallel calls"  # its pool off: our threads call it
        assert choose_mechanism(backend=True, cores=2) == "parallel calls"  # a cap: as many threads
    assert choose_mechanism(backend=False, cores=4) == "shared"  # its own call runs: its Python holds the GIL
    assert choose_mechanism(backend=True, cores=1) == "one"
    said = [r.getMessage() for r in caplog.records if "TOKENIZERS_PARALLELISM" in r.getMessage()]
    assert len(said) == 1 and "tokenize_cores=1" in said[0]  # once, with the way to one core
    assert os.environ["TOKENIZERS_PARALLELISM"] == "false"  # never turned on


@pytest.mark.parametrize("ranks, expected", [(None, 8), ("2", 4), ("3", 2), ("16", 1), ("zero", 8), ("0", 8)])
def test_torchrun_ranks_on_one_node_share_its_cores(monkeypatch, ranks, expected):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    if ranks is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", ranks)
    assert available_cores() == expected and available_cores(3) == min(3, expected)
    parent = os.getppid()  # the launcher (torchrun's agent)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)) if pid == parent else {0, 1})
    assert available_cores() == 2  # a rank pinned to cores of its own keeps them


@pytest.mark.parametrize("ranks, expected", [(None, 4), ("2", 2), ("8", 1)])
def test_torchrun_ranks_share_a_cpu_set_they_were_launched_in(monkeypatch, ranks, expected):
    # A container's or Slurm job's CPU set (4 of the host's 8 cores) is the launcher's too: each rank took all 4
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    if ranks is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", ranks)
    assert available_cores() == expected


def test_a_parent_gone_leaves_the_machines_cores_to_tell_pinning(monkeypatch):
    def affinity(pid):
        if pid:
            raise ProcessLookupError(pid)
        return {0, 1}

    monkeypatch.setattr(os, "sched_getaffinity", affinity)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert available_cores() == 2  # narrower than the machine: pinned
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert available_cores() == 1


def _cgroup_tree(tmp_path, version, limits, mount_root="/"):
    """A cgroup mount under ``tmp_path`` whose groups ``a`` and ``a/b`` (this process's) set ``limits`` (quota, period;
    ``None``: unlimited), with the ``/proc/self`` files that point there."""
    mount = tmp_path / "cgroup"
    for group, limit in zip(["a", "a/b"], limits):
        folder = mount / group
        folder.mkdir(parents=True)
        quota, period = limit or ("max" if version == 2 else "-1", 100000)
        if version == 2:
            (folder / "cpu.max").write_text(f"{quota} {period}\n")
        else:
            (folder / "cpu.cfs_quota_us").write_text(f"{quota}\n")
            (folder / "cpu.cfs_period_us").write_text(f"{period}\n")
    own = mount_root.rstrip("/") + "/a/b"
    (tmp_path / "cgroup-of-self").write_text("0::" + own + "\n" if version == 2 else
                                             "4:cpu,cpuacct:" + own + "\n3:memory:/elsewhere\n0::/\n")
    kind, options = ("cgroup2", "rw") if version == 2 else ("cgroup", "rw,cpu,cpuacct")
    (tmp_path / "mountinfo").write_text(f"31 23 0:28 / /sys rw - sysfs sysfs rw\n"
                                        f"32 31 0:29 {mount_root} {mount} rw,relatime - {kind} cgroup {options}\n")
    return tmp_path / "cgroup-of-self", tmp_path / "mountinfo"


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("limits, expected", [([None, None], 8), ([(200000, 100000), None], 2),
                                              ([(600000, 100000), (350000, 100000)], 3), ([None, (50000, 100000)], 1)])
def test_a_cgroup_cpu_quota_caps_the_cores(monkeypatch, tmp_path, version, limits, expected):
    # A container's --cpus shows in no affinity: 8 cores seen, a quota of 2 CPUs; found by timing a slow tokenizer in
    # a 1-CPU cgroup on 2 cores, where the workers started on the core it may not use and lost to one thread
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cgroup, mountinfo = _cgroup_tree(tmp_path, version, limits, mount_root="/" if version == 2 else "/kubepods")
    monkeypatch.setattr(workers, "_PROC_CGROUP", str(cgroup), raising=False)
    monkeypatch.setattr(workers, "_MOUNTINFO", str(mountinfo), raising=False)
    assert available_cores() == expected and available_cores(2) == min(2, expected)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # ranks share what the quota leaves
    assert available_cores() == max(1, expected // 2)


def test_no_cgroup_to_read_leaves_the_affinity(monkeypatch, tmp_path):
    monkeypatch.setattr(workers, "_PROC_CGROUP", str(tmp_path / "absent"))
    assert workers.cgroup_cores() is None
    assert available_cores() <= len(os.sched_getaffinity(0))


@pytest.fixture(autouse=True)
def _no_pool_left():
    yield
    release_pool()
    assert multiprocessing.active_children() == []


def _double(state, piece):
    return [state * value for value in piece]


def _fail(state, piece):
    raise ValueError(f"bad piece {piece}")


def _slow(state, piece):
    time.sleep(0.02)
    return [state * value for value in piece]


@pytest.fixture
def sleeping_pieces(monkeypatch):
    """Workers for any piece: the pieces sleep, so their ~0 CPU time must not read as a call on threads of its own
    (another thread's few milliseconds would keep the workers out)."""
    monkeypatch.setattr(workers, "POOL_MIN_SECONDS", 0)
    monkeypatch.setattr(workers, "_OWN_THREADS_SHARE", 1.0)


def _busy(state, piece):
    """20 ms of this thread's CPU a piece (the cost rule weighs CPU seconds)."""
    until = time.thread_time() + 0.02
    while time.thread_time() < until:
        pass
    return [state * value for value in piece]


class SlowToUnpickle:
    """A state that takes ``seconds`` to unpickle anywhere but the process that made it (a worker starting slowly)."""

    def __init__(self, seconds):
        self.seconds, self.home = seconds, os.getpid()

    def __setstate__(self, state):
        self.__dict__.update(state)
        if os.getpid() != self.home:
            time.sleep(self.seconds)

    def __mul__(self, value):
        return 2 * value


@pytest.mark.parametrize("alone_size, calls", [(None, [[1], [2], [3], [4], [5]]), (3, [[1], [2, 3, 4], [5]])])
def test_this_thread_alone_runs_the_rest_joined_into_pieces_of_alone_size(alone_size, calls):
    seen = []
    shared = Pieces(_noted, seen, [[1], [2], [3], [4], [5]], cores=1, alone_size=alone_size)  # one core: no worker
    assert [value for piece in shared for value in piece] == [1, 2, 3, 4, 5] and seen == calls


def _noted(seen, piece):
    seen.append(list(piece))
    return piece


@pytest.mark.parametrize("size", [1, 2, 3, 40])  # one piece (no worker), and pieces on both sides of the workers'
def test_pieces_come_back_in_order_from_this_thread_and_the_workers(sleeping_pieces, size):
    pieces = [list(range(k, k + 3)) for k in range(size)]
    shared = Pieces(_slow, 2, pieces, cores=3)
    assert list(shared) == [[2 * v for v in piece] for piece in pieces]
    assert shared.used_workers == (2 if size > 1 else 0) and not shared.failed
    again = Pieces(_slow, 2, pieces, cores=3)  # the next call reuses the process's pool
    pids = workers.shared_pool(2).pids
    assert list(again) == [[2 * v for v in piece] for piece in pieces] and workers.shared_pool(2).pids == pids


@pytest.mark.parametrize("threshold, cores, used", [(0, 2, 1), (10**6, 2, 0), (0, 1, 0)])
def test_workers_join_only_where_the_rest_takes_one_thread_long_enough(monkeypatch, sleeping_pieces, threshold, cores,
                                                                       used):
    monkeypatch.setattr(workers, "POOL_MIN_SECONDS", threshold)
    pieces = [[1, 2]] * 6
    shared = Pieces(_slow, 3, pieces, cores=cores)
    assert list(shared) == [[3, 6]] * 6 and shared.used_workers == used
    assert bool(multiprocessing.active_children()) == bool(used)


@pytest.mark.parametrize("later, used", [(0.0, 0), (50.0, 1)])  # the calls to come tip the rule, or do not
def test_the_work_of_later_calls_counts_toward_the_rule(monkeypatch, later, used):
    monkeypatch.setattr(workers, "POOL_MIN_SECONDS", 1.0)  # the rest of this call alone: ~0.04 s of CPU
    monkeypatch.setattr(workers, "IDLE_CORE", -1.0)  # as if a core stood idle beside this thread
    shared = Pieces(_busy, 3, [[1, 2]] * 3, cores=2, later=later)
    assert list(shared) == [[3, 6]] * 3 and shared.used_workers == used


@pytest.mark.parametrize("idle_core, readable, used", [(-1.0, True, 1), (10**6, True, 0), (-1.0, False, 0)])
def test_where_no_core_stood_idle_beside_the_first_piece_the_rest_must_hold_busy_factor_times_more(
        monkeypatch, idle_core, readable, used):
    # The rest of the call: two pieces of ~0.02 s of CPU; enough beside an idle core, not BUSY_FACTOR times enough
    monkeypatch.setattr(workers, "POOL_MIN_SECONDS", 0.03)
    monkeypatch.setattr(workers, "IDLE_CORE", idle_core)  # -1: every reading is idle enough; 10**6: none is
    if not readable:  # not Linux: nothing says a core is idle
        monkeypatch.setattr(workers, "idle_seconds", lambda: None)
    assert 0.03 * workers.BUSY_FACTOR > 0.04
    shared = Pieces(_busy, 3, [[1, 2]] * 3, cores=2)
    assert list(shared) == [[3, 6]] * 3 and shared.used_workers == used


def test_idle_seconds_reads_the_cores_of_this_process_and_never_runs_backwards():
    first = workers.idle_seconds()
    if first is None:
        pytest.skip("no /proc/stat here")
    started = time.perf_counter()
    time.sleep(0.05)
    second = workers.idle_seconds()
    wall = time.perf_counter() - started
    tick = 1 / os.sysconf("SC_CLK_TCK")
    # idle at most every core of this process all the time (one tick of rounding a core)
    assert 0 <= second - first <= len(os.sched_getaffinity(0)) * (wall + tick)


def test_idle_seconds_is_none_where_the_cores_cannot_be_read(monkeypatch):
    monkeypatch.delattr(os, "sched_getaffinity")
    assert workers.idle_seconds() is None


def test_a_call_that_already_spans_cores_is_left_alone(monkeypatch):
    monkeypatch.setattr(workers, "POOL_MIN_SECONDS", 0)
    monkeypatch.setattr(workers, "_OWN_THREADS_SHARE", -1.0)  # as if its first piece ran on threads of its own
    shared = Pieces(_slow, 3, [[1]] * 4, cores=2)
    assert list(shared) == [[3]] * 4 and shared.used_workers == 0


def test_this_thread_never_waits_on_a_worker_that_is_still_starting(sleeping_pieces):
    pieces = [[1]] * 10
    started = time.perf_counter()
    assert list(Pieces(_slow, SlowToUnpickle(30), pieces, cores=2)) == [[2]] * 10
    assert time.perf_counter() - started < 10  # the worker spends 30 s unpickling: this thread did every piece


def test_an_error_in_a_worker_is_raised_here_and_the_pool_goes_on(sleeping_pieces):
    with pytest.raises(ValueError, match=r"^bad piece \[7\]$"):
        list(Pieces(_fail, 1, [[7]] * 3, cores=2))
    assert list(Pieces(_slow, 2, [[1]] * 4, cores=2)) == [[2]] * 4


def test_a_ctrl_c_reaching_the_workers_leaves_them_silent_and_working(sleeping_pieces, capfd):
    """A terminal's Ctrl-C goes to the whole process group: it is this process's to act on; a worker mid-piece or idle
    prints no traceback and stays in the pool."""
    pids = workers.shared_pool(2).pids
    shared = Pieces(_slow, 2, [[1]] * 40, cores=3)
    answers = iter(shared)
    first = next(answers)  # the call is under way: the workers hold pieces
    for pid in pids:
        os.kill(pid, signal.SIGINT)
    assert [first, *answers] == [[2]] * 40 and not shared.failed
    time.sleep(0.2)
    for pid in pids:  # idle now, between calls
        os.kill(pid, signal.SIGINT)
    again = Pieces(_slow, 2, [[1]] * 40, cores=3)
    assert list(again) == [[2]] * 40 and again.used_workers == 2 and not again.failed
    assert workers.shared_pool(2).pids == pids and "Traceback" not in capfd.readouterr().err


def test_a_ctrl_c_reaching_workers_as_they_start_leaves_them_silent_and_working(sleeping_pieces, capfd):
    """The same Ctrl-C in the moment a worker starts, before its own code runs (Python's start-up of a forked
    process: 5 of 40 workers died there under load, and most of the others printed a KeyboardInterrupt)."""
    for _ in range(8):
        workers.release_pool()
        pool = workers.shared_pool(2)
        for pid in pool.pids:  # at once: the workers are still starting
            os.kill(pid, signal.SIGINT)
        shared = Pieces(_slow, 2, [[1]] * 8, cores=3)
        assert list(shared) == [[2]] * 8 and shared.used_workers == 2 and not shared.failed
    err = capfd.readouterr().err
    assert "KeyboardInterrupt" not in err and "Exception ignored" not in err, err


def test_a_state_that_cannot_be_pickled_runs_on_this_thread(caplog, sleeping_pieces):  # the pool must be tried
    with caplog.at_level(logging.WARNING, logger="dynabatch.data.workers"):
        shared = Pieces(_slow, _Local(), [[1]] * 3, cores=2)
        assert list(shared) == [[5]] * 3
    assert shared.unpicklable and "cannot be pickled" in caplog.text


class _Local:
    def __mul__(self, value):
        return 5 * value

    def __reduce__(self):
        raise pickle.PicklingError("no")


class _ReleasedMeanwhile:
    """A pool's lock whose first take lets another thread's :func:`release_pool` (a run ending there) run first, for
    as long as it needs (at most a second): the moment between a call finding the pool and taking it."""

    def __init__(self, lock):
        self.lock, self.releaser = lock, None

    def acquire(self, blocking=True, timeout=-1):
        if self.releaser is None:
            self.releaser = threading.Thread(target=release_pool)
            self.releaser.start()
            self.releaser.join(1.0)
        return self.lock.acquire(blocking, timeout)

    def release(self):
        self.lock.release()


def test_a_run_ending_in_another_thread_as_a_call_takes_the_pool_does_not_close_it_under_the_call(sleeping_pieces):
    # The pool was found, then taken, in two steps: another thread's release_pool in between closed it, and the
    # call raised "the worker pool is closed" out of the tokenizing (found probing two runs in two threads)
    pool = workers.shared_pool(2)
    pool.lock = _ReleasedMeanwhile(pool.lock)
    pieces = [[k] for k in range(6)]
    shared = Pieces(_slow, 2, pieces, cores=3)
    assert list(shared) == [[2 * k] for k in range(6)] and shared.used_workers == 2
    pool.lock.releaser.join()  # it found the pool in use: the pool is kept, and ends at the next release_pool
    assert workers.shared_pool(2) is pool


def test_a_closed_pool_refuses_work():
    pool = WorkerPool(1)
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.share(_double, 1, [[1]], [0])


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_process_forked_from_the_pools_owner_leaves_its_workers_alone(sleeping_pieces):
    pids = workers.shared_pool(1).pids
    pid = os.fork()
    if pid == 0:  # a DataLoader worker, say: the pool is not its own
        os._exit(0 if workers._shared is None else 1)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    shared = Pieces(_slow, 2, [[1]] * 6, cores=2)
    assert list(shared) == [[2]] * 6 and shared.used_workers == 1 and workers.shared_pool(1).pids == pids


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_process_forked_after_guard_forks_starts_with_parallelism_off(monkeypatch):
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    guard_forks()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: tell the parent what it sees
        os.write(write, os.environ.get("TOKENIZERS_PARALLELISM", "unset").encode())
        os._exit(0)
    os.close(write)
    seen = os.read(read, 100).decode()
    os.close(read)
    os.waitpid(pid, 0)
    assert seen == "false"  # configured in the child: tokenizers neither warns nor uses its pool there
    assert "TOKENIZERS_PARALLELISM" not in os.environ  # this process: as the user left it
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")  # a value the user set is never changed
    pid = os.fork()
    if pid == 0:
        os._exit(0 if os.environ.get("TOKENIZERS_PARALLELISM") == "true" else 1)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


_KILLED = '''
import sys, threading, time
from dynabatch.data import workers

workers.POOL_MIN_SECONDS = 0
workers._OWN_THREADS_SHARE = 1.0  # a sleeping piece's CPU is ~0: clock granularity must not read as threads of its own


def slow(state, piece):
    time.sleep(0.02)
    return piece


point = sys.argv[1]
if point == "start":  # pools started and closed over and over: killed while one starts or ends
    print("ready", flush=True)
    while True:
        workers.WorkerPool(2).close()
elif point == "after":  # a call done, the process's pool waiting for the next one
    list(workers.Pieces(slow, None, [[i] for i in range(10)], cores=3))
    print("ready", flush=True)
    time.sleep(600)
else:  # mid-call, the pool started by this thread ("busy") or by a thread that has ended (the workers must not end)
    if point == "busy from a thread":
        starter = threading.Thread(target=workers.shared_pool, args=(2,))
        starter.start()
        starter.join()
    for k, _ in enumerate(workers.Pieces(slow, None, [[i] for i in range(10**5)], cores=3)):
        if k == 40:
            print("ready", flush=True)
'''


def _children(pid):
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except FileNotFoundError:  # the thread ended between the listing and the read
            continue
    return found


def _alive_with(token):
    """Processes (not zombies) whose environment holds ``token``: everything the killed process forked."""
    alive = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if token.encode() in (entry / "environ").read_bytes() and (entry / "stat").read_text().split()[2] != "Z":
                alive.append(int(entry.name))
        except OSError:  # ended meanwhile, or not ours
            continue
    return alive


def _gone_within(token, seconds=5.0):
    deadline = time.monotonic() + seconds
    while (left := _alive_with(token)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


linux_proc = pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc")


@linux_proc
@pytest.mark.parametrize("point", ["start", "busy", "busy from a thread", "after"])
def test_nothing_outlives_a_process_killed_while_it_tokenizes_in_workers(tmp_path, point):
    token = f"dynabatch-kill-test-{uuid.uuid4().hex}"
    script = tmp_path / "killed.py"
    script.write_text(_KILLED)
    env = dict(os.environ, PYTHONPATH=str(REPO), DYNABATCH_KILL_TEST=token)
    process = subprocess.Popen([sys.executable, str(script), point], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "ready"
        if point == "start":
            time.sleep(1.0)
        else:  # both workers run (a pool started by a thread that ended kept its workers)
            assert len(_children(process.pid)) == 2
    finally:
        process.kill()  # SIGKILL: no clean-up of its own, as the out-of-memory killer does
        process.wait()
    assert _gone_within(token) == []


_SLOW_TOKENIZER = '''
import time

from dynabatch.data import tokenization, workers

workers.POOL_MIN_SECONDS = 0  # workers for a corpus this small
tokenization.fast_backend = lambda *args: None  # its own call runs (no backend): processes, not our threads, share it
_encode = tokenization._Encoder.encode


def _slowly(self, chunk):  # every piece takes a while: the run is surely mid-tokenizing when it is killed
    time.sleep(0.1)
    return _encode(self, chunk)


tokenization._Encoder.encode = _slowly
'''


@pytest.mark.slow
@linux_proc
def test_nothing_outlives_dynabatch_embed_killed_mid_run(tmp_path, tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    from transformers import BertConfig, BertModel

    from dynabatch.demo import kjv_passages, vary_lengths

    model = tmp_path / "model"
    with torch.random.fork_rng():
        torch.manual_seed(0)
        BertModel(BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                             intermediate_size=64, max_position_embeddings=64)).save_pretrained(model)
    tokenizer.save_pretrained(model)
    texts = vary_lengths(kjv_passages(), n=3000, max_words=40, seed=13)
    (tmp_path / "corpus").mkdir()
    pq.write_table(pa.table({"id": list(range(len(texts))), "text": texts}), tmp_path / "corpus" / "part-0.parquet")
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(_SLOW_TOKENIZER)
    token = f"dynabatch-kill-test-{uuid.uuid4().hex}"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(tmp_path / "hook")]), HF_HUB_OFFLINE="1",
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", DYNABATCH_KILL_TEST=token)
    command = [sys.executable, "-m", "dynabatch", "embed", str(tmp_path / "corpus"), str(tmp_path / "store"),
               "--model", str(model), "--id-column", "id", "--max-length", "32", "--no-progress"]
    with open(tmp_path / "log", "w") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while not _children(process.pid):  # its tokenizer workers have started
            assert process.poll() is None, (tmp_path / "log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no worker process within 240 s"
            time.sleep(0.02)
    finally:
        process.kill()  # SIGKILL the command alone (not its process group), as the out-of-memory killer does
        process.wait()
    assert _gone_within(token) == []


def _until_exists(flag, seconds=120.0):
    deadline = time.monotonic() + seconds
    while not flag.exists() and time.monotonic() < deadline:
        time.sleep(0.01)


class SlowHere:
    """A state whose values take 0.05 s in the process that made it and none in a worker, where each marks ``answered``.

    Past the first value (which this thread runs before any worker exists) this thread waits until a worker has
    answered, so the workers take part however long the machine takes to start them.
    """

    def __init__(self, answered):
        self.home, self.answered = os.getpid(), answered

    def __mul__(self, value):
        if os.getpid() != self.home:
            self.answered.touch()
        else:
            time.sleep(0.05)
            if value:
                _until_exists(self.answered)
        return 2 * value


@pytest.mark.parametrize("lose_below, lost", [(float("inf"), True), (0.0, False)])  # both sides of the judgement
def test_workers_that_lose_to_one_thread_get_no_more_pieces(monkeypatch, caplog, tmp_path, sleeping_pieces,
                                                            lose_below, lost):
    monkeypatch.setattr(workers, "WORKERS_LOSE_BELOW", lose_below)
    pieces = [[k] for k in range(30)]
    with caplog.at_level(logging.INFO, logger="dynabatch.data.workers"):
        shared = Pieces(_double, SlowHere(tmp_path / "answered"), pieces, cores=2)
        assert list(shared) == [[2 * k] for k in range(30)]  # every piece once, in order, whoever ran it
    assert shared.used_workers == 1 and shared.lost is lost and ("worker processes lose" in caplog.text) is lost


class StallsThere(SlowHere):
    """A state whose second value and later take a worker 30 s (a worker the machine stopped giving CPU)."""

    def __init__(self, answered):
        super().__init__(answered)
        self.seen = 0

    def __mul__(self, value):
        if os.getpid() != self.home:
            self.seen += 1
            if self.seen > 1:
                time.sleep(30)
        return super().__mul__(value)


def test_once_the_workers_lose_this_thread_takes_over_what_they_hold(monkeypatch, tmp_path, sleeping_pieces):
    monkeypatch.setattr(workers, "WORKERS_LOSE_BELOW", float("inf"))
    answered = tmp_path / "answered"
    shared = Pieces(_double, StallsThere(answered), [[k] for k in range(12)], cores=2)
    assert list(shared) == [[2 * k] for k in range(12)] and shared.lost
    assert time.time() - answered.stat().st_mtime < 10  # the worker's second piece stalls 30 s: this thread did it
