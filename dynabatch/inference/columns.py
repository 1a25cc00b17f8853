"""Rows as Arrow columns and back: :class:`Columns`, the one encoding of ``run``'s rows in Arrow. A row (a tensor, a
numpy array, a Python scalar or list, or a dict, tuple or list of those) maps to columns on Arrow's own types; the
rules are in ``docs/inference.md`` ("Types").

Example:
    >>> import torch
    >>> from dynabatch.inference.columns import Columns
    >>> rows = [{"vec": torch.ones(2), "label": "a"}, {"vec": torch.zeros(2), "label": "b"}]
    >>> columns = Columns.of(rows[0])
    >>> table = columns.table([columns.parts(rows)])
    >>> table.schema.field("vec").type, columns.rows(table)[1]["label"]
    (FixedSizeListType(fixed_size_list<item: float>[2]), 'b')
    >>> stacked = columns.stack(table, as_tensor=True)
    >>> stacked["vec"].shape, stacked["label"]
    (torch.Size([2, 2]), ['a', 'b'])
"""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

__all__ = ["RESERVED", "Columns", "arrow_names", "as_numpy", "numpy_column", "same_field", "widen"]

RESERVED = ("position", "id", "input_hash")  # the store's own columns
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
            hint = "" if kind != "list" or not isinstance(value, list) else (
                ": a row that is a list of lists, tensors or dicts is stored as one column per item; for a number "
                "of items that varies by row, return each row as one tensor (e.g. torch.tensor(spans), of shape "
                "(items, 2)) or as a list of numbers or str")
            if kind == "dict" and isinstance(value, Mapping) and sorted(value) == sorted(keys):
                hint = ": the same keys in another order, which a row read back would change; give every row's " \
                       "keys in one order"
            raise ValueError(f"{name} should be {want} in every row, as stored, but got {got}{hint}")
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


# One batch's values of one column. kind: tensor, ndarray, python or None (all None); arrays: the rows' values joined
# on dimension 0 (valid: which rows have one), each row's length (None: 0-d rows), dtype, inner shape; python: Arrow.
_Part = namedtuple("_Part", "rows kind valid values lengths dtype inner", defaults=(None, None, None, None, "", None))


def _host(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor on the CPU that numpy can view: contiguous, ``bfloat16`` (which numpy lacks) as ``float32`` (exact)."""
    tensor = tensor.detach().cpu()
    return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).contiguous()


def _misfit(name: str, dtype: str, shape: tuple, got_dtype: str, got_shape: tuple, where: str) -> str:
    varies = " (n: any length)" if "n" in shape else ""
    return (f"{name} should have dtype {dtype} and shape {str(tuple(shape)).replace(chr(39), '')} in every row, "
            f"{where}{varies}, but got dtype {got_dtype} and shape {got_shape}")


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
    types = {type(item) for item in items if item is not None}
    if len(types) > 1:  # Arrow would store 2.5 as 2 in an int column
        raise TypeError(f"{name} should be values of one type in every row with output_path set, but got "
                        f"{sorted(kind.__name__ for kind in types)}: convert them (e.g. float(x))")
    kind = _SCALARS[types.pop()] if types else pa.null()
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
    # Arrow holds one byte order: a numpy array of the other (">f4" on a little-endian machine) is stored in this one's.
    arrays = present if tensor else [np.asarray(v).astype(np.asarray(v).dtype.newbyteorder("="), copy=False)
                                     for v in present]
    dtype, shape = str(arrays[0].dtype).removeprefix("torch."), tuple(arrays[0].shape)
    if (arrays[0].dtype.is_complex if tensor else arrays[0].dtype.kind not in "biuf") or dtype.startswith("float8"):
        strings = not tensor and arrays[0].dtype.kind in "USO"
        raise TypeError(f"{name} should be storable in Arrow with output_path set (numbers or bools), but got {name} "
                        f"of dtype {dtype}: " + ("return a list of str (array.tolist()), stored as str" if strings
                                                  else "convert it to a dtype of numbers (e.g. float32)"))
    for a in arrays:
        if a.dtype != arrays[0].dtype or a.ndim != len(shape) or tuple(a.shape[1:]) != shape[1:]:
            raise ValueError(_misfit(name, dtype, ("n", *shape[1:]) if shape else (),
                                     str(a.dtype).removeprefix("torch."), tuple(a.shape), "in the same batch"))
    if tensor:
        joined = _host(torch.cat(arrays) if shape else torch.stack(arrays)).numpy()
    else:
        joined = np.concatenate(arrays) if shape else np.stack(arrays)
    lengths = np.fromiter((a.shape[0] for a in arrays), np.int64, len(arrays)) if shape else None
    valid = np.array([v is not None for v in values]) if len(present) < len(values) else None
    kind = "tensor" if tensor else "ndarray"
    return _Part(len(values), kind, valid, joined, lengths, dtype, shape[1:] if shape else None)


def _conform(part: _Part, field: pa.Field, kind: str | None, name: str) -> None:
    """Refuses a part that the column's type (``field``, ``kind``) cannot hold, naming what is stored."""
    if part.kind is None:  # (a part with values never meets a null field: fit widens it first)
        return
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
            "unless declared varying (a per-token output): for rows whose length varies (padded to their batch's "
            "width), return dynabatch.PerRow(list(output)) from the first batch on (a list column, each row its own "
            "length), or pad every row to one length" if len(wrong) else
            "; convert it to that type, or use another output_path for rows of another type"))


