"""collect_peak_alloc and bionemo's collect_cuda_peak_alloc: peaks per item, out-of-memory items, cleanup, bad input."""

import os

import pytest
import torch

from dynabatch.compat.bionemo import collect_cuda_peak_alloc, collect_peak_alloc
from dynabatch.memory.measure import track_peak_memory


def test_collect_peak_alloc_records_out_of_memory_items_and_always_cleans_up():
    cleaned = []

    def work(n):
        with track_peak_memory("cpu", limit_bytes=10_000):
            torch.zeros(n, 1024)  # n * 4 KiB
        return n

    features, peaks = collect_peak_alloc([1, 4, 2], work, "cpu", cleanup=lambda: cleaned.append(1))
    assert features == [1, None, 2]
    assert peaks == [4096, None, 8192]
    assert len(cleaned) == 3


def test_collect_peak_alloc_propagates_other_errors_after_cleanup():
    cleaned = []

    def work(n):
        raise KeyError(n)

    with pytest.raises(KeyError):
        collect_peak_alloc([1], work, "cpu", cleanup=lambda: cleaned.append(1))
    assert cleaned == [1]


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu"), "meta"])
def test_collect_cuda_peak_alloc_refuses_a_device_that_is_not_cuda(device):
    ran = []
    with pytest.raises(ValueError, match=r"device should be a CUDA device, but got device="):
        collect_cuda_peak_alloc([1, 2], ran.append, device)
    assert ran == []  # refused before any work


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_collect_cuda_peak_alloc_records_absolute_peaks_and_skips_out_of_memory_items():
    weights = torch.ones(1024, 1024, device="cuda")  # 4 MiB, counted in every absolute peak

    def work(n):
        if n < 0:
            raise torch.cuda.OutOfMemoryError("injected")
        return (weights[:n] * 2).shape[0]

    cleaned = []
    features, peaks = collect_cuda_peak_alloc([2, -1, 512], work, torch.device("cuda"), cleanup=lambda: cleaned.append(1))
    assert features == [2, 512] and len(peaks) == 2 and cleaned == [1, 1, 1]
    assert peaks[0] >= weights.numel() * 4 + 2 * 1024 * 4
    assert peaks[1] >= peaks[0] + 510 * 1024 * 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_collect_cuda_peak_alloc_works_as_the_first_cuda_call_of_a_process():
    # torch refuses a peak reset before CUDA is set up; bionemo's API resets first, so it runs in a fresh process
    import subprocess
    import sys
    from pathlib import Path

    code = ("import torch\n"
            "from dynabatch.compat.bionemo import collect_cuda_peak_alloc\n"
            "feats, peaks = collect_cuda_peak_alloc([256], lambda n: torch.ones(n, 1024, device='cuda').sum().item(),"
            " torch.device('cuda'))\n"
            "print(feats[0], peaks[0])\n")
    root = str(Path(__file__).resolve().parents[3])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False,
                          env=env)
    assert done.returncode == 0, done.stderr
    feature, peak = done.stdout.split()
    assert float(feature) == 256 * 1024 and 2**20 <= int(peak) <= 2**20 + 4096  # the 1 MiB of ones and the sum


def test_collect_peak_alloc_checks_its_callables():
    with pytest.raises(TypeError, match="work should be a callable, but got work=3 of type int"):
        collect_peak_alloc([1], 3, "cpu")
