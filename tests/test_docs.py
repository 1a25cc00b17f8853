"""The pages in ``docs/``: every ```` ```python test ```` block runs, and every relative link resolves.

A code block whose fence's info string is ``python test`` (GitHub highlights it
as Python) is a promise that it runs as written: self-contained, offline, in a
few seconds. Each runs in a fresh namespace. Links: every relative link of a
page (``[text](other.md)``, ``[text](../dynabatch/memory/budget.py)``) must name
a file or folder that exists, and a ``#fragment`` pointing into a Markdown page
must name one of its headings.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^\n`]*)$")
_LINK = re.compile(r"(?<!\!)\[(?:[^\]\[]|\[[^\]]*\])*\]\((?P<target><[^>]*>|[^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _blocks(text: str) -> list[tuple[str, int, str]]:
    """Every fenced block of ``text``: ``(info string, first line number, code)``."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        fence, start, body = opening.group("fence"), i + 1, []
        i += 1
        while i < len(lines):
            closing = _FENCE.match(lines[i])
            if closing and closing.group("fence")[0] == fence[0] and len(closing.group("fence")) >= len(fence) \
                    and not closing.group("info").strip():
                break
            body.append(lines[i].removeprefix(opening.group("indent")))
            i += 1
        blocks.append((opening.group("info").strip(), start + 1, "\n".join(body) + "\n"))
        i += 1
    return blocks


def _outside_code(text: str, *, inline: bool = False) -> str:
    """``text`` with fenced blocks blanked out, and inline code spans too unless ``inline`` (links in code are not links)."""
    out, lines, fence = [], text.splitlines(), None
    for line in lines:
        match = _FENCE.match(line)
        if fence is None and match:
            fence = match.group("fence")
            out.append("")
        elif fence is not None:
            if match and match.group("fence")[0] == fence[0] and len(match.group("fence")) >= len(fence):
                fence = None
            out.append("")
        else:
            out.append(line if inline else re.sub(r"`+[^`]*`+", "", line))
    return "\n".join(out)


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|__|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for line in _outside_code(page.read_text(encoding="utf-8"), inline=True).splitlines():
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            slug = _slug(match.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


SNIPPETS = [
    pytest.param(code, id=f"{page.name}:{line}")
    for page in PAGES
    for info, line, code in _blocks(page.read_text(encoding="utf-8"))
    if info.split() == ["python", "test"]
]


def test_there_are_pages_and_snippets_to_test():
    assert PAGES, "docs/*.md not found"
    assert len(SNIPPETS) >= 10


@pytest.mark.parametrize("code", SNIPPETS)
def test_snippet_runs(code, tmp_path, monkeypatch, one_thread):
    monkeypatch.chdir(tmp_path)  # a snippet that writes files writes them here
    namespace: dict = {"__name__": "__docs__"}
    exec(compile(code, "<docs snippet>", "exec"), namespace)  # noqa: S102 - the page's own code, by design


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_relative_links_point_to_existing_files(page):
    broken = []
    for match in _LINK.finditer(_outside_code(page.read_text(encoding="utf-8"))):
        target = match.group("target").strip("<>")
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        path, _, fragment = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target} (no such file: {resolved.relative_to(ROOT) if ROOT in resolved.parents else resolved})")
        elif fragment and resolved.suffix == ".md" and fragment not in _anchors(resolved):
            broken.append(f"{target} (no heading #{fragment} in {resolved.name})")
    assert not broken, f"{page.name}: broken links: {broken}"


def _resolves(dotted: str) -> bool:
    """Whether ``dotted`` (``dynabatch.x.y``) names a module or an attribute of one.

    A name a module loads on first use (listed in its ``__all__``, served by its
    ``__getattr__``: ``transformers.Trainer`` takes seconds to import) counts
    without being loaded; a module is found without being imported.
    """
    import importlib
    import importlib.util

    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        name = ".".join(parts[:cut])
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):  # a parent is not a package
            spec = None
        if spec is None:
            continue
        rest = parts[cut:]
        if not rest:
            return True
        obj = importlib.import_module(name)
        if rest[0] not in vars(obj):
            return rest[0] in getattr(obj, "__all__", ()) and hasattr(obj, "__getattr__")
        try:
            for attr in rest:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


def test_every_dynabatch_name_the_pages_mention_exists():
    """Dotted names in code (`dynabatch.sampling.budget.plan_batches_to_budget`) and imports in code blocks."""
    import ast

    missing = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        names = set(re.findall(r"(?<![\"'])\b(dynabatch(?:\.[A-Za-z_]\w*)+)", text))  # not inside a quoted key
        for info, line, code in _blocks(text):
            if info.split()[:1] != ["python"]:
                continue
            try:
                tree = ast.parse(code)
            except SyntaxError:  # a signature shown as in the docs, not a program
                continue
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "dynabatch":
                    names |= {f"{node.module}.{alias.name}" for alias in node.names}
        missing += [f"{page.name}: {name}" for name in sorted(names) if not name.endswith((".py", ".md"))
                    and not _resolves(name)]
    assert not missing, f"names the pages mention that dynabatch does not have: {missing}"


def test_the_checks_themselves():
    text = "a\n```python test\nx = 1\n```\n```bash\nls\n```\n````md\n```python test\nnot a block\n```\n````\n"
    assert [(info, code) for info, _, code in _blocks(text)] == [
        ("python test", "x = 1\n"), ("bash", "ls\n"), ("md", "```python test\nnot a block\n```\n")]
    assert _slug("Planning to a budget: `MemoryBudget`") == "planning-to-a-budget-memorybudget"
    assert _slug("What differs from dynabatch 0.1.6") == "what-differs-from-dynabatch-016"
    links = [m.group("target") for m in _LINK.finditer("[a](b.md) ![img](c.png) [x](https://e.org) [`c`](d.md#e)")]
    assert links == ["b.md", "https://e.org", "d.md#e"]
