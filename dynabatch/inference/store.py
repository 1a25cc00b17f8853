"""The results store of ``run(..., output_path=...)`` (the sink), and rows as Arrow columns (:class:`Columns`).

A directory of Parquet shards, one row per input: ``position``, ``id``, ``input_hash`` and the outputs on Arrow's own
types, the schema metadata saying format, key, keying and rows' structure. The rules (types fixed by the first shard,
checksums, shards set aside, inputs checked before a row is written) are in ``docs/inference.md``.

Example:
    >>> import tempfile
    >>> import numpy as np
    >>> import torch
    >>> from dynabatch.inference.store import open_store
    >>> path = tempfile.mkdtemp()
    >>> writer = open_store(path, key="demo", n=3).writer("rank0")
    >>> writer.write(np.array([2, 0]), [torch.ones(2), torch.zeros(2)], np.array([7, 9]))
    >>> writer.close()
    >>> again = open_store(path, key="demo", n=3)
    >>> again.done.tolist(), again.schema.field("output").type, again.located(3).where.tolist()
    ([True, False, True], FixedSizeListType(fixed_size_list<element: float>[2]), [1, -1, 0])
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from collections import namedtuple
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from dynabatch._malloc import trim
from dynabatch._validation import bad_value

__all__ = ["FORMAT", "RESERVED", "SHARD_BYTES", "SHARD_ROWS", "SHARD_SECONDS", "Columns", "Store", "StoreWriter",
           "open_store"]

logger = logging.getLogger(__name__)

FORMAT = "dynabatch.store/2"
SHARD_ROWS = 1_000_000  # a shard is committed once its buffer holds this many rows,
SHARD_BYTES = 16 * 2**20  # or this many bytes of Arrow data (the buffer and its Parquet encoding stay small),
SHARD_SECONDS = 60.0  # or rows that finished this long ago: a killed run loses about a minute of work at most
META = b"dynabatch"
_HOST = socket.gethostname().replace("-", "_").replace(".", "_")
RESERVED = ("position", "id", "input_hash")  # the store's own columns
_FAILED = ".failed-"  # a writer's failure records: the inputs that failed, and why
_SCALARS = {bool: pa.bool_(), int: pa.int64(), float: pa.float64(), str: pa.string()}
_NAMES = {str(t): kind.__name__ for kind, t in _SCALARS.items()}
_BF16 = {b"dynabatch.dtype": b"bfloat16"}
_KINDS = {"tensor": "a tensor", "ndarray": "a numpy array", "python": "a Python value"}
_STORABLE = "tensors, numpy arrays, int, float, bool, str or None, or tuples, lists or dicts (str keys) of those"


def _tree(value: Any, name: str, top: bool = True) -> Any:
    """A column's name, or ``[kind, [[key, node], ...]]`` for a dict, tuple or list holding tensors or containers."""
    if not isinstance(value, (tuple, Mapping)) and (type(value) is not list or all(
            v is None or type(v) in _SCALARS for v in value)):
        return name
    kind = "dict" if isinstance(value, Mapping) else "tuple" if isinstance(value, tuple) else "list"
    bad = next((key for key in value if not isinstance(key, str)), None) if kind == "dict" else None
    if bad is not None:
        raise TypeError(f"{name} keys should be str with output_path set (column names), but got key {bad!r} of "
                        f"type {type(bad).__name__}")
    items = value.items() if kind == "dict" else enumerate(value)
    return [kind, [[k, _tree(v, k if top and kind == "dict" else f"{name}_{k}", False)] for k, v in items]]


def _gather(node: Any, values: list, name: str, out: dict[str, list]) -> None:
    """Checks every row has the structure ``node`` and collects each column's values."""
    if isinstance(node, str):
        out[node] = values
        return
    kind, items = node
    keys = [key for key, _ in items]
    for value in values:
        if not (list(value) == keys if kind == "dict" and isinstance(value, Mapping) else kind != "dict" and
                isinstance(value, tuple if kind == "tuple" else list) and len(value) == len(keys)):
            want = f"a dict with keys {keys}" if kind == "dict" else f"a {kind} of {len(keys)} items"
            got = list(value) if isinstance(value, Mapping) else type(value).__name__ + (
                f" of {len(value)} items" if isinstance(value, (list, tuple)) else "")
            raise ValueError(f"{name} should be {want} in every row, as stored, but got {got}")
    for key, child in items:
        _gather(child, [value[key] for value in values], f"{name}[{key!r}]", out)


def _build(node: Any, get: Callable[[str], Any]) -> Any:
    """A row (or the stacked rows) of the structure ``node``, each column's value from ``get``."""
    if isinstance(node, str):
        return get(node)
    values = [_build(child, get) for _, child in node[1]]
    return dict(zip([k for k, _ in node[1]], values)) if node[0] == "dict" else \
        tuple(values) if node[0] == "tuple" else values


