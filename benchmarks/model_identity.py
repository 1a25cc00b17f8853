"""What the model identity of a corpus job costs: every byte of the weights hashed, first run and rerun.

``dynabatch embed`` and ``dynabatch generate`` key their store by
``dynabatch.cli.job.model_digest(folder)``: a digest of every byte of every
file of the model folder (blake2b; a large file's 64 MiB pieces on every core
this process may use), remembered under ``$DYNABATCH_CACHE_DIR`` by each file's
size, times, inode and device, so a rerun on unchanged files reads none of
them. For each size of ``--sizes`` (decimal GB) this script writes a model
folder (``config.json`` and a ``model.safetensors`` of that many bytes, random
bytes, or with ``--sparse`` a sparse file: zeros the file system never stores,
so only the hashing is timed, not the disk), drops the file from the page
cache (``posix_fadvise``, so the first run reads the disk as after a copy or
a download; its times set a minute back, as a model saved earlier), and times:

* **first run**: ``model_digest`` with an empty digest cache (every byte read
  and hashed);
* **rerun**: ``model_digest`` again (the cache hit: a ``stat`` per file).

*first run CPU s* counts every thread of the process (``time.process_time``):
on a machine shared with other jobs the wall time swings with their load,
the CPU seconds (the hashing's own cost) do not.

It also times hashlib's blake2b and sha256 on one in-memory buffer, side by
side, to say which is faster on this CPU (sha256 wins where the CPU has SHA
instructions). Files are written under ``--folder`` and deleted after; a size
that does not fit there with 2 GB to spare is refused before anything is
written. Run it with::

    python benchmarks/model_identity.py --sizes 1,15
    python benchmarks/model_identity.py --sizes 1,15 --sparse
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

_BLOCK = 64 << 20  # bytes written at a time (one random block, repeated)


def _hash_speeds(size: int = 256 << 20) -> dict[str, float]:
    """MB/s of blake2b and sha256 over one in-memory buffer (best of 3, in alternating order)."""
    data = os.urandom(size)
    best = {"blake2b": 0.0, "sha256": 0.0}
    for _ in range(3):
        for name in best:
            start = time.perf_counter()
            hashlib.new(name, data).digest()
            best[name] = max(best[name], size / (time.perf_counter() - start) / 1e6)
    return best


def _write_model(folder: Path, size: int, sparse: bool) -> Path:
    """A model folder whose ``model.safetensors`` holds ``size`` bytes, out of the page cache."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "bert", "hidden_size": 32}')
    weights = folder / "model.safetensors"
    with open(weights, "wb") as f:
        if sparse:
            f.truncate(size)
        else:
            block = os.urandom(_BLOCK)
            for start in range(0, size, _BLOCK):
                f.write(block[:min(_BLOCK, size - start)])
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    for path in folder.iterdir():  # saved a minute ago: a file modified in the last 2 s is hashed but not remembered
        os.utime(path, (time.time() - 60, time.time() - 60))
    return folder


def _time_digest(folder: Path) -> tuple[float, float, str]:
    """``(wall seconds, CPU seconds of every thread of this process, digest)`` of ``model_digest(folder)``."""
    from dynabatch.cli.job import model_digest

    start, cpu = time.perf_counter(), time.process_time()
    digest = model_digest(str(folder))
    return time.perf_counter() - start, time.process_time() - cpu, digest


def _row(folder_root: Path, gb: float, sparse: bool, cores: int) -> str:
    size = int(gb * 1e9)
    work = Path(tempfile.mkdtemp(dir=folder_root, prefix="dynabatch-identity-"))
    try:
        os.environ["DYNABATCH_CACHE_DIR"] = str(work / "cache")  # an empty digest cache
        model = _write_model(work / "model", size, sparse)
        first, cpu, digest = _time_digest(model)
        rerun, _, again = _time_digest(model)
        assert again == digest
        kind = "sparse" if sparse else "random bytes"
        return (f"| {gb:g} GB | {kind} | {cores} | {first:.1f} | {size / first / 1e6:,.0f} | {cpu:.1f} | "
                f"{size / cpu / 1e6:,.0f} | {rerun * 1e3:.1f} ms |")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1,15", help="weights sizes in GB (10^9 bytes), comma-separated")
    p.add_argument("--folder", type=Path, default=Path(tempfile.gettempdir()),
                   help="where the model folders are written (and deleted)")
    p.add_argument("--sparse", action="store_true", help="sparse weights: the hashing alone, no disk read")
    args = p.parse_args(argv)
    sizes = [float(s) for s in args.sizes.split(",")]
    free = shutil.disk_usage(args.folder).free
    if not args.sparse and max(sizes) * 1e9 + 2e9 > free:
        p.error(f"--sizes should fit in --folder with 2 GB to spare ({free / 1e9:.1f} GB free there), but got "
                f"--sizes={args.sizes!r}: give smaller sizes or --sparse")
    from dynabatch.data.workers import available_cores

    cores = available_cores()
    speeds = _hash_speeds()
    load = os.getloadavg()[0]
    print(f"- command: `python benchmarks/model_identity.py {' '.join(sys.argv[1:] if argv is None else argv)}`")
    print(f"- machine: {platform.platform()}, {os.cpu_count()} CPUs ({cores} this process may use), load average "
          f"{load:.1f}; python {platform.python_version()}")
    print(f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"- hashlib on one core, in memory: blake2b {speeds['blake2b']:,.0f} MB/s, sha256 {speeds['sha256']:,.0f} "
          "MB/s")
    print()
    print("| weights | file | cores | first run s | first run MB/s | first run CPU s | MB per CPU s | "
          "rerun (cache hit) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for gb in sizes:
        print(_row(args.folder, gb, args.sparse, cores), flush=True)


if __name__ == "__main__":
    main()
