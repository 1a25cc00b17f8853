"""The input of a command-line job, as its options name it: the library's format layer (:mod:`dynabatch.data.corpus`)
with the flags in every message.

The formats, the suffixes that tell them and every refusal are the library's
(``dynabatch.read_texts`` reads what a command reads); a command opens its
``INPUT`` here, in ``--format``, never reading its own output folder, and its
messages name ``input``, ``--format``, ``--text-column`` and ``--id-column``.

Example:
    >>> import tempfile, pathlib
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "docs.jsonl"
    >>> _ = path.write_text('{"id": 7, "text": "In the beginning"}\\n')
    >>> open_corpus(str(path)).texts("body")
    Traceback (most recent call last):
    ...
    ValueError: --text-column should be a column of the input ['id', 'text'], but got --text-column='body'
"""

from __future__ import annotations

from collections.abc import Collection

from dynabatch.data.corpus import Corpus, Naming
from dynabatch.data.corpus import open_corpus as open_files

__all__ = ["NAMING", "open_corpus"]

NAMING = Naming(input="input", format="--format", text="--text-column", ids="--id-column",
               excluded="the output folder")
"""What a command's messages call its input, its format and its columns."""


def open_corpus(path: str, fmt: str = "auto", *, exclude: str | None = None,
                keep: Collection[str] | None = None) -> Corpus:
    """The corpus a command reads (:func:`dynabatch.data.corpus.open_corpus`), its messages naming the flags;
    ``exclude``: the job's output folder."""
    return open_files(path, fmt, exclude=exclude, keep=keep, naming=NAMING)
