"""Embed a corpus of Parquet files on every GPU of a machine into a Parquet store, resumable.

One process per GPU, started by ``torchrun``; each rank claims chunks of the
corpus as it goes (``run(..., lockstep=False)``), tokenizes only those, runs
measured mode on its own GPU and writes its rows into the one store. Killed and
started again with the same command, it runs only the ids the store does not
hold. Without ``torchrun`` it runs in one process, on every GPU it sees
(``devices=``), or on the CPU.

    torchrun --standalone --nproc-per-node 8 examples/embed_corpus.py corpus/ embeddings/
    python examples/embed_corpus.py corpus/ embeddings/            # one process, every visible GPU

The corpus: Parquet files with a ``text`` column and an ``id`` column (str or
int, unique). The store: one row per id, with ``id``, ``position`` and
``output`` (the mean-pooled embedding, float16 on a GPU); read it with
``pyarrow.dataset.dataset("embeddings/")``, pandas, polars or ``datasets``.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os

import pyarrow.dataset as ds
import torch
import torch.distributed as dist
from transformers import AutoModel, AutoTokenizer

import dynabatch


def mean_pooled(model: torch.nn.Module, dtype: torch.dtype):
    """``fn(batch)``: the model's token vectors averaged over the real tokens, as ``dtype``."""

    def fn(batch: dynabatch.Batch) -> torch.Tensor:
        with torch.inference_mode():
            hidden = model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            return ((hidden * mask).sum(1) / mask.sum(1).clamp(min=1)).to(dtype)

    return fn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("corpus", help="a Parquet file, a directory of them, or a glob")
    parser.add_argument("output", help="the results store (a directory)")
    parser.add_argument("--model", default=None, help="a model folder (default: the demo's all-MiniLM-L6-v2)")
    parser.add_argument("--batch-size", type=int, default=64, help="rows of the first, longest batch")
    parser.add_argument("--max-length", type=int, default=256)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.model is None:
        from dynabatch.demo import minilm_path

        args.model = minilm_path()

    cuda = torch.cuda.is_available()
    ranks = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if ranks:
        dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if cuda else "cpu")
    dtype = torch.float16 if cuda else torch.float32

    ids = ds.dataset(args.corpus, format="parquet").to_table(columns=["id"]).column("id")
    texts = dynabatch.read_texts(args.corpus, column="text")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModel.from_pretrained(args.model, torch_dtype=dtype).eval()
    loader = dynabatch.build_dynamic_batch_dataloader(texts, tokenizer, args.batch_size, args.max_length, ids=ids,
                                                      stream=True, progress=False)
    key = f"{os.path.basename(os.path.normpath(args.model))} mean-pooled {args.max_length}"
    show = not ranks or dist.get_rank() == 0
    if ranks or not cuda or torch.cuda.device_count() < 2:
        result = dynabatch.run(mean_pooled(model.to(device), dtype), loader, device=device, output_path=args.output,
                               key=key, lockstep=False, progress=show)
    else:  # one process, every GPU: a model copy per device, in its own thread
        result = dynabatch.run(lambda d: mean_pooled(copy.deepcopy(model).to(d), dtype), loader,
                               devices=[f"cuda:{i}" for i in range(torch.cuda.device_count())],
                               output_path=args.output, key=key, progress=show)
    if show:
        report = result.report
        print(f"{len(result)} texts in {args.output}; this process ran {report.rows} rows in {report.batches} "
              f"batches, {report.oom_events} out-of-memory events, {report.batches_over_budget} batches over the "
              "first batch's peak")
    if ranks:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
