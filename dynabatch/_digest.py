"""The one fingerprint: a short, process-independent digest of data and settings.

A sampler's saved state, a results file and a plan are identified by what they
were made from: arrays of lengths and positions, numbers, strings, and the
settings objects (constraints, budgets) of the library or of its users. The
digest must be the same in every process that holds the same data, so it
never reads a ``repr`` that may carry a memory address:

* arrays and tensors: their dtype, shape and bytes;
* ``None``, bools, integers, floats and strings: a tagged canonical text;
* lists, tuples and dicts: their items (dict keys sorted by their text);
* an object with a ``key()`` method (every dynabatch constraint and budget):
  what ``key()`` returns; so a user's constraint may say what identifies it;
* any other object: its class's module and qualified name and, recursively, the
  attributes in its ``__dict__`` (a plain settings object is identified by its
  settings, two instances with equal settings alike); a function or class by
  its module and qualified name (and a function's own attributes). Attributes
  whose names start with ``_`` (caches, internals) are left out.

:func:`row_hashes` is the same idea per row, vectorised: one 64-bit hash of
every row of a flat store of values (token ids and the tokenizer's extras,
each a flat array cut into rows by ``offsets``), with no Python loop over
rows. A results store records it per row, so a rerun tells a row computed
from these very inputs from a row of other inputs at the same position or id.

:class:`FileDigests` is the same idea for files: a digest of every byte of a
file (blake2b, the faster of hashlib's strong hashes where the CPU has no SHA
instructions; a large file's 64 MiB pieces hashed on several cores at once),
remembered between processes in a cache file under the file's path, size,
modification and change times, inode and device, as git's index does: a file
none of these changed is not read again. A model's identity
(:func:`dynabatch.cli.job.model_digest`) is made of them.

Example:
    >>> import numpy as np
    >>> fingerprint(np.arange(3), "x") == fingerprint(np.arange(3), "x")
    True
    >>> fingerprint(np.arange(3)) == fingerprint(np.arange(3, dtype=np.int32))
    False
    >>> class Rule:  # a user's constraint without key(): its settings identify it
    ...     def __init__(self, limit):
    ...         self.limit = limit
    >>> fingerprint(Rule(4)) == fingerprint(Rule(4)) != fingerprint(Rule(5))
    True
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import numbers
import os
import time
import types
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from dynabatch._background import Ahead

__all__ = ["FileDigests", "fingerprint", "row_hashes"]

logger = logging.getLogger(__name__)

_DEPTH = 8  # objects nested deeper are identified by their class only


def _update(digest: Any, part: Any, depth: int) -> None:
    if isinstance(part, np.ndarray) or type(part).__module__.startswith("torch") and hasattr(part, "numpy"):
        array = np.ascontiguousarray(part.detach().cpu().numpy() if not isinstance(part, np.ndarray) else part)
        digest.update(f"a{array.dtype.str}{array.shape}".encode())
        digest.update(array.tobytes())
    elif part is None or isinstance(part, (bool, np.bool_)):
        digest.update(f"b{part!s}".encode())
    elif isinstance(part, numbers.Integral):
        digest.update(f"i{int(part)}".encode())
    elif isinstance(part, numbers.Real):
        value = float(part)
        digest.update(f"f{value.hex() if math.isfinite(value) else value}".encode())
    elif isinstance(part, (str, bytes)):
        data = part.encode() if isinstance(part, str) else part
        digest.update(f"s{len(data)}:".encode())
        digest.update(data)
    elif isinstance(part, (list, tuple)):
        digest.update(f"l{len(part)}".encode())
        for item in part:
            _update(digest, item, depth + 1)
    elif isinstance(part, Mapping):
        items = sorted(part.items(), key=lambda kv: str(kv[0]))
        digest.update(f"d{len(items)}".encode())
        for k, v in items:
            _update(digest, str(k), depth + 1)
            _update(digest, v, depth + 1)
    else:
        cls = type(part)
        name = f"{getattr(part, '__module__', cls.__module__)}.{getattr(part, '__qualname__', cls.__qualname__)}"
        digest.update(f"o{name}".encode())
        key = None if isinstance(part, type) else getattr(part, "key", None)
        if callable(key) and not isinstance(part, types.FunctionType):
            _update(digest, key(), depth + 1)
        elif depth < _DEPTH and not isinstance(part, type) and hasattr(part, "__dict__"):
            _update(digest, {k: v for k, v in vars(part).items() if not k.startswith("_")}, depth + 1)
    digest.update(b"\x00")


def fingerprint(*parts: Any) -> str:
    """A 16-hex-digit sha256 digest of ``parts`` (see the module docs for what each kind contributes)."""
    digest = hashlib.sha256()
    for part in parts:
        _update(digest, part, 0)
    return digest.hexdigest()[:16]


_GOLDEN = 0x9E3779B97F4A7C15  # odd constants of splitmix64
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_CHUNK_VALUES = 1 << 20  # values hashed at once: bounds the temporary arrays (~30 MB)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on a uint64 array (multiplications wrap modulo 2**64)."""
    x = x ^ (x >> np.uint64(30))
    x *= np.uint64(_MIX1)
    x ^= x >> np.uint64(27)
    x *= np.uint64(_MIX2)
    x ^= x >> np.uint64(31)
    return x


