"""One job per results store: the lock a job holds while it writes a store (:class:`JobLock`, :class:`StoreBusyError`).

Each hold leaves a record ``.lock-<nonce>.json`` (job, host, process id, start time), renamed into place whole, its
modification time the heartbeat; records and a gate made by ``link`` rather than ``flock``, which NFS lacks. Who is
admitted, and when a record is dead: ``docs/inference.md``, "One job at a time".

Example:
    >>> import tempfile
    >>> from dynabatch.inference.store_lock import JobLock, StoreBusyError
    >>> path = tempfile.mkdtemp()
    >>> first, same = JobLock(path, "job-a"), JobLock(path, "job-a")  # one job: both admitted
    >>> try:
    ...     JobLock(path, "job-b")
    ... except StoreBusyError as exc:
    ...     exc.holder["job"]
    'job-a'
    >>> first.release(); same.release()
    >>> run = JobLock(path)  # no job string: this hold is a job of its own
    >>> try:
    ...     JobLock(path)  # another run of this same process
    ... except StoreBusyError as exc:
    ...     exc.holder["job"] == run.job
    True
    >>> run.release()
    >>> JobLock(path, "job-b").release()  # the store is free again
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import logging
import os
import random
import socket
import threading
import time
import uuid
from typing import Any

from dynabatch._background import Ticker
from dynabatch.inference.store_shards import gone, remove

__all__ = ["GATE", "GATE_SECONDS", "HEARTBEAT_SECONDS", "LEASE_SECONDS", "PREFIX", "JobLock", "StoreBusyError"]

logger = logging.getLogger(__name__)

LEASE_SECONDS = 60.0  # a record on another machine whose heartbeat is older than this is a dead job's
HEARTBEAT_SECONDS = 10.0  # how often a process refreshes its records' heartbeats
PREFIX = ".lock-"  # a record's file name: hidden, so that pyarrow.dataset and the globs of readers skip it
GATE = PREFIX + "gate"  # the file a hold makes (link) while it writes its record and reads the others'
GATE_SECONDS = 10.0  # a gate this old is abandoned (its holder stopped inside it for that long) and broken
_FIELDS = {"host": str, "pid": int, "job": str, "started": str, "ticks": int, "boot": str, "namespace": str}
_REQUIRED = ("host", "pid", "job")
_IMPORTED = time.time()


class StoreBusyError(RuntimeError):
    """Another live job writes the results store (or took this job's lock over): ``holder`` is its record (``host``,
    ``pid``, ``started``, ``job``), ``None`` when unknown."""

    def __init__(self, message: str, holder: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.holder = holder

    def __reduce__(self) -> tuple:
        return type(self), (str(self), self.holder)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _stat(pid: int) -> tuple[str, int] | None:
    """Process ``pid``'s state letter and start time in clock ticks since boot (Linux); ``None`` where unknown."""
    stat = _read(f"/proc/{pid}/stat")
    if not stat:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after the command's name: fields 3 (state) and 22 (start time)
    return fields[0], int(fields[19])


def _process() -> dict[str, Any]:
    """This process's identity, as a record names it (a forked child is another process)."""
    return dict(_identity(os.getpid()))


