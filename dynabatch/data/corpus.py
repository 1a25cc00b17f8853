"""The format layer: a corpus of texts in files, with ids or chat conversations, read by the library and the CLI.

:func:`read_texts` (``dynabatch.read_texts``) reads the texts of a file,
folder or glob in any format below, or of what is already in memory (a
``datasets.Dataset``, an Arrow table or array, an iterable of str);
:func:`open_corpus` opens a corpus's columns (no texts yet: the command line's
jobs check them before a model loads) and refuses, in one line naming the
input, a path that does not exist, a file it cannot read, or a corpus without
rows. The format is ``format`` (``--format``), or told by the path's suffix,
never guessed from the contents:

* ``parquet``: a ``.parquet`` file, a folder of them (read recursively, in
  sorted order), or a glob such as ``"corpus/*.parquet"``;
* ``csv``, ``tsv``: a ``.csv`` (``.tsv``, ``.tab``) file, a folder or a glob of
  them; a table whose first line names its columns, read by ``pyarrow.csv``
  (quoted values may hold the delimiter, quotes doubled, and line breaks, as
  Python's ``csv`` module and pandas write them). A CSV has no types: every
  value is read as a string (ids too: ``007`` stays ``'007'``), an empty value
  as an empty string, a blank line as no row (an empty text of a one-column
  CSV is written ``""``, as ``csv`` and pandas do); a quoted value never closed is refused, naming the line
  it starts on (read to the file's end, it would hold the rows after it);
* ``jsonl``: a ``.jsonl``, ``.ndjson`` or ``.json`` file, one JSON object a line
  (a blank line is none; a string is read as written, one that looks like a
  date too);
* ``arrow``: an Arrow IPC file (``.arrow``, ``.feather``; the file or the stream
  format), memory-mapped: its texts are read in place;
* ``datasets``: a folder written by ``datasets.Dataset.save_to_disk`` (one split);
* ``text``: a ``.txt`` file (any file with ``format="text"``), one document a
  line (a blank line is an empty document, so row ``i`` is line ``i + 1``; a
  byte order mark is dropped, as from a CSV or JSONL file); its one column is
  ``text``.

A CSV, TSV, JSONL or text file may be compressed, told by a last suffix of
:data:`COMPRESSIONS` (``docs.jsonl.gz``; a folder or glob's files too). A file
of another suffix is refused, naming the formats. A JSONL line or a CSV
row that cannot be read is named by the line of the file it starts on (counted
from the file's start, not from the block pyarrow was reading). A folder or glob
never reads the files under ``exclude``, a job's own output folder, wherever
it lies (a store inside its corpus folder holds Parquet shards). Messages name
the input, its format and its columns as the caller does (:class:`Naming`:
``source``, ``format``, ``column`` for the library; the flags for the command
line). Adding a format is this module alone: its suffixes, its name in
:data:`FORMATS` and its ``_open_...`` method.

:meth:`Corpus.texts` gives the texts as :func:`dynabatch.read_texts` reads
them (Parquet files and text lines spilled into one memory-mapped Arrow file,
never one Python str per text; a CSV is first streamed, a block at a time, into
a temporary Parquet file of the columns the job reads), :meth:`Corpus.ids` one
Arrow array of ids (checked by :func:`~dynabatch.data.ids.check_ids`: unique,
str or int), and :meth:`Corpus.values` a column as Python objects (chat
conversations).

Example:
    >>> import tempfile, pathlib
    >>> folder = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (folder / "docs.csv").write_text('id,text\\n7,"In the beginning, God"\\n3,"created"\\n')
    >>> corpus = open_corpus(str(folder / "docs.csv"))
    >>> corpus.format, len(corpus), corpus.ids("id").to_pylist(), corpus.texts("text").take([0])
    ('csv', 2, ['7', '3'], ['In the beginning, God'])
    >>> corpus.texts("body")
    Traceback (most recent call last):
    ...
    ValueError: column should be a column of the input ['id', 'text'], but got column='body'
    >>> read_texts(str(folder / "docs.csv")).take([1])
    ['created']
"""

from __future__ import annotations

import codecs
import glob
import io
import json
import os
import re
import shutil
import tempfile
import weakref
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

import pyarrow as pa

from dynabatch._validation import bad_value, check_positive_int, first_few
from dynabatch.data.ids import check_ids
from dynabatch.data.text_source import SPILL_ROWS, TextSource, is_text_type, source_of

__all__ = ["FORMATS", "LIBRARY", "Corpus", "Naming", "open_corpus", "read_texts"]

FORMATS = ("auto", "parquet", "csv", "tsv", "jsonl", "arrow", "text", "datasets")
SUFFIXES = {".parquet": "parquet", ".csv": "csv", ".tsv": "tsv", ".tab": "tsv", ".jsonl": "jsonl",
            ".ndjson": "jsonl", ".json": "jsonl", ".arrow": "arrow", ".feather": "arrow", ".txt": "text"}
