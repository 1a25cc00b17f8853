"""The code blocks of README.md and docs/*.md, grouped into the chains that ``tests/test_docs.py`` runs.

The rules a page's author follows (docs/development.md says them too):

* Every ```` ```python ```` block runs as written, in a fresh interpreter, in an
  empty folder, offline (``HF_HUB_OFFLINE=1``).
* Every ```` ```bash ```` (``sh``, ``shell``, ``console``) block runs as
  written with ``bash -e -o pipefail`` in an empty folder, with the checkout's
  ``python``, ``dynabatch`` and ``torchrun`` first on ``PATH``. Its commands
  that install (a line with ``pip install``) are left out: installing is what
  a fresh environment does before the tests (CI runs the README's own install
  and test line, ``.ci/run``).
* A block whose first line is ``# continues the block above`` (words may
  follow) runs after the runnable block above it on the same page, in the same
  folder, and for Python in the same interpreter: its names are still defined.
  Such blocks form a *chain*, run as one test.
* A block whose first line is ``# fragment: <why>`` does not run (a signature,
  a piece of a larger program, a job that needs several GPUs); the reason is
  required, and a block cannot continue a fragment.
* Other fences (``text``, ``json``, none) are not code to run.

A chain is *slow* (``pytest -m "not slow"`` leaves it out) when it runs a
shell block (each command starts an interpreter and loads a model) or loads
model weights or trains (``...Model....from_pretrained(``,
``SentenceTransformer(``, ``chat_model(``, ``ray.init(``, ``.train()``, ``training_budget(``).

:class:`Server` runs chains through ``tests/_docs_server.py``: one interpreter
that imported torch, transformers and dynabatch once, forking a child per
chain, so a chain costs what its own blocks cost.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

PYTHON = ("python", "py", "python3")
SHELL = ("bash", "sh", "shell", "console")
FRAGMENT = re.compile(r"^#\s*fragment:\s*(?P<why>.*)$")
CONTINUES = re.compile(r"^#\s*continues the block above\b")
INSTALLS = re.compile(r"\bpip install\b")
SLOW = re.compile(r"Model\w*\.from_pretrained\(|SentenceTransformer\(|chat_model\(|ray\.init\(|\.train\(\)|"
                  r"training_budget\(")

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^\n`]*)$")


def fenced_blocks(text: str) -> list[tuple[str, int, str]]:
    """Every fenced block of ``text``: ``(info string, first code line's number, code)``."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        fence, start, body = opening.group("fence"), i + 1, []
        i += 1
        while i < len(lines):
            closing = FENCE.match(lines[i])
            if closing and closing.group("fence")[0] == fence[0] and len(closing.group("fence")) >= len(fence) \
                    and not closing.group("info").strip():
                break
            body.append(lines[i].removeprefix(opening.group("indent")))
            i += 1
        blocks.append((opening.group("info").strip(), start + 1, "\n".join(body) + "\n"))
        i += 1
    return blocks


def _without_installs(code: str) -> str:
    """A shell block less its commands that install (backslash-continued lines count as one command)."""
    kept, command = [], []
    for line in code.splitlines():
        command.append(line)
        if line.rstrip().endswith("\\"):
            continue
        if not INSTALLS.search(" ".join(command)):
            kept.extend(command)
        command = []
    return "\n".join(kept + command) + "\n"


@dataclass(frozen=True)
class Block:
    """One code block of a page: where it is, its language (``python`` or ``shell``) and its markers."""

    page: str  # the page's path from the repository's root
    line: int  # the page's line of the block's first code line
    language: str
    code: str
    fragment: str | None  # the reason given after "# fragment:", else None
    continues: bool

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def runnable_code(self) -> str:
        return self.code if self.language == "python" else _without_installs(self.code)

    @property
    def runs_something(self) -> bool:
        """Whether the runnable code has a line that is not blank or a comment."""
        return any(line.strip() and not line.lstrip().startswith("#") for line in self.runnable_code.splitlines())


@dataclass
class Chain:
    """Blocks of one page that run in order, in one folder (Python blocks in one interpreter)."""

    blocks: list[Block] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.blocks[0].name

    @property
    def slow(self) -> bool:
        return any(b.language == "shell" or SLOW.search(b.code) for b in self.blocks)


def page_blocks(page: Path) -> list[Block]:
    """The Python and shell blocks of ``page``, in order."""
    out = []
    for info, line, code in fenced_blocks(page.read_text(encoding="utf-8")):
        language = (info.split() or [""])[0].lower()
        if language not in PYTHON + SHELL:
            continue
        first = code.lstrip("\n").split("\n", 1)[0].strip()
        fragment = FRAGMENT.match(first)
        out.append(Block(str(page.relative_to(ROOT)), line, "python" if language in PYTHON else "shell", code,
                         fragment.group("why").strip() if fragment else None, bool(CONTINUES.match(first))))
    return out


def chains(pages: list[Path] = PAGES) -> tuple[list[Chain], list[str]]:
    """The chains of ``pages`` and the problems found: a fragment without a reason, a continuation of nothing."""
    found, problems = [], []
    for page in pages:
        previous: Block | None = None
        for block in page_blocks(page):
            if block.fragment is not None:
                if not block.fragment:
                    problems.append(f"{block.name}: '# fragment:' should say why the block does not run")
            elif block.continues:
                if previous is None or previous.fragment is not None:
                    problems.append(f"{block.name}: continues the block above, but "
                                    + ("there is none" if previous is None else f"that is a fragment ({previous.name})"))
                elif not previous.runs_something:
                    problems.append(f"{block.name}: continues the block above, which only installs ({previous.name})")
                else:
                    found[-1].blocks.append(block)
            elif block.runs_something:
                found.append(Chain([block]))
            previous = block
    return found, problems


@dataclass
class Result:
    """What a chain did: its exit status, its output, seconds per block, its CPU seconds (the steadier figure on a
    shared machine), and its plain-data names."""

    status: int
    cpu_seconds: float
    output: str
    seconds: dict[str, float]
    values: dict[str, Any]


class Server:
    """A ``tests/_docs_server.py`` process: :meth:`run` runs a chain in a forked child of it."""

    def __init__(self, environment: dict[str, str], timeout: float = 600) -> None:
        self.timeout = timeout
        self.process = subprocess.Popen([sys.executable, str(Path(__file__).with_name("_docs_server.py"))],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=environment, text=True,
                                        cwd=ROOT)
        ready = self.process.stdout.readline().strip()
        if ready != "ready":
            self.close()
            raise RuntimeError(f"tests/_docs_server.py did not start (it said {ready!r}); run it to see why")

    def run(self, chain: Chain, folder: Path) -> Result:
        """Runs ``chain`` in ``folder/work`` (made empty); its output and timings land in ``folder``."""
        work = folder / "work"
        work.mkdir(parents=True)
        blocks = [{"name": b.name, "file": b.page, "line": b.line, "language": b.language, "code": b.runnable_code}
                  for b in chain.blocks]
        start = time.perf_counter()
        self.process.stdin.write(json.dumps({"folder": str(work), "timeout": self.timeout, "blocks": blocks}) + "\n")
        self.process.stdin.flush()
        answer = self.process.stdout.readline()
        if not answer:
            raise RuntimeError(f"tests/_docs_server.py ended while running {chain.name}")
        answer = json.loads(answer)
        status = answer["status"]
        output = (folder / "output.txt").read_text(errors="replace") if (folder / "output.txt").exists() else ""
        if status == -9:
            output += f"\n{chain.name}: killed after {time.perf_counter() - start:.0f} s (the limit is {self.timeout:.0f} s)"
        seconds = json.loads((folder / "times.json").read_text()) if (folder / "times.json").exists() else {}
        values = pickle.loads((folder / "values.pkl").read_bytes()) if (folder / "values.pkl").exists() else {}
        return Result(status, answer["cpu_seconds"], output, seconds, values)

    def close(self) -> None:
        """Ends the server, idle between chains: at once (its own exit, unloading torch and the rest, takes seconds)."""
        self.process.stdin.close()
        self.process.kill()
        self.process.wait()


def environment(cache: Path, warm=None) -> dict[str, str]:
    """The chains' environment: this checkout first on the paths, offline, one thread per process (a small model
    on a busy machine runs many times slower with two), the demo's cache in ``cache``, Ray local to each job;
    with ``warm`` (a ``tests/_warm.py`` server), the shell blocks' ``python``, ``dynabatch`` and ``torchrun`` run in
    its forks, without the 15-20 s of imports a process."""
    bin_dirs = [os.path.dirname(sys.executable)]
    if warm is not None:
        bin_dirs.insert(0, str(warm.shims))
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                PATH=os.pathsep.join([*bin_dirs, os.environ.get("PATH", "")]), HF_HUB_OFFLINE="1",
                OMP_NUM_THREADS="1", DYNABATCH_CACHE_DIR=os.environ.get("DYNABATCH_CACHE_DIR", str(cache)),
                HF_HUB_DISABLE_PROGRESS_BARS="1", PYTHONUNBUFFERED="1",
                # `--ray auto` joins any Ray running on this machine (Ray's rule: another pytest worker's too);
                # the pages' jobs start a local Ray of their own, as on a machine without a cluster
                RAY_ADDRESS="local")