def _leaves(node: Any, path: tuple = ()) -> list[tuple[tuple, str]]:
    """``(path, column)`` of every column under ``node`` (a path: the dict keys and element indices to it)."""
    return [(path, node)] if isinstance(node, str) else \
        [leaf for key, child in node[1] for leaf in _leaves(child, (*path, key))]


def _layout(kind: pa.DataType) -> tuple[bool, list[int], pa.DataType]:
    """An array column's type as ``(first dimension varies, fixed dimensions, value type)``."""
    varies, dims = pa.types.is_list(kind), []
    kind = kind.value_type if varies else kind
    while pa.types.is_fixed_size_list(kind):
        dims.append(kind.list_size)
        kind = kind.value_type
    return varies, dims, kind


# One batch's values of one column. kind: tensor, ndarray, python or None (all None); arrays: the values of the rows
# with one (valid) joined on dimension 0, each row's lengths (None: 0-d rows), dtype, inner shape; python: Arrow.
_Part = namedtuple("_Part", "rows kind valid values lengths dtype inner", defaults=(None, None, None, None, "", None))


def _misfit(name: str, dtype: str, shape: tuple, got_dtype: str, got_shape: tuple, where: str) -> str:
    return (f"{name} should have dtype {dtype} and shape {str(tuple(shape)).replace(chr(39), '')} in every row, "
            f"{where} (n: any length), but got dtype {got_dtype} and shape {got_shape}")


def _part(values: list, name: str) -> _Part:
    """One batch's values of one column, checked and joined once (one ``torch.cat`` or ``pa.array``)."""
    present = [v for v in values if v is not None]
    if not present:
        return _Part(len(values))
    if isinstance(present[0], (torch.Tensor, np.ndarray, np.generic)):
        return _array_part(values, present, name)
    lists = [v for v in values if isinstance(v, list)]
    items = [x for v in lists for x in v] if lists else values
    bad = next((item for item in items if item is not None and type(item) not in _SCALARS), None)
    if bad is not None or 0 < len(lists) < len(present):
        raise TypeError(f"{name} should be storable in Arrow with output_path set ({_STORABLE}), but got {name} of "
                        f"type {type(bad if bad is not None else present[0]).__name__}")
    kinds = sorted({type(item).__name__ for item in items if item is not None})
    if len(kinds) > 1:  # Arrow would store 2.5 as 2 in an int column
        raise TypeError(f"{name} should be values of one type in every row with output_path set, but got {kinds}: "
                        "convert them (e.g. float(x))")
    kind = next((t for k, t in _SCALARS.items() if [k.__name__] == kinds), pa.null())
    try:
        return _Part(len(values), "python", values=pa.array(values, type=pa.list_(kind) if lists else kind))
    except (pa.ArrowInvalid, OverflowError) as exc:
        raise TypeError(f"{name} should be storable in Arrow with output_path set, but got {exc}") from exc


def _array_part(values: list, present: list, name: str) -> _Part:
    tensor = isinstance(present[0], torch.Tensor)
    bad = next((v for v in present if isinstance(v, torch.Tensor) != tensor
                or not isinstance(v, (torch.Tensor, np.ndarray, np.generic))), None)
    if bad is not None:
        raise TypeError(f"{name} should be {_KINDS['tensor' if tensor else 'ndarray']} or None in every row, as in "
                        f"its first row, but got {type(bad).__name__}")
    arrays = present if tensor else [np.asarray(v) for v in present]
    dtype, shape = str(arrays[0].dtype).removeprefix("torch."), tuple(arrays[0].shape)
    if (arrays[0].dtype.is_complex if tensor else arrays[0].dtype.kind not in "biuf") or dtype.startswith("float8"):
        raise TypeError(f"{name} should be storable in Arrow with output_path set (numbers or bools), but got {name} "
                        f"of dtype {dtype}")
    for a in arrays:
        if a.dtype != arrays[0].dtype or a.ndim != len(shape) or tuple(a.shape[1:]) != shape[1:]:
            raise ValueError(_misfit(name, dtype, ("n", *shape[1:]) if shape else (),
                                     str(a.dtype).removeprefix("torch."), tuple(a.shape), "in the same batch"))
    if tensor:
        joined = (torch.cat(arrays) if shape else torch.stack(arrays)).detach().cpu()
        joined = (joined.float() if joined.dtype == torch.bfloat16 else joined).contiguous().numpy()
    else:
        joined = np.concatenate(arrays) if shape else np.stack(arrays)
    lengths = np.fromiter((a.shape[0] for a in arrays), np.int64, len(arrays)) if shape else None
    valid = np.array([v is not None for v in values]) if len(present) < len(values) else None
    kind = "tensor" if tensor else "ndarray"
    return _Part(len(values), kind, valid, joined, lengths, dtype, shape[1:] if shape else None)