def _as_words(values: np.ndarray) -> np.ndarray:
    """Values as uint64 words: integers by value (so int32 and int64 ids agree), others by their bits."""
    values = np.asarray(values)
    if values.dtype == bool or np.issubdtype(values.dtype, np.integer):
        return values.astype(np.int64, copy=False).view(np.uint64)
    if values.dtype.itemsize not in (1, 2, 4, 8):
        raise TypeError(f"row_hashes hashes integers or 1-, 2-, 4- or 8-byte values, but got dtype {values.dtype}")
    return values.view(f"u{values.dtype.itemsize}").astype(np.uint64)


def _stream_hashes(values: np.ndarray, offsets: np.ndarray, salt: int) -> np.ndarray:
    """One uint64 per row of one stream: the wrapped sum of each value mixed with its place in the row."""
    n = len(offsets) - 1
    out = np.empty(n, dtype=np.uint64)
    lengths = np.diff(offsets)
    salt64 = np.uint64(salt)
    start = 0
    while start < n:  # chunks of whole rows holding about _CHUNK_VALUES values
        stop = max(start + 1, int(np.searchsorted(offsets, offsets[start] + _CHUNK_VALUES, side="right")) - 1)
        stop = min(stop, n)
        lo, hi = int(offsets[start]), int(offsets[stop])
        rows = lengths[start:stop]
        place = np.arange(hi - lo, dtype=np.uint64) - np.repeat((offsets[start:stop] - lo).astype(np.uint64), rows)
        mixed = _mix64(_as_words(values[lo:hi]) ^ salt64 ^ (place * np.uint64(_GOLDEN)))
        sums = np.zeros(stop - start, dtype=np.uint64)
        filled = rows > 0
        if hi > lo:
            sums[filled] = np.add.reduceat(mixed, (offsets[start:stop] - lo)[filled])
        out[start:stop] = _mix64(sums ^ (rows.astype(np.uint64) * np.uint64(_MIX1)) ^ salt64)
        start = stop
    return out


def row_hashes(streams: Mapping[str, np.ndarray], offsets: np.ndarray) -> np.ndarray:
    """One 64-bit hash per row of flat value streams sharing ``offsets``: ``uint64`` of shape ``(n,)``.

    Row ``i`` of stream ``name`` is ``streams[name][offsets[i]:offsets[i + 1]]``.
    A row's hash depends on every stream's name, its values (integers by value,
    other dtypes by their bits), their order within the row and its length; not
    on the row's position or on other rows. Vectorised over all rows (chunks of
    about a million values), the same in every process.

    Example:
        >>> import numpy as np
        >>> ids = np.array([5, 6, 7, 5, 6, 7, 6, 5], dtype=np.int32)
        >>> h = row_hashes({"input_ids": ids}, np.array([0, 3, 6, 8]))
        >>> h.dtype, bool(h[0] == h[1]), bool(h[1] == h[2])  # rows [5 6 7], [5 6 7], [6 5]
        (dtype('uint64'), True, False)
        >>> bool(row_hashes({"input_ids": ids.astype(np.int64)}, np.array([0, 3, 6, 8]))[2] == h[2])
        True
    """
    offsets = np.asarray(offsets, dtype=np.int64)
    out = np.zeros(len(offsets) - 1, dtype=np.uint64)
    for name in sorted(streams):
        salt = int(fingerprint("row_hashes", name), 16)
        out = _mix64(out * np.uint64(_GOLDEN) + _stream_hashes(streams[name], offsets, salt))
    return out


