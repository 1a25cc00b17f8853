"""The predictor: :class:`DynamicBatchPredictor`, a ``map_batches`` callable class."""

from __future__ import annotations

import inspect
import json
import logging
import os
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from dynabatch._validation import bad_type, bad_value, check_bool, check_positive_int, brief, did_you_mean, first_few
from dynabatch.data.tokenization import split_bad_texts
from dynabatch.inference.execute import BatchOutOfMemoryError
from dynabatch.inference.loader import plan_of
from dynabatch.inference.report import RunReport
from dynabatch.inference.results import RunResult
from dynabatch.inference.runner import check_run_options, run
from dynabatch.integrations.ray._columns import check_column, check_options, columns_of, frame_column, output_column
from dynabatch.integrations.ray._memory import WindowMemory
from dynabatch.integrations.ray._store import SUMMARY, WindowStore, check_store_options
from dynabatch.memory.model import MemoryModel

__all__ = ["DynamicBatchPredictor", "check_constructor"]

logger = logging.getLogger(__name__)

_LOADER_OWN = ("texts", "tokenizer", "batch_size", "max_input_token_length", "progress", "num_workers",
               "memory_model", "max_memory")
_CALIBRATE_OWN = ("work", "tokenizer", "batch_size", "max_input_token_length", "progress")
_RUN_OWN = ("fn", "loader", "make_fn", "devices", "device", "memory", "on_oom", "on_error", "output_path", "key",
            "progress")


