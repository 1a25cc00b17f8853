"""The output of a corpus job: its store, made, written to and opened before any model loads, and read after the run.

* :meth:`Output.prepare`: the folder made (with its parents) and a probe file
  written and removed in it: a folder this user cannot make or write, one
  inside another store (whose job would refuse it then), or one holding files
  that are no store's, is one line before any model loads; :meth:`Output.checked` prepares it around the
  checks that follow, taking it back if one fails;
* :meth:`Output.open`: the store at it opened for the run, which writes into
  it (:attr:`Output.store`), taking the store's job lock: a store another live
  job is writing is refused naming that job, and a store of rows computed otherwise (another
  model's files, another setting) is refused naming each difference and the
  ways on (another output folder, or deleting it to compute it again);
* :meth:`Output.discard`: the folders this job made (``mkdir`` says which,
  of two jobs started at once) are taken back where empty when a later check
  fails, or the model does not load (:meth:`Output.end`); a job refused because
  another holds the store touches nothing of it, whoever made the folder;
* :meth:`Output.tally`: what the store holds once the run has ended
  (:class:`Tally`, the run's :class:`~dynabatch.inference.results.Accounting`,
  read when the store was read back at the run's end, else from the store now):
  the summary, ``--report`` and the exit status come from it, never from what
  the run says it ran.

The store's calls are in this module alone (:func:`_open_store`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from dynabatch._validation import bad_value, first_few
from dynabatch.inference.results import Accounting, account
from dynabatch.inference.store_lock import StoreBusyError

__all__ = ["KEY_FORM", "Output", "Tally"]

KEY_FORM = 2
"""The form of a job key (:func:`dynabatch.cli.job.job_key`), its ``key_form=``: 2 holds every setting as applied (the
prompt's text, the generation settings ``model.generate`` applies). A key without ``key_form=`` was written by an
earlier dynabatch: before form 2 the key held the prompt and generation flags as typed, and form 2's first keys were
written without the field (a store of one of them equal to this job's key resumes: :func:`_held_key`)."""

_SETTING = re.compile(r'(\S+?)=("(?:[^"\\]|\\.)*"|\S*)')  # name=value; a JSON string value may hold spaces


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _open_store(path: str, *, key: str, n: int, ids: Any) -> Any:
    """The store at ``path`` opened for a run and held for this job (the ranks of one ``torchrun`` job share it):
    the command line's one call of ``open_store``."""
    from dynabatch.inference.distributed import job_token
    from dynabatch.inference.store import open_store

    return open_store(path, key=key, n=n, ids=ids, job=job_token())


def _make_folders(path: str) -> str | None:
    """Makes the folder ``path`` and its missing parents; the top-most of them this process made (``None``: all
    there, or made by another process at the same moment: ``mkdir`` tells which, ``makedirs`` does not)."""
    missing = []
    while not os.path.isdir(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    top = None
    for folder in reversed(missing):
        try:
            os.mkdir(folder)
        except FileExistsError:
            if not os.path.isdir(folder):
                raise
            continue
        top = top or folder
    return top


def _stored(path: str) -> tuple[dict, Any]:
    """What a store's first readable shard was written under (its metadata: ``key``, ``keyed_by``) and its schema
    (``({}, None)``: no shard)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dynabatch.inference.store import META

    for name in sorted(os.listdir(path)):
        if not (name.startswith("part-") and name.endswith(".parquet")):
            continue
        try:
            schema = pq.read_schema(os.path.join(path, name))
        except (OSError, pa.ArrowException):
            continue
        meta = (schema.metadata or {}).get(META)
        return (json.loads(meta) if meta else {}), schema
    return {}, None


def _foreign(path: str) -> list[str]:
    """The entries of the folder ``path`` that are no store's (the store's rule: shards, failure records, its
    temporaries and job locks are its own), sorted; none where it is missing."""
    from dynabatch.inference.store import foreign_entries

    return foreign_entries(sorted(os.listdir(path))) if os.path.isdir(path) else []


def _store_around(path: str) -> str | None:
    """The folder above ``path`` that holds a dynabatch store (a shard written under a key), if any: a corpus
    folder of Parquet files named ``part-*`` is none."""
    folder = os.path.dirname(os.path.abspath(path))
    while True:
        with contextlib.suppress(OSError):
            if _stored(folder)[0].get("key") is not None:
                return folder
        parent = os.path.dirname(folder)
        if parent == folder:
            return None
        folder = parent


def _other_ids(path: str, ids: Any, id_column: str | None) -> str | None:
    """How this job's ``--id-column`` (``ids``: its ids) differs from the keying of the store at ``path`` (by id or
    by position, and the ids' type), in flags; ``None``: it does not, or no shard tells."""
    meta, schema = _stored(path)
    there = meta.get("keyed_by")
    got = f"--id-column={id_column!r}" if id_column is not None else "no --id-column"
    same = "pass the --id-column of the job that wrote it, or use another output folder"
    if there is not None and there != ("id" if ids is not None else "position"):
        if there == "position":
            return (f"--id-column should be left out (the store keys its rows by position) to resume output={path!r}, "
                    f"but got {got}: leave it out, or use another output folder to key rows by id")
        return (f"--id-column should be given (the store keys its rows by id) to resume output={path!r}, but got "
                f"{got}: {same}")
    if there == "id" and ids is not None and "id" in schema.names and schema.field("id").type != ids.type:
        return (f"--id-column should name ids of type {schema.field('id').type}, the ids the store at output={path!r} "
                f"keys its rows by, to resume it, but got {got} holding ids of type {ids.type}: {same}")
    return None


def _settings(key: str) -> dict[str, str]:
    """A job key (:func:`dynabatch.cli.job.job_key`) as ``{name: value}``, the command under ``command``."""
    command, _, rest = key.partition(" ")
    return {"command": command, **dict(_SETTING.findall(rest))}


def _key_form(key: str) -> int | None:
    """A command line's job key's ``key_form`` (0: written before the field); ``None``: no command line's key (no
    ``model=``: the library's ``key=``)."""
    settings = _settings(key)
    form = settings.get("key_form", "0")
    return int(form) if "model" in settings and form.isdigit() else None


def _held_key(path: str, key: str) -> str:
    """The key to open the store at ``path`` under: this job's ``key``, or the store's where that is ``key`` without
    its ``key_form`` (written by the dynabatch whose keys were of form :data:`KEY_FORM` before they said so: the same
    job, whose rows resume under the key they were stored with)."""
    command, _, rest = key.partition(" ")
    unmarked = f"{command} {rest.removeprefix(f'key_form={KEY_FORM} ')}"
    stored = _stored(path)[0].get("key") if unmarked != key and os.path.isdir(path) else None
    return stored if stored == unmarked else key


def _computed_otherwise(path: str, stored: str, key: str) -> str:
    """The refusal of the store at ``path``, whose key ``stored`` is not this job's ``key``: what differs, and where
    the store's key is of an earlier form (:data:`KEY_FORM`), that an earlier dynabatch wrote it and how to go on."""
    got = f"output should be a new folder, or the store of this same job to resume it, but got output={path!r}"
    there, here = _key_form(stored), _key_form(key)
    if there is None or here is None or there >= here:
        return (f"{got} holding rows computed otherwise ({_differences(stored, key)}): use another output folder for "
                f"this job, or delete {path!r} to compute it again")
    form = f"key_form={there}" if there else "no key_form"
    return (f"{got} written by an earlier dynabatch, whose job key had another form ({form} there, key_form={here} "
            f"here: a key of an earlier form may hold the prompt and the generation settings as the flags were typed, "
            f"not as applied), its key differing ({_differences(stored, key)}): use another output folder for this "
            f"job, or resume the store with the dynabatch version that wrote it")


def _differences(stored: str, key: str) -> str:
    """What differs between the key of a store and this job's, read by a person (the keys' form aside:
    :func:`_computed_otherwise` says it)."""
    there, here = _settings(stored), _settings(key)
    names = [n for n in dict.fromkeys([*there, *here]) if there.get(n) != here.get(n) and n != "key_form"]
    if "model" in names:
        from dynabatch.cli.job import sampled_identity

        names.remove("model")
        model = [f"model files of digest {there.get('model', '-')} there, {here.get('model', '-')} here (--model)"]
        if sampled_identity(there.get("model", "")):  # the same files or not: no one can tell
            model[0] += (": the store was written by an earlier dynabatch whose model identity sampled the weights, "
                         "so whether its rows come from these files cannot be told")
    else:
        model = []
    def side(name: str, settings: dict[str, str], where: str) -> str:
        return f"{name}={settings[name]} {where}" if name in settings else f"no {name} {where}"

    shown = model + [f"{side(n, there, 'there')}, {side(n, here, 'here')}" for n in names]
    return "; ".join(shown) if shown else f"key={stored!r} there, key={key!r} here"


@dataclass(frozen=True)
class Tally(Accounting):
    """What a job accounts for of its ``n`` inputs (the run's
    :class:`~dynabatch.inference.results.Accounting`), as the summary and
    ``--report`` show it."""

    def names(self, positions: Any) -> list:
        """The ids (or positions) of ``positions``, as Python values."""
        positions = [int(p) for p in positions]
        if self.ids is None:
            return positions
        import pyarrow as pa

        return self.ids.take(pa.array(positions, type=pa.int64())).to_pylist()

    def shown(self, positions: Any) -> str:
        """The first ids (or positions) of ``positions``, for a message."""
        positions = list(positions)
        what = "ids" if self.ids is not None else "positions"
        names = list(map(repr if self.ids is not None else str, self.names(positions[:6])))  # 5 shown, then "..."
        return f"{what} {first_few(names)}"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the counts, each failed input with its cause, each missing input (position, and id)."""

        def inputs(positions: list[int]) -> list[dict[str, Any]]:
            if self.ids is None:
                return [{"position": p} for p in positions]
            return [{"position": p, "id": name} for p, name in zip(positions, self.names(positions))]

        failed = sorted(self.failures)
        return {"inputs": self.n, "stored": self.stored, "stored_before": self.before, "stored_now": self.now,
                "other_rows": self.others,
                "failed": [{**entry, "cause": self.failures[entry["position"]]} for entry in inputs(failed)],
                "missing": inputs([int(p) for p in self.missing])}


class Output:
    """The store of a corpus job at ``path`` (a folder)."""

    def __init__(self, path: Any) -> None:
        self.path = os.path.expanduser(os.fspath(path))  # as the store reads it ("~" quoted past the shell)
        self.made: str | None = None  # the top-most folder this job made, taken back if a later check fails
        self.store: Any = None
        self.before: np.ndarray | None = None
        self.started = False  # the run began: the folder is kept, whatever it holds

    def prepare(self) -> None:
        """Makes the folder (and its parents) and writes and removes a probe file in it.

        Raises:
            ValueError: an empty or blank path, a file, a folder this user cannot make or write (the reason named),
                one inside another store, or one holding files that are no store's (named).
        """
        path = self.path
        if not path.strip():  # "" would be the working folder to some calls and no folder to others
            raise bad_value("output", "a folder for the store (a path: not empty or blank)", path)
        if os.path.exists(path) and not os.path.isdir(path):
            raise bad_value("output", "a folder for the store, not a file", path)
        if (outer := _store_around(path)) is not None:  # its folder in there: the outer store's job refuses it then
            raise ValueError(f"output should be a folder outside any other store (a store's folder holds its own "
                             f"files alone), but got output={path!r} inside the store {outer!r}")
        try:
            self.made = _make_folders(os.path.abspath(path))
        except OSError as exc:
            raise ValueError(f"output should be a folder this user can make, but got output={path!r}: "
                             f"{exc.strerror} ({exc.filename})") from exc
        # A name the store leaves alone, and no other job's: two jobs of one process (threads) probe at once too.
        probe = os.path.join(path, f".tmp-dynabatch-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            with open(probe, "wb") as f:
                f.write(b"dynabatch")
                f.flush()
                os.fsync(f.fileno())
            os.remove(probe)
        except OSError as exc:
            self.discard()
            raise ValueError(f"output should be a folder this user can write, but got output={path!r}: "
                             f"{exc.strerror}") from exc
        if foreign := _foreign(path):  # the store refuses it too, once the model's files are hashed for the key
            raise ValueError(f"output should be a new folder, or the store of this same job to resume it, but got "
                             f"output={path!r} holding {len(foreign)} other entries ({first_few(foreign)}): remove "
                             "them, or use another output folder")

    def open(self, *, key: str, n: int, ids: Any, id_column: str | None = None) -> str:
        """Opens the store for a run over ``n`` inputs (``ids``: their ids, of the column ``id_column``) computed as
        ``key`` says, held for this job (its lock taken); returns the key it is held under, the run's: ``key``, or a
        store's key of this job written before keys said their form (:func:`_held_key`).

        Raises:
            ValueError: another live job is writing it (that job named), or it holds rows computed otherwise (the
                differences named; a store's key of an earlier form said to be one), keyed otherwise (by id or by
                position, or ids of another type: ``--id-column`` named), or other files.
        """
        key = _held_key(self.path, key)
        try:
            self.store = _open_store(self.path, key=key, n=n, ids=ids)
        except StoreBusyError as exc:
            self.made = None  # another job's store now, whoever made the folder: a refused job touches nothing of it
            raise ValueError(f"output should be a store no other job is writing, but got output={self.path!r}: "
                             f"{_first_line(exc)}; wait for that job to end, or use another output folder") from exc
        except ValueError as exc:
            stored = _stored(self.path)[0].get("key") if os.path.isdir(self.path) else None
            if stored is not None and stored != key:
                raise ValueError(_computed_otherwise(self.path, stored, key)) from exc
            # the store's own words name the library's ids= and output_path: this job's are --id-column and output
            other = _other_ids(self.path, ids, id_column) if stored is not None else None
            if other is not None:
                raise ValueError(other) from exc
            raise ValueError(f"output should be a new folder, or the store of this same job to resume it, but got "
                             f"output={self.path!r}: {_first_line(exc)}") from exc
        self.before = np.array(self.store.done, dtype=bool)
        return key

    @contextlib.contextmanager
    def checked(self) -> Iterator[Output]:
        """Prepares the folder (:meth:`prepare`); the checks in the block that fail :meth:`discard` it."""
        self.prepare()
        try:
            yield self
        except BaseException:
            self.discard()
            raise

    def discard(self) -> None:
        """Closes the store; the folders this job made are removed where empty (nothing ran). Only ``rmdir``: a
        folder another job opened meanwhile holds its lock record, and stays."""
        self.close()
        made, self.made = self.made, None
        if made is None:
            return
        head = os.path.abspath(self.path)
        while head.startswith(made) and len(head) >= len(made):  # the folder, then the parents it made
            try:
                os.rmdir(head)
            except OSError:
                break
            head = os.path.dirname(head)

    def end(self) -> None:
        """Closes the store, or :meth:`discard` it if the run never began (a model that failed to load)."""
        if self.started:
            self.close()
        else:
            self.discard()

    def close(self) -> None:
        """Releases the store (its job lock)."""
        store, self.store = self.store, None
        if store is not None:
            store.close()

    def tally(self, n: int, result: Any = None) -> Tally:
        """What the store holds for the ``n`` inputs: the accounting of ``result`` (a run's, read from this store
        as the run ended), else its rows and failure records now (one scan)."""
        accounting = getattr(result, "accounting", None)
        if accounting is None or accounting.n != n:
            located = self.store.located(n)
            accounting = account(n, located.where >= 0, located.failures, before=self.before, ids=located.ids,
                                 rows=sum(located.counts))
        return Tally(**{f.name: getattr(accounting, f.name) for f in fields(accounting)})  # no copy
