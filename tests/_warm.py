"""Python processes for the tests without the import wait: forks of one interpreter that imported the heavy modules.

A process of this machine spends 15-20 s importing torch, transformers and
sentence-transformers before it runs a line; a test that runs a script, a
benchmark or a documented command pays that per process. :func:`run` (a
``subprocess.run`` for ``[python, script | -m module | -c code, *args]``) and
the commands of :func:`shims` (``python``, ``python3``, ``dynabatch``,
``torchrun`` for the docs' shell blocks) instead ask a server,
``python tests/_warm.py SOCKET``, that imported those modules once and runs
nothing else: it forks a process that takes the caller's arguments, working
folder, environment and standard streams, runs the program as ``__main__`` as
the interpreter would, and hands back its exit status. Nothing the server
imported has run an operation, so the fork starts as a fresh interpreter would,
less the import time (what ``tests/_docs_server.py`` does for the pages'
Python blocks).

What is not the same as a fresh process, and so stays a real one: interpreter
options other than ``-u`` (:func:`run` falls back to ``subprocess.run``), an
environment variable a module reads when imported (the server starts with the
tests' ``HF_HUB_OFFLINE`` and ``OMP_NUM_THREADS`` is applied to torch in the
fork), and anything the tests kill mid-run or time as a cold start: those
tests keep ``subprocess``.

The protocol: the client connects to the Unix socket and sends one JSON line
(``argv`` after the interpreter's path, ``cwd``, ``env``, ``executable``)
with its stdin, stdout and stderr descriptors; the server answers the pid of the
program, then ``exit <status>`` when it ends (minus the signal that ended it).
A client that goes away before the end takes the program with it (killed with
its process group).
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHIMS = {  # command name -> what the fork runs: the console scripts' own entry points
    "python": None, "python3": None, "dynabatch": "dynabatch.cli:main", "torchrun": "torch.distributed.run:main"}


# --- the server ------------------------------------------------------------------------------------


def _streams(unbuffered: bool) -> None:
    """``sys.stdin``, ``sys.stdout`` and ``sys.stderr`` over descriptors 0-2, buffered as a fresh interpreter's."""
    import io

    for fd, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        old = getattr(sys, name)
        raw = io.open(fd, mode + "b", buffering=0 if unbuffered and mode == "w" else -1, closefd=False)
        setattr(sys, name, io.TextIOWrapper(raw, encoding=old.encoding, errors=old.errors,
                                            line_buffering=name == "stderr" or os.isatty(fd),
                                            write_through=unbuffered and mode == "w"))


def _program(request: dict) -> int:
    """In the fork: becomes the requested program (its folder, environment, streams, ``sys.path``, a
    ``sitecustomize`` on its ``PYTHONPATH``); returns its exit status."""
    import atexit
    import importlib
    import runpy
    import traceback

    os.setpgid(0, 0)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.executable = request["executable"]
    args, unbuffered = list(request["argv"]), "PYTHONUNBUFFERED" in request["env"]
    while args and args[0] == "-u":
        unbuffered, args = True, args[1:]
    _streams(unbuffered)
    if request["env"].get("OMP_NUM_THREADS"):  # read by OpenMP when torch loaded, in the server: set here
        import torch

        torch.set_num_threads(int(request["env"]["OMP_NUM_THREADS"]))
    paths = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    # sys.path as the interpreter makes it: the script's folder (else the working folder), then PYTHONPATH
    first = [] if request.get("entry") else [os.path.dirname(os.path.abspath(args[0]))
                                              if not args[0].startswith("-") else ""]
    sys.path[:0] = first + paths
    status = 0
    try:
        if any(os.path.isfile(os.path.join(p, "sitecustomize.py")) for p in paths):  # what site imports at start
            sys.modules.pop("sitecustomize", None)
            importlib.import_module("sitecustomize")
        if request.get("entry"):
            module, _, function = request["entry"].partition(":")
            sys.argv = [request["argv0"], *args]
            status = getattr(importlib.import_module(module), function)()
        elif args[0] == "-m":
            sys.argv = [args[1], *args[2:]]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        elif args[0] == "-":
            sys.argv = ["-", *args[1:]]
            exec(compile(sys.stdin.read(), "<stdin>", "exec"), {"__name__": "__main__"})  # noqa: S102
        elif args[0] == "-c":
            sys.argv = ["-c", *args[2:]]
            exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__"})  # noqa: S102
        else:
            sys.argv = args
            runpy.run_path(os.path.abspath(args[0]), run_name="__main__")
    except SystemExit as exc:
        status = exc.code
    except BaseException:  # noqa: BLE001 - the traceback a fresh interpreter prints, status 1
        traceback.print_exc()
        status = 1
    atexit._run_exitfuncs()
    if status is None or isinstance(status, int):
        return status or 0
    print(status, file=sys.stderr)  # sys.exit("message"): printed, status 1
    return 1