"""The suffixes that tell a file's format."""
COMPRESSIONS = (".gz", ".bz2", ".zst", ".lz4")
"""The last suffixes of a compressed CSV, TSV, JSONL or text file (``docs.jsonl.gz``): pyarrow's CSV and JSON readers
decompress such a file as they read it (told by that suffix), and so does every other reading of its bytes here."""
_STREAMED = ("csv", "tsv", "jsonl", "text")  # the formats read as a stream of bytes: compressed ones too
_FILE_SETS = ("parquet", "csv", "tsv")  # the formats a folder or a glob may hold
_DELIMITERS = {"csv": ",", "tsv": "\t"}
_ONE_FILE = "a JSONL, Arrow or text input is one file, named as it is"
_NAMED = [f"{kind} (one document a line)" if kind == "text" else kind for kind in FORMATS[1:]]
_FORMAT_HELP = (f"{', '.join(_NAMED[:-1])} or {_NAMED[-1]}; suffixes {', '.join(SUFFIXES)} (a CSV, TSV, JSONL or "
                f"text file's followed by {', '.join(COMPRESSIONS)} where it is compressed)")


@dataclass(frozen=True)
class Naming:
    """What the corpus's messages call the input, its format, its text and id columns, and the folder it excludes:
    the caller's own names (:data:`LIBRARY`'s, or a command's flags)."""

    input: str = "source"
    format: str = "format"
    text: str = "column"
    ids: str = "id_column"
    excluded: str = "the excluded folder"


LIBRARY = Naming()
"""The names of :func:`read_texts`'s arguments."""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _unreadable(name: str, path: str, what: str, exc: BaseException | None, detail: str | None = None) -> ValueError:
    """``path`` (the argument ``name``) refused as not ``what``: ``detail``, else the first line of the error reading
    it raised."""
    return ValueError(f"{name} should be {what}, but got {name}={path!r}: {detail or _first_line(exc)}")


_WIDE = ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"), (codecs.BOM_UTF16_LE, "UTF-16"),
         (codecs.BOM_UTF16_BE, "UTF-16"))  # UTF-32's little-endian mark starts with UTF-16's: it is tried first


def _not_utf8(path: str) -> str | None:
    """Why the text file ``path`` is not UTF-8 where its start tells (a UTF-16 or UTF-32 byte order mark, or a NUL
    in every other byte: UTF-16 of mostly ASCII text); ``None`` otherwise. pyarrow's CSV reader splits such a file's
    bytes into rows anyway, and its error blames a row's number of values: this says why instead."""
    with _bytes_of(path) as file:
        start = file.read(4096)
    wide = next((name for mark, name in _WIDE if start.startswith(mark)), None)
    if wide is not None:
        return f"{wide} text (it starts with a {wide} byte order mark), not UTF-8: save it as UTF-8"
    if len(start) >= 4 and max(start[0::2].count(0), start[1::2].count(0)) > len(start) // 4:
        return "UTF-16 text (a NUL in every other byte), not UTF-8: save it as UTF-8"
    return None


_JSONL_RULE = "a JSONL file (one JSON object a line)"
_JSON_KINDS = ((bool, "boolean"), ((int, float), "number"), (str, "string"), (list, "array"), (dict, "object"))


def _without_block_row(exc: BaseException) -> str:
    """pyarrow's first line, less its row number: it counts rows within a block of the file, not from its start."""
    return re.sub(r"\s*in row \d+\s*$", "", _first_line(exc))


def _json_kind(value: Any) -> str:
    return next(kind for types, kind in _JSON_KINDS if isinstance(value, types))


def _kind_conflict(value: Any, path: str, kinds: dict[str, str]) -> str | None:
    """Where ``value`` (at column ``path``) holds a kind of JSON value other than earlier lines held there."""
    if value is None:  # null: a missing value of any kind
        return None
    kind, now = kinds.setdefault(path, _json_kind(value)), _json_kind(value)
    if kind != now:
        return f"column {path} holds values of kind {kind} on earlier lines and of kind {now} here"
    if isinstance(value, dict):
        children = [(f"{path}/{key}", child) for key, child in value.items()]
    else:
        children = [(f"{path}/[]", child) for child in value] if isinstance(value, list) else []
    return next((found for at, child in children if (found := _kind_conflict(child, at, kinds))), None)


