"""What a :class:`~dynabatch.integrations.ray.DynamicBatchPredictor` actor knows about memory; how it plans a window.

:class:`WindowMemory` is the predictor's memory half (a base class): it
calibrates, builds each window's loader by what the actor has measured (one of
:data:`PLANS`), and grows the actor's :class:`~dynabatch.memory.model.MemoryModel`
and reference peak from every window's report. See the predictor's
"Planning a window".
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import warnings
from typing import Any

import numpy as np

from dynabatch.data.tokenization import TokenizedTexts, tokenize_texts
from dynabatch.inference.loader import build_dynamic_batch_dataloader
from dynabatch.inference.report import RunReport
from dynabatch.memory.budget import BudgetTooSmallError
from dynabatch.memory.model import MemoryModel

__all__ = ["PLANS", "WindowMemory"]

logger = logging.getLogger(__name__)

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


class WindowMemory:
    """The memory half of a predictor: calibration, planning a window, learning from it (see the module)."""

    # Set by the predictor before these run.
    memory_model: MemoryModel | None
    reference_bytes: int | None
    reference_width: int | None

    def _grad_mode(self) -> Any:
        import torch

        return torch.inference_mode() if self.inference_mode else contextlib.nullcontext()

    def _measure_device(self) -> str:
        """The device measured peaks are of: ``device``, else the CPU."""
        return str(self.device) if self.device is not None else "cpu"

    def _calibrate(self) -> MemoryModel:

        from dynabatch.memory.calibrate import calibrate

        options = dict(self.calibrate_kwargs)
        options.setdefault("device", self.device)
        # Probes padded and tokenized as the windows' batches will be: the loader's margin, padding multiple and
        # tokenizer keywords.
        for key in ("pad_to_multiple_of", "memory_margin"):
            if key in self.loader_kwargs:
                options.setdefault(key, self.loader_kwargs[key])
        tokenizer_kwargs = self._tokenizer_kwargs()
        if tokenizer_kwargs:
            options.setdefault("tokenizer_kwargs", tokenizer_kwargs)
        with self._grad_mode():
            mm = calibrate(self.fn, self.tokenizer, batch_size=self.batch_size,
                           max_input_token_length=self.max_input_token_length, progress=False, **options)
        logger.info("calibrated in the actor: %d probes, leave-one-out error %.3f", len(mm.probes_), mm.loo_error_)
        return mm

    def _tokenizer_kwargs(self) -> dict[str, Any]:
        """The tokenizer keywords of ``loader_kwargs``: those that are not the loader's own parameters."""
        own = inspect.signature(build_dynamic_batch_dataloader).parameters
        return {k: v for k, v in self.loader_kwargs.items() if k not in own and k != "pad_to_multiple_of"}

    def _tokenize(self, texts: list[str]) -> TokenizedTexts:
        """``texts`` tokenized as a window's loader tokenizes them (its token store, without planning)."""
        return tokenize_texts(texts, self.tokenizer, self.max_input_token_length, progress=False,
                              **self._tokenizer_kwargs())

    def _loader(self, texts: list[str], plan: str, ids: Any = None) -> Any:
        options = dict(self.loader_kwargs)
        if ids is not None:  # the rows' own ids, which run's errors name beside each row
            options["ids"] = ids
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

    def _plan(self, texts: list[str], ids: Any = None) -> tuple[Any, str, int]:
        """The window's loader (of ``texts``, with their ``ids``, or none), how it was planned, and its longest padded
        length."""
        plan = self._first_plan()
        try:
            loader = self._loader(texts, plan, ids)
        except BudgetTooSmallError:  # the reference bytes hold no row of this window's longest text: planned anew
            loader = None
        probe = loader if loader is not None else self._loader(texts, "relative", ids)
        first = next(iter(probe), None)  # longest first: the window's longest text
        if first is None:  # every text of the window a bad input, skipped: no batch to run, nothing to learn
            return probe, plan, 0
        width = int(first["input_ids"].shape[1])
        if plan == "relative":
            return loader, plan, width
        territory = self.memory_model.measured_length_
        fits = loader is not None and width <= territory and (plan != "measured" or width <= self.reference_width)
        if fits:
            return loader, plan, width
        replan = "model-relative" if width <= territory else "relative"
        logger.info("window's longest text pads to %d tokens, beyond what was measured (model up to %d, reference "
                    "batch %s): planned %s to its own first batch", width, territory, self.reference_width, replan)
        self.replans += 1
        return (probe if replan == "relative" else self._loader(texts, replan, ids)), replan, width

    # -- memory knowledge --------------------------------------------------------
    def _learn(self, report: RunReport, plan: str, width: int) -> None:
        """Raises the reference when a window's first batch set one, and grows the model from the window's batches."""
        if not report.records:
            return
        first = report.records[0]
        if first.peak_bytes is not None and first.peak_bytes <= 0 and report.budget_bytes == 0:
            logger.warning("the first batch's peak measured 0 bytes on %s: fn does not run on the measured device "
                           "(pass device=); not learning memory in this actor",
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
