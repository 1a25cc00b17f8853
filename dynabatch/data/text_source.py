"""Texts by position, for a corpus too large to hold as Python strings: :class:`TextSource` and :func:`source_of`.

A :class:`TextSource` is what the streaming loader reads texts from: their
character lengths (the cheap proxy that orders tokenization, longest first)
and the texts at given positions, one chunk at a time. It holds either a
Python list as it was given, or an Arrow string array: a ``datasets.Dataset``
column (memory-mapped from its cache files), a ``pyarrow`` array or table
column, or what :func:`source_of` writes from Parquet files or an iterable of
str into one Arrow IPC file and memory-maps, so the texts live in the page
cache, not in the Python heap: the pages a read touches are handed back after
it (``madvise``), so the process's resident memory does not grow with the
corpus as its texts are read.

Example:
    >>> from dynabatch.data.text_source import source_of
    >>> source = source_of(iter(["In the beginning", "God", None]))  # any iterable, read in chunks
    >>> len(source), source.char_lengths().tolist(), source.bad().tolist()
    (3, [16, 3, -1], [2])
    >>> source.take([1, 0])
    ['God', 'In the beginning']
"""

from __future__ import annotations

import glob
import itertools
import mmap
import os
import shutil
import sys
import tempfile
import unicodedata
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from dynabatch._malloc import trim
from dynabatch._validation import bad_type, bad_value, check_positive_int, first_few
from dynabatch.data.tokenization import (as_items, check_encodable, log_skipped, plain_text, split_bad_texts,
                                         validate_texts)

__all__ = ["DROPPABLE", "SPILL_ROWS", "TextSource", "check_on_bad_input", "is_text_source", "is_text_type",
           "open_texts", "parquet_paths", "source_of"]

SPILL_ROWS = 8192
"""Texts per Arrow record batch when an iterable or Parquet files are read in."""

DROPPABLE = r"[\p{C}\p{M}\p{Z}\x{FFFD}]"
"""The characters a tokenizer's normalizer may drop, as an RE2 class: the Unicode categories C (control, format such
as U+200B and U+FEFF, private use), M (combining marks: accents stripped) and Z (separators: every whitespace but
the ASCII controls, which are C), and U+FFFD. A text of these alone may tokenize to no token
(:meth:`TextSource.no_token_candidates`)."""


def _droppable(char: str) -> bool:
    """Whether ``char`` is of :data:`DROPPABLE`, by Python's Unicode tables: unassigned code points (Cn) are not, as
    RE2's class does not hold them, so a list and an Arrow array of the same texts have the same candidates."""
    category = unicodedata.category(char)
    return char == "\ufffd" or (category[0] in "CMZ" and category != "Cn")


def _check_utf8(strings: Any, where: str, first: int = 0) -> None:
    """Refuses (``ValueError``) an Arrow string array holding bytes that are not UTF-8, naming the first such row
    (``where``: what holds it; ``first``: the array's first row's number there).

    Arrow takes a Parquet, Arrow or ``datasets`` file's string bytes as they are; taking such a text raises Python's
    decode error, which names neither file nor row.
    """
    import pyarrow as pa

    try:
        strings.validate(full=True)
    except pa.ArrowInvalid:
        for row, raw in enumerate(strings.cast(pa.large_binary()).to_pylist()):  # the error path alone
            try:
                raw is None or raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(f"texts should be UTF-8 text, but got {where} holding bytes that are not UTF-8 at row "
                                 f"{first + row} ({exc.reason} at byte {exc.start}: {raw[:40]!r}): write it as UTF-8"
                                 ) from None
        raise


def is_text_type(kind: Any) -> bool:
    """Whether the Arrow type ``kind`` holds texts: ``string``, ``large_string``, ``string_view`` (polars' strings,
    in its Arrow files) or a dictionary of them (pandas' categorical, in its Parquet files); each is read as
    ``large_string``."""
    import pyarrow as pa

    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    is_view = getattr(pa.types, "is_string_view", None)  # pyarrow >= 16
    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or bool(is_view and is_view(kind))


def _is_arrow_strings(values: Any) -> bool:
    pa = sys.modules.get("pyarrow")
    if pa is None or not isinstance(values, (pa.Array, pa.ChunkedArray)):
        return False
    return is_text_type(values.type)


def _is_dataset(values: Any) -> bool:
    datasets = sys.modules.get("datasets")
    return datasets is not None and isinstance(values, datasets.Dataset)