def _jsonl_fault(path: str, *, kinds: bool) -> str | None:
    """The first line of the JSONL file ``path`` pyarrow cannot read, as ``"line N: why"`` (lines counted over the
    whole file, from 1), or ``None`` if none is found. Run once the read failed: one line at a time, in flat memory.
    ``kinds``: also find the first value whose kind (string, number, ...) differs from its column's on earlier lines
    (pyarrow's "Column(/name) changed from" error; slower: every value is visited).
    """
    decoder, seen = json.JSONDecoder(), {}
    with _bytes_of(path) as lines:
        for number, raw in enumerate(lines, start=1):
            try:
                line, end = raw.decode("utf-8").strip(), 0
                while end < len(line):  # pyarrow reads values one after another, a line holding several too
                    value, end = decoder.raw_decode(line, end)
                    if not isinstance(value, dict):
                        return f"line {number}: a JSON {_json_kind(value)} where a JSON object should be"
                    if kinds and (conflict := _kind_conflict(value, "", seen)) is not None:
                        return f"line {number}: {conflict}"
                    end = len(line) - len(line[end:].lstrip())
            except json.JSONDecodeError as exc:
                return f"line {number}, column {exc.colno}: {exc.msg}"
            except UnicodeDecodeError as exc:
                return f"line {number}: not UTF-8 ({exc.reason} at byte {exc.start})"
    return None


_SURROGATE = re.compile("[\udc80-\udcff]")  # a byte that is not UTF-8, as errors="surrogateescape" reads it
_BLOCK = 1 << 20  # pyarrow's CSV and JSON readers' default block, in bytes
_LARGEST_BLOCK = (1 << 31) - 1  # the largest block pyarrow takes (an int32)


def _in_blocks(read: Callable[[int], Any], path: str) -> Any:
    """``read(block_size)``, again with blocks four times larger while a row straddles two (pyarrow parses whole
    rows within a block: a document longer than its default block, a book on one JSONL line, is refused with "try
    to increase block size"); a block holding the whole file, or the largest, is the last try."""
    size = _BLOCK
    while True:
        try:
            return read(size)
        except pa.ArrowInvalid as exc:
            whole = _LARGEST_BLOCK if _is_compressed(path) else os.path.getsize(path)
            if "straddl" not in str(exc) or size >= min(whole, _LARGEST_BLOCK):
                raise
            size = min(size * 4, _LARGEST_BLOCK)


def _strings_for_dates(kind: pa.DataType) -> pa.DataType:
    """``kind`` with every timestamp in it a string: pyarrow's JSON reader takes a column (or a chat message's field)
    whose strings all look like dates (``"2024-01-01"``) for timestamps, which would refuse such texts and ids and
    turn such a message's content into a ``datetime``; a JSON file holds strings there, read as written."""
    if pa.types.is_timestamp(kind):
        return pa.string()
    if pa.types.is_struct(kind):
        return pa.struct([field.with_type(_strings_for_dates(field.type)) for field in kind])
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        value = kind.value_field.with_type(_strings_for_dates(kind.value_type))
        return pa.list_(value) if pa.types.is_list(kind) else pa.large_list(value)
    return kind