class DynamicBatchPredictor(WindowMemory):
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

    Every batch is measured while a model is being grown (``memory="record"``
    unless you choose another mode), and each measured batch that
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
        error_column: with ``on_oom="skip"``, ``on_error="skip"`` or
            ``loader_kwargs={"on_bad_input": "skip"}``, a str column added
            beside the results: ``""`` for every row that ran, its cause for a
            row set aside (``"out of memory alone: ..."``, the error ``fn``
            raised on it alone, or ``"bad input: not a str ..."``; its result
            is ``None``).
        on_oom: ``"raise"`` (a row that runs out of memory on its own raises
            :class:`~dynabatch.inference.execute.BatchOutOfMemoryError`, which
            fails the window and the job) or ``"skip"`` (it is reported in
            ``error_column``). Larger batches are always split and retried.
        on_error: ``run``'s: ``"raise"`` (a row whose ``fn`` call raises fails
            the window) or ``"skip"`` (it is set aside, reported as with
            ``on_oom="skip"``, with the error's text).
        device: where to move each batch before ``fn`` (``run``'s ``device``),
            and the device calibration and measurement use; ``None`` leaves it.
        memory: ``run``'s ``memory``; ``"auto"``: while a memory model is grown
            (``learn_memory``), a window planned by it runs as planned with every
            batch measured (``"record"``: the model already learns from each of
            its batches), other windows in measured mode; else ``run``'s default.
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
            ``on_bad_input="skip"``: a text that is not a str (a null) gets
            ``None`` and its cause in ``error_column``, as a row ``on_error="skip"``
            sets aside; else such a text fails the window, naming its row.
        calibrate_kwargs: more keywords for :func:`dynabatch.calibrate`
            (``texts``, ``max_probes``, ``limit_bytes``, ...), with ``calibrate=True``.
        run_kwargs: more keywords for :func:`dynabatch.run` (``token_outputs``,
            ``prefetch``, ...), except those set here.
        output_path: a directory (reachable from every actor) to store the
            results in: the results store of ``dynabatch.run(...,
            output_path=...)``, keyed by ``id_column``. Each window runs only
            the rows whose id the store does not hold yet (a resumed job),
            after checking that the held rows were computed from the same
            inputs, and commits the rows it ran as one Parquet shard (whole or
            not at all); it returns one row per window instead of its rows
            (columns ``rows``, ``held``, ``ran``, ``failed``). ``None``: the
            window comes back with its results.
        key: with ``output_path``, what computes the rows (the model, its
            revision, the settings); a store of another key is refused.
        id_column: with ``output_path``, the column of each row's id (str or
            int, unique in the dataset).
        keyed_by: with ``output_path``, how the store keys rows: ``"id"``
            (``id_column``'s ids), or ``"position"`` (``id_column`` holds each
            row's int position in the corpus: the store of a ``run`` over texts
            without ids, as ``dynabatch embed`` writes without ``--id-column``).
        job: with ``output_path``, the job the store's lock is held for
            (:mod:`~dynabatch.inference.store_lock`); ``None``: this Ray job.
            The command line passes its driver's, which holds the store.
        report_column: with ``output_path``, a str column added to the
            window's summary row: its :class:`~dynabatch.inference.report.RunReport`
            as JSON (``RunReport.to_dict``), for a driver that reports the job.

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
        >>> from dynabatch.integrations.ray import DynamicBatchPredictor
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
        on_error: str = "raise",
        device: Any = None,
        memory: str = "auto",
        calibrate: bool = False,
        memory_model: Any = None,
        learn_memory: bool = True,
        inference_mode: bool = True,
        loader_kwargs: dict[str, Any] | None = None,
        calibrate_kwargs: dict[str, Any] | None = None,
        run_kwargs: dict[str, Any] | None = None,
        output_path: str | os.PathLike | None = None,
        key: str | None = None,
        id_column: str = "id",
        keyed_by: str = "id",
        job: str | None = None,
        report_column: str | None = None,
    ) -> None:

        self.batch_size = check_positive_int("batch_size", batch_size)
        self.max_input_token_length = check_positive_int("max_input_token_length", max_input_token_length)
        self.text_column = check_column("text_column", text_column)
        self.output_column = check_column("output_column", output_column)
        self.error_column = check_column("error_column", error_column)
        if self.output_column == self.text_column:
            raise bad_value("output_column", f"another column than text_column={text_column!r}", output_column)
        check_run_options(device, on_oom, memory, on_error)
        self.loader_kwargs = check_options("loader_kwargs", loader_kwargs, _LOADER_OWN)
        # A text the loader skips (on_bad_input="skip") gets None as a row that failed does: reported alike, with its
        # cause, in a column that a window with such a row and one without type alike.
        skips = on_oom == "skip" or on_error == "skip" or self.loader_kwargs.get("on_bad_input") == "skip"
        if skips and self.error_column in (self.text_column, self.output_column):
            raise bad_value("error_column", "another column than text_column and output_column", error_column)
        self.on_oom, self.on_error, self.skips = on_oom, on_error, skips
        self.device = device
        for name, value in (("calibrate", calibrate), ("learn_memory", learn_memory),
                            ("inference_mode", inference_mode)):
            check_bool(name, value)
        if learn_memory and memory == "off":
            raise bad_value("memory", "a mode that measures while learn_memory=True (the memory model learns from "
                            "measured peaks)", memory)
        if memory_model is not None and not isinstance(memory_model, (str, os.PathLike, MemoryModel)):
            raise bad_type("memory_model", "None, a MemoryModel, or the path of a saved one", memory_model)
        if calibrate and memory_model is not None:
            raise bad_value("memory_model", "None with calibrate=True (calibrate makes the model)", memory_model)
        self.memory = memory
        self.learn_memory = learn_memory
        self.inference_mode = inference_mode
        if calibrate_kwargs is not None and not calibrate:
            raise bad_value("calibrate_kwargs", "None without calibrate=True", calibrate_kwargs)
        self.calibrate_kwargs = check_options("calibrate_kwargs", calibrate_kwargs, _CALIBRATE_OWN)
        self.run_kwargs = check_options("run_kwargs", run_kwargs, _RUN_OWN)
        check_store_options(output_path, key, id_column, keyed_by, job, report_column)
        self.id_column, self.report_column = id_column, report_column
        if output_path is not None and (id_column == self.output_column
                                        or (skips and id_column == self.error_column)):
            raise bad_value("id_column", "another column than output_column and error_column", id_column)
        # Opened before setup loads the model: a store of another key is refused at once.
        self.store = WindowStore(output_path, key=key, id_column=id_column, keyed_by=keyed_by,
                                 job=job) if output_path is not None else None

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

    # -- one window ------------------------------------------------------------
    def __call__(self, batch: Any) -> Any:
        """Runs one window: the window with ``output_column`` (and, with ``on_oom="skip"``, ``error_column``) added."""
        names, is_frame = columns_of(batch)
        if self.text_column not in names:
            raise bad_value("text_column", f"a column of the batch {names}", self.text_column)
        added = [self.output_column] + ([self.error_column] if self.skips else [])
        for name, column in zip(("output_column", "error_column"), added):
            if column in names:
                raise bad_value(name, f"a column the batch does not have already {names}", column)
        texts = batch[self.text_column]
        texts = texts.tolist() if hasattr(texts, "tolist") else list(texts)
        self._check_texts(batch, names, texts)
        if self.store is not None:
            return self._run_stored(batch, names, is_frame, texts)
        result = self._run_window(texts)[0] if texts else RunResult()
        columns = {self.output_column: output_column(list(result), nullable=self.skips, varying=result.varying)}
        if self.skips:
            errors = np.full(len(texts), "", dtype=object)
            for p, cause in result.failures.items():
                errors[p] = cause
            columns[self.error_column] = errors
        if is_frame:
            return batch.assign(**{name: frame_column(values, batch.index) for name, values in columns.items()})
        out = dict(batch)
        out.update(columns)
        return out

    def _check_texts(self, batch: Any, names: list[str], texts: list[Any]) -> None:
        """Refuses a window with texts that are not str (nulls), naming the column, rows and ids, unless the loader
        skips them (``loader_kwargs={"on_bad_input": "skip"}``).

        The loader's own error names its ``texts`` argument and positions, which a ``map_batches`` user never passed:
        this one names what they did pass, and where to find the rows.
        """
        if self.loader_kwargs.get("on_bad_input") == "skip" or not texts:
            return
        bad = split_bad_texts(texts)[1].tolist()  # the loader's own rule, at C speed where every text is a str
        if not bad:
            return
        where = f"window rows {first_few(bad)}"
        if self.id_column in names:
            ids = batch[self.id_column]
            where += f", ids {first_few([ids[i] for i in bad] if not hasattr(ids, 'iloc') else ids.iloc[bad].tolist())}"
        first = texts[bad[0]]
        raise TypeError(f"text_column={self.text_column!r} should hold a str in every row, but got {len(bad)} of the "
                        f"window's {len(texts)} rows without one ({where}; the first: {first!r} of type "
                        f"{type(first).__name__}): clean them, or pass loader_kwargs={{'on_bad_input': 'skip'}} to "
                        f"get None and the cause in error_column={self.error_column!r} for each")

    def _run_stored(self, batch: Any, names: list[str], is_frame: bool, texts: list[Any]) -> Any:
        """Runs the window's rows the store does not hold and commits them; one summary row (:data:`SUMMARY`)."""
        if self.id_column not in names:
            raise bad_value("id_column", f"a column of the batch {names}", self.id_column)
        ids = self.store.window_ids(batch[self.id_column])
        held, where = self.store.held(ids)
        if held.any():  # rows stored before: computed from these very inputs?
            self.store.check(where[held], self._tokenize([texts[i] for i in np.flatnonzero(held)]))
        todo = np.flatnonzero(~held)
        failed: list[int] = []
        report = RunReport()
        if todo.size:
            result, tokenized = self._run_window([texts[i] for i in todo], todo, ids.take(todo))
            failed, report = result.failed, result.report
            self.store.write(ids.take(todo), list(result), result.failures, tokenized)
        summary: dict[str, list[Any]] = dict(zip(SUMMARY, ([len(texts)], [int(held.sum())], [int(todo.size)],
                                                           [len(failed)])))
        if self.report_column is not None:
            summary[self.report_column] = [json.dumps(report.to_dict())]
        if is_frame:
            import pandas as pd

            return pd.DataFrame(summary)
        return {name: np.array(values, dtype=object if name == self.report_column else np.int64)
                for name, values in summary.items()}

    def _run_options(self, plan: str) -> dict[str, Any]:
        options: dict[str, Any] = {**self.run_kwargs, "on_oom": self.on_oom, "on_error": self.on_error,
                                   "progress": False}
        if self.device is not None:
            options["device"] = self.device
        if self.memory != "auto" or not self._learning:
            options["memory"] = self.memory
        else:
            # A window planned by this actor's measured memory model, which learns from every batch in _learn:
            # run keeps that plan rather than re-sizing it (and feeding the same model) a second time.
            options["memory"] = "measured" if plan == "relative" else "record"
        return options

    def _run_window(self, texts: list[str], rows: np.ndarray | None = None, ids: Any = None) -> tuple[RunResult, Any]:
        """The results of ``texts`` (the window's rows ``rows``; ``None``: all of them; their ids ``ids``, or none),
        and their token store (as the loader tokenized them)."""
        loader, plan, width = self._plan(texts, ids)
        with self._grad_mode():
            try:
                result = run(self.fn, loader, **self._run_options(plan))
            except BatchOutOfMemoryError as exc:
                text = texts[exc.position] if exc.position is not None else ""
                row = int(rows[exc.position]) if rows is not None and exc.position is not None else exc.position
                instead = ("leave it unstored (counted in the window's 'failed'; a rerun tries it again)"
                           if self.store is not None else f"get it reported in the {self.error_column!r} column")
                raise BatchOutOfMemoryError(
                    f"row {row} of this window ran out of memory on its own (text {text[:80]!r}); pass "
                    f"on_oom='skip' to {instead} instead", position=row) from exc
            except Exception as exc:
                _as_window_rows(exc, rows)
                raise
        self.windows += 1
        if self._learning:
            self._learn(result.report, plan, width)
        self.window_done(result.report, plan)
        return result, plan_of(loader).collator.tokenized


