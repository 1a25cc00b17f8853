"""The results store's files: how a shard is named, written whole and read back verified.

The names are ``docs/inference.md``'s ("Shards", "Merging", "Damage"); a shard being written or set aside has a
hidden name, so that ``pyarrow.dataset``, pandas and ``*.parquet`` globs read each row once at any time.

Example:
    >>> from dynabatch.inference.store_shards import covered, shard_name
    >>> shard_name("w", 3, 17), sorted(covered([shard_name("w", 3, 17), shard_name("w", 5), shard_name("v", 5)]))
    ('part-w-00003-00017.parquet', ['part-w-00005.parquet'])
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import re
import socket
import time
import zlib
from collections.abc import Collection
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

__all__ = ["CHECK", "FAILED", "FORMAT", "HOST", "MERGING", "META", "RETRY_SECONDS", "SET_ASIDE", "TEMPORARY",
           "WRITE_ATTEMPTS", "TornFooter", "checked_meta", "covered", "footer_check", "gone", "is_dead", "is_shard",
           "later_shard", "merged_name", "merging_name", "read_whole", "remove", "rename", "shard_name", "write_whole"]

logger = logging.getLogger(__name__)

FORMAT = "dynabatch.store/3"
META = b"dynabatch"  # the key of a shard's metadata: format, key, keying and the rows' structure
# The key of the CRC-32 of that metadata and the column names: Parquet's page checksums cover the pages, not the footer
# that holds them, so a flipped byte there would otherwise refuse the whole store (another key, a missing column) or
# fail to parse, where a damaged page sets its shard aside.
CHECK = b"dynabatch.crc32"
WRITE_ATTEMPTS = 5  # tries of a shard write that fails (a full disk, an I/O error) before the error is raised,
RETRY_SECONDS = 0.5  # the wait before the second, doubled before each later one (7.5 s in all)
FAILED = "_failed"  # the folder of failure records: readers of the store's folder (pyarrow.dataset) skip it
TEMPORARY = ".tmp-"  # a shard being written: .tmp-<host>-<pid>-<shard>.tmp, renamed into place once whole
# A merged shard while its parts are removed: .merge-<host>-<pid>-<shard>.merge, renamed into place after, so that a
# reader of the folder never reads a row both in its part and in the merged shard (it may miss them meanwhile).
MERGING = ".merge-"
SET_ASIDE = ".torn-"  # a shard that cannot be read: .torn-<shard>.torn, kept until its rows are stored again
HOST = socket.gethostname().replace("-", "_").replace(".", "_")
_SHARD = re.compile(r"part-(?P<writer>[\w.]+)-(?P<first>\d+)(?:-(?P<last>\d+))?\.parquet")  # -<last>: merged
_RUN = re.compile(r"\d{8}T\d{12}")  # the time a writer's run opened the store, first in its name
_LASTING = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.ENAMETOOLONG)


def shard_name(writer: str, first: int, last: int | None = None) -> str:
    """The file name of ``writer``'s shard ``first`` (merged up to ``last``)."""
    return f"part-{writer}-{first:05d}{'' if last is None or last == first else f'-{last:05d}'}.parquet"


class TornFooter(ValueError):
    """A shard's footer (its schema and metadata, which no page checksum covers) is damaged: set aside as torn."""


def footer_check(meta: bytes, names: list[str]) -> bytes:
    """The :data:`CHECK` value of a shard whose :data:`META` is ``meta`` and whose columns are ``names``."""
    return str(zlib.crc32(b"\0".join([meta, *(name.encode() for name in names)]))).encode()


def checked_meta(metadata: dict[bytes, bytes] | None, names: list[str]) -> bytes | None:
    """A shard's :data:`META` (``None``: a Parquet file dynabatch did not write), verified against its :data:`CHECK`
    where it has one (shards written before it have none); raises :class:`TornFooter` where they disagree."""
    metadata = metadata or {}
    meta, check = metadata.get(META), metadata.get(CHECK)
    if check is not None and (meta is None or footer_check(meta, names) != check):
        raise TornFooter(f"its footer fails its checksum ({CHECK.decode()})")
    return meta


