"""Host and device side by side: ``run`` on a simulated accelerator, with and without batches built ahead, on one
and on two devices.

The simulated device is a call that sleeps ``--ns-per-cell`` nanoseconds per padded cell of its batch
(``time.sleep`` releases the GIL, as a CUDA kernel leaves the CPU free) and returns one 384-value row per text.
Held-out texts (``vary_lengths(kjv_passages(), n, max_words=128, seed=27)``), the real all-MiniLM-L6-v2
tokenizer, 256 tokens. For each setting: the wall time of the whole job (loader built, every batch run), the
device time (the sleeps summed per device), the host time (wall time of the same job with a device that takes
no time), and wall / max(device, host): 1.0 is full overlap.

Run it with::

    python benchmarks/overlap.py                  # 30,000 texts
    python benchmarks/overlap.py --n-texts 5000   # a quick look
"""

from __future__ import annotations

import argparse
import os
import threading
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

import dynabatch  # noqa: E402
from dynabatch.demo import kjv_passages, minilm_path, vary_lengths  # noqa: E402


class SimulatedDevice:
    """``fn(batch)``: sleeps in proportion to the batch's padded cells, returns 384 float32 values per row."""

    def __init__(self, ns_per_cell: float) -> None:
        self.ns_per_cell, self.busy, self.lock = ns_per_cell, 0.0, threading.Lock()

    def __call__(self, batch: dynabatch.Batch) -> torch.Tensor:
        rows, width = batch["input_ids"].shape
        seconds = rows * width * self.ns_per_cell * 1e-9
        time.sleep(seconds)
        with self.lock:
            self.busy += seconds
        return batch["input_ids"][:, :1].float().expand(rows, 384).contiguous()


def _job(texts: list[str], tokenizer, ns: float, prefetch: int, devices: int) -> tuple[float, float]:
    start = time.perf_counter()
    loader = dynabatch.build_dynamic_batch_dataloader(texts, tokenizer, 32, 256, num_workers=0, progress=False)
    made: list[SimulatedDevice] = []

    def make_fn(device):
        made.append(SimulatedDevice(ns))
        return made[-1]

    if devices == 1:
        result = dynabatch.run(make_fn("cpu"), loader, progress=False, prefetch=prefetch)
    else:
        result = dynabatch.run(make_fn, loader, progress=False, devices=["cpu"] * devices)
    if len(result) != len(texts):
        raise RuntimeError("a text went missing")
    return time.perf_counter() - start, max(d.busy for d in made)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-texts", type=int, default=30_000)
    parser.add_argument("--ns-per-cell", type=float, default=4000.0, help="simulated device time per padded cell")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    texts = vary_lengths(kjv_passages(), n=args.n_texts, max_words=128, seed=27)
    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    _job(texts[:2000], tokenizer, 0.0, 2, 1)  # warm-up: imports, the classifier, the tokenizer
    host, _ = _job(texts, tokenizer, 0.0, 0, 1)
    rows = []
    for name, prefetch, devices in [("one device, built in turn (prefetch=0)", 0, 1),
                                    ("one device, built ahead (prefetch=2, the default)", 2, 1),
                                    ("two devices (devices=['cpu', 'cpu'])", 0, 2)]:
        wall, device = _job(texts, tokenizer, args.ns_per_cell, prefetch, devices)
        rows.append((name, wall, device))
    print(f"{args.n_texts:,} texts, {args.ns_per_cell:g} ns per padded cell, host time {host:.2f} s "
          f"(the same job on a device that takes no time)\n")
    print("| setting | wall s | device s (busiest) | wall / max(device, host) | wall vs one device in turn |")
    print("|---|---:|---:|---:|---:|")
    for name, wall, device in rows:
        print(f"| {name} | {wall:.2f} | {device:.2f} | {wall / max(device, host):.2f} | {wall / rows[0][1]:.2f}x |")


if __name__ == "__main__":
    main()
