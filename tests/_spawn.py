"""Runs a worker script on two local processes that meet in a ``torch.distributed`` rendezvous.

Used by the two-process (gloo / accelerate) tests through the ``run_two_ranks``
fixture of ``tests/conftest.py`` (tests are imported with
``--import-mode=importlib``, so this file is not importable by name).
"""

import json
import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import _warm

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for the rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_ranks(worker: str, out: Path, timeout: float = 150, args: Sequence[str] = (), warm=None) -> list[dict]:
    """Runs ``worker`` (Python source) as ``python worker.py RANK OUT *ARGS`` on ranks 0 and 1; returns their reports.

    Each rank gets the environment of ``torchrun`` / ``accelerate launch``
    (``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE=2``, ``RANK``,
    ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``), one OpenMP thread and the repository
    on ``PYTHONPATH``, and must write its report as JSON to ``OUT/rank{RANK}.json``.
    Output goes to ``OUT/rank{RANK}.log`` (a file: a full pipe would stall a
    rank mid-collective). Fails the test with the log's tail if a rank does not
    exit with 0 within ``timeout`` seconds. With ``warm`` (a ``tests/_warm.py`` server), the ranks are forks of
    it: processes of their own, without the 15-20 s of imports.
    """
    out = Path(out)
    script = out / "worker.py"
    script.write_text(worker)
    base = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2",
                LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    logs = [out / f"rank{rank}.log" for rank in range(2)]
    procs = []
    try:
        for rank in range(2):
            env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank))
            with open(logs[rank], "w") as log:
                command = [sys.executable, str(script), str(rank), str(out), *args]
                if warm is None:
                    procs.append(subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
                else:
                    procs.append(_warm.Process(warm, command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
        for p in procs:
            p.wait(timeout=timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, p in enumerate(procs):
        assert p.returncode == 0, f"rank {rank} exited with {p.returncode}:\n{logs[rank].read_text()[-4000:]}"
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]