# run's note names rows by input position: "input position 2", "input positions 2, 5, 9, ...".
_INPUT_POSITIONS = re.compile(r"input position(s?) (\d+(?:, \d+)*)")


def _as_window_rows(error: BaseException, rows: np.ndarray | None) -> None:
    """``run``'s note on ``error`` names rows by their input positions, which here are their places among the texts
    the window ran (``rows``: their rows of the window; ``None``: all of them, in order): named as the window's rows
    instead (Ray's rows carry no place in the job's input; the note names their ids where the window has them), so
    that no other input is blamed."""

    def window_rows(match: re.Match) -> str:
        places = [int(p) for p in match.group(2).split(", ")]
        return f"window row{match.group(1)} " + ", ".join(str(int(rows[p]) if rows is not None else p) for p in places)

    notes = getattr(error, "__notes__", None)
    if notes:
        error.__notes__ = [_INPUT_POSITIONS.sub(window_rows, note) if note.startswith("dynabatch.run:") else note
                           for note in notes]


def check_constructor(cls: type, kwargs: Mapping[str, Any], caller: str) -> None:
    """Refuses (``TypeError``) the keywords that ``cls(**kwargs)`` would refuse in every actor: one that ``cls`` does
    not take (named, with the closest it takes and all it takes), or one that its own ``__init__`` requires and
    ``kwargs`` lack. ``caller`` passed ``kwargs`` on. Called on the driver: an actor whose constructor raises dies,
    and Ray says so seconds later, as an ``ActorDiedError`` holding the traceback.

    ``cls``'s own signature (``inspect.signature(cls)``: its most-derived ``__init__``) says what it takes and
    requires. Where it takes ``**kwargs``, they are taken to be passed on to ``super().__init__``: the keywords
    named by its bases' ``__init__`` in turn, to the first without ``**kwargs`` (``DynamicBatchPredictor``'s at
    the latest), are taken too. A base's required keyword is not asked of ``kwargs``: the subclass may supply it to
    ``super().__init__`` itself (an actor refuses one it does not).

    Example:
        >>> from dynabatch.integrations.ray.predictor import DynamicBatchPredictor, check_constructor
        >>> try:
        ...     check_constructor(DynamicBatchPredictor, {"batch_size": 8, "max_lenght": 64}, "map_texts")
        ... except TypeError as exc:
        ...     print(str(exc).split(":")[0])
        map_texts() got an unexpected keyword argument 'max_lenght' for DynamicBatchPredictor()
    """
    owner = next((klass for klass in cls.__mro__ if "__init__" in vars(klass)), cls)  # whose __init__ cls runs
    try:
        own = list(inspect.signature(cls).parameters.values())
    except (TypeError, ValueError):  # no signature to read (a C type): it may take anything
        return
    named = [p for p in own if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    taken = {p.name for p in named}
    lacking = [p.name for p in named if p.default is p.empty and p.name not in kwargs]
    if any(p.kind is p.VAR_KEYWORD for p in own):  # passed on to super().__init__: the bases' keywords are taken
        bases = cls.__mro__[cls.__mro__.index(owner) + 1:]
        if not _passed_on(bases, taken):
            return  # every __init__ takes **kwargs: any keyword may be taken
    for name, value in kwargs.items():
        if name not in taken:
            raise TypeError(
                f"{caller}() got an unexpected keyword argument {name!r} for {cls.__name__}(){did_you_mean(name, taken)}"
                f": the keywords {caller} does not take itself go to the predictor, which takes "
                f"{', '.join(sorted(taken))}; but got {name}={brief(value)}")
    if lacking:
        raise TypeError(f"{owner.__name__}.__init__() should get the keyword argument {lacking[0]!r}, but {caller}() "
                        f"got none: pass {lacking[0]}=... to {caller}(), which passes it on")


def _passed_on(bases: tuple[type, ...], taken: set[str]) -> bool:
    """Adds to ``taken`` the keywords of the ``__init__`` of ``bases`` in turn, to the first without ``**kwargs``;
    whether there was one (else every keyword may be taken)."""
    for klass in bases:
        if "__init__" not in vars(klass):
            continue
        try:
            parameters = list(inspect.signature(klass.__init__).parameters.values())[1:]  # after self
        except (TypeError, ValueError):  # no signature to read (a C type): it may take anything
            return False
        taken.update(p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
        if not any(p.kind is p.VAR_KEYWORD for p in parameters):
            return True
    return False