def _conform(part: _Part, field: pa.Field, kind: str | None, name: str) -> None:
    """Refuses a part that the column's type (``field``, ``kind``) cannot hold, naming what is stored."""
    if part.kind is None:
        return
    if pa.types.is_null(field.type):
        raise ValueError(f"{name} should be None in every row, as stored: its type was fixed as Arrow null by the "
                         f"first shard stored, where it was None in every row, but got {part.kind} values; return a "
                         "value of its type where it may be empty (NaN, an empty tensor, ''), or use another "
                         "output_path")
    if part.kind != kind:
        raise TypeError(f"{name} should be {_KINDS[kind]} or None in every row, as stored, but got {_KINDS[part.kind]}")
    if kind == "python":
        if part.values.type not in (field.type, pa.null(), pa.list_(pa.null())):
            raise TypeError(f"{name} should be values of one type in every row with output_path set ("
                            f"{_NAMES.get(str(field.type), field.type)}, as stored), but got "
                            f"['{_NAMES.get(str(part.values.type), part.values.type)}']: convert them (e.g. float(x))")
        return
    varies, dims, value = _layout(field.type)
    dtype = "bfloat16" if field.metadata == _BF16 else str(np.dtype(value.to_pandas_dtype()))
    lengths = part.lengths if part.lengths is not None else np.zeros(0, np.int64)
    wrong = np.flatnonzero(lengths != dims[0]) if dims and not varies else []
    if part.dtype != dtype or part.inner != (tuple(dims[not varies:]) if dims or varies else None) or len(wrong):
        row = (int(lengths[wrong[0] if len(wrong) else 0]), *part.inner) if part.inner is not None else ()
        raise ValueError(_misfit(name, dtype, ("n", *dims) if varies else dims, part.dtype, row, "as stored") + (
            "; a float vector is stored with a fixed length when it has one length in every row of the first shard, "
            "unless declared varying (a per-token output)" if len(wrong) else ""))


def _array(parts: list[_Part], field: pa.Field, kind: str | None) -> pa.Array:
    """One Arrow array of ``field``'s type from the parts of one or more batches; rows without a value are nulls."""
    filled = [p for p in parts if p.kind is not None]
    if kind in (None, "python") or not filled or pa.types.is_null(field.type):
        arrays = [pa.nulls(p.rows, field.type) if p.kind is None else p.values.cast(field.type) for p in parts]
        return pa.concat_arrays(arrays) if arrays else pa.nulls(0, field.type)
    varies, dims, value = _layout(field.type)
    array = pa.array(np.concatenate([p.values for p in filled]).reshape(-1), type=value)
    for size in reversed(dims):
        array = pa.FixedSizeListArray.from_arrays(array, size)
    if varies:
        offsets = np.concatenate([[0], np.cumsum(np.concatenate([p.lengths for p in filled]))])
        array = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), array)
    valid = np.concatenate([np.full(p.rows, p.kind is not None) if p.valid is None else p.valid for p in parts])
    return array if valid.all() else array.take(pa.array(np.cumsum(valid) - 1, mask=~valid))  # nulls between


def _flat(array: pa.Array, field: pa.Field) -> tuple[np.ndarray, np.ndarray | None]:
    """An array column without nulls as numpy ``(rows, *dims)``, or ``(total, *inner)`` with each row's length."""
    varies, dims, _ = _layout(field.type)
    lengths = pc.list_value_length(array).to_numpy(zero_copy_only=False).astype(np.int64) if varies else None
    for _ in range(len(dims) + varies):
        array = array.flatten()
    values = array.to_numpy(zero_copy_only=False)
    return values.reshape(-1, *dims) if dims else values, lengths


def _tensor(values: np.ndarray, field: pa.Field) -> torch.Tensor:
    tensor = torch.from_numpy(np.array(values, copy=True))
    return tensor.to(torch.bfloat16) if field.metadata == _BF16 else tensor


def _column_rows(array: pa.Array, field: pa.Field, kind: str | None) -> list:
    """A column's rows as ``run`` gave them (tensors in compact storage of their own); a null as ``None``."""
    if kind in (None, "python"):
        return array.to_pylist()
    valid = array.is_valid().to_numpy(zero_copy_only=False)
    values, lengths = _flat(array.filter(valid) if not valid.all() else array, field)
    if kind == "tensor":
        whole = _tensor(values, field)
        rows = [part.clone() for part in (whole.split(lengths.tolist()) if lengths is not None else whole.unbind(0))]
    elif lengths is not None:
        rows = [np.array(part) for part in np.split(values, np.cumsum(lengths)[:-1])] if len(lengths) else []
    else:
        rows = list(values) if values.ndim == 1 else [np.array(v) for v in values]
    rows = iter(rows)
    return [next(rows) if ok else None for ok in valid.tolist()]