class _QuoteCount(io.RawIOBase):
    """The bytes of the file ``path`` as pyarrow's CSV reader reads them by its path (:func:`pyarrow.input_stream`,
    decompressed where its suffix names a compression), their ``"`` counted on the way: the pass that converts the
    file tells whether they pair up, which a second read would otherwise (decompressing it again)."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self._stream = pa.input_stream(path)
        self.quotes = 0

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        data = self._stream.read(None if size < 0 else size)
        self.quotes += data.count(b'"')
        return data

    def close(self) -> None:
        self._stream.close()
        super().close()


def _unclosed_quote(path: str, delimiter: str) -> int | None:
    """The line (from 1) where a quoted value of the CSV file ``path`` starts that is never closed, or ``None``:
    pyarrow, as Python's ``csv``, reads such a value to the file's end, the rows after it too, without an error.
    Read line by line, by a caller that found the file's quotes do not pair up (a value left open makes their number
    odd: :class:`_QuoteCount`)."""
    opening = re.compile(f'(?:^|(?<={re.escape(delimiter)}))"')  # a quote opens a value only at its start
    opened = None  # the line the open value starts on
    with io.TextIOWrapper(_bytes_of(path), encoding="utf-8-sig", errors="surrogateescape", newline="") as lines:
        for number, line in enumerate(lines, start=1):
            at = 0
            while True:
                if opened is None:
                    found = opening.search(line, at)
                    if found is None:
                        break
                    opened, at = number, found.end()
                    continue
                end = line.find('"', at)
                if end < 0:
                    break
                doubled = line.startswith('"', end + 1)  # "" in a quoted value: one quote of it
                opened, at = (opened, end + 2) if doubled else (None, end + 1)
    return opened


def _is_glob(path: str) -> bool:
    return any(c in path for c in "*?[")


def _is_compressed(path: str) -> bool:
    return os.path.splitext(path)[1].lower() in COMPRESSIONS


def _bytes_of(path: str) -> BinaryIO:
    """The file ``path`` opened for its bytes, decompressed where its suffix names a compression (as pyarrow's
    readers read it)."""
    return io.BufferedReader(pa.input_stream(path)) if _is_compressed(path) else open(path, "rb")


def _is_empty(path: str) -> bool:
    """Whether the file ``path`` holds no bytes (a compressed one: none once decompressed)."""
    if not _is_compressed(path):
        return not os.path.getsize(path)
    with _bytes_of(path) as file:
        return not file.read(1)


def _suffix_format(path: str) -> str | None:
    root, suffix = os.path.splitext(path)
    if suffix.lower() not in COMPRESSIONS:
        return SUFFIXES.get(suffix.lower())
    kind = SUFFIXES.get(os.path.splitext(root)[1].lower())
    return kind if kind in _STREAMED else None


def _outside(paths: list[str], exclude: str | None) -> list[str]:
    """``paths`` less hidden files (a writer's temporaries) and those under the folder ``exclude``."""
    kept = [p for p in paths if not os.path.basename(p).startswith(".")]
    if exclude is None:
        return kept
    root = os.path.join(os.path.realpath(exclude), "")
    return [p for p in kept if not os.path.realpath(p).startswith(root)]


def _listed(path: str, exclude: str | None) -> list[str]:
    """The files a folder (recursively) or a glob names, sorted, outside ``exclude``."""
    if os.path.isdir(path):
        found = glob.glob(os.path.join(glob.escape(path), "**", "*"), recursive=True)
    else:
        found = glob.glob(path, recursive=True)
    return sorted(_outside([p for p in found if os.path.isfile(p)], exclude))


def _format_of(path: str, exclude: str | None, naming: Naming) -> str:
    """The format ``path`` names by its suffix (a folder or glob: by its files'); refused when it names none."""
    if os.path.isdir(path) and not _is_glob(path):
        names = set(os.listdir(path))
        if {"state.json", "dataset_info.json"} <= names or "dataset_dict.json" in names:
            return "datasets"
    if os.path.isdir(path) or _is_glob(path):
        found = {k for k in map(_suffix_format, _listed(path, exclude)) if k is not None}
        kinds = sorted(found & set(_FILE_SETS))
        if len(kinds) == 1:
            return kinds[0]
        what = "a folder" if os.path.isdir(path) else "a glob"
        outside = f" outside {naming.excluded}" if exclude is not None else ""
        alone = f"it holds {' and '.join(sorted(found))} files: {_ONE_FILE}" if found else f"or pass {naming.format}"
        rule = (f"{what} of files of one format (it holds {' and '.join(kinds)} files: pass {naming.format})" if kinds
                else f"{what} holding .parquet, .csv or .tsv files{outside} ({alone})")
        raise bad_value(naming.input, rule, path)
    kind = _suffix_format(path)
    if kind is None:
        raise bad_value(naming.input, f"a file whose suffix names its format, or given {naming.format} {_FORMAT_HELP}",
                        path)
    return kind


class Corpus:
    """A corpus opened by :func:`open_corpus`: its format, its columns (name -> Arrow type) and its rows.

    ``keep``: the columns the job reads (a CSV's others are not converted; ``None``: all of them); ``naming``: what
    its messages call the input, the format and the columns.
    """

    def __init__(self, path: str, fmt: str, *, exclude: str | None = None, keep: Collection[str] | None = None,
                 naming: Naming = LIBRARY) -> None:
        self.path, self.format, self.exclude, self.naming = path, fmt, exclude, naming
        self.name = naming.input
        self.keep = None if keep is None else list(dict.fromkeys(keep))
        self.files: list[str] = []  # Parquet files (a CSV's: converted, on first use)
        self.file_columns: list[tuple[str, list[str]]] = []  # each file of a folder or glob and its columns
        self.table: pa.Table | None = None  # a JSONL file, read whole into Arrow memory
        self.dataset: Any = None
        self.lines: TextSource | None = None  # a text file's lines
        self.columns: dict[str, pa.DataType] = {}
        self.rows: int | None = 0  # None: a CSV not converted yet
        self._scratch: str | None = None  # the temporary folder of a CSV's Parquet files
        {"parquet": self._open_parquet, "csv": self._open_delimited, "tsv": self._open_delimited,
         "jsonl": self._open_jsonl, "arrow": self._open_arrow, "datasets": self._open_datasets, "text": self._open_text}[fmt]()
        if self.rows is not None:
            self._check_rows()

    def __len__(self) -> int:
        return self._count()

    def __repr__(self) -> str:
        return f"Corpus({self.path!r}, format={self.format!r}, rows={self.rows})"

    def _check_rows(self) -> None:
        if not self.rows:
            raise ValueError(f"{self.name} should hold at least one text, but got {self.name}={self.path!r} with no "
                             "rows")

    def _count(self) -> int:
        if self.rows is None:
            self._convert()
            self._check_rows()
        return self.rows

    # -- opening: schema and row count --------------------------------------------------------------------

    def _file_list(self, what: str) -> list[str]:
        """The files of the input: itself, or those a folder or glob names (outside the excluded folder)."""
        if not _is_glob(self.path) and not os.path.exists(self.path):
            raise bad_value(self.name, "an existing file, folder or glob", self.path)
        if os.path.isfile(self.path):
            return [self.path]
        files = _listed(self.path, self.exclude)
        if os.path.isdir(self.path):
            files = [f for f in files if _suffix_format(f) == self.format]
        if not files:
            holder = "a folder holding some" if os.path.isdir(self.path) else "a glob matching some"
            outside = f" (outside {self.naming.excluded})" if self.exclude is not None else ""
            raise bad_value(self.name, f"{what}: a file, {holder}{outside}", self.path)
        return files

    def _add_file(self, name: str, schema: pa.Schema) -> None:
        self.file_columns.append((name, list(schema.names)))
        if not self.columns:
            self.columns = dict(zip(schema.names, schema.types))
        self.columns = {n: t for n, t in self.columns.items() if n in schema.names}  # in every file

    def _open_parquet(self) -> None:
        import pyarrow.parquet as pq

        self.files = self._file_list("Parquet files (.parquet)")
        for file in self.files:
            try:
                meta = pq.ParquetFile(file).metadata
            except (OSError, pa.ArrowException) as exc:
                raise _unreadable(self.name, file, "a readable Parquet file", exc) from exc
            self._add_file(file, meta.schema.to_arrow_schema())
            self.rows += meta.num_rows

    def _csv_options(self) -> Any:
        from pyarrow import csv

        return csv.ParseOptions(delimiter=_DELIMITERS[self.format], newlines_in_values=True)

    def _open_delimited(self) -> None:
        """A CSV or TSV's columns, from each file's first line (its rows are counted when it is converted)."""
        from pyarrow import csv

        for file in self._file_list(f"{self.format.upper()} files ({', '.join(self._suffixes())})"):
            try:
                names = _in_blocks(lambda size, f=file: csv.open_csv(
                    f, read_options=csv.ReadOptions(block_size=size), parse_options=self._csv_options()).schema.names,
                    file)
            except (OSError, pa.ArrowException, UnicodeDecodeError) as exc:
                raise self._refusal(file, exc) from exc
            self._add_file(file, pa.schema([(n, pa.large_string()) for n in names]))
        self.rows = None

    def _table_rule(self) -> str:
        return f"a UTF-8 {self.format.upper()} file: a first line naming the columns, then as many values a row"

    def _suffixes(self) -> list[str]:
        return [s for s, kind in SUFFIXES.items() if kind == self.format]

    def _convert(self) -> None:
        """Streams each CSV file, a block at a time, into a temporary Parquet file of the kept columns (strings)."""
        import pyarrow.parquet as pq
        from pyarrow import csv

        self._scratch = tempfile.mkdtemp(prefix="dynabatch-corpus-")
        weakref.finalize(self, shutil.rmtree, self._scratch, True)
        self.rows = 0
        for i, (file, names) in enumerate(self.file_columns):
            kept = [n for n in names if self.keep is None or n in self.keep]
            convert = csv.ConvertOptions(column_types={n: pa.large_string() for n in names}, include_columns=kept)
            target = os.path.join(self._scratch, f"{i:06d}.parquet")

            def write(size: int, file: str = file, convert: Any = convert, target: str = target) -> tuple[int, int]:
                """The file's rows written to ``target``, and the ``"`` its bytes hold."""
                with _QuoteCount(file) as source:
                    reader = csv.open_csv(source, read_options=csv.ReadOptions(block_size=size),
                                          parse_options=self._csv_options(), convert_options=convert)
                    rows = 0
                    with pq.ParquetWriter(target, reader.schema) as writer:
                        for batch in reader:
                            writer.write_batch(batch)
                            rows += batch.num_rows
                return rows, source.quotes

            try:
                rows, quotes = _in_blocks(write, file)
            except (OSError, pa.ArrowException) as exc:
                raise self._refusal(file, exc) from exc
            self.rows += rows
            if quotes % 2 and (line := _unclosed_quote(file, _DELIMITERS[self.format])) is not None:
                raise _unreadable(self.name, file, self._table_rule(), None, f'line {line}: a quoted value starts here '
                                  'and is never closed, so the rest of the file would be read into it: close it with '
                                  'a ", or double a " inside a value ("")')
            self.files.append(target)

    def _refusal(self, file: str, exc: BaseException) -> ValueError:
        """``file`` refused, naming the line of its first ragged row, or of its first value that is not UTF-8, where
        pyarrow's error names only its text (or the column's number)."""
        wide = None if isinstance(exc, OSError) else _not_utf8(file)
        fault = self._bad_row(file, exc) if ("Expected" in str(exc) or "UTF8" in str(exc)) and wide is None else None
        if isinstance(exc, UnicodeDecodeError):  # pyarrow decoding the first line's column names
            fault = (f"line 1: a column name holds bytes that are not UTF-8 ({exc.object[:40]!r}): save the file as "
                     "UTF-8")
        return _unreadable(self.name, file, self._table_rule(), exc, wide or fault)

    def _bad_row(self, file: str, exc: BaseException) -> str | None:
        """Where the first row of ``file`` that pyarrow refused (``exc``) starts (lines from 1), and why: another
        number of values than its first row, or a value of a column the job reads holding bytes that are not UTF-8;
        ``None`` if Python's ``csv`` finds none. One row at a time."""
        import csv

        bytes_read = _bytes_of(file)  # a byte that is not UTF-8 is read as a surrogate
        with io.TextIOWrapper(bytes_read, encoding="utf-8", errors="surrogateescape", newline="") as lines:
            reader, start, names = csv.reader(lines, delimiter=_DELIMITERS[self.format]), 1, None
            try:
                for row in reader:
                    names = names or row
                    if row and len(row) != len(names):  # pyarrow skips empty lines, as csv gives them: []
                        return f"line {start}: {_first_line(exc)}"
                    bad = next(((n, v) for n, v in zip(names, row) if (self.keep is None or n in self.keep)
                                and not v.isascii() and _SURROGATE.search(v)), None)
                    if bad is not None and start > 1:
                        raw = bad[1].encode("utf-8", "surrogateescape")
                        return (f"line {start}: column {bad[0]!r} holds bytes that are not UTF-8 ({raw[:40]!r}): save "
                                "the file as UTF-8")
                    start = reader.line_num + 1
            except csv.Error:  # a value past csv's field size limit (a long document), which pyarrow reads
                return None
        return None

    def _open_jsonl(self) -> None:
        import pyarrow.json

        self._check_file()
        if _is_empty(self.path):
            return

        def read(schema: pa.Schema | None) -> pa.Table:
            return _in_blocks(lambda size: pyarrow.json.read_json(
                self.path, read_options=pyarrow.json.ReadOptions(block_size=size),
                parse_options=pyarrow.json.ParseOptions(explicit_schema=schema)), self.path)

        try:
            self.table = read(None)
            as_written = pa.schema([field.with_type(_strings_for_dates(field.type)) for field in self.table.schema])
            if as_written != self.table.schema:  # a column of date-like strings, read again as the strings they are
                self.table = read(as_written)
            # pyarrow reads bytes that are not UTF-8 inside a JSON string into the string column as they are; only
            # here can they be named by file and line (taking such a text raises Python's decode error, naming neither)
            self.table.validate(full=True)
            self.columns = dict(zip(self.table.schema.names, self.table.schema.types))  # a key not UTF-8: decode error
        except (OSError, pa.ArrowException, UnicodeDecodeError) as exc:
            fault = None if isinstance(exc, OSError) else _jsonl_fault(self.path, kinds="Column(/" in str(exc))
            fault = fault and _not_utf8(self.path) or fault
            raise _unreadable(self.name, self.path, _JSONL_RULE, exc, fault or _without_block_row(exc)) from exc
        self.rows = self.table.num_rows

    def _open_arrow(self) -> None:
        """An Arrow IPC file (file or stream format, as ``pyarrow.feather`` and ``datasets`` write them),
        memory-mapped: its texts are read in place, never copied."""
        self._check_file()
        try:
            mapped = pa.memory_map(self.path)  # kept open: the table's buffers are views of it
            try:
                self.table = pa.ipc.open_file(mapped).read_all()
            except pa.ArrowInvalid:  # not the file format: the stream format
                mapped.seek(0)
                self.table = pa.ipc.open_stream(mapped).read_all()
        except (OSError, pa.ArrowException) as exc:
            raise _unreadable(self.name, self.path, "an Arrow IPC file (.arrow, .feather)", exc) from exc
        self._add_file(self.path, self.table.schema)  # its columns, a name given twice among them found by require()
        self.rows = self.table.num_rows

    def _open_datasets(self) -> None:
        if os.path.isfile(os.path.join(self.path, "dataset_dict.json")):
            splits = sorted(n for n in os.listdir(self.path) if os.path.isdir(os.path.join(self.path, n)))
            raise bad_value(self.name, f"one split's folder of a saved DatasetDict (one of {splits})", self.path)
        import datasets

        try:
            self.dataset = datasets.load_from_disk(self.path)
        except (OSError, ValueError, pa.ArrowException) as exc:
            raise _unreadable(self.name, self.path, "a folder written by datasets.Dataset.save_to_disk", exc) from exc
        schema = self.dataset.data.schema
        self.columns = dict(zip(schema.names, schema.types))
        self.rows = len(self.dataset)

    def _open_text(self) -> None:
        self._check_file()
        self.columns = {"text": pa.large_string()}
        if _is_empty(self.path):
            return
        try:
            self.lines = source_of(self._lines())  # read once here: the rows are the lines
        except (UnicodeDecodeError, OSError) as exc:
            wide = _not_utf8(self.path) if isinstance(exc, UnicodeDecodeError) else None
            raise _unreadable(self.name, self.path, "a UTF-8 text file, one document a line", exc, wide) from exc
        self.rows = len(self.lines)

    def _check_file(self) -> None:
        if os.path.isdir(self.path) or _is_glob(self.path) and not os.path.exists(self.path):
            raise bad_value(self.name, f"one file in format {self.format!r} (a folder or a glob holds Parquet, CSV "
                            "or TSV files)", self.path)
        if not os.path.isfile(self.path):
            raise bad_value(self.name, "an existing file, folder or glob", self.path)
        if not os.access(self.path, os.R_OK):
            raise bad_value(self.name, "a file this user can read", self.path)

    # -- columns ---------------------------------------------------------------------------------------

    def require(self, flag: str, column: str, kinds: tuple[str, ...]) -> pa.DataType:
        """The Arrow type of ``column`` (the option ``flag`` names it), refused if missing (the files without it
        named) or not of ``kinds`` (``"string"``, ``"integer"``, ``"list"``)."""
        if self.format == "text" and flag != self.naming.text:
            raise bad_value(flag, "given with a table (Parquet, CSV, JSONL, datasets): a text file's lines have only "
                            "their position", column)
        if self.format == "text":
            if column != "text":
                raise bad_value(flag, "'text' with a text file (its lines are its one column)", column)
            return self.columns["text"]
        if column not in self.columns:
            lacking = [(f, names) for f, names in self.file_columns if column not in names]
            if not lacking or len(lacking) == len(self.file_columns):
                union = sorted({n for _, names in self.file_columns for n in names} or self.columns)
                raise bad_value(flag, f"a column of the input {union}", column)
            (file, names), more = lacking[0], len(lacking) - 1
            others = f", and {more} more files do" if more else ""
            raise bad_value(flag, f"a column of every file of the input ({file!r} lacks it{others}; its columns: "
                            f"{names})", column)
        twice = next(((f, names) for f, names in self.file_columns if names.count(column) > 1), None)
        if twice is not None:  # which of them is meant? pyarrow cannot pick one either
            raise bad_value(flag, f"a column named once in every file of the input ({twice[0]!r} has "
                            f"{twice[1].count(column)} named so; its columns: {twice[1]}): rename all but one", column)
        kind = self.columns[column]
        value = kind.value_type if pa.types.is_dictionary(kind) else kind  # pandas' categorical: its values count
        checks = {"string": is_text_type, "integer": pa.types.is_integer,
                  "list": lambda t: pa.types.is_list(t) or pa.types.is_large_list(t)}
        if not any(checks[k](value) for k in kinds):
            raise bad_value(flag, f"a column of {' or '.join(kinds)} values (the input's {column!r} holds {kind})",
                            column)
        return kind

    def texts(self, column: str, flag: str | None = None, *, chunk_size: int = SPILL_ROWS) -> TextSource:
        """The texts of ``column`` (the option ``flag`` names it; default: the naming's), read into one
        memory-mapped Arrow file ``chunk_size`` at a time where they are in files; a missing (null) text is
        refused."""
        flag = self.naming.text if flag is None else flag
        self.require(flag, column, ("string",))
        self._count()
        if self.lines is not None:
            source = self.lines
        elif self.dataset is not None:
            source = source_of(self.dataset, column=column)
        else:
            source = source_of(self.files or self.table, column=column, chunk_size=chunk_size)
        try:
            missing = source.bad()
        except ValueError as exc:  # bytes that are not UTF-8 in an Arrow file or a dataset, read in place: say where
            raise ValueError(f"{flag}={column!r} of {self.name}={self.path!r}: {exc}") from None
        if missing.size:
            raise ValueError(f"{flag} should name a column without missing texts, but got {flag}={column!r} with "
                             f"{missing.size} missing (null) texts, at rows {first_few(missing)}: fill or drop them")
        return source

    def _lines(self) -> Iterator[str]:
        # universal newlines: "\r\n" ends a line too; utf-8-sig: a byte order mark (Windows editors write one) is
        # no part of the first line's text, as pyarrow reads a CSV or JSONL file
        with io.TextIOWrapper(_bytes_of(self.path), encoding="utf-8-sig") as lines:
            for line in lines:
                yield line.removesuffix("\n")

    def column(self, column: str) -> pa.ChunkedArray:
        """One column, whole, as Arrow."""
        self._count()
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
                             f"{sorted(kinds)} in {self.name}={self.path!r}")
        return pa.chunked_array([chunk for part in parts for chunk in part.chunks], type=parts[0].type)

    def ids(self, column: str, flag: str | None = None) -> pa.Array:
        """The ids of ``column`` as one Arrow array (str or int64), each text's own (unique, none missing)."""
        flag = self.naming.ids if flag is None else flag
        self.require(flag, column, ("string", "integer"))
        rows = len(self)  # a CSV's rows are counted here, first: a file of no rows is the input's refusal, not the ids'
        try:
            return check_ids(self.column(column), rows)
        except ValueError as exc:
            raise ValueError(f"{flag}={column!r}: {exc}") from exc

    def values(self, column: str, flag: str) -> list:
        """One column as Python objects (one per row), for what a model call takes whole (chat conversations)."""
        self.require(flag, column, ("list",))
        return self.column(column).to_pylist()