def _serve(connection: socket.socket) -> None:
    """In a fork of the server, for one request: forks the program, waits for it (or for the client to go)."""
    message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
    request = json.loads(message.decode())
    pid = os.fork()
    if pid == 0:
        connection.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        status = 1
        try:
            status = _program(request)
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:  # noqa: BLE001, S110 - a closed stream: nothing more to say
                    pass
            os._exit(status & 0xFF)
    for fd in fds:
        os.close(fd)
    try:
        os.setpgid(pid, pid)
    except OSError:
        pass
    connection.sendall(f"{pid}\n".encode())
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        readable, _, _ = select.select([connection], [], [], 0.05)
        if readable and not connection.recv(1):  # the client went away: so does the program
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)
            return
    try:
        connection.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
    except OSError:
        pass


def serve(path: str) -> None:
    """The server: imports, says ``ready``, forks a :func:`_serve` per connection until stdin closes."""
    import numpy  # noqa: F401
    import pandas  # noqa: F401
    import pyarrow.dataset  # noqa: F401
    import pyarrow.parquet  # noqa: F401
    import sentence_transformers  # noqa: F401
    import torch  # noqa: F401
    import torch.distributed.run  # noqa: F401
    import transformers  # noqa: F401
    import transformers.modeling_utils  # noqa: F401
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments  # noqa: F401

    import dynabatch
    import dynabatch.cli  # noqa: F401

    for name in ("run", "build_dynamic_batch_dataloader", "BatchSamplerTrainer", "SmartBatchSampler"):
        getattr(dynabatch, name)  # the lazy attributes load their modules now, once
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    print("ready", flush=True)
    while True:
        readable, _, _ = select.select([listener, sys.stdin], [], [], 1)
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:  # the ended request forks (their CPU time counts as this one's)
                pass
        except ChildProcessError:
            pass
        if sys.stdin in readable and not sys.stdin.readline():
            return
        if listener in readable:
            connection, _ = listener.accept()
            if os.fork() == 0:
                listener.close()
                try:
                    _serve(connection)
                finally:
                    os._exit(0)
            connection.close()


class Server:
    """A :func:`serve` process of this interpreter, for this test process (one per pytest worker)."""

    def __init__(self, folder: Path, environment: dict[str, str]) -> None:
        self.path = str(folder / "warm.sock")
        self.process = subprocess.Popen([sys.executable, __file__, self.path], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, env=environment, text=True)
        ready = self.process.stdout.readline().strip()
        if ready != "ready":
            self.close()
            raise RuntimeError(f"tests/_warm.py did not start (it said {ready!r}); run it to see why")
        self.shims = shims(folder / "bin", self.path)

    def close(self) -> None:
        self.process.stdin.close()
        self.process.kill()
        self.process.wait()


# --- the clients -----------------------------------------------------------------------------------


def forkable(args: list[str]) -> bool:
    """Whether interpreter arguments ``args`` (after its path) are ones a fork runs: ``-u``, then a script, ``-``,
    ``-m module`` or ``-c code``."""
    plain = [a for a in args if a != "-u"][:1]
    return bool(plain) and (not plain[0].startswith("-") or plain[0] in ("-", "-m", "-c"))


def _start(path: str, request: dict, fds: tuple[int, int, int]):
    """Sends ``request`` with ``fds``; returns the connection, its reader and the program's pid."""
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.connect(path)
    socket.send_fds(connection, [json.dumps(request).encode()], list(fds))
    reader = connection.makefile("rb")
    return connection, reader, int(reader.readline())


def _status(reader) -> int:
    line = reader.readline().decode()
    if not line.startswith("exit "):
        raise RuntimeError("tests/_warm.py: the server ended before the program did")
    return int(line.split()[1])