def _stacked(array: pa.Array, field: pa.Field, kind: str | None, name: str, as_tensor: bool) -> Any:
    if array.null_count:
        raise ValueError(f"{name} should have a value in every row to stack, but got None in {array.null_count} "
                         "rows; read rows one by one or use to_arrow()")
    if kind not in (None, "python"):
        values, lengths = _flat(array, field)
    elif pa.types.is_list(field.type):
        values = array.flatten().to_numpy(zero_copy_only=False)
        lengths = pc.list_value_length(array).to_numpy(zero_copy_only=False)
    else:
        values, lengths = array.to_numpy(zero_copy_only=False), None
    if lengths is not None and len(lengths) and (lengths != lengths[0]).any():
        raise ValueError(f"{name} should have rows of one shape to stack, but got first dimensions from "
                         f"{int(lengths.min())} to {int(lengths.max())} (rows of different lengths); read rows one "
                         "by one or use to_arrow()")
    if lengths is not None:
        values = values.reshape(len(array), int(lengths[0]) if len(lengths) else 0, *values.shape[1:])
    return _tensor(values, field) if as_tensor else values


class Columns:
    """How rows map to Arrow columns: their structure ``tree`` and each column's kind once it had a value."""

    def __init__(self, tree: Any, kinds: dict[str, str] | None = None) -> None:
        self.tree, self.kinds = tree, dict(kinds or {})
        self.names = [name for _, name in _leaves(tree)]

    @classmethod
    def of(cls, row: Any) -> Columns:
        """The columns of rows shaped like ``row`` (named as ``docs/inference.md`` says)."""
        columns = cls(_tree(row, "output"))
        for name in set(columns.names) & set(RESERVED):
            raise ValueError(f"fn(batch) should not name a result {name!r} with output_path set (the store's own "
                             f"columns are {list(RESERVED)}), but got a column {name!r}; rename it")
        if len(set(columns.names)) != len(columns.names):
            raise ValueError(f"fn(batch) rows should give distinct column names, but got {columns.names}; rename them")
        return columns

    def parts(self, rows: Sequence[Any]) -> dict[str, _Part]:
        """Each column's values of ``rows``, checked (``ValueError`` / ``TypeError`` naming the column)."""
        values: dict[str, list] = {}
        _gather(self.tree, list(rows), "output", values)
        parts = {name: _part(values[name], name) for name in self.names}
        for name, part in parts.items():
            if part.kind is not None:
                self.kinds.setdefault(name, part.kind)  # a tensor, numpy or Python column: its first value's kind
        return parts

    def fields(self, parts: Sequence[dict[str, _Part]], varying: Collection[str] = (),
               stored: pa.Schema | None = None) -> list[pa.Field]:
        """Each column's field, ``stored``'s or fixed by ``parts`` (``varying``: columns whose rows vary in length)."""
        fields = []
        for name in self.names:
            column = [p[name] for p in parts]
            fields.append(stored.field(name) if stored is not None else self._decide(name, column, name in varying))
            for part in column:
                _conform(part, fields[-1], self.kinds.get(name), name)
        return fields

    def _decide(self, name: str, parts: list[_Part], varying: bool) -> pa.Field:
        """The field of ``parts``: see ``docs/inference.md`` for when a first dimension is fixed or a list."""
        known = [p for p in parts if p.kind is not None]
        if not known or known[0].kind == "python":
            kinds = {p.values.type for p in known} - {pa.null(), pa.list_(pa.null())}
            return pa.field(name, kinds.pop() if len(kinds) == 1 else known[0].values.type if known else pa.null())
        first = known[0]
        kind = pa.float32() if first.dtype == "bfloat16" else pa.from_numpy_dtype(np.dtype(first.dtype))
        for size in reversed(first.inner or ()):
            kind = pa.list_(kind, size)
        if first.inner is not None:
            lengths = np.concatenate([p.lengths for p in known])
            fixed = pa.types.is_floating(kind) and not (varying or (lengths != lengths[0]).any())
            kind = pa.list_(kind, int(lengths[0])) if fixed else pa.list_(kind)
        return pa.field(name, kind, metadata=_BF16 if first.dtype == "bfloat16" else None)

    def table(self, parts: Sequence[dict[str, _Part]], fields: list[pa.Field] | None = None) -> pa.Table:
        """The parts of one or more batches as one table (``fields``: from :meth:`fields`; ``None``: fixed by them)."""
        fields = self.fields(parts) if fields is None else fields
        arrays = [_array([p[f.name] for p in parts], f, self.kinds.get(f.name)) for f in fields]
        return pa.Table.from_arrays(arrays, schema=pa.schema(fields))

    def rows(self, table: pa.Table) -> list:
        """Rows back from a table of these columns, as ``run`` gave them."""
        decoded = {name: _column_rows(table.column(name).combine_chunks(), table.schema.field(name),
                                      self.kinds.get(name)) for name in self.names}
        return [_build(self.tree, lambda name: decoded[name][i]) for i in range(table.num_rows)]

    def stack(self, table: pa.Table, *, as_tensor: bool) -> Any:
        """Every row stacked: one array (or tensor) per column, in the rows' structure."""
        return _build(self.tree, lambda name: _stacked(table.column(name).combine_chunks(), table.schema.field(name),
                                                       self.kinds.get(name), name, as_tensor))


