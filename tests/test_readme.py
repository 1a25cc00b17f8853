"""The README's Quick Start runs as written."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_quick_start_runs_and_gives_one_embedding_per_text(capsys):
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## Quick Start"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)
    assert namespace["embeddings"].shape == (1000, 384)
    assert "batches;" in capsys.readouterr().out


def test_the_readme_starts_with_the_demo_and_test_commands():
    text = README.read_text(encoding="utf-8")
    commands = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    assert "python examples/embed_kjv.py" in commands
    assert "python -m pytest" in commands
    ci = (README.parent / ".ci" / "run").read_text(encoding="utf-8")
    test_command = next(line for line in commands.splitlines() if line.endswith("python -m pytest"))
    assert test_command.replace("pip install", "pip install -q") in ci
