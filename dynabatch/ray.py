"""Ray Data integration: memory-safe dynamic batches inside ``Dataset.map_batches``.

Ray Data hands each actor fixed windows of rows (``map_batches``' ``batch_size``
counts rows only). :class:`DynamicBatchPredictor` is a callable class for
``map_batches`` that, for every window, tokenizes the window's texts once,
plans them longest first into memory-safe batches with
:func:`~dynabatch.inference.loader.build_dynamic_batch_dataloader` (the planner
and safe default of :func:`dynabatch.run`), runs them with
:func:`dynabatch.run` (a batch that runs out of memory is split in halves, down
to one row) and returns the window with the result added as one column, in the
window's row order; the input columns pass through.

Subclass it and write :meth:`DynamicBatchPredictor.setup`, which loads the
model once per actor and returns ``(tokenizer, fn)``; ``fn`` takes a
:class:`~dynabatch.data.collate.Batch` as :func:`dynabatch.run` does::

    import ray
    from transformers import AutoModel, AutoTokenizer
    from dynabatch.ray import DynamicBatchPredictor, map_texts

    class Embed(DynamicBatchPredictor):
        def setup(self):
            tok = AutoTokenizer.from_pretrained("sentence-transformers/all-MiniLM-L6-v2")
            model = AutoModel.from_pretrained("sentence-transformers/all-MiniLM-L6-v2").eval()
            return tok, lambda b: model(**b).last_hidden_state[:, 0]

    ds = ray.data.read_parquet("texts.parquet")          # a "text" column
    out = ds.map_batches(Embed, fn_constructor_kwargs=dict(batch_size=16, max_input_token_length=256),
                         batch_size=4096, compute=ray.data.ActorPoolStrategy(size=2))
    # or let the helper choose the window, the actors and the GPUs:
    out = map_texts(ds, Embed, batch_size=16, max_input_token_length=256)
    out.write_parquet("embeddings/")                     # columns: text, output

Memory knowledge per actor: each actor keeps a
:class:`~dynabatch.memory.model.MemoryModel`, seeded by ``calibrate=True`` or a
saved model (``memory_model=``) and grown from every measured batch of every
window, so that later windows are sized by what was measured instead of
re-learned (see :class:`DynamicBatchPredictor`, "Planning a window").

Faults are Ray's: an actor that dies is restarted (Ray Data's actor pools set
``max_restarts=-1`` and ``max_task_retries=-1`` unless you pass others) and the
window it was running is run again; a window's output is made only from its own
rows and comes back whole or not at all, so no row is lost or duplicated. A row
that runs out of memory even alone raises
:class:`~dynabatch.inference.results.BatchOutOfMemoryError` (``on_oom="raise"``,
which fails the job) or is reported in an error column (``on_oom="skip"``).

Ray is optional (``pip install dynabatch[ray]``): this module imports without
it, and only :func:`map_texts` imports ``ray``. Nothing in dynabatch imports
this module.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import numbers
import os
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

from dynabatch._validation import bad_type, bad_value, check_positive_int
from dynabatch.inference.loader import build_dynamic_batch_dataloader
from dynabatch.inference.report import RunReport
from dynabatch.inference.results import BatchOutOfMemoryError, RunResult
from dynabatch.inference.runner import check_run_options, run
from dynabatch.memory.model import MemoryModel

__all__ = ["PLANS", "DynamicBatchPredictor", "default_window", "map_texts", "to_column"]

logger = logging.getLogger(__name__)

_LOADER_OWN = ("texts", "tokenizer", "batch_size", "max_input_token_length", "progress", "num_workers",
               "memory_model", "max_memory")
_CALIBRATE_OWN = ("work", "tokenizer", "batch_size", "max_input_token_length", "progress")
_LOOSE = 0.10  # a measured batch predicted more than this far above its peak tightens the model
_TIGHTENING_POINTS = 8  # of those, at most this many per window (each is a refit)
_TIGHTENING_PROBES = 256  # and none once the model holds this many points (a long job's model stays small)

PLANS = ("relative", "model-relative", "measured")
"""How a window was planned (the ``plan`` of :meth:`DynamicBatchPredictor.window_done`):

* ``"relative"``: the loader's default plan (the spike classifier), relative
  to the window's own first batch of ``batch_size`` longest texts;