def _key(key: str | None) -> str:
    return "no key" if key is None else f"key={key!r}"


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _dead(name: str) -> bool:
    """Whether ``name`` is the temporary shard of a killed writer on this host (``.tmp-<host>-<pid>-<shard>``)."""
    pid = name.split("-", 3)[2] if name.startswith(f".tmp-{_HOST}-") and name.count("-") >= 3 else ""
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, ValueError):  # alive (another user's), or not a temporary shard
        pass
    return False


Located = namedtuple("Located", "path files counts where columns schema ids")


class Store:
    """A results store opened for a run over ``n`` inputs (``None``: as the stored positions say), keyed by position
    or by ``ids``; ``keyed_by="id"`` without ids: the inputs are the ids stored (Ray's map_texts checks each
    window's). ``verify``: every shard read whole, checksums verified. ``done``: which inputs the store holds;
    ``columns``,
    ``schema``: the rows' :class:`Columns` and Arrow fields; ``files``: the shards, in the order rows are numbered."""

    def __init__(self, path: Any, *, key: str | None, n: int | None = None, ids: pa.Array | None = None,
                 keyed_by: str | None = None, verify: bool = True, job: str | None = None) -> None:
        path = os.fspath(path)
        if os.path.exists(path) and not os.path.isdir(path):  # a socket, a device
            raise bad_value("output_path", "a directory (a Parquet results store)", path)
        os.makedirs(path, exist_ok=True)
        self.path, self.key, self.ids, self.job = path, key, ids, job
        self.keyed_by = keyed_by or ("position" if ids is None else "id")
        self._stored_ids = ids is None and self.keyed_by == "id"  # the inputs are the ids stored
        self.run = f"{time.strftime('%Y%m%dT%H%M%S')}_{uuid.uuid4().hex[:8]}"  # in this open's shard names
        self.columns, self.schema, self._shard_schema = None, None, None
        self.files, self._keys, self._hashes = [], [], []
        self._lock = threading.Lock()
        self._scan(verify)
        self.ids, self.where, self._stored_hash = self._locate(n)
        self.n, self.done = len(self.where), self.where >= 0
        self._checked = np.full(self.n, self._stored_ids)
        # Inputs not known up front (n=None: an iterable of batches) are checked batch by batch as they are built.
        self._unchecked = 0 if self._stored_ids or n is None else int(self.done.sum())

    def _scan(self, verify: bool) -> None:
        """Indexes the shards not seen yet; removes killed writers' temporary files; sets aside unreadable shards."""
        names = sorted(os.listdir(self.path))
        foreign = [n for n in names if not (n.startswith("part-") and n.endswith(".parquet")
                                            or n.startswith((".tmp-", ".torn-", _FAILED)))]
        if foreign:
            raise ValueError(f"output_path should be a new or empty directory, or a dynabatch results store, but got "
                             f"output_path={self.path!r} holding {len(foreign)} other entries "
                             f"({', '.join(foreign[:5])}); use another directory")
        for name in names:
            file = os.path.join(self.path, name)
            if _dead(name):
                logger.warning("output_path=%r: removing %s, a shard a killed run did not finish", self.path, name)
                with contextlib.suppress(FileNotFoundError):
                    os.remove(file)
            if not name.startswith("part-") or file in self.files:
                continue
            try:
                schema = pq.read_schema(file)
                meta = self._check(schema, name)
                table = pq.ParquetFile(file, page_checksum_verification=True).read(
                    columns=None if verify else [self.keyed_by, "input_hash"])
            except (OSError, pa.ArrowException) as exc:  # torn, or a page failing its checksum
                logger.warning("output_path=%r: %s cannot be read (%s); moving it to .torn-%s, its rows run again",
                               self.path, name, str(exc).splitlines()[0][:120], name)
                with contextlib.suppress(FileNotFoundError):  # set aside by another process meanwhile
                    os.replace(file, os.path.join(self.path, ".torn-" + name))
                continue
            self.columns = self.columns or Columns(meta["tree"], meta["kinds"])
            self.columns.kinds = {**meta["kinds"], **self.columns.kinds}
            schema = schema.remove_metadata()
            if self._shard_schema is not None and schema != self._shard_schema:  # first shards of writers that raced
                schema = pa.unify_schemas([self._shard_schema, schema], promote_options="permissive")
                logger.warning("output_path=%r: shards of other column types; reading them as %s", self.path, schema)
            self._shard_schema, self.schema = schema, pa.schema([schema.field(c) for c in self.columns.names])
            self.files.append(file)
            self._keys.append(table.column(self.keyed_by).combine_chunks())
            self._hashes.append(table.column("input_hash").to_numpy())
            del table
        trim()  # the shards read (verified whole on a resume) are freed: memory stays flat

    def _check(self, schema: pa.Schema, name: str) -> dict:
        """A shard's metadata; refuses a Parquet file dynabatch did not write, or another format, key or keying."""
        meta = json.loads((schema.metadata or {}).get(META, b"null"))
        if meta is None:
            raise ValueError(f"output_path should be a dynabatch results store, but got output_path={self.path!r} "
                             f"holding {name}, a Parquet file dynabatch did not write; use another directory")
        if meta["format"] != FORMAT:
            raise ValueError(f"output_path={self.path!r} should hold results in dynabatch's format {FORMAT!r}, but got "
                             f"{meta['format']!r}: read it with the dynabatch that wrote it, or use a new directory")
        if meta["key"] != self.key:
            raise ValueError(f"key should be the key the results at output_path={self.path!r} were stored with "
                             f"({_key(meta['key'])}) to resume them, but got {_key(self.key)}: pass that key if the "
                             "model and settings are the same, or another output_path for another model or settings")
        if meta["keyed_by"] != self.keyed_by:
            rule = "given (the store keys rows by id)" if meta["keyed_by"] == "id" else \
                "None (the store keys rows by position)"
            raise ValueError(f"the loader's ids should be {rule}, as for the results at output_path={self.path!r}, "
                             f"but got rows keyed by {self.keyed_by}: use the same ids, or another output_path")
        return meta

    def _locate(self, n: int | None) -> tuple[pa.Array | None, np.ndarray, np.ndarray]:
        """The run's ids, each input's row among every shard's rows in file order (``-1``: none) and its hash."""
        keys = pa.chunked_array(self._keys, type=self._keys[0].type if self._keys else pa.int64()).combine_chunks()
        ids = (pc.unique(keys) if len(keys) else pa.array([], pa.string())) if self._stored_ids else self.ids
        if ids is not None and len(keys) and keys.type != ids.type:
            raise ValueError(f"the loader's ids should be of type {keys.type}, as the ids of the results at "
                             f"output_path={self.path!r}, but got ids of type {ids.type}: use the same ids")
        target = keys.to_numpy() if ids is None else np.zeros(0) if not len(keys) else \
            pc.fill_null(pc.index_in(keys, value_set=ids), -1).to_numpy()  # through Arrow, no dict per row
        target = np.asarray(target, dtype=np.int64)
        n = len(ids) if ids is not None else n if n is not None else int(target.max()) + 1 if target.size else 0
        inside = np.flatnonzero((target >= 0) & (target < n))
        if inside.size < target.size:
            logger.info("output_path=%r: %d stored rows are not inputs of this run", self.path,
                        target.size - inside.size)
        unique, at = np.unique(target[inside], return_index=True)  # one stored row per input: the first found
        if unique.size < inside.size:
            logger.warning("output_path=%r: %d inputs are stored more than once; reading the first copy", self.path,
                           inside.size - unique.size)
        where, stored_hash = np.full(n, -1, dtype=np.int64), np.zeros(n, dtype=np.uint64)
        where[unique] = inside[at]
        stored_hash[unique] = np.concatenate(self._hashes)[inside[at]] if unique.size else 0
        return ids, where, stored_hash

    def check_inputs(self, positions: np.ndarray, hashes: np.ndarray) -> None:
        """Refuses stored rows whose input hash differs from this run's inputs (``hashes``) at ``positions``: a
        ``ValueError`` naming how many, the first positions (or ids), the key and what to do."""
        positions = np.asarray(positions, dtype=np.int64)
        inside = positions < self.n
        positions, hashes = positions[inside], np.asarray(hashes, dtype=np.uint64)[inside]
        stored = self.done[positions]
        differ = np.sort(positions[stored & (self._stored_hash[positions] != hashes)])
        if not differ.size:
            fresh = np.unique(positions[stored & ~self._checked[positions]])
            self._checked[fresh] = True
            self._unchecked -= fresh.size
            return
        what = "ids" if self.ids is not None else "positions"
        shown = self.ids.take(pa.array(differ[:5])).to_pylist() if self.ids is not None else differ[:5].tolist()
        shown = ", ".join(map(str, shown)) + ", ..." * (differ.size > 5)
        raise ValueError(
            f"output_path={self.path!r} should hold results of these inputs at their {what}, but got {differ.size} "
            f"stored rows computed from other inputs ({what} {shown}): the texts, their order, the tokenizer or "
            f"its settings differ from the run that stored them ({_key(self.key)}); use another output_path"
            + ("" if self.ids is not None else ", or give the loader ids= to key rows by id (a grown or reordered "
               "corpus)"))

    def writer(self, name: Any, *, ids: pa.Array | None = None, exact: bool = False) -> StoreWriter:
        """A :class:`StoreWriter` (``name``: unique per writer of this run). ``ids``: the rows' ids, which positions
        index (``position`` is -1). ``exact``: shards named ``part-<name>-<seq>``, so that a rewrite replaces them."""
        name = re.sub(r"[^\w.]", "_", str(name))
        return StoreWriter(self, name if exact else f"{self.run}_{name}", ids)

    def _fix(self, row: Any, parts: list[dict] | None = None, varying: Collection[str] = ()) -> Any:
        """The store's columns for rows like ``row``; with a writer's buffered ``parts``, their fields: fixed by them
        when no shard is stored yet (after looking for another process's first shard), else checked."""
        with self._lock:
            self.columns = self.columns or Columns.of(row)
            if parts is not None and self.schema is None:
                self._scan(verify=False)
            if parts is not None and self.schema is None:
                self.schema = pa.schema(self.columns.fields(parts, varying))
                return list(self.schema)
        return self.columns if parts is None else self.columns.fields(parts, stored=self.schema)

    def failures(self) -> dict[int, str]:
        """The inputs of this run that failed (failure records of any writer, the latest first) and are not stored
        since: position -> cause."""
        with self._lock:
            self._scan(verify=False)
            _, where, _ = self._locate(None)
        out: dict[int, str] = {}
        for name in sorted(n for n in os.listdir(self.path) if n.startswith(_FAILED)):
            with open(os.path.join(self.path, name), encoding="utf-8") as f:
                record = json.load(f)
            keys = np.asarray(record["keys"])
            if self.ids is not None:
                positions = pc.fill_null(pc.index_in(pa.array(record["keys"], self.ids.type), value_set=self.ids),
                                         -1).to_numpy()
            else:
                positions = keys.astype(np.int64) if keys.size else np.zeros(0, dtype=np.int64)
            for position, cause in zip(positions.tolist(), record["causes"]):
                if position >= 0 and (position >= len(where) or where[position] < 0):
                    out[position] = cause
        return out

    def close(self) -> None:
        """Ends this run's use of the store."""

    def located(self, n: int) -> Located:
        """Where each of ``n`` inputs' rows is in the store as it is now (every writer's committed shards), to read
        them back (:class:`~dynabatch.inference.results.StoredRunResult`)."""
        with self._lock:
            self._scan(verify=False)
            ids, where, _ = self._locate(n)
        return Located(self.path, list(self.files), [len(k) for k in self._keys], where, self.columns,
                       self._shard_schema, ids)