def is_text_source(texts: Any) -> bool:
    """Whether the loader streams ``texts`` whatever their number: a :class:`TextSource`, an Arrow string
    array, a ``datasets.Dataset``, or an iterator (read once, in chunks)."""
    return (isinstance(texts, TextSource) or _is_arrow_strings(texts) or _is_dataset(texts)
            or (isinstance(texts, Iterable) and iter(texts) is texts))


class TextSource:
    """Texts by position: a Python list as given, or an Arrow ``string`` / ``large_string`` array.

    Args:
        texts: a list (or tuple, pandas Series, 1-D numpy array) of texts, or a
            ``pyarrow`` string ``Array`` / ``ChunkedArray``.

    Items that are not str (``None``, a pandas NaN; an Arrow null) are the
    source's :meth:`bad` positions; the loader raises or skips them.
    """

    def __init__(self, texts: Any) -> None:
        self._spill: str | None = None  # a directory this source owns (an iterable or Parquet files read in)
        self._map: mmap.mmap | None = None  # the memory map of the file it wrote, whose pages a read hands back
        self._chars: np.ndarray | None = None
        self._plain = False  # a list source of str only (not subclasses): taken as it is
        if _is_arrow_strings(texts):
            import pyarrow as pa

            self.arrow = texts if isinstance(texts, pa.ChunkedArray) else pa.chunked_array([texts])
            if not (pa.types.is_string(texts.type) or pa.types.is_large_string(texts.type)):
                self.arrow = self.arrow.cast(pa.large_string())  # a view or dictionary: Arrow's compute reads these
            self.items: list | None = None
            self.n = len(self.arrow)
            if not self.n:
                raise ValueError("texts should be a non-empty sequence of str, but got an empty Arrow array")
            self._starts = np.cumsum([0, *(len(c) for c in self.arrow.chunks)], dtype=np.int64)
        else:
            self.arrow = None
            self.items = as_items(texts)
            self.n = len(self.items)

    def __len__(self) -> int:
        return self.n

    def __repr__(self) -> str:
        kind = "list" if self.items is not None else f"Arrow {self.arrow.type}"
        return f"{type(self).__name__}(texts={self.n}, {kind})"

    def char_lengths(self) -> np.ndarray:
        """Every text's length in characters (``int64``, read once); ``-1`` where the item is not a str."""
        if self._chars is None:
            self._plain = self.items is not None and set(map(type, self.items)) == {str}
            if self._plain:  # the common case, at C speed
                self._chars = np.fromiter(map(len, self.items), dtype=np.int64, count=self.n)
            elif self.items is not None:
                self._chars = np.fromiter((len(t) if isinstance(t, str) else -1 for t in self.items),
                                          dtype=np.int64, count=self.n)
            else:
                import pyarrow.compute as pc

                for chunk, start in zip(self.arrow.chunks, self._starts):
                    _check_utf8(chunk, "the texts", int(start))
                lengths = pc.fill_null(pc.utf8_length(self.arrow), -1)
                self._chars = np.concatenate([c.to_numpy(zero_copy_only=False) for c in lengths.chunks]
                                             ).astype(np.int64)
            self._chars.flags.writeable = False
        return self._chars

    def bad(self) -> np.ndarray:
        """The ``int64`` positions of items that are not str."""
        return np.flatnonzero(self.char_lengths() < 0)

    def no_token_candidates(self) -> tuple[np.ndarray, list[str], np.ndarray]:
        """The texts a tokenizer may turn into no token: those of :data:`DROPPABLE` characters alone (or none), which
        a tokenizer's normalizer may strip to nothing (BERT's drops control, format, private-use, combining and
        separator characters and U+FFFD: a zero-width space alone is no token). ``(positions, distinct, which)``:
        their ``int64`` positions, the distinct such texts, and the index into ``distinct`` of each position's
        text. An Arrow source is read by Arrow's compute (RE2, no Python str per row).

        Example:
            >>> source = source_of(iter(["a", "", " ", "\u200b", None, "e\u0301", "\u200b"]))
            >>> positions, distinct, which = source.no_token_candidates()
            >>> positions.tolist(), distinct, which.tolist()
            ([1, 2, 3, 6], ['', ' ', '\u200b'], [0, 1, 2, 2])
        """
        if self.items is not None:  # Python objects already: one pass over them
            positions = np.flatnonzero([isinstance(t, str) and all(map(_droppable, t)) for t in self.items])
            texts = [plain_text(self.items[i]) for i in positions.tolist()]
            distinct = list(dict.fromkeys(texts))
            index = {text: k for k, text in enumerate(distinct)}
            return positions, distinct, np.array([index[t] for t in texts], dtype=np.int64)
        import pyarrow.compute as pc

        self.char_lengths()  # the bytes checked as UTF-8 first: Arrow's compute reads them as such
        mask = pc.fill_null(pc.match_substring_regex(self.arrow, f"^{DROPPABLE}*$"), False)
        found = self.arrow.filter(mask)
        distinct = pc.unique(found)
        which = pc.index_in(found, value_set=distinct)
        positions = np.flatnonzero(np.concatenate([c.to_numpy(zero_copy_only=False) for c in mask.chunks]))
        which = np.concatenate([np.zeros(0, dtype=np.int64)] + [c.to_numpy(zero_copy_only=False) for c in which.chunks])
        return positions.astype(np.int64), distinct.to_pylist(), which.astype(np.int64)

    def texts(self) -> list[str]:
        """Every text as a Python str, in input order (``""`` for an item that is not a str): a list source's own
        list when it holds only str."""
        if self.items is not None:
            return split_bad_texts(self.items)[0]
        return self.take(np.arange(self.n))

    def take(self, positions: Any) -> list:
        """The texts at ``positions`` (Python str; ``""`` for an item that is not a str), in that order."""
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        if self._plain:
            return list(map(self.items.__getitem__, pos.tolist()))
        if self.items is not None:
            items = self.items
            return [plain_text(items[i]) for i in pos.tolist()]
        import pyarrow as pa

        # Taken chunk by chunk: a ChunkedArray's own take concatenates every chunk first (the whole corpus, per call).
        out: list = [""] * len(pos)
        chunk = np.searchsorted(self._starts, pos, side="right") - 1
        for k in np.unique(chunk).tolist():
            where = np.flatnonzero(chunk == k)
            texts = self.arrow.chunk(k).take(pa.array(pos[where] - self._starts[k])).to_pylist()
            for i, text in zip(where.tolist(), texts):
                if text is not None:
                    out[i] = text
            if self._map is not None:
                # The pages read are the page cache's again, not this process's: after each record batch, since a
                # read maps the file's cached pages around it too (the kernel's fault-around, 64 KB), so scattered
                # rows of a whole file would map most of it, and resident memory would grow with the corpus.
                self._map.madvise(mmap.MADV_DONTNEED)
        return out

    def close(self) -> None:
        """Removes the Arrow file this source wrote (also done when it is garbage-collected)."""
        if self._spill is not None:
            self.arrow, self._map = None, None  # the map itself closes with the last Arrow buffer viewing it
            shutil.rmtree(self._spill, ignore_errors=True)
            self._spill = None