def open_corpus(path: str | os.PathLike, fmt: str = "auto", *, exclude: str | None = None,
                keep: Collection[str] | None = None, naming: Naming = LIBRARY) -> Corpus:
    """Opens the corpus at ``path`` (a file, folder or glob) in format ``fmt`` (``auto``: told by the path's suffix).

    Args:
        path: the input.
        fmt: one of :data:`FORMATS`.
        exclude: a folder whose files a folder or glob input never reads (a job's output).
        keep: the columns the job reads; a CSV's others are not converted (``None``: all).
        naming: what the messages call the input, the format and the columns (default: :func:`read_texts`'s
            arguments).

    Raises:
        ValueError: the path does not exist, names no format, cannot be read in that format, or holds no rows.
    """
    if fmt not in FORMATS:
        raise bad_value(naming.format, f"one of {FORMATS}", fmt)
    path = os.fspath(path)
    exclude = None if exclude is None else os.fspath(exclude)
    if not _is_glob(path) and not os.path.exists(path):
        raise bad_value(naming.input, "an existing file, folder or glob", path)
    if _is_glob(path) and not glob.glob(path, recursive=True):
        raise bad_value(naming.input, "a glob matching at least one file", path)
    return Corpus(path, _format_of(path, exclude, naming) if fmt == "auto" else fmt, exclude=exclude, keep=keep,
                  naming=naming)


