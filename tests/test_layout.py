"""The layout shows the architecture: the core imports no facade, integration or CLI; layers hold; no import circles.

The core is ``dynabatch/_*.py``, ``demo.py`` and the packages ``data``, ``memory``, ``sampling``,
``inference`` and ``training``; above it sit the facades (``dynabatch.compat``), the integrations
(``dynabatch.integrations``) and the command line (``dynabatch.cli``). Inside the core the layers are

    _validation (and the other base modules)  <  data  <  memory  <  sampling  <  {inference, training}

A lower layer never imports a higher one; ``inference`` and ``training`` never import each other.
Every module is parsed with ``ast``: imports inside functions count for the first two rules (they run,
only later); the circle rule looks at the imports that run when a module is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "dynabatch"

BASE = 0
LAYERS = {"data": 1, "memory": 2, "sampling": 3, "inference": 4, "training": 4}
"""Each core package's layer; the base modules (``_validation``, ``_digest``, ``demo``, ...) are layer 0."""

ABOVE_THE_CORE = ("dynabatch.compat", "dynabatch.integrations", "dynabatch.cli")

ALLOWED = {}
"""``(importer, imported) -> reason`` for a layer rule knowingly broken. Empty: none is."""


def module_names(package: Path = PACKAGE) -> dict[str, Path]:
    """Every module of the package by its dotted name (a package by its ``__init__.py``)."""
    names = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _runs_at_import(body: list[ast.stmt]) -> list[ast.stmt]:
    """The statements of a module body that run when it is imported (not function bodies, not TYPE_CHECKING)."""
    out = []
    for node in body:
        out.append(node)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out += _runs_at_import(node.orelse)
        elif isinstance(node, (ast.If, ast.Try, ast.With, ast.ClassDef)):
            for field in ("body", "orelse", "finalbody"):
                out += _runs_at_import(getattr(node, field, []))
            for handler in getattr(node, "handlers", []):
                out += _runs_at_import(handler.body)
    return out


def imports(name: str, source: str, known: set[str], *, at_import_only: bool = False) -> set[str]:
    """The dynabatch modules ``name`` imports, resolved against ``known`` (``from p import m``: ``p.m`` when that is a
    module, else ``p``; relative imports resolved), and every string that is exactly a submodule's name. With
    ``at_import_only``: only the import statements that run when the module is imported."""
    tree = ast.parse(source)
    here = name if _is_package(name, known) else name.rpartition(".")[0]
    nodes = _runs_at_import(tree.body) if at_import_only else list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
        elif not at_import_only and isinstance(node, ast.Constant) and node.value in known and "." in node.value:
            found.add(node.value)  # a module named for importlib.import_module or lazy_attributes
    return {_known_prefix(m, known) for m in found if m == "dynabatch" or m.startswith("dynabatch.")} - {name, None}


def _is_package(name: str, known: set[str]) -> bool:
    return any(other.startswith(name + ".") for other in known)


def _known_prefix(module: str, known: set[str]) -> str | None:
    """``module``, or the longest known module it starts with (a name inside a module)."""
    while module and module not in known:
        module = module.rpartition(".")[0]
    return module or None


