"""The name this library installs under, and the other project that installs the same import name.

This library is distributed as ``torch-dynabatch`` and imported as
``dynabatch``, as scikit-learn is imported as ``sklearn``: the package index's
``dynabatch`` is another project (a different API), and both put their files in
one ``dynabatch`` folder. Installed side by side, whichever was installed last
overwrote the other's files, and uninstalling one deletes files of the other.
:func:`check_installation` (run when ``dynabatch`` is imported) warns once,
saying what to do, rather than leaving an ``AttributeError`` for later.

An editable install named ``dynabatch`` is a checkout of this library made
before it was renamed (the other project is installed from the index): it is
not warned about.

Example:
    >>> from dynabatch._distribution import DISTRIBUTION, other_installs
    >>> DISTRIBUTION, other_installs()  # nothing else named dynabatch in this environment
    ('torch-dynabatch', [])
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import warnings
from types import ModuleType

__all__ = ["DISTRIBUTION", "OTHER", "check_installation", "extra", "import_extra", "other_installs"]

DISTRIBUTION = "torch-dynabatch"
"""This library's name on the package index (``pip install torch-dynabatch``)."""
OTHER = "dynabatch"
"""The other project's name on the package index; it installs the import package ``dynabatch`` too."""


def _editable(dist: importlib.metadata.Distribution) -> bool:
    try:
        return bool(json.loads(dist.read_text("direct_url.json") or "{}").get("dir_info", {}).get("editable"))
    except (OSError, ValueError, AttributeError):
        return False


def other_installs() -> list[str]:
    """``"dynabatch 0.2.23"`` for each install of the other project in this environment (editable ones left out)."""
    found = []
    for dist in importlib.metadata.distributions(name=OTHER):
        if not _editable(dist):
            found.append(f"{dist.metadata['Name']} {dist.version}")
    return sorted(set(found))


def check_installation() -> None:
    """Warns (once: at import) when the other ``dynabatch`` distribution is installed beside this library."""
    found = other_installs()
    if not found:
        return
    warnings.warn(
        f"the package index's {found[0]!r} (another project, with another API) is installed in this environment "
        f"beside this library ({DISTRIBUTION}); both install the import package 'dynabatch', so whichever was "
        f"installed last overwrote the other's files. Remove both and reinstall this one: pip uninstall -y "
        f"{OTHER} {DISTRIBUTION} && pip install {DISTRIBUTION} (in a checkout: pip install -e .)",
        UserWarning, stacklevel=2)


def extra(name: str) -> str:
    """The install command of one of this library's extras (for messages).

    Example:
        >>> extra("ray")
        "pip install 'torch-dynabatch[ray]'"
    """
    return f"pip install '{DISTRIBUTION}[{name}]'"


def import_extra(module: str, name: str, needed_by: str) -> ModuleType:
    """``module`` imported; where it (or a module it needs) is not installed, a ``ModuleNotFoundError`` naming what
    needs it and the extra ``name`` that installs it, rather than the bare one from deep inside ``needed_by``.

    Example:
        >>> import_extra("no_such_module", "ray", "f()")
        Traceback (most recent call last):
        ...
        ModuleNotFoundError: f() needs no_such_module, which is not installed: pip install 'torch-dynabatch[ray]'
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        package = (exc.name or module).partition(".")[0]  # what pip installs: matplotlib, not matplotlib.figure
        raise ModuleNotFoundError(f"{needed_by} needs {package}, which is not installed: {extra(name)}",
                                  name=exc.name) from exc
