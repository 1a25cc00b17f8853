"""``map_texts``: ``ds.map_batches`` with a predictor, its window, actors and GPUs chosen for the common case."""

from __future__ import annotations

import logging
import numbers
import os
from typing import Any

import numpy as np
import pyarrow as pa

from dynabatch._distribution import import_extra
from dynabatch._validation import bad_type, bad_value, check_bool, check_positive_int, first_few
from dynabatch.data.text_source import is_text_type
from dynabatch.integrations.ray._columns import check_column
from dynabatch.integrations.ray._store import SUMMARY, check_id_type, check_store_options, column_ids, open_store
from dynabatch.integrations.ray.predictor import DynamicBatchPredictor, check_constructor
from dynabatch.memory.device import device_count

__all__ = ["default_window", "map_texts", "stored_results"]

logger = logging.getLogger(__name__)


def _cluster_counts() -> tuple[float, float]:
    """CPUs and GPUs of the Ray cluster (this machine's when Ray is not initialized yet)."""
    import ray

    if ray.is_initialized():
        resources = ray.cluster_resources()
        return float(resources.get("CPU", 1)), float(resources.get("GPU", 0))
    return float(os.cpu_count() or 1), float(device_count("cuda"))


def default_window(batch_size: int) -> int:
    """Rows per window ``map_texts`` asks Ray for: 64 first batches, between 1,024 and 16,384 rows.

    Example:
        >>> default_window(16), default_window(4), default_window(1024)
        (1024, 1024, 16384)
    """
    return int(min(max(64 * check_positive_int("batch_size", batch_size), 1024), 16384))