def check_on_bad_input(on_bad_input: Any) -> str:
    """``on_bad_input`` if it is ``"raise"`` or ``"skip"``; else a ``TypeError`` / ``ValueError``."""
    if not isinstance(on_bad_input, str):
        raise bad_type("on_bad_input", "'raise' or 'skip'", on_bad_input)
    if on_bad_input not in ("raise", "skip"):
        raise bad_value("on_bad_input", "'raise' or 'skip'", on_bad_input)
    return on_bad_input


def open_texts(texts: Any, on_bad_input: str = "raise", *, name: str = "texts") -> tuple[TextSource, np.ndarray]:
    """The loader's texts as a :class:`TextSource` and the ``int64`` positions of its bad inputs (items that are not
    str: ``None``, a pandas NaN, bytes; Arrow nulls): the one place that reads texts in and applies ``on_bad_input``.

    Args:
        texts: a list (or tuple, pandas Series, 1-D numpy array, other
            sequence) of str, or what :func:`source_of` reads (a ``datasets.Dataset``,
            an Arrow string array, an iterator, a :class:`TextSource`).
        on_bad_input: ``"raise"`` a ``TypeError`` naming how many bad inputs
            there are and the first ten positions, or ``"skip"`` them (logged).
        name: what an error about an iterable of no text calls ``texts`` (the caller's argument).

    Raises:
        TypeError: texts of no such kind, or bad inputs with ``on_bad_input="raise"``.
        ValueError: no texts, or a bad ``on_bad_input``.

    Example:
        >>> source, bad = open_texts(["a", None, "b"], on_bad_input="skip")
        >>> len(source), bad.tolist(), source.texts()
        (3, [1], ['a', '', 'b'])
    """
    check_on_bad_input(on_bad_input)
    source = source_of(texts, name=name) if is_text_source(texts) else TextSource(texts)
    bad = source.bad()
    if bad.size and on_bad_input == "raise":
        if source.items is not None:
            validate_texts(source.items)  # the one message for items that are not str
        raise TypeError(f"texts should hold only str, but got {bad.size} of {len(source)} missing (null) texts "
                        f"(positions {first_few(bad, 10)}): "
                        "clean them, or pass on_bad_input='skip' to skip them (their results are None)")
    log_skipped(bad, len(source), "texts that are not str")  # all of them, too: no batch runs, each is listed failed
    return source, bad