def _array(parts: list[_Part], field: pa.Field, kind: str | None) -> pa.Array:
    """One Arrow array of ``field``'s type from the parts of one or more batches; rows without a value are nulls."""
    filled = [p for p in parts if p.kind is not None]
    if kind in (None, "python") or not filled or pa.types.is_null(field.type):
        arrays = [pa.nulls(p.rows, field.type) if p.kind is None else p.values.cast(field.type) for p in parts]
        return pa.concat_arrays(arrays)
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
    values, lengths = _flat(array.drop_null(), field)
    if kind == "tensor":
        whole = _tensor(values, field)
        rows = [part.clone() for part in (whole.split(lengths.tolist()) if lengths is not None else whole.unbind(0))]
    elif lengths is not None:
        rows = [np.array(part) for part in np.split(values, np.cumsum(lengths)[:-1])]
    else:
        rows = list(values) if values.ndim == 1 else [np.array(v) for v in values]
    rows = iter(rows)
    return [next(rows) if ok else None for ok in valid.tolist()]


def _stacked(array: pa.Array, field: pa.Field, kind: str | None, name: str, as_tensor: bool) -> Any:
    """One column's rows stacked into one array (or tensor); a column of strings (or lists of them) as a numpy array
    of objects, or for ``as_tensor`` a list (a tensor holds numbers only)."""
    if array.null_count:
        raise ValueError(f"{name} should have a value in every row to stack, but got None in {array.null_count} "
                         "rows; read rows one by one or use to_arrow()")
    value = _layout(field.type)[2]
    if not (pa.types.is_integer(value) or pa.types.is_floating(value) or pa.types.is_boolean(value)):
        return array.to_pylist() if as_tensor else array.to_numpy(zero_copy_only=False)
    values, lengths = _flat(array, field)
    if lengths is not None and len(lengths) and (lengths != lengths[0]).any():
        raise ValueError(f"{name} should have rows of one shape to stack, but got first dimensions from "
                         f"{int(lengths.min())} to {int(lengths.max())} (rows of different lengths); read rows one "
                         "by one or use to_arrow()")
    if lengths is not None:
        values = values.reshape(len(array), int(lengths[0]) if len(lengths) else 0, *values.shape[1:])
    return _tensor(values, field) if as_tensor else values