_PIECE = 64 << 20  # a large file is hashed in pieces of this many bytes, several at once
_READ = 8 << 20  # bytes read at a time
_SETTLED_NS = 2_000_000_000  # a file modified this recently is hashed but not remembered (as git's "racily clean")
_CACHE_FORMAT = 1
_LOCK_WAIT = 900.0  # seconds a process waits for another hashing the same cache's files (15 GB on a slow node)
_CACHE_ENTRIES = 20_000  # at most this many files remembered; those whose path is gone are dropped first


def _piece_digest(path: str, start: int, stop: int) -> bytes:
    """The blake2b digest of bytes ``[start, stop)`` of the file at ``path``."""
    digest = hashlib.blake2b(digest_size=32)
    view = memoryview(bytearray(min(_READ, max(stop - start, 1))))
    with open(path, "rb", buffering=0) as f:
        f.seek(start)
        left = stop - start
        while left:
            n = f.readinto(view[:min(left, len(view))])
            if not n:
                raise OSError(f"{path!r} ended at byte {stop - left:,} while it was read (it was {stop:,} bytes)")
            digest.update(view[:n])
            left -= n
    return digest.digest()


def _piece_digests(path: str, size: int, cores: int) -> Iterator[bytes]:
    """The digests of the file's pieces, in order: up to ``cores`` threads hash every ``cores``-th piece each
    (hashlib lets go of the GIL while it hashes)."""
    starts = list(range(0, size, _PIECE)) or [0]
    lanes = [Ahead((_piece_digest(path, s, min(s + _PIECE, size)) for s in starts[lane::cores]), depth=2,
                   name=f"dynabatch-digest-{lane}") for lane in range(min(cores, len(starts)))]
    try:
        for i in range(len(starts)):
            yield lanes[i % len(lanes)].next()
    finally:
        for lane in lanes:
            lane.close()


def _stat_key(st: os.stat_result) -> list[int]:
    """What says a file is unchanged since it was hashed: size, modification and change times, inode, device."""
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