def map_texts(
    ds: Any,
    predictor_cls: type,
    *,
    batch_size: int,
    max_input_token_length: int,
    window: int | None = None,
    actors: int | tuple[int, int] | None = None,
    num_gpus: float | None = None,
    num_cpus: float | None = None,
    sort_by_length: bool = False,
    ray_remote_args: dict[str, Any] | None = None,
    output_path: str | os.PathLike | None = None,
    key: str | None = None,
    id_column: str = "id",
    **predictor_kwargs: Any,
) -> Any:
    """``ds.map_batches(predictor_cls, ...)`` with sensible window, actors and GPUs: the common case in one call.

    With ``output_path`` the job runs in this call and its results go to a
    results store that a rerun resumes: each window runs only the rows whose
    id (``id_column``) the store does not hold yet, so a killed job, run
    again with the same arguments, computes only the rows it had not stored.

    Args:
        ds: a ``ray.data.Dataset`` with a text column.
        predictor_cls: your :class:`DynamicBatchPredictor` subclass.
        batch_size, max_input_token_length: the predictor's (rows of each
            window's first batch, truncation limit).
        window: rows per window (``map_batches``' ``batch_size``); ``None``:
            :func:`default_window` (64 first batches, 1,024 to 16,384 rows):
            enough batches per window that its partial last batch and its
            planning cost little, small enough to spread over the actors.
        actors: the actor pool (one window in flight per actor, so that a
            few large windows spread over the actors): a size, or
            ``(min, max)`` to autoscale;
            ``None``: one actor per ``num_gpus`` GPUs of the cluster, or,
            without GPUs, one per ``num_cpus`` CPUs but one CPU: Ray Data
            starts the pool before the stages that feed it, and a pool that
            holds every CPU leaves none for them (a ``read_parquet``), so the
            job stalls. Ray is asked for the cluster's resources when it is
            initialized; else this machine's CPUs and CUDA devices are counted.
        num_gpus: GPUs per actor; ``None``: 1 when the cluster has GPUs, else 0.
            With GPUs the predictor's ``device`` defaults to ``"cuda"``.
        num_cpus: CPUs per actor; ``None``: Ray Data's default (1).
        sort_by_length: sort the dataset by text length (characters), longest
            first, before the windows are cut, so that each window holds
            texts of similar lengths. It costs a global sort, run here
            (``materialize()``: the sorted rows are held in Ray's object
            store before the actors start), and the windows are cut from
            that order, not yours (carry an id column to restore it); see
            ``docs/ray.md`` for whether it pays.
        ray_remote_args: more actor options (``max_restarts``,
            ``max_task_retries``, ``memory``, ...), passed to ``map_batches``.
        output_path: a directory for the results, on a file system every
            actor and this process reach (local, or shared such as NFS): the
            results store of ``dynabatch.run(..., output_path=...)`` (Parquet
            shards, each committed whole by a rename; a shard a killed job did
            not finish is ignored), keyed by ``id_column``. The job runs now
            (as ``write_parquet`` does); each window skips the rows whose id
            the store holds, after checking their input hashes (their texts
            tokenized again, as the loader does: the same texts, tokenizer and
            settings), and commits the rows it ran as one shard. Rows without
            a result (``on_oom="skip"``) are not stored: a rerun tries them
            again. ``None``: nothing is stored, the mapped dataset is returned.
        key: with ``output_path``, what computes the rows (the model, its
            revision, the settings); a store written with another key is
            refused, naming both keys (``None`` is a key too).
        id_column: with ``output_path``, the column of each row's id (str or
            int, unique in the dataset and stable across reruns). The
            driver reads this column once, before any actor starts, and
            refuses an id given to two rows or missing, as
            :func:`dynabatch.run` refuses its ``ids``: each window checks
            only its own rows, and an id in two windows would run in both.
        **predictor_kwargs: the predictor's other arguments (``text_column``,
            ``output_column``, ``on_oom``, ``calibrate``, ...); one the
            predictor does not take (a subclass: those its ``__init__``
            names, then, where it takes ``**kwargs``, those its base takes),
            or one its own ``__init__`` requires and lacks, is refused here
            (``TypeError``).

    Returns:
        Without ``output_path``: the mapped ``ray.data.Dataset`` (lazy, as
        ``map_batches`` returns it): the input columns and the output column.
        With ``output_path``: a ``ray.data.Dataset`` reading the store once
        the job has finished: one row per stored id, ``id_column``'s ids in a
        column ``id`` and the output as the store holds it (one column per
        output; tensors as Arrow lists).

    Raises:
        TypeError, ValueError: a bad argument (a ``text_column`` or, with
            ``output_path``, an ``id_column`` the dataset lacks, or an
            ``output_column`` it has, refused here where the dataset's schema
            is known without running it); with ``output_path``, ids
            repeated or missing (refused before any actor starts), a store
            of another ``key`` or of other ids' type, not a dynabatch store, or
            held rows computed from other inputs than the dataset's (the job
            fails with the ``ValueError``).

    Example:
        A killed job, run again, computes only the rows it had not stored
        (``Embed`` as in :mod:`dynabatch.integrations.ray`)::

            ds = ray.data.read_parquet("texts/")          # columns "id", "text"
            out = map_texts(ds, Embed, batch_size=16, max_input_token_length=256,
                            output_path="embeddings/", key="all-MiniLM-L6-v2 cls 256")
            out.take(1)                                    # [{"id": ..., "output": [...]}]
    """
    import_extra("ray.data", "ray", "dynabatch.integrations.ray.map_texts")  # names the extra where Ray is missing
    import ray.data

    if not (isinstance(predictor_cls, type) and issubclass(predictor_cls, DynamicBatchPredictor)):
        raise bad_type("predictor_cls", "a subclass of dynabatch.integrations.ray.DynamicBatchPredictor", predictor_cls)
    if not isinstance(ds, ray.data.Dataset):
        raise bad_type("ds", "a ray.data.Dataset", ds)
    check_positive_int("batch_size", batch_size)
    window = default_window(batch_size) if window is None else check_positive_int("window", window)
    check_bool("sort_by_length", sort_by_length)
    check_store_options(output_path, key, id_column)
    for name, value in (("num_gpus", num_gpus), ("num_cpus", num_cpus)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real) or value < 0):
            raise bad_value(name, "None or a number >= 0", value)
    cpus, gpus = _cluster_counts()
    if num_gpus is None:
        num_gpus = 1 if gpus >= 1 else 0
    if actors is None:  # without GPUs, one CPU stays free: a pool holding every CPU starves the reads and stalls
        actors = max(1, int(gpus // num_gpus)) if num_gpus else max(1, int((cpus - 1) // (num_cpus or 1)))
    if isinstance(actors, tuple):
        if len(actors) != 2 or not all(isinstance(a, int) and not isinstance(a, bool) and a >= 1 for a in actors) \
                or actors[0] > actors[1]:
            raise bad_value("actors", "a positive int or a (min, max) pair of them with min <= max", actors)
        pool = {"min_size": actors[0], "max_size": actors[1]}
    else:
        pool = {"size": check_positive_int("actors", actors)}
    # One window in flight per actor: windows are large and few, and Ray Data's default (2) queues a second one on
    # the first actor to start while the others are still loading their model, leaving them idle.
    compute = ray.data.ActorPoolStrategy(**pool, max_tasks_in_flight_per_actor=1)
    if num_gpus and "device" not in predictor_kwargs:
        predictor_kwargs["device"] = "cuda"
    kwargs = dict(predictor_kwargs, batch_size=batch_size, max_input_token_length=max_input_token_length)
    stored = {} if output_path is None else {"output_path": output_path, "key": key, "id_column": id_column}
    # Here, not in each actor: an actor whose constructor raises dies, and Ray says so seconds later. Before the
    # columns: a misspelt text_column is named as such, not as a column the dataset lacks.
    check_constructor(predictor_cls, {**kwargs, **stored}, "map_texts")
    text_column = predictor_kwargs.get("text_column", "text")
    _check_columns(ds, text_column, predictor_kwargs.get("output_column", "output"),
                   id_column if output_path is not None else None)
    store = None
    if output_path is not None:
        ids = _dataset_ids(ds, id_column)  # before the store is opened: a refused dataset makes nothing
        store = open_store(output_path, key)  # refuses another key here, before any actor starts
        try:
            check_id_type(store, ids.type, id_column)  # as each window would, once its actor has loaded the model
        except ValueError:
            store.close()
            raise
        kwargs.update(stored, output_path=store.path)
    remote = dict(ray_remote_args or {})
    if num_gpus:
        remote["num_gpus"] = num_gpus
    if num_cpus is not None:
        remote["num_cpus"] = num_cpus
    chars = "__dynabatch_chars"
    if sort_by_length:
        # Materialized before the actors start: a global sort is a barrier anyway, and the sort's tasks must not
        # wait for CPUs the actor pool holds.
        def char_lengths(table: Any) -> Any:  # nested: pickled by value, so the tasks do not import dynabatch
            import pyarrow.compute as pc

            return table.append_column(chars, pc.utf8_length(table.column(text_column)))

        ds = ds.map_batches(char_lengths, batch_format="pyarrow").sort(chars, descending=True)
        ds = ds.materialize()
    logger.info("map_texts: windows of %d rows, %s actor(s), %s GPU(s) each%s", window, actors, num_gpus,
                ", sorted by length" if sort_by_length else "")
    out = ds.map_batches(predictor_cls, fn_constructor_kwargs=kwargs, batch_size=window, compute=compute,
                         **remote)
    if store is not None:
        try:  # the driver holds the store for the job while the actors write into it
            return _run_stored(out, store, key, id_column)
        finally:
            store.close(job_done=True)  # and gives it up with every actor's hold
    return out.drop_columns([chars]) if sort_by_length else out


def _check_columns(ds: Any, text_column: Any, output_column: Any, id_column: str | None) -> None:
    """Refuses a dataset without ``text_column`` (or, with a store, ``id_column``), with a ``text_column`` of another
    type than str or an ``id_column`` of other types than str and int, or with ``output_column`` already, where its
    schema is known without running it (``read_parquet``, ``from_items``, ...; else the first window checks, and
    :func:`_dataset_ids` the ``id_column``).

    Each actor checks its windows too, but only once it has loaded its model, and the error comes back wrapped in
    Ray's task error: here it is the caller's, before any actor starts or the store is opened.
    """
    schema = ds.schema(fetch_if_missing=False)
    if schema is None:
        return None
    names = [str(name) for name in schema.names]
    check_column("text_column", text_column)
    check_column("output_column", output_column)
    if text_column not in names:
        raise bad_value("text_column", f"a column of the dataset {names}", text_column)
    kind = schema.types[names.index(text_column)]
    if isinstance(kind, pa.DataType) and not _holds_str(kind):
        # Not one row could be a str: every window would fail (with sort_by_length, the sort first, on its length).
        raise TypeError(f"text_column should be a column of str (Arrow string), but got text_column={text_column!r} "
                        f"of type {kind}")
    if id_column is not None and id_column not in names:
        raise _lacks_id_column(names, id_column)
    ids = schema.types[names.index(id_column)] if id_column is not None else None
    if isinstance(ids, pa.DataType) and not (pa.types.is_integer(ids) or _holds_str(ids)):
        raise TypeError(f"id_column should be a column of str or int ids (Arrow string or integer), but got "
                        f"id_column={id_column!r} of type {ids}")
    if output_column in names:
        raise bad_value("output_column", f"a column the dataset does not have already {names}", output_column)


def _lacks_id_column(names: list[str], id_column: str) -> ValueError:
    return bad_value("id_column", f"a column of the dataset {names} (each row's id, with output_path)", id_column)


def _dataset_ids(ds: Any, id_column: str) -> pa.Array:
    """The dataset's ids, read once here in its order and checked by :func:`column_ids` (the rule of
    :func:`dynabatch.run` and the command line): an id given to two rows is refused before any actor runs,
    naming the id and its rows' positions in the dataset.

    Each window checks only its own ids, and each actor the ids stored when it started: an id in two windows that run
    at the same time would run in both and be stored twice, found only by a reader of the whole store. The read moves
    the id column alone to this process (``id_column``'s values, not the texts) and holds it, as the command line
    holds its ``--id-column``.
    """

    def id_only(table: Any) -> Any:  # nested: pickled by value, so the tasks do not import dynabatch
        if id_column in table.column_names:
            return pa.table({"id": table.column(id_column)})
        return pa.table({"lacking": pa.array([list(table.column_names)])})  # the block's columns, for the message

    options = ds.context.execution_options
    before, options.preserve_order = options.preserve_order, True  # positions in the dataset's own order
    try:
        tables = list(ds.map_batches(id_only, batch_format="pyarrow", batch_size=None)
                      .iter_batches(batch_size=None, batch_format="pyarrow"))
    finally:
        options.preserve_order = before
    lacking = next((t.column("lacking")[0].as_py() for t in tables if "lacking" in t.column_names), None)
    if lacking is not None:
        raise _lacks_id_column(lacking, id_column)
    try:
        ids = pa.concat_tables(tables, promote_options="permissive").column("id") if tables else pa.array([])
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:  # blocks of str ids and of int ids
        kinds = sorted({str(t.schema.field("id").type) for t in tables})
        raise TypeError(f"id_column={id_column!r}: ids should be of one type, str or int, in every row, but got "
                        f"ids of types {', '.join(kinds)}") from exc
    return column_ids(ids, id_column)


def _holds_str(kind: pa.DataType) -> bool:
    """Whether an Arrow column of type ``kind`` holds str rows (null: no value yet, which the windows check)."""
    return is_text_type(kind) or pa.types.is_null(kind)


def _run_stored(out: Any, opened: Any, key: str | None, id_column: str) -> Any:
    """Runs the job (each window commits its rows to the store) and returns a dataset reading the whole store.

    Raises:
        ValueError: the store holds an id twice that it did not before (:func:`_read_store`): the dataset's ids,
            read and checked before the job, were not those its windows ran (a dataset that reads differently
            each time).
    """
    import ray.data

    totals = dict.fromkeys(SUMMARY, 0)
    for batch in out.iter_batches(batch_size=None, batch_format="numpy"):
        for name in SUMMARY:
            totals[name] += int(np.sum(batch[name]))
    logger.info("map_texts: output_path=%r held %d rows before; of this dataset's %d rows, %d were held, %d ran now, "
                "%d of them without a result (not stored: a rerun tries them again)", opened.path, len(opened.ids),
                totals["rows"], totals["held"], totals["ran"], totals["failed"])
    return _read_store(open_store(opened.path, key), id_column, known=_repeated(opened))


def stored_results(output_path: str | os.PathLike, *, key: str | None, id_column: str = "id") -> Any:
    """The results store predictors wrote (``output_path``), checked and read as a ``ray.data.Dataset``, once their
    job has finished: what ``map_texts(..., output_path=...)`` returns, for a job run with ``ds.map_batches``.

    Each window checks its own ids only, and each actor the ids stored when it started: an id in rows of two
    windows runs in both and is stored twice, maybe from two texts. ``map_texts`` reads the dataset's ids and refuses
    such an id before any actor runs; after a ``map_batches`` job, nothing but this does (a plain Parquet read of the
    store reads both copies).

    Args:
        output_path: the store's directory (the predictors' ``output_path``).
        key: the predictors' ``key``; a store of another key is refused.
        id_column: the predictors' ``id_column``, for the message.

    Returns:
        A dataset of one row per stored id: the ids in a column ``id`` and the output as the store holds it (one
        column per output; tensors as Arrow lists).

    Raises:
        ValueError: ids stored more than once (naming them), a store of another ``key``, or no dynabatch store.

    Example:
        After a job without ``map_texts`` (``Embed`` as in :mod:`dynabatch.integrations.ray`)::

            ds.map_batches(Embed, fn_constructor_kwargs=dict(batch_size=16, max_input_token_length=256,
                           output_path="embeddings/", key="minilm cls 256"), batch_size=4096,
                           compute=ray.data.ActorPoolStrategy(size=2)).materialize()   # one summary row a window
            out = stored_results("embeddings/", key="minilm cls 256")
    """
    import_extra("ray.data", "ray", "dynabatch.integrations.ray.stored_results")
    rule = "the directory of a results store (the predictors' output_path)"
    if not isinstance(output_path, (str, os.PathLike)):
        raise bad_type("output_path", rule, output_path)
    check_store_options(output_path, key, id_column)
    if not os.path.isdir(output_path):  # not made here: a misspelt path would read as a store of no rows
        raise bad_value("output_path", rule, output_path)
    return _read_store(open_store(output_path, key), id_column, known=set())


def _repeated(store: Any) -> set[Any]:
    """The ids ``store`` holds more than one row of."""
    return set(store.ids.take(pa.array(store.repeated, pa.int64())).to_pylist()) if len(store.repeated) else set()


def _read_store(store: Any, id_column: str, *, known: set[Any]) -> Any:
    """A dataset reading ``store`` (opened for it, closed here), refusing (``ValueError``) ids it holds more than one
    row of, except those ``known`` (stored twice before this job).

    Only a reader of the whole store sees every window's ids, once they are stored: an id in two windows ran in
    both, and the store holds both copies, maybe from different texts, reading the first.
    """
    import ray.data

    repeated = sorted(_repeated(store) - known)
    if repeated:
        store.close()
        raise ValueError(
            f"id_column={id_column!r} should hold ids unique in the dataset (each row's result is stored under its "
            f"id), but got {len(repeated)} ids in more than one row ({first_few(repeated)}): each of their "
            f"rows ran and output_path={store.path!r} now holds a copy of each (read as the first found); give every "
            "row its own id, and use another output_path")
    store.settle()  # one schema in every shard: Ray reads each shard on its own
    store.close()
    if store.columns is None:
        return ray.data.from_arrow(pa.table({"id": store.ids}))
    columns = ["id", *store.columns.names]

    # One task per shard, reading it with pyarrow: ray.data.read_parquet resolves paths in threads that import
    # fsspec's HTTP filesystem, which fails (ImportError, not caught) without aiohttp when two threads race.
    def read(shards: Any) -> Any:  # nested: pickled by value, so the tasks do not import dynabatch
        import pyarrow.parquet as pq

        return pa.concat_tables([pq.read_table(file, columns=columns) for file in shards.column("file").to_pylist()])

    return ray.data.from_items([{"file": file} for file in store.files]).map_batches(
        read, batch_size=1, batch_format="pyarrow")
