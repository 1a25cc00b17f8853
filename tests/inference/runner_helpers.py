"""Helpers shared by the ``run`` test modules (tests/inference/test_run_*.py), imported as ``runner_helpers``."""

import torch

from dynabatch import build_dynamic_batch_dataloader, track_peak_memory
from dynabatch.data.collate import take_rows

MAX_LEN = 48
NEW_TOKENS = 4


def _load(texts, tokenizer, **kwargs):
    kwargs.setdefault("batch_size", 4)
    kwargs.setdefault("max_input_token_length", MAX_LEN)
    kwargs.setdefault("num_workers", 0)
    return build_dynamic_batch_dataloader(texts, tokenizer, **kwargs)


def _lengths(batch):
    """A cheap deterministic per-row result: real tokens and the sum of real token ids."""
    mask = batch["attention_mask"]
    return torch.stack([mask.sum(1), (batch["input_ids"] * mask).sum(1)], dim=1).float()


def _oom_over(fn, max_rows, error=None):
    """``fn`` that raises an out-of-memory error for batches of more than ``max_rows`` rows; records calls."""

    def wrapped(batch):
        rows = len(batch["input_ids"])
        wrapped.calls.append((rows, batch["input_ids"].shape[1]))
        if rows > max_rows:
            raise error() if error else torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return fn(batch)

    wrapped.calls = []
    return wrapped


def _cpu_oom():
    return RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 123456789 bytes.")


def _fails_at(fn, position):
    def wrapped(batch):
        if position in batch.indices.tolist():
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return fn(batch)

    return wrapped


def _embed_under_a_real_limit(minilm, loader):
    """MiniLM's first-token embedding under a CPU tracker limit that 2 rows of the first batch fit and 4 do not."""
    first = next(iter(loader))
    peaks = {}
    with torch.no_grad():
        for rows in (2, 4):
            with track_peak_memory("cpu") as mem:
                minilm(**take_rows(first, range(rows)))
            peaks[rows] = mem.peak_bytes
    limit = (peaks[2] + peaks[4]) // 2

    def limited(batch):
        with track_peak_memory("cpu", limit_bytes=limit):
            return minilm(**batch).last_hidden_state[:, 0]

    limited.limit = limit
    return limited
