"""The README: its set-up commands are CI's and it stays a front door.

Every block of the README runs as written in ``tests/test_docs.py::test_chain_runs``; what its blocks print
is checked there too, on the same runs (``test_the_readme_*``).
"""

import re

import _docs_blocks

README = _docs_blocks.ROOT / "README.md"


def test_the_readme_starts_with_the_demo_and_test_commands():
    text = README.read_text(encoding="utf-8")
    commands = re.search(r"```bash\n(.*?)```", text, re.DOTALL).group(1)
    assert "python examples/embed_kjv.py" in commands
    assert "python -m pytest" in commands
    ci = (README.parent / ".ci" / "run").read_text(encoding="utf-8")
    test_command = next(line for line in commands.splitlines() if line.endswith("python -m pytest"))
    assert test_command.replace("pip install", "pip install -q") in ci


def test_the_readme_is_a_front_door():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 300
    for word in ("issue", "seed 0", "this machine", "load average", "target"):
        assert word not in text.lower(), word