@functools.cache
def _identity(pid: int) -> dict[str, Any]:
    ticks = (_stat(pid) or (None, None))[1]
    booted = next((int(line.split()[1]) for line in (_read("/proc/stat") or "").splitlines()
                   if line.startswith("btime ")), None)
    started = booted + ticks / os.sysconf("SC_CLK_TCK") if booted is not None and ticks is not None else _IMPORTED
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = None
    return {"host": socket.gethostname(), "pid": pid, "ticks": ticks, "boot": _read("/proc/sys/kernel/random/boot_id"),
            "namespace": namespace, "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started))}


def _same_machine(record: dict[str, Any], me: dict[str, Any]) -> bool:
    """Whether ``record``'s process id means a process of this machine's (same host, boot and process namespace)."""
    return all(record.get(k) == me[k] for k in ("host", "boot", "namespace"))


def _alive(record: dict[str, Any], heartbeat: float, now: float, me: dict[str, Any]) -> bool:
    """Whether the process of ``record`` (heartbeat at ``heartbeat``, the server's time ``now``) still runs."""
    if record.get("host") == me["host"] and record.get("boot") != me["boot"] and me["boot"] is not None:
        return False  # this host booted since
    if not _same_machine(record, me):
        return now - heartbeat < LEASE_SECONDS
    stat = _stat(record["pid"])
    # Z, X: ended (a killed job's process its parent has not reaped yet); other start ticks: the pid was reused.
    return not gone(record["pid"]) and (stat is None or stat[0] not in "ZX" and record.get("ticks") in (None, stat[1]))


def _holder(record: dict[str, Any]) -> str:
    return (f"host {record.get('host')}, process {record.get('pid')} started {record.get('started')}, "
            f"job {record.get('job')!r}")


def _parse(text: str | None) -> dict[str, Any] | None:
    """A lock record read from its file's ``text``; ``None`` where it is not one (``host``, ``pid`` and ``job`` set,
    each field of its type)."""
    try:
        record = json.loads(text)
    except (TypeError, ValueError):
        return None
    valid = isinstance(record, dict) and all(type(record.get(name)) is kind or name not in _REQUIRED
                                             and record.get(name) is None for name, kind in _FIELDS.items())
    return record if valid else None


_HELD: set[JobLock] = set()  # this process's holds, whose records the heartbeat refreshes
_GUARD = threading.RLock()  # re-entered where a store dropped meanwhile is released by the garbage collector
_BEATING: list[Ticker] = []  # the heartbeat, while this process holds a record


def _beat() -> None:
    """Refreshes the heartbeat of every record this process holds."""
    with _GUARD:
        holds = list(_HELD)
    for hold in holds:
        try:
            os.utime(hold.file)
        except FileNotFoundError:  # another job took the store over: this one must not write on
            hold.lost = True
        except OSError as exc:  # a file server away for a moment: the next beat tries again
            logger.warning("could not refresh the heartbeat of %s (%s)", hold.file, exc)


def _enter_gate(path: str, me: dict[str, Any]) -> str | None:
    """Waits for the store's gate and takes it; its nonce, ``None`` where this file system cannot link (the records
    alone then decide: two jobs at once are never both admitted, but may both be refused)."""
    nonce = uuid.uuid4().hex[:16]
    mine, gate = os.path.join(path, f"{PREFIX}{nonce}.gate.tmp"), os.path.join(path, GATE)
    with open(mine, "w") as f:
        json.dump({**me, "job": "gate", "nonce": nonce}, f)
    try:
        while True:
            try:
                os.link(mine, gate)
                return nonce
            except FileExistsError:
                if os.stat(mine).st_nlink == 2:  # linked after all: NFS answered a retried link (the classic check)
                    return nonce
            except OSError as exc:  # no hard links here (some FUSE and object-store mounts)
                logger.debug("output_path=%r: no lock gate (%s)", path, exc)
                return None
            _break_abandoned(path, mine, me)
            time.sleep(0.002 + random.random() * 0.01)
    finally:
        remove(mine)


def _break_abandoned(path: str, mine: str, me: dict[str, Any]) -> None:
    """Removes the store's gate if its holder is gone or has held it :data:`GATE_SECONDS` (a stopped process)."""
    gate = os.path.join(path, GATE)
    try:
        since, text = os.stat(gate).st_mtime, _read(gate)
    except FileNotFoundError:
        return
    os.utime(mine)  # the file server's time now
    holder, now = _parse(text), os.stat(mine).st_mtime
    if now - since < GATE_SECONDS and (holder is None or _alive(holder, since, now, me)):
        return  # held (or being made): wait
    broken = os.path.join(path, f"{PREFIX}{uuid.uuid4().hex[:16]}.broken.tmp")
    try:
        os.rename(gate, broken)
    except FileNotFoundError:  # left, or broken by another, meanwhile
        return
    if _read(broken) != text:  # a gate taken since it was judged: put back where none was taken again
        with contextlib.suppress(OSError):
            os.link(broken, gate)
    else:
        logger.warning("output_path=%r: breaking the lock gate left by %s", path,
                       _holder(holder) if holder else "an unknown process")
    remove(broken)


def _take(path: str, job: str) -> str:
    """Writes this hold's record into the store at ``path`` inside the gate, then refuses it if another job's live
    record is there, or removes the dead ones; its file."""
    me = _process()
    nonce = _enter_gate(path, me)
    try:
        mine = os.path.join(path, f"{PREFIX}{uuid.uuid4().hex[:16]}.json")
        with open(mine + ".tmp", "w") as f:
            json.dump({**me, "job": job, "since": time.strftime("%Y-%m-%d %H:%M:%S")}, f)
        os.replace(mine + ".tmp", mine)  # written before the others are read: of two jobs at once, one sees the other
        now = os.stat(mine).st_mtime  # the file server's clock, which every heartbeat is read on
        dead: list[tuple[str, str]] = []  # removed once this hold is admitted: a refused hold removes nothing else
        for name in sorted(os.listdir(path)):
            other = os.path.join(path, name)
            if not name.startswith(PREFIX) or other == mine or name == GATE:
                continue
            try:
                heartbeat, text = os.stat(other).st_mtime, _read(other)
            except FileNotFoundError:  # released meanwhile
                continue
            if not name.endswith(".json"):  # a record or gate being written, or a killed writer's temporary file
                if name.endswith(".tmp") and now - heartbeat >= LEASE_SECONDS:
                    dead.append((other, ""))
                continue
            record = _parse(text)
            if record is None:
                if text is not None:  # None: unreadable (a folder), or removed meanwhile
                    why = f"removing {name}, not a lock record (a JSON object with {', '.join(_REQUIRED)}): {text[:80]!r}"
                    dead.append((other, why))
                continue
            if _alive(record, heartbeat, now, me):
                if record["job"] == job:
                    continue
                remove(mine)
                here = " of this process: a run in another thread, or a store opened and not closed" if \
                    _same_machine(record, me) and record["pid"] == me["pid"] else ""
                raise StoreBusyError(
                    f"output_path={path!r} should be written by one job at a time, but another job is writing it "
                    f"({_holder(record)}{here}): wait for it to end or stop it, or use another output_path; a job "
                    f"that was killed holds it no longer than its process runs (on another host: {LEASE_SECONDS:.0f} "
                    "s after its last heartbeat)", record)
            dead.append((other, "" if record["job"] == job else
                         f"taking over the lock of a job that is gone ({_holder(record)})"))
    finally:
        if nonce is not None and (_parse(_read(os.path.join(path, GATE))) or {}).get("nonce") == nonce:
            remove(os.path.join(path, GATE))
    for other, why in dead:
        if why:
            logger.warning("output_path=%r: %s", path, why)
        remove(other)
    return mine


class JobLock:
    """The store at ``path`` (a directory) held for ``job`` (one string for every process of a job; ``None``: this
    hold alone) until :meth:`release`; :class:`StoreBusyError` where another live job holds it. ``lost``: another job
    took the store over (this hold's heartbeat was found too old): write no more."""

    def __init__(self, path: str, job: str | None = None) -> None:
        self.job = job if job is not None else "process {host}:{pid}:{ticks} run {run}".format(
            **_process(), run=uuid.uuid4().hex[:8])  # one run: another hold of this process is another job
        self.path, self.lost, self._released = path, False, False
        # Taken outside the guard: the gate orders the holds of every process and thread, and the heartbeats of
        # other stores go on while this one waits for it.
        self.file = _take(path, self.job)
        with _GUARD:
            _HELD.add(self)
            ticker = None if _BEATING else Ticker(_beat, seconds=HEARTBEAT_SECONDS, name="dynabatch-lock-heartbeat")
            if ticker is not None:
                _BEATING.append(ticker)
        if ticker is not None:  # started outside the guard: a store the garbage collector releases in the new thread
            ticker.start()  # takes it (a deadlock while this thread waited for the new one to start)

    @property
    def held(self) -> bool:
        """Whether this hold still holds the store: neither released nor lost."""
        return not self._released and not self.lost

    def release(self, wait: bool = True) -> None:
        """Gives this hold up, its record removed; the last hold of the process stops the heartbeat (``wait=False``:
        not waiting for it, for the garbage collector). Idempotent."""
        stopped = None
        with _GUARD:
            if self._released:
                return
            self._released = True
            _HELD.discard(self)
            remove(self.file)
            if not _HELD and _BEATING:
                stopped = _BEATING.pop()
        if stopped is not None:
            stopped.close(wait=wait)

    def release_job(self) -> None:
        """Removes every record of this job from the store, then :meth:`release`: for a job whose other processes
        have ended without removing theirs (Ray's actors, stopped when the job's dataset is done)."""
        for name in os.listdir(self.path):
            other = os.path.join(self.path, name)
            record = _parse(_read(other)) if name.startswith(PREFIX) and name.endswith(".json") else None
            if record is not None and record["job"] == self.job and other != self.file:
                remove(other)
        self.release()


@atexit.register
def _release_all() -> None:
    """Records of a process that ends (not killed) are removed, so a later job does not wait on them."""
    with _GUARD:
        holds = list(_HELD)
    for hold in holds:  # the last stops the heartbeat, not waiting for it
        hold.release(wait=False)
