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
    from dynabatch.integrations.ray import DynamicBatchPredictor, map_texts

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
:class:`~dynabatch.inference.execute.BatchOutOfMemoryError` (``on_oom="raise"``,
which fails the job) or is reported in an error column (``on_oom="skip"``).
A job killed as a whole resumes with ``map_texts(..., output_path=..., key=...)``:
each window commits its rows to :func:`dynabatch.run`'s results store, keyed by
the dataset's id column (read by the driver first: an id given to two rows is refused before any
actor runs), and a rerun runs only the ids the store does not hold. A job
run with ``map_batches`` and ``output_path`` is read with :func:`stored_results`, which
refuses an id two windows stored (each window checks only its own ids).

Ray is optional (the ``ray`` extra, ``pip install -e ".[ray]"``): this module imports without
it, and only :func:`map_texts` imports ``ray``. Nothing in dynabatch imports
this module.
"""

from dynabatch.inference.columns import numpy_column as to_column
from dynabatch.integrations.ray._map import default_window, map_texts, stored_results
from dynabatch.integrations.ray._memory import PLANS
from dynabatch.integrations.ray.predictor import DynamicBatchPredictor

__all__ = ["PLANS", "DynamicBatchPredictor", "default_window", "map_texts", "stored_results", "to_column"]