def _spill(batches: Iterable[Any], schema: Any, empty: str) -> TextSource:
    """Writes record batches of one ``text`` column to an Arrow IPC file in a new temporary directory and returns a
    :class:`TextSource` over it, memory-mapped (its character lengths read as the batches are written, so opening it
    touches no text); the directory goes with the source. ``empty``: the ``ValueError``'s message where the batches
    hold no text."""
    import pyarrow as pa
    import pyarrow.compute as pc

    folder = tempfile.mkdtemp(prefix="dynabatch-texts-")
    path = os.path.join(folder, "texts.arrow")
    chars = []
    with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
        for batch in batches:
            chars.append(pc.fill_null(pc.utf8_length(batch.column(0)), -1).to_numpy(zero_copy_only=False))
            writer.write_batch(batch)
            del batch
            trim()  # the batch's buffers: Arrow's allocator and the C heap keep them otherwise
    if not sum(map(len, chars)):
        shutil.rmtree(folder, ignore_errors=True)
        raise ValueError(empty)
    with open(path, "rb") as file:
        mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    table = pa.ipc.open_file(pa.py_buffer(mapped)).read_all()  # zero-copy: views of the map
    source = TextSource(table.column(0))
    source._spill, source._map = folder, mapped
    source._chars = np.concatenate(chars).astype(np.int64)
    source._chars.flags.writeable = False
    weakref.finalize(source, shutil.rmtree, folder, True)
    return source


def parquet_paths(source: Any) -> list[str] | None:
    """The Parquet files ``source`` names (a path, a directory, a glob, or a list of them); ``None`` if it names none."""
    names = [source] if isinstance(source, (str, os.PathLike)) else source
    if not isinstance(names, (list, tuple)) or not names or not all(isinstance(s, (str, os.PathLike)) for s in names):
        return None
    paths: list[str] = []
    for name in map(os.fspath, names):
        if os.path.isdir(name):
            paths.extend(sorted(glob.glob(os.path.join(name, "**", "*.parquet"), recursive=True)))
        elif any(c in name for c in "*?["):
            paths.extend(sorted(glob.glob(name, recursive=True)))
        elif os.path.isfile(name):
            paths.append(name)
        else:
            texts = "" if names is not source else " (a list of str names paths: texts go as iter(texts))"
            raise bad_value("source", f"existing Parquet files, directories of them, or globs{texts}", name)
    if not paths:
        raise bad_value("source", "paths that match at least one Parquet file", names)
    if bad := [p for p in paths if not p.endswith(".parquet")]:
        raise bad_value("source", "Parquet files (.parquet)", bad[:3])
    return paths


