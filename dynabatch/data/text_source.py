"""Texts by position, for a corpus too large to hold as Python strings: :class:`TextSource` and :func:`read_texts`.

A :class:`TextSource` is what the streaming loader reads texts from: their
character lengths (the cheap proxy that orders tokenization, longest first)
and the texts at given positions, one chunk at a time. It holds either a
Python list as it was given, or an Arrow string array: a ``datasets.Dataset``
column (memory-mapped from its cache files), a ``pyarrow`` array or table
column, or what :func:`read_texts` writes from Parquet files or an iterable of
str into one Arrow IPC file and memory-maps, so the texts live in the page
cache, not in the Python heap.

Example:
    >>> from dynabatch.data.text_source import read_texts
    >>> source = read_texts(iter(["In the beginning", "God", None]))  # any iterable, read in chunks
    >>> len(source), source.char_lengths().tolist(), source.bad().tolist()
    (3, [16, 3, -1], [2])
    >>> source.take([1, 0])
    ['God', 'In the beginning']
"""

from __future__ import annotations

import glob
import itertools
import os
import shutil
import sys
import tempfile
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from dynabatch._validation import bad_type, bad_value, check_positive_int
from dynabatch.data.tokenization import _as_items, plain_text

__all__ = ["TextSource", "is_text_source", "parquet_paths", "read_texts"]

_SPILL_ROWS = 65_536  # texts per Arrow record batch when an iterable or Parquet files are read in


def _is_arrow_strings(values: Any) -> bool:
    pa = sys.modules.get("pyarrow")
    if pa is None or not isinstance(values, (pa.Array, pa.ChunkedArray)):
        return False
    return pa.types.is_string(values.type) or pa.types.is_large_string(values.type)


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
        self._chars: np.ndarray | None = None
        if _is_arrow_strings(texts):
            import pyarrow as pa

            self.arrow = texts if isinstance(texts, pa.ChunkedArray) else pa.chunked_array([texts])
            self.items: list | None = None
            self.n = len(self.arrow)
            if not self.n:
                raise ValueError("texts should be a non-empty sequence of str, but got an empty Arrow array")
        else:
            self.arrow = None
            self.items = _as_items(texts)
            self.n = len(self.items)

    def __len__(self) -> int:
        return self.n

    def __repr__(self) -> str:
        kind = "list" if self.items is not None else f"Arrow {self.arrow.type}"
        return f"{type(self).__name__}(texts={self.n}, {kind})"

    def char_lengths(self) -> np.ndarray:
        """Every text's length in characters (``int64``, read once); ``-1`` where the item is not a str."""
        if self._chars is None:
            if self.items is not None:
                self._chars = np.fromiter((len(t) if isinstance(t, str) else -1 for t in self.items),
                                          dtype=np.int64, count=self.n)
            else:
                import pyarrow.compute as pc

                lengths = pc.fill_null(pc.utf8_length(self.arrow), -1)
                self._chars = np.concatenate([c.to_numpy(zero_copy_only=False) for c in lengths.chunks]
                                             ).astype(np.int64)
            self._chars.flags.writeable = False
        return self._chars

    def bad(self) -> np.ndarray:
        """The ``int64`` positions of items that are not str."""
        return np.flatnonzero(self.char_lengths() < 0)

    def take(self, positions: Any) -> list:
        """The texts at ``positions`` (Python str; ``""`` for an item that is not a str), in that order."""
        pos = np.asarray(positions, dtype=np.int64)
        if self.items is not None:
            items = self.items
            return [plain_text(items[i]) for i in pos.tolist()]
        import pyarrow as pa

        return ["" if t is None else t for t in self.arrow.take(pa.array(pos)).to_pylist()]

    def close(self) -> None:
        """Removes the Arrow file this source wrote (also done when it is garbage-collected)."""
        if self._spill is not None:
            self.arrow = None
            shutil.rmtree(self._spill, ignore_errors=True)
            self._spill = None


def _spill(batches: Iterable[Any], schema: Any) -> TextSource:
    """Writes record batches of one ``text`` column to an Arrow IPC file in a new temporary directory and returns a
    :class:`TextSource` over it, memory-mapped; the directory goes with the source."""
    import pyarrow as pa

    folder = tempfile.mkdtemp(prefix="dynabatch-texts-")
    path = os.path.join(folder, "texts.arrow")
    with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
        for batch in batches:
            writer.write_batch(batch)
    table = pa.ipc.open_file(pa.memory_map(path)).read_all()
    if not table.num_rows:
        shutil.rmtree(folder, ignore_errors=True)
        raise ValueError("source should hold at least one text, but got none")
    source = TextSource(table.column(0))
    source._spill = folder
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
            raise bad_value("source", "existing Parquet files, directories of them, or globs", name)
    if not paths:
        raise bad_value("source", "paths that match at least one Parquet file", names)
    if bad := [p for p in paths if not p.endswith(".parquet")]:
        raise bad_value("source", "Parquet files (.parquet)", bad[:3])
    return paths


def read_texts(source: Any, column: str = "text", *, chunk_size: int = _SPILL_ROWS) -> TextSource:
    """Texts from wherever they are, as a :class:`TextSource` the loader streams from, never all as Python str.

    Args:
        source: Parquet files (a path, a directory, a glob such as
            ``"corpus/*.parquet"``, or a list of them), read a row group at a
            time; a ``datasets.Dataset`` (its ``column``, memory-mapped as
            ``datasets`` keeps it); a ``pyarrow.Table`` (its ``column``) or
            string array; or any iterable of str (a generator, a file's lines),
            read ``chunk_size`` texts at a time. Files and iterables are
            written once into one Arrow file in a temporary directory, removed
            with the source.
        column: the text column of a file, table or dataset.
        chunk_size: texts held as Python objects at once while an iterable is read in.

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
    if _is_dataset(source):
        if column not in source.column_names:
            raise bad_value("column", f"a column of the dataset {source.column_names}", column)
        if getattr(source, "_indices", None) is not None:  # a select or shuffle view: its rows, in its order
            source = source.flatten_indices()
        source = source.data.table
    if isinstance(source, pa.Table):
        if column not in source.column_names:
            raise bad_value("column", f"a column of the table {source.column_names}", column)
        source = source.column(column)
    if _is_arrow_strings(source):
        return TextSource(source)
    if isinstance(source, (pa.Array, pa.ChunkedArray)):
        raise bad_type("source", "an Arrow array of strings", source)
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
            done += len(chunk)
            yield pa.record_batch([pa.array(chunk, pa.large_string())], schema=schema)

    return _spill(batches(), schema)


def _read_parquet(paths: list[str], column: str, chunk_size: int) -> TextSource:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([("text", pa.large_string())])

    def batches() -> Iterable[Any]:
        for path in paths:
            file = pq.ParquetFile(path)
            if column not in file.schema_arrow.names:
                raise bad_value("column", f"a column of {Path(path).name} {file.schema_arrow.names}", column)
            kind = file.schema_arrow.field(column).type
            if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
                raise bad_type("column", f"a column of strings (in {Path(path).name} it is {kind})", column)
            for batch in file.iter_batches(batch_size=chunk_size, columns=[column]):
                yield pa.record_batch([batch.column(0).cast(pa.large_string())], schema=schema)

    return _spill(batches(), schema)
