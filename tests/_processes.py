"""The processes of this machine as ``/proc`` shows them, for the tests that kill commands: who started whom, and
whether a process has ended. Importable as ``_processes`` from any test module (``tests/conftest.py`` registers it)."""

import time
from pathlib import Path


def stats() -> dict[int, list[str]]:
    """Every process's ``/proc/<pid>/stat`` fields from the state on (``[0]``: state, ``[1]``: parent)."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            found[int(stat.parent.name)] = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended while read
    return found


def descendants(pids: list[int]) -> list[int]:
    """The processes ``pids`` started, and the ones they started, as they are now."""
    children: dict[int, list[int]] = {}
    for child, fields in stats().items():
        children.setdefault(int(fields[1]), []).append(child)
    found, todo = [], list(pids)
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def command_line(pid: int) -> str:
    """Process ``pid``'s command line, its arguments joined by spaces ("" once it has ended)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def wait_until_ended(pids: list[int], timeout: float = 60) -> None:
    """Waits until every process of ``pids`` has ended (a zombie has): a SIGKILLed process runs on for the time the
    kernel takes to tear it down, longer on a busy machine, and holds what it held till then."""
    deadline = time.monotonic() + timeout
    while running := [pid for pid, fields in stats().items() if pid in pids and fields[0] not in "ZX"]:
        assert time.monotonic() < deadline, f"processes {running} still run {timeout} s after SIGKILL"
        time.sleep(0.05)