* ``"model-relative"``: the actor's memory model, relative to that first batch's predicted peak;
* ``"measured"``: the actor's memory model, to the reference peak measured on
  an earlier window's first batch (``max_memory`` in bytes).
"""


def _check_column(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise bad_type(name, "a column name (a non-empty str)", value)
    if not value:
        raise bad_value(name, "a column name (a non-empty str)", value)
    return value


def _check_options(name: str, value: Any, own: tuple[str, ...]) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise bad_type(name, "None or a dict of keyword arguments", value)
    taken = sorted(set(value) & set(own))
    if taken:
        raise bad_value(name, f"a dict without the keywords DynamicBatchPredictor sets itself {list(own)}",
                        dict(value))
    return dict(value)


def _as_numpy(item: Any) -> Any:
    """A result row with its tensors as numpy arrays (inside plain tuples, lists and dicts too)."""
    import torch

    if isinstance(item, torch.Tensor):
        item = item.detach().cpu()
        if item.dtype == torch.bfloat16:  # numpy has no bfloat16
            item = item.float()
        return item.numpy()
    if type(item) in (list, tuple):
        return type(item)(_as_numpy(x) for x in item)
    if type(item) is dict:
        return {key: _as_numpy(value) for key, value in item.items()}
    return item


def to_column(results: list[Any]) -> np.ndarray:
    """One column from per-row results: stacked when every row is an array of one shape and dtype.

    Tensors become numpy arrays. Rows that are arrays of one shape and dtype
    (an embedding, logits, a scalar) are stacked into one array, which Ray
    stores as a tensor column; anything else (``generate`` token ids of their
    own lengths, strings, dicts, a ``None`` for a failed row) is an object
    array with one item per row.

    Example:
        >>> import torch
        >>> to_column([torch.ones(3), torch.zeros(3)]).shape
        (2, 3)
        >>> column = to_column([torch.tensor([5, 6]), torch.tensor([7]), None])
        >>> column.dtype, [None if r is None else r.tolist() for r in column]
        (dtype('O'), [[5, 6], [7], None])
    """
    rows = [_as_numpy(r) for r in results]
    if rows and all(isinstance(r, np.ndarray) for r in rows):
        first = rows[0]
        if all(r.shape == first.shape and r.dtype == first.dtype for r in rows):
            return np.stack(rows)
    column = np.empty(len(rows), dtype=object)
    for i, row in enumerate(rows):
        column[i] = row
    return column


def _columns(batch: Any) -> tuple[list[str], Any]:
    """The batch's column names, and whether it is a pandas DataFrame (else a dict of arrays)."""
    if isinstance(batch, Mapping):
        return list(batch), False
    if hasattr(batch, "columns") and hasattr(batch, "assign"):  # a pandas DataFrame
        return [str(c) for c in batch.columns], True
    raise bad_type("batch", "a dict of numpy arrays (map_batches' default batch_format) or a pandas DataFrame",
                   batch)