def _described(field: pa.Field, kind: str | None) -> str:
    """A column's type as a person reads it: ``int``, ``list of str``, ``float32 (n, 2)``, ``bfloat16 (384,)``."""
    if pa.types.is_null(field.type):
        return "None"
    varies, dims, value = _layout(field.type)
    if kind in (None, "python"):
        return f"list of {_NAMES.get(str(value), value)}" if varies else _NAMES.get(str(value), str(value))
    dtype = "bfloat16" if field.metadata == _BF16 else str(np.dtype(value.to_pandas_dtype()))
    return f"{dtype} {str(tuple(['n', *dims] if varies else dims)).replace(chr(39), '')}"


def _items(kind: pa.DataType) -> pa.DataType | None:
    """The type of a row's items after its first dimension (``None``: not an array column of rows with one)."""
    return kind.value_type if pa.types.is_list(kind) or pa.types.is_fixed_size_list(kind) else None


def _named(kind: pa.DataType) -> pa.DataType:
    if _items(kind) is None:
        return kind
    item = kind.value_field.with_name("item").with_type(_named(kind.value_type))
    return pa.list_(item, kind.list_size) if pa.types.is_fixed_size_list(kind) else pa.list_(item)


def arrow_names(schema: pa.Schema) -> pa.Schema:
    """``schema`` with the items of every list and fixed-size list (the list types a store writes) named as Arrow
    names them (``item``), whatever the Parquet file it was read from named them (its writer names them
    ``element``): a store's columns read back typed as the rows were.

    Example:
        >>> import pyarrow as pa
        >>> arrow_names(pa.schema([("v", pa.list_(pa.field("element", pa.float32()), 2))])).field("v").type
        FixedSizeListType(fixed_size_list<item: float>[2])
    """
    return pa.schema([field.with_type(_named(field.type)) for field in schema], metadata=schema.metadata)


def same_field(a: pa.Field, b: pa.Field) -> bool:
    """Whether two fields of a column hold the same values (type and metadata, not the names of list items)."""
    return a.type == b.type and (a.metadata or None) == (b.metadata or None)


def widen(stored: pa.Field, new: pa.Field, kind: str | None = None) -> pa.Field:
    """The one field holding the values of two fields of a column (``docs/inference.md``, "Types"); a ``TypeError``
    naming the column and both types where there is none (``kind``: the column's, as :class:`Columns` keeps it).

    Example:
        >>> import pyarrow as pa
        >>> widen(pa.field("note", pa.null()), pa.field("note", pa.string())).type
        DataType(string)
        >>> widen(pa.field("v", pa.list_(pa.float32(), 3)), pa.field("v", pa.list_(pa.float32(), 5))).type
        ListType(list<item: float>)
    """
    if same_field(stored, new):
        return stored
    for a, b in ((stored, new), (new, stored)):
        if pa.types.is_null(a.type) or a.type == pa.list_(pa.null()) and pa.types.is_list(b.type):
            return b
    items = _items(stored.type)
    if items is not None and items == _items(new.type) and pa.types.is_floating(_layout(items)[2]) \
            and stored.metadata == new.metadata:  # vectors of other lengths
        return pa.field(stored.name, pa.list_(items), metadata=stored.metadata)
    raise TypeError(f"{stored.name} should keep one type in every row with output_path set "
                    f"({_described(stored, kind)}, as in the rows stored or written before), but got "
                    f"{_described(new, kind)}: convert it (e.g. float(x)), or use another output_path")