def source_of(source: Any, column: str = "text", *, chunk_size: int = SPILL_ROWS, name: str = "source") -> TextSource:
    """Texts in memory or in Parquet files, as a :class:`TextSource` the loader streams from, never all as Python
    str (:func:`dynabatch.read_texts` reads every format of files, through this for what they hold).

    Args:
        source: Parquet files (a path, a directory, a glob such as
            ``"corpus/*.parquet"``, or a list of them), read a row group at a
            time; a ``datasets.Dataset`` (its ``column``, memory-mapped as
            ``datasets`` keeps it); a ``pyarrow.Table`` or pandas ``DataFrame``
            (its ``column``) or string array; or any iterable of str (a generator, a file's lines),
            read ``chunk_size`` texts at a time. Files and iterables are
            written once into one Arrow file in a temporary directory, removed
            with the source.
        column: the text column of a file, table or dataset.
        chunk_size: texts read in at a time (an iterable's held as Python objects, a Parquet file's decoded).
        name: what the error about an iterable of no text calls it (the caller's argument).

    Raises:
        TypeError: a source of none of these kinds, or a column that is not strings.
        ValueError: a missing file or column, or no texts at all.
    """
    import pyarrow as pa

    if not isinstance(column, str):
        raise bad_type("column", "a str naming the text column", column)
    chunk_size = check_positive_int("chunk_size", chunk_size)
    if isinstance(source, TextSource):
        return source
    holder = None  # what holds the column: a dataset's (its feature named) or a table's
    if _is_dataset(source):
        if column not in source.column_names:
            raise bad_value("column", f"a column of the dataset {source.column_names}", column)
        holder = f"the dataset's column {column!r} holds {source.features[column]}, Arrow type"
        if getattr(source, "_indices", None) is not None:  # a select or shuffle view: its rows, in its order
            source = source.flatten_indices()
        source = source.data.table
    if "pandas" in sys.modules and isinstance(source, sys.modules["pandas"].DataFrame):  # iterated: its column names
        if column not in source.columns:
            raise bad_value("column", f"a column of the frame {list(source.columns)}", column)
        holder = f"the frame's column {column!r} holds Arrow type"
        try:
            source = pa.array(source[column], from_pandas=True)  # a NaN (pandas' missing value): a null, a bad input
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise bad_type("column", f"a column of str (the frame's {column!r}: {exc})", column) from None
    if isinstance(source, pa.Table):
        if column not in source.column_names:
            raise bad_value("column", f"a column of the table {source.column_names}", column)
        holder = holder or f"the table's column {column!r} holds Arrow type"
        source = source.column(column)
    if _is_arrow_strings(source):
        return TextSource(source)
    if holder is not None and not is_text_type(source.type):
        raise bad_type("column", f"a column of strings ({holder} {source.type})", column)
    if isinstance(source, (pa.Array, pa.ChunkedArray)):
        raise bad_type("source", f"an Arrow array of strings (it holds Arrow type {source.type})", source)
    paths = parquet_paths(source)
    if paths is not None:
        return _read_parquet(paths, column, chunk_size)
    if isinstance(source, (str, bytes, dict)) or not isinstance(source, Iterable):
        raise bad_type("source", "Parquet paths, a datasets.Dataset, a pyarrow Table or string array, or an "
                       "iterable of str", source)
    schema = pa.schema([("text", pa.large_string())])
    items = iter(source)

    def batches() -> Iterable[Any]:
        done = 0
        while chunk := list(itertools.islice(items, chunk_size)):
            bad = next((i for i, t in enumerate(chunk) if t is not None and not isinstance(t, str)), None)
            if bad is not None:
                raise bad_type(f"texts[{done + bad}]", "a str (or None, a bad input)", chunk[bad])
            try:
                array = pa.array(chunk, pa.large_string())
            except UnicodeEncodeError as exc:  # a lone surrogate: pyarrow names neither the text nor its position
                check_encodable(chunk, range(done, done + len(chunk)), exc, "pyarrow")
                raise
            done += len(chunk)
            yield pa.record_batch([array], schema=schema)

    # an iterator (a generator) yields its texts once: the one a loader was built from yields none the second time
    return _spill(batches(), schema, f"{name} should hold at least one text, but got an iterable that yielded none "
                  "(an iterator or generator yields its texts once: one read already yields nothing; make a new one, "
                  "or pass a list)")


def _read_parquet(paths: list[str], column: str, chunk_size: int) -> TextSource:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([("text", pa.large_string())])

    def batches() -> Iterable[Any]:
        for path in paths:
            file = pq.ParquetFile(path, pre_buffer=False)  # a row group's column read as it is decoded
            if column not in file.schema_arrow.names:
                raise bad_value("column", f"a column of {Path(path).name} {file.schema_arrow.names}", column)
            kind = file.schema_arrow.field(column).type
            if not is_text_type(kind):
                raise bad_type("column", f"a column of strings (in {Path(path).name} it is {kind})", column)
            row = 0
            for batch in file.iter_batches(batch_size=chunk_size, columns=[column], use_threads=False):
                _check_utf8(batch.column(0), f"{Path(path).name}'s column {column!r}", row)
                row += batch.num_rows
                yield pa.record_batch([batch.column(0).cast(pa.large_string())], schema=schema)

    return _spill(batches(), schema, "source should hold at least one text, but got none")
