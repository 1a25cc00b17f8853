"""A memory model's JSON file and what identifies it: the model, the device, the library versions.

Private to :mod:`dynabatch.memory.model`: :class:`~dynabatch.memory.model.MemoryModel`'s
``report``, ``to_dict``, ``save``, ``from_dict``, ``load`` and ``check`` are these functions.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import logging
import math
import os
import platform
import threading
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from dynabatch._validation import bad_type, bad_value, check_bool, check_choice, check_non_negative_int
from dynabatch.memory import TASKS
from dynabatch.memory.units import MB

logger = logging.getLogger(__name__)

FORMAT = "dynabatch.MemoryModel"
FORMAT_VERSION = 1
_LIBRARIES = ("dynabatch", "torch", "transformers", "numpy", "scipy")
_PROBE_FIELDS = ("rows", "padded_length", "peak_bytes", "out_of_memory", "source")


def library_versions() -> dict[str, str]:
    """Python's and the installed versions of the libraries a measured peak depends on."""
    out = {"python": platform.python_version()}
    for name in _LIBRARIES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def describe_model(model: Any) -> dict[str, Any] | None:
    """What identifies a model in a saved memory model: name, class, parameter count, dtype and attention.

    ``model`` is a torch module (a ``transformers`` model), a name, or ``None``. ``attention`` is a
    ``transformers`` config's attention implementation (``"sdpa"``, ``"eager"``, ``"flash_attention_2"``): one
    model's peaks differ by it (eager attention holds every row's ``length x length`` scores), so it is recorded
    where the config says it.

    Example:
        >>> import torch
        >>> describe_model(torch.nn.Linear(3, 2))
        {'name': 'Linear', 'class': 'Linear', 'parameters': 8, 'dtype': 'torch.float32'}
        >>> describe_model("my-model")
        {'name': 'my-model'}
    """
    if model is None:
        return None
    if isinstance(model, (str, Path)):
        return {"name": str(model)}
    params = list(model.parameters()) if callable(getattr(model, "parameters", None)) else []
    if not params and getattr(model, "config", None) is None:
        raise bad_type("model", "a torch module (e.g. a transformers model), a name, or None", model)
    config = getattr(model, "config", None)
    name = getattr(config, "_name_or_path", "") or type(model).__name__
    described = {
        "name": str(name),
        "class": type(model).__name__,
        "parameters": int(sum(p.numel() for p in params)),
        "dtype": str(params[0].dtype) if params else None,
    }
    attention = getattr(config, "_attn_implementation", None)
    if isinstance(attention, str):
        described["attention"] = attention
    return described


def report(mm: Any) -> str:
    """A fitted model's probe table (measured against predicted, in MB of 10**6 bytes as memory limits are
    parsed, leave-one-out error) and its terms."""
    loo = iter(mm.loo_errors_.tolist())
    lines = [(f"{'rows':>6} {'length':>6} {'measured MB':>13} {'predicted MB':>14} {'error':>7} "
              f"{'LOO error':>9}  source")]
    for p in mm.probes_:
        measured = "" if p["peak_bytes"] is None else f"{p['peak_bytes'] / MB:.2f}"
        error = loo_error = ""
        if p["out_of_memory"]:
            measured = ("> " + measured) if measured else "OOM"
        elif p["peak_bytes"]:
            error = f"{p['predicted_bytes'] / p['peak_bytes'] - 1:+.1%}"
            value = next(loo)
            loo_error = "" if math.isnan(value) else f"{value:+.1%}"
        lines.append(f"{p['rows']:>6} {p['padded_length']:>6} {measured:>13} "
                     f"{p['predicted_bytes'] / MB:>14.2f} {error:>7} {loo_error:>9}  {p['source']}")
    used = [f"{c:.4g} * {t}" for c, t in zip(mm.coef_.tolist(), mm.terms_) if c > 0]
    lines.append(f"peak bytes = {' + '.join(used) or '0'}")
    lines.append(f"largest leave-one-probe-out error: {mm.loo_error_:.1%} over "
                 f"{int(np.isfinite(mm.loo_errors_).sum())} probes; device {mm.device}")
    return "\n".join(lines)


def to_dict(mm: Any) -> dict[str, Any]:
    """The JSON document of a memory model."""
    keep = (*_PROBE_FIELDS, "seconds")
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "saved": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": mm.model_info,
        "device": mm.device,
        "dtype": (mm.model_info or {}).get("dtype"),
        "versions": mm.versions,
        "metadata": mm.metadata,
        "knots": mm.knots,
        "terms": mm.terms_,
        "coef": mm.coef_.tolist(),
        "loo_error": None if math.isnan(mm.loo_error_) else mm.loo_error_,
        "probes": [{k: p[k] for k in keep if k in p} for p in mm.probes_],
    }