def layer(module: str) -> int | None:
    """The core layer of a module, or ``None`` above the core (facades, integrations, CLI, the package surface)."""
    parts = module.split(".")
    if len(parts) == 2 and (parts[1].startswith("_") and not parts[1].startswith("__") or parts[1] == "demo"):
        return BASE
    return LAYERS.get(parts[1]) if len(parts) > 1 else None


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Each import of a core module that goes above the core, up a layer, or between inference and training."""
    bad = []
    for importer, imported in sorted((a, b) for a, targets in graph.items() for b in targets):
        mine, theirs = layer(importer), layer(imported)
        if mine is None or (importer, imported) in ALLOWED:
            continue
        if theirs is None:
            bad.append(f"{importer} imports {imported}, which is above the core")
        elif theirs > mine or (theirs == mine and mine == LAYERS["inference"]
                               and importer.split(".")[1] != imported.split(".")[1]):
            bad.append(f"{importer} (layer {mine}) imports {imported} (layer {theirs})")
    return bad


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``graph``: its strongly connected components of more than one module, and self-imports
    (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph.get(node, ()):
                    found.append(sorted(component))
    return found


def import_graph(*, at_import_only: bool) -> dict[str, set[str]]:
    names = module_names()
    known = set(names)
    return {name: imports(name, path.read_text(encoding="utf-8"), known, at_import_only=at_import_only)
            for name, path in names.items()}


@pytest.fixture(scope="module")
def every_import():
    graph = import_graph(at_import_only=False)
    # the graph is real: the core's modules are there, with the imports everyone knows of
    assert sum(layer(m) is not None for m in graph) > 60
    assert "dynabatch.inference.execute" in graph["dynabatch.inference.runner"]
    assert "dynabatch.training.step_guard" in graph["dynabatch.training.hf"]
    return graph


def test_the_top_level_holds_the_core_and_one_folder_each_for_facades_integrations_and_the_cli():
    entries = {p.name for p in PACKAGE.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    core = {name for name in entries if layer(f"dynabatch.{Path(name).stem}") is not None}
    assert entries - core == {"__init__.py", "__main__.py", "compat", "integrations", "cli"}
    assert {"data", "memory", "sampling", "inference", "training", "_validation.py"} <= core


def test_no_core_module_imports_a_facade_an_integration_or_the_cli(every_import):
    bad = [f"{importer} imports {imported}" for importer, targets in sorted(every_import.items())
           if layer(importer) is not None for imported in sorted(targets) if imported.startswith(ABOVE_THE_CORE)]
    assert bad == []


def test_the_core_layers_hold(every_import):
    assert layer_violations(every_import) == []


def test_no_import_circles():
    graph = import_graph(at_import_only=True)
    assert "dynabatch.compat.multitask.oom_guardian" in graph["dynabatch.compat.multitask"]
    assert circles(graph) == []


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module ``start`` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for imported in graph.get(todo.pop(), ()):
            if imported not in seen:
                seen.add(imported)
                todo.append(imported)
    return seen


def test_the_executor_sees_neither_the_scheduler_nor_the_sink_nor_the_loop(every_import):
    later_or_beside = {f"dynabatch.inference.{m}" for m in ("scheduler", "sink", "store", "loop", "runner")}
    assert "dynabatch.inference.build" in reachable(every_import, "dynabatch.inference.execute")
    assert reachable(every_import, "dynabatch.inference.execute") & later_or_beside == set()


def test_only_the_source_frees_the_token_stream_in_the_run():
    freeing = [path.name for path in (PACKAGE / "inference").glob("*.py") if ".consumed(" in path.read_text()]
    assert freeing == ["source.py"]


def test_no_thread_starts_outside_the_one_thread_mechanism():
    starting = {str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
                if "threading.Thread(" in path.read_text() and path.name != "_background.py"}
    assert starting == set()


# --------------------------------------------------------------------------- the rules catch what they should

_KNOWN = {"dynabatch", "dynabatch.data", "dynabatch.data.collate", "dynabatch.data.order", "dynabatch.sampling",
          "dynabatch.sampling.ffd", "dynabatch.compat", "dynabatch.compat.axolotl", "dynabatch.training",
          "dynabatch.training.hf", "dynabatch.inference", "dynabatch.inference.runner", "dynabatch._validation"}


def test_an_import_inside_a_function_a_relative_one_and_a_module_named_in_a_string_all_count():
    source = ("from . import order\n"
              "from ..compat.axolotl import pack_group as g\n"
              "def f():\n"
              "    import dynabatch.training.hf\n"
              "    return importlib.import_module('dynabatch.inference.runner')\n")
    found = imports("dynabatch.data.collate", source, _KNOWN)
    assert found == {"dynabatch.data.order", "dynabatch.compat.axolotl", "dynabatch.training.hf",
                     "dynabatch.inference.runner"}
    assert imports("dynabatch.data.collate", source, _KNOWN, at_import_only=True) == {
        "dynabatch.data.order", "dynabatch.compat.axolotl"}
    guarded = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from dynabatch.data import order\n"
    assert imports("dynabatch.data.collate", guarded, _KNOWN, at_import_only=True) == set()


def test_each_layer_rule_catches_its_violation():
    graph = {
        "dynabatch._validation": {"dynabatch.data.collate"},  # base up to data
        "dynabatch.sampling.ffd": {"dynabatch.compat.axolotl", "dynabatch.data.collate"},  # a facade; data is fine
        "dynabatch.inference.runner": {"dynabatch.training.hf"},  # sideways
        "dynabatch.compat.axolotl": {"dynabatch.sampling.ffd", "dynabatch.training.hf"},  # above the core: free
    }
    assert layer_violations(graph) == [
        "dynabatch._validation (layer 0) imports dynabatch.data.collate (layer 1)",
        "dynabatch.inference.runner (layer 4) imports dynabatch.training.hf (layer 4)",
        "dynabatch.sampling.ffd imports dynabatch.compat.axolotl, which is above the core",
    ]


def test_a_circle_of_any_length_is_found():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}) == [["a", "b", "c"]]
    assert circles({"a": {"a"}}) == [["a"]]
    assert circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def _starts_a_thread(tree: ast.AST) -> bool:
    """Whether the module calls ``threading.Thread(...)`` (or ``Thread(...)``) itself."""
    return any(isinstance(node, ast.Call) and (getattr(node.func, "attr", None) == "Thread"
                                               or getattr(node.func, "id", None) == "Thread")
               for node in ast.walk(tree))


def test_the_store_and_the_sink_start_no_thread_of_their_own():
    """The results store's writer, its lock's heartbeat and the sinks run on the one thread mechanism
    (``dynabatch/_background.py``)."""
    files = [*sorted((PACKAGE / "inference").glob("store*.py")), PACKAGE / "inference" / "sink.py"]
    assert len(files) >= 4
    assert [f.name for f in files if _starts_a_thread(ast.parse(f.read_text()))] == []
    assert _starts_a_thread(ast.parse("import threading\nthreading.Thread(target=print).start()"))
