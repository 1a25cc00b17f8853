"""Runs chains of documentation blocks, each in a forked child of one interpreter that has imported the heavy modules.

Started by ``tests/test_docs.py`` as ``python tests/_docs_server.py``. It
imports what the pages' blocks import (torch, transformers, dynabatch, ...:
seconds a process, paid once here instead of once per chain), prints
``ready``, then answers one request per line on stdin, a JSON object::

    {"folder": "/tmp/.../README.md-53", "timeout": 600,
     "blocks": [{"name": "README.md:53", "line": 53, "language": "python", "code": "..."}, ...]}

For each request it forks a child that starts its own process group, moves
into ``folder`` (an empty folder), sends its stdout and stderr to
``folder/../output.txt``, and runs the blocks in order: a ``python`` block
with ``exec`` in one ``__main__`` namespace shared by the chain (so a block
continues the one before it), a ``shell`` block with ``bash -e -o pipefail``
in the same folder, each command echoed with the block's seconds so far.
Tracebacks name the page and the block's own line numbers. The child writes ``times.json`` (seconds per block) and
``values.pkl`` (the namespace's plain data: tensors, arrays, numbers, strings
and lists of them) beside ``output.txt``. The server answers one JSON line,
``{"status": exit status or -signal, "cpu_seconds": ...}`` (the CPU time of the child and
of the commands it ran); a child past ``timeout`` seconds is
killed with its process group (commands it started too).

Nothing the server imports has run an operation, so the children start as a
fresh interpreter would, less the import time.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
import traceback

import numpy
import pandas  # noqa: F401
import pyarrow.dataset
import pyarrow.parquet  # noqa: F401
import sentence_transformers  # noqa: F401
import torch
import transformers  # noqa: F401
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments  # noqa: F401

import dynabatch
import dynabatch.cli

for _name in ("run", "build_dynamic_batch_dataloader", "BatchSamplerTrainer", "SmartBatchSampler"):
    getattr(dynabatch, _name)  # the lazy attributes load their modules now, once


def _plain(value: object) -> bool:
    """Data a test may read back: tensors, arrays, numbers, strings, and lists or tuples of them."""
    if type(value) in (torch.Tensor, numpy.ndarray, str, int, float, bool):
        return True
    return type(value) in (list, tuple) and len(value) < 100_000 and all(_plain(v) for v in value[:100])


def _picklable(value: object) -> bool:
    try:
        pickle.dumps(value)
    except Exception:  # noqa: BLE001 - a value that does not pickle is not read back
        return False
    return True


def _run_blocks(request: dict) -> int:
    """In the child: the chain's blocks in order; returns the exit status."""
    namespace: dict = {"__name__": "__main__"}
    times: dict[str, float] = {}
    status = 0
    for block in request["blocks"]:
        start = time.perf_counter()
        try:
            if block["language"] == "python":
                # Blank lines before the code: a traceback names the block's own lines of the page.
                exec(compile("\n" * (block["line"] - 1) + block["code"], block["file"], "exec"), namespace)  # noqa: S102
            else:
                sys.stdout.flush()
                # Each command is echoed to the output with the block's seconds so far, before it runs (bash run
                # by root takes no PS4 from the environment).
                trace = "PS4='+ [${SECONDS}s] '; set -x\n"
                subprocess.run(["bash", "-e", "-o", "pipefail", "-c", trace + block["code"]], check=True)
        except BaseException as exc:  # noqa: BLE001 - any failure of a block is its chain's result
            if isinstance(exc, subprocess.CalledProcessError):
                print(f"\n{block['name']}: the shell block exited with status {exc.returncode}", file=sys.stderr)
            else:
                traceback.print_exc()
                print(f"\n{block['name']}: the block raised {type(exc).__name__}", file=sys.stderr)
            status = 1
        times[block["name"]] = time.perf_counter() - start
        if status:
            break
    here = os.path.dirname(os.getcwd())
    with open(os.path.join(here, "times.json"), "w") as out:
        json.dump(times, out)
    with open(os.path.join(here, "values.pkl"), "wb") as out:
        pickle.dump({k: v for k, v in namespace.items() if not k.startswith("__") and _plain(v) and _picklable(v)},
                    out)
    return status


def _child(request: dict) -> None:
    os.setpgid(0, 0)
    os.chdir(request["folder"])
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # stdin is the server's requests
    log = os.open(os.path.join(os.path.dirname(request["folder"]), "output.txt"), os.O_WRONLY | os.O_CREAT, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    status = 1
    try:
        status = _run_blocks(request)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def _wait(pid: int, timeout: float) -> tuple[int, float]:
    """The child's exit status (or minus the signal that ended it) and the CPU seconds it and the commands it
    waited for used."""
    deadline = time.monotonic() + timeout
    while True:
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status), usage.ru_utime + usage.ru_stime
        if time.monotonic() > deadline:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _, _, usage = os.wait4(pid, 0)
            return -signal.SIGKILL, usage.ru_utime + usage.ru_stime
        time.sleep(0.02)


def main() -> None:
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)
        try:
            os.setpgid(pid, pid)  # as the child does: whichever runs first, a kill reaches all it started
        except OSError:
            pass
        status, cpu = _wait(pid, request["timeout"])
        print(json.dumps({"status": status, "cpu_seconds": cpu}), flush=True)


if __name__ == "__main__":
    main()