class Process:
    """``subprocess.Popen([python, *options], stdin=..., stdout=..., stderr=...)`` in a fork of ``server``: its
    ``pid``, ``returncode``, ``poll()``, ``wait(timeout)`` and ``kill()`` (the program's process group).

    The streams are open files (``None``: /dev/null for stdin, this process's for stdout and stderr;
    ``subprocess.STDOUT`` for stderr: stdout's).
    """

    def __init__(self, server: Server, argv: list[str], *, cwd=None, env=None, stdin=None, stdout=None,
                 stderr=None) -> None:
        self.args, self.returncode = argv, None
        args = list(map(str, argv[1:]))
        launcher = args[:2] == ["-m", "torch.distributed.run"]  # its ranks, started as sys.executable, forks too
        request = {"argv": args, "cwd": str(cwd or os.getcwd()), "env": dict(os.environ if env is None else env),
                   "entry": None, "argv0": "",
                   "executable": str(server.shims / "python") if launcher else sys.executable}
        with open(os.devnull, "rb") as null:
            out = 1 if stdout is None else stdout.fileno()
            err = out if stderr == subprocess.STDOUT else 2 if stderr is None else stderr.fileno()
            self._connection, self._reader, self.pid = _start(
                server.path, request, ((stdin or null).fileno(), out, err))

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._connection], [], [], 0)[0]:
            self.wait()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._connection.settimeout(timeout)
            try:
                self.returncode = _status(self._reader)
            except (TimeoutError, socket.timeout):
                raise subprocess.TimeoutExpired(self.args, timeout) from None
            self._connection.close()
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def runs_in_a_fork(server: Server | None, argv: list[str]) -> bool:
    """Whether :class:`Process` runs ``argv``: a server, this interpreter, and options it takes."""
    args = list(map(str, argv[1:]))
    return server is not None and str(argv[0]) == sys.executable and forkable(args) and "-" not in args[:2]


def shims(folder: Path, path: str) -> Path:
    """``folder`` holding ``python``, ``python3``, ``dynabatch`` and ``torchrun`` commands that run in forks of the
    server at ``path`` (put ``folder`` first on ``PATH``); returns ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, entry in SHIMS.items():
        shim = folder / name
        shim.write_text(f"#!{sys.executable} -IS\nimport sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\n"
                        f"import _warm\n_warm.shim({path!r}, {entry!r}, {str(folder / 'python')!r})\n")
        shim.chmod(0o755)
    return folder


def _fresh() -> None:
    """Becomes the command this shim stands in for: the next one of its name on ``PATH``."""
    import shutil

    name, here = os.path.basename(sys.argv[0]), os.path.dirname(os.path.abspath(sys.argv[0]))
    rest = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if os.path.abspath(p) != here)
    command = shutil.which(name, path=rest)
    if command is None:
        sys.exit(f"{name}: command not found (after tests/_warm.py's shim)")
    os.execv(command, [command, *sys.argv[1:]])


def shim(path: str, entry: str | None, python: str) -> None:
    """A shim's body: runs its command line in a fork of the server, passing on the signals it gets; other
    interpreter options, and a job on Ray (whose cluster starts interpreters of its own: not tried in a fork), run
    the command itself."""
    if (entry is None and not forkable(sys.argv[1:])) or "--ray" in sys.argv:
        _fresh()
    request = {"argv": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ), "entry": entry,
               "argv0": sys.argv[0], "executable": python if entry and "torch" in entry else sys.executable}
    connection, reader, pid = _start(path, request, (0, 1, 2))
    for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(number, lambda n, _: os.kill(pid, n))
    status = _status(reader)
    if status < 0:
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    sys.exit(status)


def run(server: Server | None, argv: list[str], *, cwd=None, env=None, timeout: float | None = None,
        check: bool = False, text: bool = True, capture_output: bool = True, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, capture_output=True, ...)`` of ``[python, *options]`` in a fork of ``server``; plain
    ``subprocess.run`` unless :func:`runs_in_a_fork`."""
    if not runs_in_a_fork(server, argv):
        return subprocess.run(argv, cwd=cwd, env=env, timeout=timeout, check=check, text=text,
                              capture_output=True, **kwargs)
    assert capture_output and not kwargs, f"tests/_warm.py run: {sorted(kwargs)} not supported (output is captured)"
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        process = Process(server, argv, cwd=cwd, env=env, stdout=out, stderr=err)
        try:
            process.wait(timeout)
        finally:
            process.kill()
        outputs = []
        for stream in (out, err):
            stream.seek(0)
            data = stream.read()
            outputs.append(data.decode(errors="replace") if text else data)
    result = subprocess.CompletedProcess(argv, process.returncode, *outputs)
    if check:
        result.check_returncode()
    return result


if __name__ == "__main__":
    serve(sys.argv[1])