class DynamicBatchPredictor:
    """A ``map_batches`` callable class that runs each window of rows in memory-safe dynamic batches.

    Subclass it and write :meth:`setup`. Ray constructs one instance per actor
    with ``fn_constructor_kwargs`` (the arguments below); ``setup`` runs once
    there, and every call gets one window of rows (a dict of numpy arrays)
    and returns it with the result column added.

    Planning a window. Each window is tokenized once and planned longest first
    by :func:`~dynabatch.inference.loader.build_dynamic_batch_dataloader`; how
    depends on what the actor knows (``learn_memory=True``, the default):

    * nothing yet: the loader's default plan, relative to the window's first
      batch of ``batch_size`` longest texts (``"relative"``), as
      :func:`dynabatch.run` plans one machine's texts;
    * a memory model (calibrated, loaded, or grown from earlier windows)
      but no reference peak yet: planned by the model, relative to the
      predicted peak of that first batch (``"model-relative"``);
    * a reference peak: the measured peak of ``batch_size`` rows of the
      longest texts the actor has run (the first batch of its first window,
      raised when a later window brings longer texts). Later windows are
      planned by the model to that reference as an absolute budget
      (``max_memory``, ``"measured"``), so a window of short texts starts
      with large batches at once instead of re-learning from ``batch_size``.

    The model never extrapolates to longer texts than it has measured: a
    window whose longest text (padded) is longer than the reference batch or
    the model's longest measured point is planned relative to its own first
    batch instead (by the model where its measurements reach, else by the
    default plan), and that first batch's peak becomes the new reference.
    Such a window is tokenized a second time (the first plan is only looked
    at): once per new longest length, so a few times per actor.

    Every batch is measured while a model is being grown (``measure_memory``
    is ``True`` unless you name a device), and each measured batch that
    tells the model something is added to it: a longer length than measured,
    or a peak above its prediction (always), or one more than 10% under it
    (at most 8 a window, until the model holds 256 points, so that a long
    job's model stays small; each point is a refit). A batch that ran out of
    memory caps the rows at its shape and longer. An actor that Ray restarts starts
    again from ``setup`` (and ``calibrate``) with what it was given.

    Args:
        batch_size: rows of each window's first batch, the ``batch_size``
            longest texts (:func:`~dynabatch.inference.loader.build_dynamic_batch_dataloader`).
        max_input_token_length: truncation limit per text, in tokens.
        text_column: the column of input texts (str).
        output_column: the column the results go in (added; an existing
            column of that name is refused). Tensors become numpy arrays:
            one row each (stacked into a tensor column when they share a
            shape); ``generate`` token ids lose their padding as in
            :func:`dynabatch.run`, each row its own length (an object column).
        error_column: with ``on_oom="skip"``, a str column added beside the
            results: ``""`` for every row that ran, a message for a row that
            ran out of memory on its own (its result is ``None``).
        on_oom: ``"raise"`` (a row that runs out of memory on its own raises
            :class:`~dynabatch.inference.results.BatchOutOfMemoryError`, which
            fails the window and the job) or ``"skip"`` (it is reported in
            ``error_column``). Larger batches are always split and retried.
        device: where to move each batch before ``fn`` (``run``'s ``device``),
            and the device calibration and measurement use; ``None`` leaves it.
        measure_memory: ``run``'s ``measure_memory``; ``None``: ``True`` while a
            memory model is grown (``learn_memory``), else ``run``'s default.
        adapt: ``run``'s ``adapt``; ``None``: ``run``'s default, except that a
            window planned by the memory model this actor grows runs as planned
            (``adapt=False``: the model already learns from each of its batches).
        calibrate: run :func:`dynabatch.calibrate` on ``fn`` once in the actor,
            after ``setup``, and plan with that model from the first window.
        memory_model: a saved :class:`~dynabatch.memory.model.MemoryModel`
            (a path, or the object, which is copied) to start from.
        learn_memory: carry what each window measures to the next ones (see
            above). ``False``: every window is planned on its own, as ``run``
            plans one machine's texts (with ``calibrate`` / ``memory_model``,
            by that model, relative to the window's first batch).
        inference_mode: call ``fn`` (and calibrate) under ``torch.inference_mode()``.
        loader_kwargs: more keywords for ``build_dynamic_batch_dataloader``
            (``model_shape``, ``threshold``, ``memory_margin``, tokenizer
            keywords such as ``return_token_type_ids=False``), except those set here.
        calibrate_kwargs: more keywords for :func:`dynabatch.calibrate`
            (``texts``, ``max_probes``, ``limit_bytes``, ...), with ``calibrate=True``.

    Attributes:
        tokenizer, fn: what :meth:`setup` returned.
        memory_model: the actor's :class:`~dynabatch.memory.model.MemoryModel`
            (``None`` without ``learn_memory``, ``calibrate`` or ``memory_model``).
        reference_bytes: the reference peak (``None`` until measured).
        reference_width: the padded length of the batch that measured it.
        windows: windows run so far by this instance.
        replans: windows planned twice (longer texts than measured).

    Raises:
        TypeError, ValueError: a bad argument (checked before ``setup`` runs),
            or ``setup`` not returning a ``(tokenizer, fn)`` pair.

    Example:
        Called directly on one window (what a Ray actor does with each):

        >>> import numpy as np
        >>> from transformers import AutoModel, AutoTokenizer
        >>> from dynabatch.demo import minilm_path
        >>> from dynabatch.ray import DynamicBatchPredictor
        >>> class Embed(DynamicBatchPredictor):
        ...     def setup(self):
        ...         tok = AutoTokenizer.from_pretrained(minilm_path())
        ...         model = AutoModel.from_pretrained(minilm_path()).eval()
        ...         return tok, lambda b: model(**b).last_hidden_state[:, 0]
        >>> embed = Embed(batch_size=2, max_input_token_length=32)
        >>> window = {"id": np.arange(3), "text": np.array(["In the beginning", "And God said", "Let there be light"])}
        >>> out = embed(window)
        >>> sorted(out), out["output"].shape, out["id"].tolist()
        (['id', 'output', 'text'], (3, 384), [0, 1, 2])
    """

    def __init__(
        self,
        *,
        batch_size: int,
        max_input_token_length: int,
        text_column: str = "text",
        output_column: str = "output",
        error_column: str = "error",
        on_oom: str = "raise",
        device: Any = None,
        measure_memory: Any = None,
        adapt: bool | None = None,
        calibrate: bool = False,
        memory_model: Any = None,
        learn_memory: bool = True,
        inference_mode: bool = True,
        loader_kwargs: dict[str, Any] | None = None,
        calibrate_kwargs: dict[str, Any] | None = None,
    ) -> None:

        self.batch_size = check_positive_int("batch_size", batch_size)
        self.max_input_token_length = check_positive_int("max_input_token_length", max_input_token_length)
        self.text_column = _check_column("text_column", text_column)
        self.output_column = _check_column("output_column", output_column)
        self.error_column = _check_column("error_column", error_column)
        if self.output_column == self.text_column:
            raise bad_value("output_column", f"another column than text_column={text_column!r}", output_column)
        check_run_options(device, on_oom, measure_memory, adapt)
        if on_oom == "skip" and self.error_column in (self.text_column, self.output_column):
            raise bad_value("error_column", "another column than text_column and output_column", error_column)
        self.on_oom = on_oom
        self.device = device
        for name, value in (("calibrate", calibrate), ("learn_memory", learn_memory),
                            ("inference_mode", inference_mode)):
            if not isinstance(value, bool):
                raise bad_type(name, "a bool", value)
        if learn_memory and measure_memory is False:
            raise bad_value("measure_memory", "True, None or a device while learn_memory=True (the memory model "
                            "learns from measured peaks)", measure_memory)
        if memory_model is not None and not isinstance(memory_model, (str, os.PathLike, MemoryModel)):
            raise bad_type("memory_model", "None, a MemoryModel, or the path of a saved one", memory_model)
        if calibrate and memory_model is not None:
            raise bad_value("memory_model", "None with calibrate=True (calibrate makes the model)", memory_model)
        self.measure_memory = measure_memory
        self.adapt = adapt
        self.learn_memory = learn_memory
        self.inference_mode = inference_mode
        self.loader_kwargs = _check_options("loader_kwargs", loader_kwargs, _LOADER_OWN)
        if calibrate_kwargs is not None and not calibrate:
            raise bad_value("calibrate_kwargs", "None without calibrate=True", calibrate_kwargs)
        self.calibrate_kwargs = _check_options("calibrate_kwargs", calibrate_kwargs, _CALIBRATE_OWN)

        self.tokenizer, self.fn = self._set_up()
        self.memory_model: MemoryModel | None = None
        if isinstance(memory_model, MemoryModel):
            self.memory_model = MemoryModel.from_dict(memory_model.to_dict())  # the caller's object stays as it was
        elif memory_model is not None:
            self.memory_model = MemoryModel.load(memory_model, device=device)
        elif calibrate:
            self.memory_model = self._calibrate()
        elif learn_memory:
            self.memory_model = MemoryModel(device=self._measure_device())
        self.reference_bytes: int | None = None
        self.reference_width: int | None = None
        self.windows = 0
        self.replans = 0
        self._learning = learn_memory

    # -- what a subclass writes ------------------------------------------------
    def setup(self) -> tuple[Any, Any]:
        """Loads the model once per actor; returns ``(tokenizer, fn)``.

        ``tokenizer`` is a Hugging Face tokenizer object with a pad token;
        ``fn`` takes a :class:`~dynabatch.data.collate.Batch` (a dict of
        tensors for ``model(**batch)`` or ``model.generate(**batch)``) and
        returns one result per row, as for :func:`dynabatch.run`. The
        constructor's arguments are attributes by then (``self.device``,
        ``self.max_input_token_length``, ...).
        """
        raise NotImplementedError(
            f"{type(self).__name__} should define setup(self), which loads the model once per actor and returns "
            "(tokenizer, fn): subclass DynamicBatchPredictor and write it")

    def window_done(self, report: RunReport, plan: str) -> None:
        """Called after each window with its :class:`~dynabatch.inference.report.RunReport` and how it was
        planned (one of :data:`PLANS`); logs one line. Override it to collect per-batch records."""
        summary = report.summary()
        logger.info("window %d: %d rows in %d batches (%s plan), padding efficiency %.3f, max peak ratio %s",
                    self.windows, summary["rows"], summary["batches"], plan, summary["padding_efficiency"] or 0.0,
                    summary["max_peak_ratio"])

    # -- setup ---------------------------------------------------------------
    def _set_up(self) -> tuple[Any, Any]:
        returned = self.setup()
        if not (isinstance(returned, tuple) and len(returned) == 2):
            raise bad_type("setup()", "a (tokenizer, fn) pair", returned)
        tokenizer, fn = returned
        if not callable(tokenizer) or isinstance(tokenizer, str):
            raise bad_type("setup()[0]", "a tokenizer object (e.g. AutoTokenizer.from_pretrained(...))", tokenizer)
        if not callable(fn):
            raise bad_type("setup()[1]", "a callable taking a dynabatch.Batch", fn)
        return tokenizer, fn

    def _grad_mode(self) -> Any:
        import torch

        return torch.inference_mode() if self.inference_mode else contextlib.nullcontext()

    def _measure_device(self) -> str:
        """The device measured peaks are of: ``measure_memory`` when it names one, else ``device``, else the CPU."""
        if self.measure_memory is not None and not isinstance(self.measure_memory, bool):
            return str(self.measure_memory)
        return str(self.device) if self.device is not None else "cpu"

    def _calibrate(self) -> MemoryModel:
        import torch

        from dynabatch.memory.calibrate import calibrate

        options = dict(self.calibrate_kwargs)
        options.setdefault("device", self.device)
        if isinstance(self.measure_memory, (str, torch.device)):
            options.setdefault("measure_memory", self.measure_memory)
        # Probes padded and tokenized as the windows' batches will be: the loader's margin, padding multiple and
        # tokenizer keywords (those of loader_kwargs that are not the loader's own parameters).
        own = inspect.signature(build_dynamic_batch_dataloader).parameters
        for key in ("pad_to_multiple_of", "memory_margin"):
            if key in self.loader_kwargs:
                options.setdefault(key, self.loader_kwargs[key])
        tokenizer_kwargs = {k: v for k, v in self.loader_kwargs.items() if k not in own and k != "pad_to_multiple_of"}
        if tokenizer_kwargs:
            options.setdefault("tokenizer_kwargs", tokenizer_kwargs)
        with self._grad_mode():
            mm = calibrate(self.fn, self.tokenizer, batch_size=self.batch_size,
                           max_input_token_length=self.max_input_token_length, progress=False, **options)
        logger.info("calibrated in the actor: %d probes, leave-one-out error %.3f", len(mm.probes_), mm.loo_error_)
        return mm

    # -- one window ------------------------------------------------------------
    def __call__(self, batch: Any) -> Any:
        """Runs one window: the window with ``output_column`` (and, with ``on_oom="skip"``, ``error_column``) added."""
        names, is_frame = _columns(batch)
        if self.text_column not in names:
            raise bad_value("text_column", f"a column of the batch {names}", self.text_column)
        added = [self.output_column] + ([self.error_column] if self.on_oom == "skip" else [])
        for name, column in zip(("output_column", "error_column"), added):
            if column in names:
                raise bad_value(name, f"a column the batch does not have already {names}", column)
        texts = batch[self.text_column]
        texts = texts.tolist() if hasattr(texts, "tolist") else list(texts)
        if not texts:
            results: list[Any] = []
            failed: list[int] = []
        else:
            result = self._run_window(texts)
            results, failed = list(result), result.failed
        columns = {self.output_column: to_column(results)}
        if self.on_oom == "skip":
            errors = np.full(len(texts), "", dtype=object)
            for p in failed:
                errors[p] = "out of memory on its own (a batch of one row); its result is None"
            columns[self.error_column] = errors
        if is_frame:
            return batch.assign(**{name: list(values) for name, values in columns.items()})
        out = dict(batch)
        out.update(columns)
        return out

    def _loader(self, texts: list[str], plan: str) -> Any:
        options = dict(self.loader_kwargs)
        if plan != "relative":
            options["memory_model"] = self.memory_model
        if plan == "measured":
            options["max_memory"] = self.reference_bytes
        with warnings.catch_warnings():
            # The model's extrapolation warnings do not apply here. More rows than measured: the model bounds them
            # linearly from the most rows measured at that length or longer (MemoryModel's reach rule), which holds
            # for every phase of the form a + rows * s. Longer texts than measured: _plan looks at the window's
            # longest text only once its loader is built, and discards a model's plan that reaches past what was
            # measured; the plan it keeps never does.
            warnings.filterwarnings("ignore", message="MemoryModel extrapolates: ", category=UserWarning)
            return build_dynamic_batch_dataloader(texts, self.tokenizer, self.batch_size,
                                                  self.max_input_token_length, progress=False, num_workers=0,
                                                  **options)

    def _first_plan(self) -> str:
        mm = self.memory_model
        if mm is None or not len(mm.coef_):
            return "relative"
        if self._learning and self.reference_bytes is not None:
            return "measured"
        return "model-relative"

    def _plan(self, texts: list[str]) -> tuple[Any, str, int]:
        """The window's loader, how it was planned, and its longest padded length."""
        plan = self._first_plan()
        loader = self._loader(texts, plan)
        width = int(next(iter(loader))["input_ids"].shape[1])  # longest first: the window's longest text
        if plan == "relative":
            return loader, plan, width
        territory = self.memory_model.measured_length_
        fits = width <= territory and (plan != "measured" or width <= self.reference_width)
        if fits:
            return loader, plan, width
        replan = "model-relative" if width <= territory else "relative"
        logger.info("window's longest text pads to %d tokens, beyond what was measured (model up to %d, reference "
                    "batch %s): planned %s to its own first batch", width, territory, self.reference_width, replan)
        self.replans += 1
        return self._loader(texts, replan), replan, width

    def _run_options(self, plan: str) -> dict[str, Any]:
        options: dict[str, Any] = {"on_oom": self.on_oom, "progress": False}
        if self.device is not None:
            options["device"] = self.device
        if self.measure_memory is not None:
            options["measure_memory"] = self.measure_memory
        elif self._learning:
            options["measure_memory"] = True
        if self.adapt is not None:
            options["adapt"] = self.adapt
        elif self._learning and plan != "relative":
            # The window was planned by this actor's measured memory model, which learns from every batch in
            # _learn: run keeps that plan rather than re-sizing it (and feeding the same model) a second time.
            options["adapt"] = False
        return options

    def _run_window(self, texts: list[str]) -> RunResult:
        loader, plan, width = self._plan(texts)
        with self._grad_mode():
            try:
                result = run(self.fn, loader, **self._run_options(plan))
            except BatchOutOfMemoryError as exc:
                text = texts[exc.position] if exc.position is not None else ""
                raise BatchOutOfMemoryError(
                    f"row {exc.position} of this window ran out of memory on its own (text {text[:80]!r}); pass "
                    f"on_oom='skip' to get it reported in the {self.error_column!r} column instead",
                    position=exc.position) from exc
        self.windows += 1
        if self._learning:
            self._learn(result.report, plan, width)
        self.window_done(result.report, plan)
        return result

    # -- memory knowledge --------------------------------------------------------
    def _learn(self, report: RunReport, plan: str, width: int) -> None:
        """Raises the reference when a window's first batch set one, and grows the model from the window's batches."""
        if not report.records:
            return
        first = report.records[0]
        if first.peak_bytes is not None and first.peak_bytes <= 0 and report.budget_bytes == 0:
            logger.warning("the first batch's peak measured 0 bytes on %s: fn does not run on the measured device "
                           "(pass device= or measure_memory=); not learning memory in this actor",
                           self._measure_device())
            self._learning = False
            return
        if (plan != "measured" and report.budget_bytes is not None and first.rows >= self.batch_size
                and (self.reference_width is None or width >= self.reference_width)):
            self.reference_bytes = max(int(report.budget_bytes), self.reference_bytes or 0)
            self.reference_width = width
        mm = self.memory_model
        tightening = 0
        for rec in report.records:
            if rec.pre_split:  # run split it before trying: its shape was not tried
                continue
            if rec.oom_splits:  # the whole batch ran out of memory: rows stay below it at its length and longer
                if rec.rows > 1:
                    mm.observe(rec.rows, rec.width, None, out_of_memory=True, source="ray")
                continue
            if rec.failed_rows or rec.peak_bytes is None or rec.peak_bytes <= 0:  # a row that failed alone
                continue
            if len(mm.coef_) and rec.width <= mm.measured_length_:
                predicted = float(mm.predict_unchecked(np.array([float(rec.rows)]), np.array([float(rec.width)]))[0])
                if predicted >= rec.peak_bytes:  # the model already covers it
                    if (predicted <= (1 + _LOOSE) * rec.peak_bytes or tightening >= _TIGHTENING_POINTS
                            or len(mm.probes_) >= _TIGHTENING_PROBES):
                        continue
                    tightening += 1
            mm.observe(rec.rows, rec.width, rec.peak_bytes, source="ray")