def read_texts(source: Any, column: str = "text", *, format: str = "auto",  # noqa: A002 (the CLI's --format)
               chunk_size: int = SPILL_ROWS) -> TextSource:
    """Texts from wherever they are, as a :class:`~dynabatch.data.text_source.TextSource` the loader streams from,
    never all as Python str: the texts the command line reads from the same input.

    Args:
        source: a path (a file, a folder, a glob such as ``"corpus/*.parquet"``) in any of :data:`FORMATS`, told
            by its suffix (or ``format``); a list of Parquet files (a list of str is one: texts go as an
            iterator); a ``datasets.Dataset`` (its ``column``, memory-mapped as ``datasets`` keeps it); a
            ``pyarrow.Table`` or pandas ``DataFrame`` (its ``column``) or string array; or any iterable of str (a
            generator, a file's lines), read ``chunk_size`` texts at a time. Files and iterables are written once
            into one Arrow file in a temporary directory, removed with the source.
        column: the text column of a file, table or dataset (a text file's lines are ``"text"``).
        format: one of :data:`FORMATS`, for a path (``"auto"``: its suffix says; never guessed from the contents).
        chunk_size: texts read in at a time (an iterable's held as Python objects, a Parquet file's decoded).

    Raises:
        TypeError: a source of none of these kinds, or a column that is not strings.
        ValueError: a missing file or column, a file of no known format or that cannot be read in it (the line
            of a JSONL or CSV file named), missing (null) texts in a file, or no texts at all.

    Example:
        >>> import tempfile, pathlib
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "docs.jsonl"
        >>> _ = path.write_text('{"text": "In the beginning"}\\n{"text": "God"}\\n')
        >>> read_texts(path).take([1, 0])
        ['God', 'In the beginning']
    """
    if isinstance(source, (str, os.PathLike)):
        return open_corpus(source, format, keep=[column]).texts(column, chunk_size=check_positive_int(
            "chunk_size", chunk_size))
    if format != "auto":
        raise bad_value("format", "'auto' for a source that is not a path (it is read as it is)", format)
    return source_of(source, column, chunk_size=chunk_size)