class StoreWriter:
    """Buffers rows checked at :meth:`write`; commits them as shards from one background thread; :meth:`close`."""

    def __init__(self, store: Store, name: str, ids: pa.Array | None) -> None:
        self.store, self.name, self.ids = store, name, ids
        self.seq, self.rows, self.bytes, self.since = 0, 0, 0, None
        self.buffer: list[tuple] = []  # (positions, input hashes, each column's part) per batch
        self._varying: set[tuple] = set()
        self._thread, self._pending = None, None  # the background thread, the shard it writes
        self._failed: list[tuple[np.ndarray, list[str]]] = []  # (positions, causes) of inputs that failed

    def fail(self, positions: np.ndarray, hashes: np.ndarray | None, causes: list[str]) -> None:
        """Records inputs that failed (``causes[i]`` of input ``positions[i]``), written when the writer closes."""
        self._failed.append((np.asarray(positions, dtype=np.int64), list(causes)))

    def _write_failures(self) -> None:
        positions = np.concatenate([p for p, _ in self._failed])
        ids = self.ids if self.ids is not None else self.store.ids
        keys = ids.take(pa.array(positions)).to_pylist() if ids is not None else positions.tolist()
        name = f"{_FAILED}{self.name}-{self.seq:05d}.json"
        temp = os.path.join(self.store.path, f".tmp-{_HOST}-{os.getpid()}-{name}")
        with open(temp, "w", encoding="utf-8") as f:
            json.dump({"keys": keys, "causes": [c for _, causes in self._failed for c in causes]}, f)
        os.replace(temp, os.path.join(self.store.path, name))
        self._failed = []

    def write(self, positions: np.ndarray, rows: list, hashes: np.ndarray, varying: Collection[tuple] = ()) -> None:
        """Adds rows (``rows[i]`` of input ``positions[i]``, input hash ``hashes[i]``; ``None`` rows are not stored);
        ``varying``: row paths (keys and indices; ``()``: the row) of per-token tensors, stored as lists. Raises
        ``TypeError`` / ``ValueError`` for a row the columns cannot hold, ``RuntimeError`` before check_inputs."""
        keep = [i for i, row in enumerate(rows) if row is not None]
        if not keep:
            return
        if self.store._unchecked:
            raise RuntimeError(f"output_path={self.store.path!r}: {self.store._unchecked} stored rows of this run's "
                               "inputs should be checked (store.check_inputs) before the run writes, so that a run "
                               "over other inputs is refused before it writes a row")
        columns = self.store._fix(rows[keep[0]])
        parts = columns.parts([rows[i] for i in keep])
        if self.store.schema is not None:
            columns.fields([parts], stored=self.store.schema)
        self._varying.update(tuple(path) for path in varying)
        positions = np.asarray(positions, dtype=np.int64)[keep]
        self.buffer.append((positions, np.asarray(hashes, dtype=np.uint64)[keep], parts))
        self.rows += len(positions)
        self.bytes += positions.nbytes * 2 + sum(p.values.nbytes for p in parts.values() if p.values is not None)
        self.since = time.monotonic() if self.since is None else self.since
        if self.rows >= SHARD_ROWS or self.bytes >= SHARD_BYTES or time.monotonic() - self.since >= SHARD_SECONDS:
            self._submit()

    def _submit(self) -> None:
        """Hands the buffered rows to the background thread as one shard, once the shard before it is on disk."""
        if not self.buffer:
            return
        where = dict(_leaves(self.store.columns.tree))  # each row path's column
        fields = self.store._fix(None, [b[2] for b in self.buffer], {where[path] for path in self._varying if path in where})
        buffer, name = self.buffer, f"part-{self.name}-{self.seq:05d}.parquet"
        self.seq, self.buffer, self.rows, self.bytes, self.since = self.seq + 1, [], 0, 0, None
        self._wait()
        self._thread = self._thread or ThreadPoolExecutor(max_workers=1, thread_name_prefix="dynabatch-store")
        self._pending = self._thread.submit(self._commit, buffer, name, fields)

    def _commit(self, buffer: list, name: str, fields: list[pa.Field]) -> None:
        """Writes one shard whole: a temporary file with page checksums, fsynced, renamed into place."""
        positions = np.concatenate([b[0] for b in buffer])
        ids = self.ids if self.ids is not None else self.store.ids
        keys = {"position": pa.array(positions if self.ids is None else np.full(len(positions), -1))}
        if ids is not None:
            keys["id"] = ids.take(pa.array(positions))
        keys["input_hash"] = pa.array(np.concatenate([b[1] for b in buffer]))
        columns = self.store.columns
        outputs = columns.table([b[2] for b in buffer], fields)
        meta = json.dumps({"format": FORMAT, "key": self.store.key, "keyed_by": self.store.keyed_by,
                           "tree": columns.tree, "kinds": dict(columns.kinds)})
        table = pa.Table.from_arrays([*keys.values(), *outputs.columns], schema=pa.schema(
            [pa.field(k, v.type) for k, v in keys.items()] + fields, metadata={META: meta}))
        temp = os.path.join(self.store.path, f".tmp-{_HOST}-{os.getpid()}-{name}")
        pq.write_table(table, temp, use_dictionary=["id"] if ids is not None else False, write_page_checksum=True,
                       write_statistics=list(keys)[:-1])
        _fsync(temp)
        os.replace(temp, os.path.join(self.store.path, name))
        _fsync(self.store.path)  # the rename survives a crash
        del table, outputs
        trim()  # the shard's buffers are freed: resident memory stays flat over a long run

    def _wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()  # a failed write raises here

    def close(self, commit: bool = True) -> None:
        """Ends the writer: the buffered rows committed (``commit=True``) or dropped; a shard already handed to the
        thread lands whole. The thread has stopped when this returns, also when an error (Ctrl-C) interrupts it."""
        try:
            if commit:
                self._submit()
            self.buffer, self.rows, self.bytes, self.since = [], 0, 0, None
            self._wait()
            if self._failed:
                self._write_failures()
        finally:
            if self._thread is not None:
                self._thread.shutdown(wait=True)
                self._thread = None


open_store = Store  # open_store(path, key=..., n=..., ids=...): the store at path, opened for a run
