"""The pages: every Python and shell block of README.md and docs/*.md runs as written, and every relative link resolves.

The rules for blocks are in ``tests/_docs_blocks.py`` (and docs/development.md):
every ```` ```python ```` and ```` ```bash ```` block runs, in an empty folder,
offline; ``# continues the block above`` as a block's first line runs it after
the block above, in the same folder and interpreter; ``# fragment: <why>``
leaves a block out. ``test_chain_runs`` runs each chain once, in a child of
one server process that imported torch, transformers and dynabatch once; a
chain that runs a shell block or loads model weights is marked ``slow``.

Links: every relative link of a page (``[text](other.md)``,
``[text](../dynabatch/memory/budget.py)``) must name a file or folder that
exists, and a ``#fragment`` pointing into a Markdown page must name one of its
headings.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import _docs_blocks
import pytest
from _docs_blocks import FENCE, PAGES, ROOT, fenced_blocks

os.environ.setdefault("HF_HUB_OFFLINE", "1")

CHAINS, PROBLEMS = _docs_blocks.chains()
_LINK = re.compile(r"(?<!\!)\[(?:[^\]\[]|\[[^\]]*\])*\]\((?P<target><[^>]*>|[^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _outside_code(text: str, *, inline: bool = False) -> str:
    """``text`` with fenced blocks blanked out, and inline code spans too unless ``inline`` (links in code are not links)."""
    out, lines, fence = [], text.splitlines(), None
    for line in lines:
        match = FENCE.match(line)
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


def test_every_block_runs_or_says_why_not():
    assert len(CHAINS) >= 20, "README.md and docs/*.md: fewer chains than expected (is the parser broken?)"
    assert not PROBLEMS, PROBLEMS


@pytest.mark.parametrize("chain", [pytest.param(c, id=c.name, marks=[pytest.mark.slow] if c.slow else [])
                                   for c in CHAINS])
def test_chain_runs(chain, docs_runner):
    result = docs_runner(chain)
    seconds = ", ".join(f"{name} {t:.1f} s" for name, t in result.seconds.items())
    assert result.status == 0, f"{chain.name} (blocks: {seconds}) failed:\n{result.output[-6000:]}"


# --- what the README's blocks print is what it says (on the runs above: docs_runner keeps each chain's) ---


def _chain(code: str):
    """The README's chain with a block holding ``code``."""
    return next(c for c in CHAINS if c.name.startswith("README.md:") and any(code in b.code for b in c.blocks))


@pytest.mark.slow
def test_the_readme_quick_start_gives_one_sentence_transformers_vector_per_text_on_growing_batches(docs_runner):
    import numpy as np
    from sentence_transformers import SentenceTransformer

    from dynabatch.demo import minilm_path

    result = docs_runner(_chain("embeddings = torch.stack(rows)"))
    assert result.status == 0, result.output[-3000:]
    texts, embeddings = result.values["texts"], result.values["embeddings"]
    assert embeddings.shape == (len(texts), 384)
    batches = int(re.search(r"^(\d+) batches;", result.output, re.MULTILINE).group(1))
    assert batches < len(texts) / 32  # batches grew beyond batch_size
    sample = np.random.default_rng(0).choice(len(texts), size=60, replace=False)
    want = SentenceTransformer(minilm_path(), device="cpu").encode([texts[i] for i in sample], convert_to_tensor=True)
    cosine = (embeddings[sample] * want).sum(1) / want.norm(dim=1)
    assert float(cosine.min()) >= 0.9999
    assert len(result.values["replies"]) == len(texts) and all(isinstance(r, str) for r in result.values["replies"])


@pytest.mark.slow
def test_the_readme_corpus_job_commands_store_every_text_and_every_reply(docs_runner):
    result = docs_runner(_chain("dynabatch generate chats.jsonl"))
    assert result.status == 0, result.output[-3000:]
    assert result.output.count("100 of 100 texts stored in embeddings/") == 2  # embed, then torchrun: resumed
    assert "dynabatch generate: 16 of 16 replies stored in replies/" in result.output


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
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
        for info, line, code in fenced_blocks(text):
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


def test_the_checks_themselves(tmp_path):
    text = "a\n```python test\nx = 1\n```\n```bash\nls\n```\n````md\n```python test\nnot a block\n```\n````\n"
    assert [(info, code) for info, _, code in fenced_blocks(text)] == [
        ("python test", "x = 1\n"), ("bash", "ls\n"), ("md", "```python test\nnot a block\n```\n")]
    assert _slug("Planning to a budget: `MemoryBudget`") == "planning-to-a-budget-memorybudget"
    assert _slug("What differs from dynabatch 0.1.6") == "what-differs-from-dynabatch-016"
    links = [m.group("target") for m in _LINK.finditer("[a](b.md) ![img](c.png) [x](https://e.org) [`c`](d.md#e)")]
    assert links == ["b.md", "https://e.org", "d.md#e"]


def test_blocks_group_into_chains_by_their_first_line(tmp_path, monkeypatch):
    monkeypatch.setattr(_docs_blocks, "ROOT", tmp_path)
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nx = 1\n```\n"
        "```python\n# continues the block above: x is still defined\ny = x\n```\n"
        "```bash\npip install -e .  # installs: left out\npython -c 'print(1)' \\\n  && echo done\n```\n"
        "```text\n$ not run\n```\n"
        "```sh\n# continues the block above\nls\n```\n"
        "```python\n# fragment: a signature\nf(a, *, b=1)\n```\n"
        "```python\n# continues the block above\nz = 1\n```\n"
        "```python\n# fragment:\n```\n"
        "```bash\npip install torch  # only installs\n```\n"
        "```python\n# continues the block above\nw = 1\n```\n")
    chains, problems = _docs_blocks.chains([page])
    assert [[b.line for b in c.blocks] for c in chains] == [[2, 5], [9, 17]]
    assert [b.language for b in chains[1].blocks] == ["shell", "shell"]
    assert chains[1].blocks[0].runnable_code == "python -c 'print(1)' \\\n  && echo done\n"
    assert chains[1].slow and not chains[0].slow
    assert problems == ["page.md:25: continues the block above, but that is a fragment (page.md:21)",
                        "page.md:29: '# fragment:' should say why the block does not run",
                        "page.md:35: continues the block above, which only installs (page.md:32)"]