def save(mm: Any, path: str | Path) -> None:
    """Writes :func:`to_dict` as JSON, whole or not at all.

    The document goes to a file beside ``path`` renamed over it once written: a save interrupted (Ctrl-C, a kill, a
    full disk) leaves the file as it was, where writing in place had emptied the last good calibration first.
    """
    path = Path(path)
    # a name of this call's own: two saves of one path at once (two threads) would write and rename one file
    partial = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        partial.write_text(json.dumps(to_dict(mm), indent=1) + "\n", encoding="utf-8")
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)  # written and renamed: gone already


def from_dict(cls: type, data: Any) -> Any:
    """The ``cls`` model of a :func:`to_dict` document, refitted from its probes."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise bad_value("data", f"a document with format={FORMAT!r}",
                        data.get("format") if isinstance(data, dict) else data)
    version = data.get("format_version")
    # A document of another layout read as this one would give another model without a word (its probes' fields
    # may mean other things); there is only version 1 so far, so any other was written by another dynabatch.
    if type(version) is not int or version != FORMAT_VERSION:
        raise bad_value("data", f"a document of format_version={FORMAT_VERSION}, the one this dynabatch reads "
                        "(calibrate again with this dynabatch, or load the file with the dynabatch that wrote it)",
                        version)
    probes = data.get("probes")
    # save() writes every probe of a fitted model, and the fit is made again from them: a document without them
    # would make an empty model, whose first predict() fails
    if not (isinstance(probes, list) and probes and all(
            isinstance(p, dict) and all(k in p for k in _PROBE_FIELDS[:4]) for p in probes)):
        shown = f"<{len(probes)} probes>" if isinstance(probes, list) else probes
        raise bad_value("data", "a document with at least one probe, each with rows, padded_length, peak_bytes and "
                        "out_of_memory (as MemoryModel.save writes them)", shown)
    mm = cls(device=data.get("device"), model=data.get("model"), knots=data.get("knots"),
             metadata=data.get("metadata"))
    mm.versions = dict(data.get("versions") or {})
    for i, p in enumerate(probes):
        extra = {k: v for k, v in p.items() if k not in _PROBE_FIELDS}
        # as written (true or false): bool() of a hand-edited "false" is True, a silent out-of-memory point
        out_of_memory = check_bool(f"probes[{i}]['out_of_memory']", p["out_of_memory"])
        mm._add(p["rows"], p["padded_length"], p["peak_bytes"], out_of_memory,
                p.get("source", "user"), extra)
    mm._refit()
    return mm


def load(cls: type, path: str | Path, model: Any = None, device: Any = None, task: str | None = None,
         max_new_tokens: int | None = None) -> Any:
    """Reads a file :func:`save` wrote; warns if it was made for another ``model``, ``device``, ``task`` or fewer
    ``max_new_tokens`` (see :func:`check`)."""
    check_setting(task, max_new_tokens)
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise bad_value("path", "a JSON file written by MemoryModel.save", str(path)) from exc
    try:
        mm = from_dict(cls, data)
    except (TypeError, ValueError) as exc:  # the document's own rule, for the file named
        raise bad_value("path", f"a JSON file written by MemoryModel.save ({exc})", str(path)) from exc
    current = library_versions()
    changed = {k: (v, current.get(k)) for k, v in mm.versions.items() if k in ("torch", "transformers")
               and current.get(k) != v}
    if changed:
        logger.info("memory model %s was measured with %s; installed now: %s", path, changed, current)
    check(mm, model=model, device=device, task=task, max_new_tokens=max_new_tokens, stacklevel=4)
    return mm


def same_name(given: str, recorded: str) -> bool:
    """Whether two models' names name the same model: equal, or one local folder spelt two ways (the file of
    ``dynabatch calibrate --model ./my-model`` holds ``./my-model``; ``from_pretrained("my-model")`` names it
    ``my-model``, an absolute path names it by that).

    Example:
        >>> same_name("./my-model", "my-model"), same_name("org/model", "org/other")
        (True, False)
    """
    if os.path.normpath(given) == os.path.normpath(recorded):
        return True
    try:  # a relative name is read from this process's folder, where the recorded one may no longer resolve
        return os.path.samefile(given, recorded)
    except OSError:  # a hub name, or a folder that is not here
        return False


def check_setting(task: Any, max_new_tokens: Any) -> None:
    """Refuses a ``task`` not of :data:`TASKS`, or ``max_new_tokens`` (``None`` or an int >= 0) with a task that
    generates none (as ``dynabatch calibrate`` refuses ``--max-new-tokens`` without ``--task generate``)."""
    if task is not None:
        check_choice("task", task, TASKS)
    if max_new_tokens is not None:
        check_non_negative_int("max_new_tokens", max_new_tokens)
        if max_new_tokens and task not in (None, "generate"):
            raise bad_value("max_new_tokens", f"None or 0 with task={task!r} (a forward or a training step "
                            "generates no tokens)", max_new_tokens)


def calibrated_setting(mm: Any) -> tuple[str | None, int | None]:
    """The task and new tokens per row ``mm`` was calibrated for, ``None`` where its metadata does not say.

    ``dynabatch calibrate`` records both; :func:`dynabatch.calibrate` records ``max_new_tokens`` only (its work is
    yours), given for work that generates, so a positive one there means ``generate``.
    """
    recorded = mm.metadata.get("max_new_tokens")
    new_tokens = recorded if isinstance(recorded, int) and not isinstance(recorded, bool) else None
    task = mm.metadata.get("task")
    if task not in TASKS:
        task = "generate" if new_tokens else None
    return task, new_tokens


def setting_problems(mm: Any, task: str | None, max_new_tokens: int | None) -> list[str]:
    """What differs between the run's ``task`` and ``max_new_tokens`` and those ``mm`` was calibrated for: another
    task, or more new tokens (a longer KV cache than measured). Fewer new tokens over-predict: no problem."""
    calibrated_task, calibrated_tokens = calibrated_setting(mm)
    # new tokens given without a task are a generate run's (check_setting refuses them with another task), as a
    # file's are in calibrated_setting: a forward file loaded for max_new_tokens=256 alone is of other work too
    run_task = task if task is not None else ("generate" if max_new_tokens else None)
    given = f"task={task!r}" if task is not None else f"max_new_tokens={max_new_tokens} (a generate run)"
    new_tokens = f" --max-new-tokens {max_new_tokens}" if max_new_tokens else ""
    advice = f"calibrate for this setting (dynabatch calibrate ... --task {run_task or 'generate'}{new_tokens})"
    if run_task is not None and calibrated_task is not None and run_task != calibrated_task:
        return [f"{given} differs from the task the memory model was calibrated for ({calibrated_task!r}): "
                f"its peaks are of other work; {advice}"]
    if (max_new_tokens is not None and calibrated_tokens is not None and task in (None, "generate")
            and max_new_tokens > calibrated_tokens):
        return [f"max_new_tokens={max_new_tokens} exceeds the max_new_tokens the memory model was calibrated for "
                f"({calibrated_tokens}): its peaks under-predict the longer KV cache; {advice}"]
    return []


def check(mm: Any, model: Any = None, device: Any = None, task: str | None = None,
          max_new_tokens: int | None = None, stacklevel: int = 3) -> list[str]:
    """Warns (and returns the messages) where ``model``, ``device``, ``task`` or ``max_new_tokens`` differ from what
    was calibrated: another model or device type, another task, or more new tokens than calibrated. What the file
    does not record (a file saved before it was, a task of your own work) is not compared."""
    check_setting(task, max_new_tokens)
    problems = []
    if device is not None and mm.device is not None:
        import torch

        if torch.device(str(device)).type != torch.device(mm.device).type:
            problems.append(f"device={str(device)!r} differs from the device the memory model was measured "
                            f"on ({mm.device!r}); its peaks may not hold there: calibrate on this device")
    if model is not None and mm.model_info is not None:
        given = describe_model(model)
        differ = [k for k in ("class", "parameters", "dtype", "attention")  # a file without one compares the rest
                  if k in given and k in mm.model_info and given[k] != mm.model_info[k]]
        if "name" in given and "name" in mm.model_info and not same_name(given["name"], mm.model_info["name"]):
            differ.insert(0, "name")
        if differ:
            mine = {k: mm.model_info[k] for k in differ}
            theirs = {k: given[k] for k in differ}
            problems.append(f"model={theirs} differs from the model the memory model was measured on "
                            f"({mine}): calibrate for this model")
    problems += setting_problems(mm, task, max_new_tokens)
    for problem in problems:
        warnings.warn(problem, UserWarning, stacklevel=stacklevel)
    return problems