def _cluster_counts() -> tuple[float, float]:
    """CPUs and GPUs of the Ray cluster (this machine's when Ray is not initialized yet)."""
    import ray

    if ray.is_initialized():
        resources = ray.cluster_resources()
        return float(resources.get("CPU", 1)), float(resources.get("GPU", 0))
    try:
        import torch

        gpus = torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - no usable CUDA: count none
        gpus = 0
    return float(os.cpu_count() or 1), float(gpus)


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
    **predictor_kwargs: Any,
) -> Any:
    """``ds.map_batches(predictor_cls, ...)`` with sensible window, actors and GPUs: the common case in one call.

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
        **predictor_kwargs: the predictor's other arguments (``text_column``,
            ``output_column``, ``on_oom``, ``calibrate``, ...).

    Returns:
        The mapped ``ray.data.Dataset`` (lazy, as ``map_batches`` returns it).

    Raises:
        TypeError, ValueError: a bad argument.
    """
    import ray.data

    if not (isinstance(predictor_cls, type) and issubclass(predictor_cls, DynamicBatchPredictor)):
        raise bad_type("predictor_cls", "a subclass of dynabatch.ray.DynamicBatchPredictor", predictor_cls)
    if not isinstance(ds, ray.data.Dataset):
        raise bad_type("ds", "a ray.data.Dataset", ds)
    check_positive_int("batch_size", batch_size)
    window = default_window(batch_size) if window is None else check_positive_int("window", window)
    if not isinstance(sort_by_length, bool):
        raise bad_type("sort_by_length", "a bool", sort_by_length)
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
    text_column = predictor_kwargs.get("text_column", "text")
    kwargs = dict(predictor_kwargs, batch_size=batch_size, max_input_token_length=max_input_token_length)
    remote = dict(ray_remote_args or {})
    if num_gpus:
        remote["num_gpus"] = num_gpus
    if num_cpus is not None:
        remote["num_cpus"] = num_cpus
    key = "__dynabatch_chars"
    if sort_by_length:
        # Materialized before the actors start: a global sort is a barrier anyway, and the sort's tasks must not
        # wait for CPUs the actor pool holds.
        def char_lengths(table: Any) -> Any:  # nested: pickled by value, so the tasks do not import dynabatch
            import pyarrow.compute as pc

            return table.append_column(key, pc.utf8_length(table.column(text_column)))

        ds = ds.map_batches(char_lengths, batch_format="pyarrow").sort(key, descending=True)
        ds = ds.materialize()
    logger.info("map_texts: windows of %d rows, %s actor(s), %s GPU(s) each%s", window, actors, num_gpus,
                ", sorted by length" if sort_by_length else "")
    out = ds.map_batches(predictor_cls, fn_constructor_kwargs=kwargs, batch_size=window, compute=compute,
                         **remote)
    return out.drop_columns([key]) if sort_by_length else out