def is_shard(name: str) -> bool:
    return name.startswith("part-") and name.endswith(".parquet")


def remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rename(file: str, name: str) -> None:
    """Renames ``file`` to ``name`` in its folder, the rename fsynced so that it survives a crash."""
    folder = os.path.dirname(file)
    os.replace(file, os.path.join(folder, name))
    _fsync(folder)


def gone(pid: int) -> bool:
    """Whether no process ``pid`` runs on this machine (another user's process runs)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    return False


def is_dead(name: str, prefix: str = TEMPORARY) -> bool:
    """Whether ``name`` is the temporary shard (``prefix``: or merged shard, :data:`MERGING`) of a killed writer on this
    host (``<prefix><host>-<pid>-...``)."""
    pid = name.split("-", 3)[2] if name.startswith(f"{prefix}{HOST}-") and name.count("-") >= 3 else ""
    return pid.isdigit() and gone(int(pid))


def merging_name(shard: str) -> str:
    """The hidden name of merged ``shard`` while this process removes its parts."""
    return f"{MERGING}{HOST}-{os.getpid()}-{shard}.merge"


def merged_name(name: str) -> str:
    """The shard name of a merged shard's hidden name (:func:`merging_name`)."""
    return name.split("-", 3)[3].removesuffix(".merge")


def later_shard(shard: str, names: Collection[str]) -> str | None:
    """A shard among ``names`` of a run that opened the store after ``shard``'s (``None``: none, or not known): its
    writer names start with the run's time (``Store.run``)."""
    match = _SHARD.fullmatch(shard)
    run = _RUN.match(match["writer"]) if match else None
    if run is None:
        return None
    return next((n for n in names if (m := _SHARD.fullmatch(n)) and (r := _RUN.match(m["writer"])) and
                 r[0] > run[0]), None)


def write_whole(folder: str, name: str, table: pa.Table, **options: Any) -> None:
    """Writes ``table`` as the Parquet file ``folder/name`` whole or not at all (a temporary file with page checksums,
    fsynced, renamed into place), trying a failed write :data:`WRITE_ATTEMPTS` times; ids dictionary-encoded."""
    temp, final = os.path.join(folder, f"{TEMPORARY}{HOST}-{os.getpid()}-{name}.tmp"), os.path.join(folder, name)
    dictionary = ["id"] if "id" in table.column_names else False
    for attempt in itertools.count(1):
        try:
            pq.write_table(table, temp, write_page_checksum=True, use_dictionary=dictionary, **options)
            _fsync(temp)
            rename(temp, name)
            return
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.remove(temp)
            if attempt == WRITE_ATTEMPTS or exc.errno in _LASTING:
                exc.add_note(f"writing {final} failed {attempt} times; its rows are kept by the writer")
                raise
            logger.warning("writing %s failed (%s); trying again (%d of %d)", final, exc, attempt + 1, WRITE_ATTEMPTS)
            time.sleep(RETRY_SECONDS * 2 ** (attempt - 1))


def read_whole(file: str, columns: list[str] | None = None) -> pa.Table:
    """A shard's table (or ``columns`` of it), every page's checksum verified."""
    return pq.ParquetFile(file, page_checksum_verification=True).read(columns=columns)


def covered(names: Collection[str]) -> set[str]:
    """Shards that a merged shard of the same writer holds (``part-w-00003-00017`` holds ``part-w-00005``): what a
    merge cut short left (a merged shard is renamed into place before its parts are removed). One sort: a span is
    covered when one starting no later reaches as far."""
    spans = sorted((match["writer"], int(match["first"]), -int(match["last"] or match["first"]), name)
                   for name in names if (match := _SHARD.fullmatch(name)))
    held, writer, reach = set(), None, -1
    for owner, first, last, name in spans:
        if owner != writer:
            writer, reach = owner, -1
        if -last <= reach:
            held.add(name)
        reach = max(reach, -last)
    return held