class Columns:
    """How rows map to Arrow columns: their structure ``tree`` and each column's kind once it had a value."""

    def __init__(self, tree: Any, kinds: dict[str, str] | None = None) -> None:
        self.tree, self.kinds = tree, dict(kinds or {})
        self._paths = dict(_leaves(tree))
        self.names = list(self._paths.values())

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

    def at(self, paths: Collection[tuple]) -> set[str]:
        """The columns at row ``paths`` (dict keys and element indices; ``()``: the row)."""
        return {self._paths[tuple(path)] for path in paths if tuple(path) in self._paths}

    def parts(self, rows: Sequence[Any]) -> dict[str, _Part]:
        """Each column's values of ``rows``, checked (``ValueError`` / ``TypeError`` naming the column)."""
        values: dict[str, list] = {}
        _gather(self.tree, list(rows), "output", values)
        parts = {name: _part(values[name], name) for name in self.names}
        for name, part in parts.items():
            if part.kind is not None:
                self.kinds.setdefault(name, part.kind)  # a tensor, numpy or Python column: its first value's kind
        return parts

    def fit(self, parts: Sequence[dict[str, _Part]], fields: Mapping[str, pa.Field] | None = None,
            fixed: Collection[str] = (), varying: Collection[str] = ()) -> dict[str, pa.Field]:
        """Each column's field holding ``parts`` and the rows before them (``fields``): kept for the ``fixed``
        columns, else widened by the field ``parts`` decide (``varying``: columns whose rows vary in length); a
        ``TypeError`` / ``ValueError`` naming the column for a part that does not fit."""
        fields, fitted = fields or {}, {}
        for name in self.names:
            column = [p[name] for p in parts]
            field = fields.get(name)
            if name not in fixed:
                decided = self._decide(name, column, name in varying)
                field = decided if field is None else widen(field, decided, self.kinds.get(name))
            for part in column:
                _conform(part, field, self.kinds.get(name), name)
            fitted[name] = field
        return fitted

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
        """The parts of one or more batches as one table (``fields``: from :meth:`fit`; ``None``: fixed by them)."""
        fields = list(self.fit(parts).values()) if fields is None else fields
        arrays = [_array([p[f.name] for p in parts], f, self.kinds.get(f.name)) for f in fields]
        return pa.Table.from_arrays(arrays, schema=pa.schema(fields))

    def rows(self, table: pa.Table) -> list:
        """Rows back from a table of these columns, as ``run`` gave them."""
        decoded = {name: _column_rows(table.column(name).combine_chunks(), table.schema.field(name),
                                      self.kinds.get(name)) for name in self.names}
        return [_build(self.tree, lambda name, i=i: decoded[name][i]) for i in range(table.num_rows)]

    def stack(self, table: pa.Table, *, as_tensor: bool) -> Any:
        """Every row stacked: one array (or tensor) per column, in the rows' structure."""
        return _build(self.tree, lambda name: _stacked(table.column(name).combine_chunks(), table.schema.field(name),
                                                       self.kinds.get(name), name, as_tensor))


def as_numpy(item: Any) -> Any:
    """A row with its tensors as numpy arrays (``bfloat16`` as ``float32``), inside plain tuples, lists and dicts too."""
    if isinstance(item, torch.Tensor):
        return _host(item).numpy()
    if type(item) in (list, tuple):
        return type(item)(as_numpy(x) for x in item)
    if type(item) is dict:
        return {key: as_numpy(value) for key, value in item.items()}
    return item


def numpy_column(rows: list[Any]) -> np.ndarray:
    """Rows as one numpy column: stacked when every row is an array (a tensor made one) of one shape and dtype (Ray's
    tensor column), else an array of objects, one item per row (a ``None`` for a failed row).

    Example:
        >>> import torch
        >>> numpy_column([torch.ones(3), torch.zeros(3)]).shape
        (2, 3)
        >>> column = numpy_column([torch.tensor([5, 6]), torch.tensor([7]), None])
        >>> column.dtype, [None if r is None else r.tolist() for r in column]
        (dtype('O'), [[5, 6], [7], None])
    """
    arrays = [as_numpy(r) for r in rows]
    if arrays and all(isinstance(a, np.ndarray) and (a.shape, a.dtype) == (arrays[0].shape, arrays[0].dtype)
                      for a in arrays):
        return np.stack(arrays)
    return np.fromiter(arrays, dtype=object, count=len(arrays))
