"""The input of a command-line job: a corpus of texts, with ids or chat conversations, checked before a model loads.

:func:`open_corpus` reads a corpus's columns and row count (no texts yet) and
refuses, in one line naming the input, a path that does not exist, a file it
cannot read, or a corpus without rows. The formats (``--format``, or told by
the path):

* ``parquet``: a ``.parquet`` file, a folder of them (read recursively, in
  sorted order), or a glob such as ``"corpus/*.parquet"``;
* ``jsonl``: a ``.jsonl``, ``.ndjson`` or ``.json`` file, one JSON object a line;
* ``datasets``: a folder written by ``datasets.Dataset.save_to_disk`` (one split);
* ``text``: any other file, one document a line (a blank line is an empty
  document, so row ``i`` is line ``i + 1``); its one column is ``text``.

:meth:`Corpus.texts` gives the texts as :func:`dynabatch.read_texts` reads
them (Parquet files and text lines spilled into one memory-mapped Arrow file,
never one Python str per text), :meth:`Corpus.ids` one Arrow array of ids
(checked by :func:`~dynabatch.data.ids.check_ids`: unique, str or int), and
:meth:`Corpus.values` a column as Python objects (chat conversations).

Example:
    >>> import tempfile, pathlib
    >>> folder = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (folder / "docs.jsonl").write_text('{"id": 7, "text": "In the beginning"}\\n{"id": 3, "text": "God"}\\n')
    >>> corpus = open_corpus(str(folder / "docs.jsonl"))
    >>> corpus.format, len(corpus), corpus.ids("id").to_pylist(), corpus.texts("text").take([1])
    ('jsonl', 2, [7, 3], ['God'])
    >>> corpus.texts("body")
    Traceback (most recent call last):
    ...
    ValueError: --text-column should be a column of the input ['id', 'text'], but got --text-column='body'
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator
from typing import Any

import pyarrow as pa

from dynabatch._validation import bad_value
from dynabatch.data.ids import check_ids
from dynabatch.data.text_source import TextSource, parquet_paths, read_texts

__all__ = ["FORMATS", "Corpus", "open_corpus"]

FORMATS = ("auto", "parquet", "jsonl", "text", "datasets")
_JSON_SUFFIXES = (".jsonl", ".ndjson", ".json")
_FEW = 5


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _unreadable(path: str, what: str, exc: BaseException) -> ValueError:
    return ValueError(f"input should be {what}, but got input={path!r}: {_first_line(exc)}")


def _format_of(path: str) -> str:
    if any(c in path for c in "*?["):
        return "parquet"
    if os.path.isdir(path):
        names = set(os.listdir(path))
        return "datasets" if {"state.json", "dataset_info.json"} <= names or "dataset_dict.json" in names \
            else "parquet"
    if path.endswith(".parquet"):
        return "parquet"
    return "jsonl" if path.lower().endswith(_JSON_SUFFIXES) else "text"


class Corpus:
    """A corpus opened by :func:`open_corpus`: its format, its columns (name -> Arrow type) and its rows."""

    def __init__(self, path: str, fmt: str) -> None:
        self.path, self.format = path, fmt
        self.files: list[str] = []
        self.table: pa.Table | None = None  # a JSONL file, read whole into Arrow memory
        self.dataset: Any = None
        self.lines: TextSource | None = None  # a text file's lines
        self.columns: dict[str, pa.DataType] = {}
        self.rows = 0
        getattr(self, f"_open_{fmt}")()
        if not self.rows:
            raise ValueError(f"input should hold at least one text, but got input={path!r} with no rows")

    def __len__(self) -> int:
        return self.rows

    def __repr__(self) -> str:
        return f"Corpus({self.path!r}, format={self.format!r}, rows={self.rows})"

    # -- opening: schema and row count --------------------------------------------------------------------

    def _open_parquet(self) -> None:
        import pyarrow.parquet as pq

        if not any(c in self.path for c in "*?[") and not os.path.exists(self.path):
            raise bad_value("input", "an existing file, folder or glob", self.path)
        try:
            self.files = parquet_paths(self.path) or []
        except ValueError:
            raise bad_value("input", "Parquet files (.parquet): a file, a folder holding some, or a glob matching "
                            "some", self.path) from None
        for file in self.files:
            try:
                meta = pq.ParquetFile(file).metadata
            except (OSError, pa.ArrowException) as exc:
                raise _unreadable(file, "a readable Parquet file", exc) from exc
            schema = meta.schema.to_arrow_schema()
            if not self.columns:
                self.columns = dict(zip(schema.names, schema.types))
            self.columns = {n: t for n, t in self.columns.items() if n in schema.names}  # in every file
            self.rows += meta.num_rows

    def _open_jsonl(self) -> None:
        import pyarrow.json

        self._check_file()
        if os.path.getsize(self.path) == 0:
            return
        try:
            self.table = pyarrow.json.read_json(self.path)
        except (OSError, pa.ArrowException) as exc:
            raise _unreadable(self.path, "a JSONL file (one JSON object a line)", exc) from exc
        self.columns = dict(zip(self.table.schema.names, self.table.schema.types))
        self.rows = self.table.num_rows

    def _open_datasets(self) -> None:
        if os.path.isfile(os.path.join(self.path, "dataset_dict.json")):
            splits = sorted(n for n in os.listdir(self.path) if os.path.isdir(os.path.join(self.path, n)))
            raise bad_value("input", f"one split's folder of a saved DatasetDict (one of {splits})", self.path)
        import datasets

        try:
            self.dataset = datasets.load_from_disk(self.path)
        except (OSError, ValueError, pa.ArrowException) as exc:
            raise _unreadable(self.path, "a folder written by datasets.Dataset.save_to_disk", exc) from exc
        schema = self.dataset.data.schema
        self.columns = dict(zip(schema.names, schema.types))
        self.rows = len(self.dataset)

    def _open_text(self) -> None:
        self._check_file()
        self.columns = {"text": pa.large_string()}
        if not os.path.getsize(self.path):
            return
        try:
            self.lines = read_texts(self._lines())  # read once here: the rows are the lines
        except (UnicodeDecodeError, OSError) as exc:
            raise _unreadable(self.path, "a UTF-8 text file, one document a line", exc) from exc
        self.rows = len(self.lines)

    def _check_file(self) -> None:
        if not os.path.isfile(self.path):
            raise bad_value("input", "an existing file, folder or glob", self.path)
        if not os.access(self.path, os.R_OK):
            raise bad_value("input", "a file this user can read", self.path)

    # -- columns ---------------------------------------------------------------------------------------

    def require(self, flag: str, column: str, kinds: tuple[str, ...]) -> pa.DataType:
        """The Arrow type of ``column`` (the option ``flag`` names it), refused if missing or not of ``kinds``
        (``"string"``, ``"integer"``, ``"list"``)."""
        if self.format == "text" and flag != "--text-column":
            raise bad_value(flag, "given with a table (Parquet, JSONL, datasets): a text file's lines have only "
                            "their position", column)
        if self.format == "text":
            if column != "text":
                raise bad_value(flag, "'text' with a text file (its lines are its one column)", column)
            return self.columns["text"]
        if column not in self.columns:
            raise bad_value(flag, f"a column of the input {sorted(self.columns)}", column)
        kind = self.columns[column]
        checks = {"string": lambda t: pa.types.is_string(t) or pa.types.is_large_string(t),
                  "integer": pa.types.is_integer,
                  "list": lambda t: pa.types.is_list(t) or pa.types.is_large_list(t)}
        if not any(checks[k](kind) for k in kinds):
            raise bad_value(flag, f"a column of {' or '.join(kinds)} values (the input's {column!r} holds {kind})",
                            column)
        return kind

    def texts(self, column: str, flag: str = "--text-column") -> TextSource:
        """The texts of ``column`` as :func:`dynabatch.read_texts` reads them; a missing (null) text is refused."""
        self.require(flag, column, ("string",))
        if self.lines is not None:
            source = self.lines
        elif self.dataset is not None:
            source = read_texts(self.dataset, column=column)
        else:
            source = read_texts(self.files or self.table, column=column)
        missing = source.bad()
        if missing.size:
            rows = ", ".join(str(i) for i in missing[:_FEW].tolist()) + (", ..." if missing.size > _FEW else "")
            raise ValueError(f"{flag} should name a column without missing texts, but got {flag}={column!r} with "
                             f"{missing.size} missing (null) texts, at rows {rows}: fill or drop them")
        return source

    def _lines(self) -> Iterator[str]:
        with open(self.path, encoding="utf-8") as lines:  # universal newlines: "\r\n" ends a line too
            for line in lines:
                yield line[:-1] if line.endswith("\n") else line

    def column(self, column: str) -> pa.ChunkedArray:
        """One column, whole, as Arrow."""
        if self.dataset is not None:
            return self.dataset.with_format("arrow")[column]
        if self.table is not None:
            return self.table.column(column)
        import pyarrow.parquet as pq

        parts = [pq.read_table(file, columns=[column]).column(column) for file in self.files]
        kinds = {str(p.type) for p in parts}
        if len(kinds) > 1 and all(pa.types.is_integer(p.type) for p in parts):
            parts = [p.cast(pa.int64()) for p in parts]
        elif len(kinds) > 1:
            raise ValueError(f"input should hold column {column!r} with one type in every file, but got types "
                             f"{sorted(kinds)} in input={self.path!r}")
        return pa.chunked_array([chunk for part in parts for chunk in part.chunks], type=parts[0].type)

    def ids(self, column: str, flag: str = "--id-column") -> pa.Array:
        """The ids of ``column`` as one Arrow array (str or int64), each text's own (unique, none missing)."""
        self.require(flag, column, ("string", "integer"))
        try:
            return check_ids(self.column(column), self.rows)
        except ValueError as exc:
            raise ValueError(f"{flag}={column!r}: {exc}") from exc

    def values(self, column: str, flag: str) -> list:
        """One column as Python objects (one per row), for what a model call takes whole (chat conversations)."""
        self.require(flag, column, ("list",))
        return self.column(column).to_pylist()


def open_corpus(path: str, fmt: str = "auto") -> Corpus:
    """Opens the corpus at ``path`` (a file, folder or glob) in format ``fmt`` (``auto``: told by the path).

    Raises:
        ValueError: the path does not exist, cannot be read in that format, or holds no rows.
    """
    if fmt not in FORMATS:
        raise bad_value("--format", f"one of {FORMATS}", fmt)
    path = os.fspath(path)
    if fmt == "auto" and not any(c in path for c in "*?[") and not os.path.exists(path):
        raise bad_value("input", "an existing file, folder or glob", path)
    if fmt == "auto" and any(c in path for c in "*?[") and not glob.glob(path, recursive=True):
        raise bad_value("input", "a glob matching at least one Parquet file", path)
    return Corpus(path, _format_of(path) if fmt == "auto" else fmt)
