"""Rows of results as Arrow columns and back: what a results store holds and what ``RunResult`` gives.

A :class:`Layout` says how one row (what :func:`dynabatch.run` gives for one
input) maps to columns, and how each column stores its values:

* a tensor or numpy array: one column ``output``; a dict: one column per key
  (a nested tuple, list or dict adds ``_<index>`` / ``_<key>`` to the name);
  a tuple: ``output_0``, ``output_1``, ... read back as a tuple; a list whose
  items are tensors, arrays or containers: the same, read back as a list;
* a list of numbers, bools or str: one Arrow list column, read back as a list;
* tensors keep dtype and shape: a fixed shape as a (nested) ``FixedSizeList``;
  a first dimension that varies by row as a ``List`` of them (per-token
  outputs, token ids); ``bfloat16`` (no Arrow type) is stored as ``float32``
  and comes back as ``bfloat16``, exactly; ``float16`` stays ``float16``;
* ``int``, ``float``, ``bool``, ``str`` and ``None`` as Arrow scalars.

A column's type settles at its first value that is not ``None``: a column ``None`` in every row so far is
*untyped* (Arrow ``null``, or a list of ``null`` for empty lists) and takes the type of the first batch with a
value (:meth:`Layout.convert`); after that ``None`` is allowed in any row (a null). Layouts of shards stored
before and after a column settled merge into the settled one (:meth:`Layout.merge`).

A tensor column's first dimension varies by row (is *ragged*) when its dtype is not a float (token ids, tags),
when it has two or more dimensions, when the rows of the first batch with values differ in it, or when it equals
every row's number of real tokens (a per-token output); else the shape is fixed (an embedding, logits), and a
later row of another shape raises ``ValueError``. A batch's rows are converted column by column (one
``torch.stack`` or ``torch.cat`` per column), not value by value.

Example:
    >>> import torch
    >>> from dynabatch.inference._columns import Layout
    >>> from dynabatch.inference._decode import decode_rows
    >>> rows = [{"vec": torch.ones(2, dtype=torch.float16), "n": 3}, {"vec": torch.zeros(2, dtype=torch.float16), "n": 1}]
    >>> layout = Layout.infer(rows)
    >>> columns = layout.encode(rows)
    >>> {name: str(array.type) for name, array in columns.items()}
    {'vec': 'fixed_size_list<item: halffloat>[2]', 'n': 'int64'}
    >>> back = decode_rows(layout, columns)
    >>> back[1]["vec"].dtype, back[1]["n"]
    (torch.float16, 1)
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import torch

__all__ = ["RESERVED", "Layout"]

RESERVED = ("position", "id", "input_hash")  # the store's own columns
_SCALARS = {bool: "bool", int: "int", float: "float", str: "str"}
_ARROW_SCALARS = {"bool": pa.bool_(), "int": pa.int64(), "float": pa.float64(), "str": pa.string(), "null": pa.null()}
_STORABLE = ("tensors, numpy arrays, int, float, bool, str or None, or tuples, lists or dicts (str keys) of those")


def _storable_error(name: str, value: Any) -> TypeError:
    return TypeError(f"{name} should be storable in Arrow with output_path set ({_STORABLE}), but got {name} of "
                     f"type {type(value).__name__}")


def _scalar_kind(value: Any) -> str | None:
    return _SCALARS.get(type(value)) if not isinstance(value, bool) else "bool"


def _is_leaf_list(value: list) -> bool:
    """A list of numbers, bools, str or None: stored as one Arrow list value."""
    return all(item is None or _scalar_kind(item) is not None for item in value)


def _infer_tree(value: Any, name: str, top: bool = True) -> Any:
    if isinstance(value, tuple) or (isinstance(value, list) and not _is_leaf_list(value)):
        kind = "tuple" if isinstance(value, tuple) else "list"
        return {kind: [_infer_tree(item, f"{name}_{i}", False) for i, item in enumerate(value)]}
    if isinstance(value, Mapping):
        items = []
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"{name} keys should be str with output_path set (column names), but got key "
                                f"{key!r} of type {type(key).__name__}")
            items.append([key, _infer_tree(item, key if top else f"{name}_{key}", False)])
        return {"dict": items}
    return {"column": name}


def _gather(node: Any, values: list, name: str, out: dict[str, list]) -> None:
    """Checks every row has the layout's structure and collects each column's values, row by row."""
    if "column" in node:
        out[node["column"]] = values
        return
    for kind, container in (("tuple", tuple), ("list", list)):
        if kind in node:
            children = node[kind]
            for value in values:
                if type(value) is not container or len(value) != len(children):
                    raise ValueError(f"{name} should be a {kind} of {len(children)} items in every row, as stored, "
                                     f"but got a row's {name} = {type(value).__name__}"
                                     + (f" of {len(value)} items" if isinstance(value, (list, tuple)) else ""))
            for i, child in enumerate(children):
                _gather(child, [value[i] for value in values], f"{name}[{i}]", out)
            return
    keys = [key for key, _ in node["dict"]]
    for value in values:
        if not isinstance(value, Mapping) or list(value) != keys:
            got = list(value) if isinstance(value, Mapping) else type(value).__name__
            raise ValueError(f"{name} should be a dict with keys {keys} in every row, as stored, but got {got}")
    for key, child in node["dict"]:
        _gather(child, [value[key] for value in values], f"{name}[{key!r}]", out)


def _build(node: Any, columns: dict[str, list], i: int) -> Any:
    if "column" in node:
        return columns[node["column"]][i]
    if "tuple" in node:
        return tuple(_build(child, columns, i) for child in node["tuple"])
    if "list" in node:
        return [_build(child, columns, i) for child in node["list"]]
    return {key: _build(child, columns, i) for key, child in node["dict"]}


@dataclass
class _Spec:
    """How one column stores its values: ``kind`` tensor / ndarray / scalar / values, dtype and row shape."""

    kind: str
    dtype: str
    shape: list[int | None] = field(default_factory=list)  # tensors: shape[0] None when ragged
    ragged: bool = field(init=False)

    def __post_init__(self) -> None:
        self.ragged = bool(self.shape) and self.shape[0] is None

    @property
    def untyped(self) -> bool:
        """``None`` (or empty lists) in every row so far: the type is not known yet."""
        return self.dtype == "null"

    def settles(self, other: _Spec) -> bool:
        """Whether this spec is ``other`` with a type where ``other`` is still untyped."""
        return other.untyped and not self.untyped and (other.kind == "scalar" or other.kind == self.kind == "values")

    def arrow_type(self) -> pa.DataType:
        if self.kind == "scalar":
            return _ARROW_SCALARS[self.dtype]
        if self.kind == "values":
            return pa.list_(_ARROW_SCALARS[self.dtype])
        element = pa.float32() if self.dtype == "bfloat16" else pa.from_numpy_dtype(np.dtype(self.dtype))
        for size in reversed(self.shape[1:] if self.ragged else self.shape):
            element = pa.list_(element, size)
        return pa.list_(element) if self.ragged else element


def _array_spec(values: list, kind: str, name: str, real_lengths: np.ndarray | None) -> _Spec:
    sample = values[0]
    dtype = str(sample.dtype).removeprefix("torch.")
    if (sample.dtype.is_complex if kind == "tensor" else sample.dtype.kind not in "biuf"):
        raise TypeError(f"{name} should be storable in Arrow with output_path set (numbers or bools), but got "
                        f"{name} of dtype {dtype}")
    shapes = [tuple(v.shape) for v in values]
    if not shapes[0]:
        return _Spec(kind, dtype, [])
    firsts = np.array([s[0] for s in shapes])
    integer = (not sample.dtype.is_floating_point) if kind == "tensor" else sample.dtype.kind in "biu"
    ragged = (integer or len(shapes[0]) > 1 or bool((firsts != firsts[0]).any())
              or (real_lengths is not None and np.array_equal(firsts, real_lengths)))
    return _Spec(kind, dtype, [None if ragged else shapes[0][0], *shapes[0][1:]])


def _infer_spec(values: list, name: str, real_lengths: np.ndarray | None) -> _Spec:
    present = [v for v in values if v is not None]
    if not present:
        return _Spec("scalar", "null")
    if real_lengths is not None and len(present) < len(values):  # the real tokens of the rows with a value
        real_lengths = np.asarray(real_lengths)[[v is not None for v in values]]
    sample = present[0]
    if isinstance(sample, torch.Tensor):
        return _array_spec(present, "tensor", name, real_lengths)
    if isinstance(sample, (np.ndarray, np.generic)):
        return _array_spec([np.asarray(v) for v in present], "ndarray", name, real_lengths)
    if _scalar_kind(sample) is not None:
        return _Spec("scalar", _kinds(present, name).pop())
    if isinstance(sample, list):
        kinds = _kinds(present, name)
        return _Spec("values", kinds.pop() if kinds else "null")
    raise _storable_error(name, sample)


def _kinds(values: list, name: str, stored: str | None = None) -> set[str]:
    """The scalar kinds (``int``, ``float``, ...) of ``values``, or of their items for lists: one kind, or refused
    (Arrow would turn 2.5 into 2 in an int column, and 1 into 1.0 in a float one)."""
    items = [item for v in values if isinstance(v, list) for item in v] if any(isinstance(v, list) for v in values) \
        else values
    kinds = {_scalar_kind(item) for item in items if item is not None}
    if None in kinds:
        bad = next(item for item in items if item is not None and _scalar_kind(item) is None)
        raise _storable_error(name, bad)
    if len(kinds) > 1 or (stored is not None and stored != "null" and kinds - {stored}):
        raise TypeError(f"{name} should be values of one type in every row with output_path set"
                        + (f" ({stored}, as stored)" if stored else "") + f", but got {sorted(kinds)}: convert them "
                        "(e.g. float(x))")
    return kinds


@dataclass
class _Part:
    """One batch's values of one column, checked against its spec: numpy values of the rows with one (``(rows, *shape)``,
    ragged: ``(total, *shape[1:])`` with ``lengths``), Arrow scalars or lists, or ``None``; ``valid``: rows with one."""

    values: Any
    rows: int
    lengths: np.ndarray | None = None
    valid: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in (self.values, self.lengths, self.valid) if a is not None)


def _convert_array(values: list, spec: _Spec, name: str) -> _Part:
    tensor = spec.kind == "tensor"
    kind = torch.Tensor if tensor else (np.ndarray, np.generic)
    if not all(isinstance(v, kind) for v in values):
        v = next(v for v in values if not isinstance(v, kind))
        raise TypeError(f"{name} should be a {'tensor' if tensor else 'numpy array'} or None in every row, as "
                        f"stored, but got {type(v).__name__}")
    fixed = tuple(spec.shape[1:] if spec.ragged else spec.shape)
    dtypes = {v.dtype for v in values}
    shapes = {tuple(v.shape[1:]) if spec.ragged else tuple(v.shape) for v in values} if tensor else \
        {np.shape(v)[1:] if spec.ragged else np.shape(v) for v in values}
    if len(dtypes) > 1 or shapes != {fixed} or (spec.ragged and any(not np.shape(v) for v in values)):
        for v in values:  # name the first row that does not fit
            dtype, shape = str(v.dtype).removeprefix("torch."), tuple(np.shape(v))
            if dtype != spec.dtype or (shape[1:] if spec.ragged else shape) != fixed or (spec.ragged and not shape):
                stored = ("n", *fixed) if spec.ragged else fixed
                raise ValueError(f"{name} should have dtype {spec.dtype} and shape {stored} in every row, as stored "
                                 f"(n: any length), but got dtype {dtype} and shape {shape}")
    dtype = str(dtypes.pop()).removeprefix("torch.") if dtypes else spec.dtype
    if dtype != spec.dtype:
        raise ValueError(f"{name} should have dtype {spec.dtype} in every row, as stored, but got dtype {dtype}")
    if tensor:
        joined = torch.cat(values) if spec.ragged else torch.stack(values) if values else torch.zeros(0, *fixed)
        joined = joined.detach().cpu()
        array = (joined.float() if joined.dtype == torch.bfloat16 else joined).contiguous().numpy()
    else:
        arrays = [np.asarray(v) for v in values]
        array = np.concatenate(arrays) if spec.ragged else np.stack(arrays)
    lengths = np.fromiter((np.shape(v)[0] for v in values), dtype=np.int64, count=len(values)) if spec.ragged else None
    return _Part(array, len(values), lengths)


def _convert(values: list, spec: _Spec, name: str) -> _Part:
    if spec.kind == "scalar" and spec.untyped:  # every value None (Layout.convert typed any other)
        return _Part(None, len(values), valid=np.zeros(len(values), dtype=bool))
    if spec.kind in ("tensor", "ndarray"):
        valid = np.fromiter((v is not None for v in values), dtype=bool, count=len(values))
        if valid.all():
            return _convert_array(values, spec, name)
        if not valid.any():
            return _Part(None, len(values), valid=valid)
        part = _convert_array([v for v in values if v is not None], spec, name)
        return _Part(part.values, len(values), part.lengths, valid)
    if spec.kind == "values" and not all(v is None or isinstance(v, list) for v in values):
        bad = next(v for v in values if v is not None and not isinstance(v, list))
        raise TypeError(f"{name} should be a list in every row, as stored, but got {type(bad).__name__}")
    _kinds(values, name, spec.dtype)
    try:
        return _Part(pa.array(values, type=spec.arrow_type()), len(values))
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError) as exc:
        raise TypeError(f"{name} should be {spec.dtype} values in every row, as stored, but got {exc}") from exc


def _to_arrow(parts: list[_Part], spec: _Spec) -> pa.Array:
    """One Arrow array from the parts of several batches (concatenated once); rows without a value are nulls."""
    rows = sum(p.rows for p in parts)
    if spec.kind in ("scalar", "values"):
        kind = spec.arrow_type()  # parts converted before the column settled hold nulls (or lists of them): cast
        arrays = [pa.nulls(p.rows, kind) if p.values is None else p.values.cast(kind) for p in parts]
        return arrays[0] if len(arrays) == 1 else pa.concat_arrays(arrays)
    filled = [p for p in parts if p.values is not None]
    if not filled:
        return pa.nulls(rows, spec.arrow_type())
    values = filled[0].values if len(filled) == 1 else np.concatenate([p.values for p in filled])
    array = pa.array(values.reshape(-1))
    for size in reversed(spec.shape[1:] if spec.ragged else spec.shape):
        array = pa.FixedSizeListArray.from_arrays(array, size)
    if spec.ragged:
        lengths = np.concatenate([p.lengths for p in filled])
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        array = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), array)
    if all(p.valid is None for p in parts):
        return array
    valid = np.concatenate([p.valid if p.valid is not None else np.ones(p.rows, dtype=bool) for p in parts])
    return array.take(pa.array(np.cumsum(valid) - 1, mask=~valid))  # the values spread over their rows, nulls between


class Layout:
    """How rows map to Arrow columns (see the module docs): a tree of containers and one spec per column."""

    def __init__(self, tree: Any, specs: dict[str, _Spec]) -> None:
        self.tree = tree
        self.specs = specs

    @classmethod
    def infer(cls, rows: Sequence[Any], real_lengths: np.ndarray | None = None) -> Layout:
        """The layout of ``rows`` (one batch's); ``real_lengths``: each row's real tokens, to spot per-token outputs."""
        tree = _infer_tree(rows[0], "output")
        columns: dict[str, list] = {}
        _gather(tree, list(rows), "output", columns)
        for name in columns:
            if name in RESERVED:
                raise ValueError(f"fn(batch) should not name a result {name!r} with output_path set (the store's "
                                 f"own columns are {list(RESERVED)}), but got a column {name!r}; rename it")
        names = [n for n in _leaf_names(tree)]
        if len(set(names)) != len(names):
            raise ValueError(f"fn(batch) rows should give distinct column names, but got {names}; rename the keys")
        return cls(tree, {name: _infer_spec(values, name, real_lengths) for name, values in columns.items()})

    @property
    def untyped(self) -> set[str]:
        """The columns whose type is not known yet (``None`` in every row so far)."""
        return {name for name, spec in self.specs.items() if spec.untyped}

    def convert(self, rows: Sequence[Any], real_lengths: np.ndarray | None = None) -> dict[str, _Part]:
        """Each column's values of ``rows``, checked (``ValueError`` / ``TypeError`` for rows that do not fit), as
        numpy arrays: one conversion per column, not per value. An untyped column with a value in ``rows`` takes
        its type here (``real_lengths``: each row's real tokens, as for :meth:`infer`)."""
        columns: dict[str, list] = {}
        _gather(self.tree, list(rows), "output", columns)
        for name, spec in self.specs.items():
            if spec.untyped:
                self.specs[name] = _settle(spec, columns[name], name, real_lengths)
        return {name: _convert(columns[name], spec, name) for name, spec in self.specs.items()}

    @classmethod
    def merge(cls, layouts: Sequence[Layout]) -> Layout | None:
        """The layout of rows stored under ``layouts`` (shards written before and after columns settled): each
        column's type where any of them has one; ``None`` when they differ otherwise."""
        merged = cls(layouts[0].tree, dict(layouts[0].specs))
        for layout in layouts[1:]:
            if layout.tree != merged.tree or list(layout.specs) != list(merged.specs):
                return None
            for name, spec in layout.specs.items():
                if spec.settles(merged.specs[name]):
                    merged.specs[name] = spec
                elif spec != merged.specs[name] and not merged.specs[name].settles(spec):
                    return None
        return merged

    def to_arrow(self, parts: Sequence[dict[str, _Part]]) -> dict[str, pa.Array]:
        """One Arrow array per column from :meth:`convert`'s parts of one or more batches."""
        return {name: _to_arrow([p[name] for p in parts], spec) for name, spec in self.specs.items()}

    def encode(self, rows: Sequence[Any]) -> dict[str, pa.Array]:
        """One Arrow array per column for ``rows`` (:meth:`convert`, then :meth:`to_arrow`)."""
        return self.to_arrow([self.convert(rows)])

    def fields(self) -> list[pa.Field]:
        return [pa.field(name, spec.arrow_type()) for name, spec in self.specs.items()]

    def to_json(self) -> str:
        return json.dumps({"tree": self.tree, "columns": {n: [s.kind, s.dtype, s.shape] for n, s in self.specs.items()}})

    @classmethod
    def from_json(cls, text: str) -> Layout:
        data = json.loads(text)
        return cls(data["tree"], {name: _Spec(*spec) for name, spec in data["columns"].items()})

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and self.to_json() == other.to_json()

    def describe(self) -> str:
        return ", ".join(f"{name}: " + ("None so far" if spec.untyped else f"{spec.kind} {spec.dtype}"
                                        + (str(tuple(spec.shape)).replace("None", "n") if spec.shape else ""))
                         for name, spec in self.specs.items())


def _settle(spec: _Spec, values: list, name: str, real_lengths: np.ndarray | None) -> _Spec:
    """The spec of an untyped column once ``values`` (one batch's) come: their type if any is not ``None``."""
    if spec.kind == "values":  # lists that were empty or held only None: their items' kind, once one shows
        kinds = _kinds(values, name) if all(v is None or isinstance(v, list) for v in values) else set()
        return _Spec("values", kinds.pop()) if kinds else spec
    nested = [v for v in values if isinstance(v, (tuple, Mapping)) or (isinstance(v, list) and not _is_leaf_list(v))]
    if nested:
        kind = type(nested[0]).__name__
        raise ValueError(f"{name} should be one value (a column) in every row, as stored: it was None in every row "
                         f"before, but got a {kind}; return the {kind} in every row, with None inside where empty")
    return _infer_spec(values, name, real_lengths)


def _leaf_names(node: Any) -> list[str]:
    if "column" in node:
        return [node["column"]]
    children = node.get("tuple") or node.get("list") or [child for _, child in node.get("dict", [])]
    return [name for child in children for name in _leaf_names(child)]