class FileDigests:
    """Digests of whole files (every byte), remembered in the JSON file ``cache`` (``None``: nothing remembered).

    A file whose size, modification and change times, inode and device are
    those remembered under its real path is not read again; any other is read
    in full. A file modified in the last 2 seconds is hashed but not
    remembered (a later write in the same clock tick could leave its times
    unchanged). A cache that cannot be read or parsed is ignored, one that
    cannot be written is left as it is: it only saves time.
    ``hashed_bytes`` counts the bytes read since this object was made.

    Example:
        >>> import pathlib, tempfile
        >>> folder = pathlib.Path(tempfile.mkdtemp())
        >>> _ = (folder / "weights.bin").write_bytes(b"0" * 1000)
        >>> files = FileDigests(folder / "cache.json")
        >>> first = files.digest(folder / "weights.bin")
        >>> _ = (folder / "weights.bin").write_bytes(b"0" * 999 + b"1")
        >>> first == files.digest(folder / "weights.bin"), len(first), files.hashed_bytes
        (False, 64, 2000)
    """

    def __init__(self, cache: str | os.PathLike | None, *, cores: int = 1) -> None:
        self.cache = None if cache is None else os.fspath(cache)
        self.cores = max(1, int(cores))
        self.hashed_bytes = 0
        self._entries = self._read(self.cache)
        self._changed = False

    @staticmethod
    def _read(cache: str | None) -> dict[str, list]:
        if cache is None:
            return {}
        try:
            with open(cache, encoding="utf-8") as f:
                data = json.load(f)
            entries = data["files"] if data.get("format") == _CACHE_FORMAT else {}
            return {k: v for k, v in entries.items() if isinstance(v, list) and len(v) == 6}
        except (OSError, ValueError, TypeError, AttributeError, KeyError) as exc:  # it only saves time
            if not isinstance(exc, FileNotFoundError):
                logger.info("file digest cache %s ignored: %s", cache, exc)
            return {}

    def digest(self, path: str | os.PathLike) -> str:
        """The 64-hex-digit digest of every byte of the file at ``path`` (its size too)."""
        real = os.path.realpath(path)
        st = os.stat(real)
        key = _stat_key(st)
        entry = self._entries.get(real)
        if entry is not None and entry[:5] == key:
            return entry[5]
        started = time.time_ns()
        combined = hashlib.blake2b(f"file {st.st_size} {_PIECE}:".encode(), digest_size=32)
        for piece in _piece_digests(real, st.st_size, self.cores):
            combined.update(piece)
        self.hashed_bytes += st.st_size
        digest = combined.hexdigest()
        if _stat_key(os.stat(real)) == key and st.st_mtime_ns < started - _SETTLED_NS:
            self._entries[real] = [*key, digest]
            self._changed = True
        return digest

    @contextlib.contextmanager
    def held(self) -> Iterator[FileDigests]:
        """The block's digests made by this process alone, then saved: it holds an exclusive lock on the cache
        (``cache + ".lock"``), so another process after the same files (a rank of the same ``torchrun`` job, a
        second job) waits, then finds them remembered rather than reading every byte again. Without a cache, where
        the lock cannot be taken, or after ``_LOCK_WAIT`` seconds of waiting (a holder stopped or stuck), the block
        runs unlocked: the cache only saves time."""
        lock = None
        if self.cache is not None:
            try:
                lock = self._locked(f"{self.cache}.lock")
                self._entries = {**self._read(self.cache), **self._entries}  # what the holder before remembered
            except (ImportError, OSError, TimeoutError) as exc:
                logger.warning("file digest cache %s not locked (%s): this process hashes the files itself",
                               self.cache, exc)
        try:
            yield self
            self.save()
        finally:
            if lock is not None:
                lock.close()  # releases the lock

    @staticmethod
    def _locked(path: str) -> Any:
        """``path`` opened and locked (exclusive), waiting at most ``_LOCK_WAIT`` seconds."""
        import fcntl

        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        lock = open(path, "a")  # noqa: SIM115 (held until the caller's block ends)
        deadline, told = time.monotonic() + _LOCK_WAIT, False
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return lock
            except BlockingIOError:
                if time.monotonic() > deadline:
                    lock.close()
                    raise TimeoutError(f"held by another process for {_LOCK_WAIT:.0f} s") from None
                if not told:
                    logger.info("waiting for another process hashing files into %s", path)
                    told = True
                time.sleep(0.1)
            except BaseException:
                lock.close()
                raise

    def save(self) -> None:
        """Writes the digests remembered to the cache file (with those another process wrote meanwhile)."""
        if self.cache is None or not self._changed:
            return
        entries = {**self._read(self.cache), **self._entries}
        if len(entries) > _CACHE_ENTRIES:
            entries = {k: v for k, v in entries.items() if os.path.exists(k)}
            entries = dict(list(entries.items())[-_CACHE_ENTRIES:])
        partial = f"{self.cache}.{os.getpid()}.tmp"
        try:
            os.makedirs(os.path.dirname(self.cache) or ".", exist_ok=True)
            with open(partial, "w", encoding="utf-8") as f:
                json.dump({"format": _CACHE_FORMAT, "files": entries}, f)
            os.replace(partial, self.cache)
            self._changed = False
        except OSError as exc:  # a read-only home: every run hashes again, nothing else changes
            logger.info("file digest cache %s not written: %s", self.cache, exc)
            with contextlib.suppress(OSError):
                os.remove(partial)
