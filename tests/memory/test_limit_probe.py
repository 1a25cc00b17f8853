"""The probe at the limit: the most rows at each length, found by running the call under the limit."""

import numpy as np
import pytest
import torch

from dynabatch.memory.budget import MemoryBudget
from dynabatch.memory.limit_probe import probe_limit


class Device:
    """A device that holds ``cells`` padded tokens a call: above, a real out-of-memory error (a size, injected)."""

    def __init__(self, cells: int) -> None:
        self.cells, self.calls = cells, []

    def __call__(self, batch) -> None:
        rows, width = batch["input_ids"].shape
        self.calls.append((rows, width))
        if rows * width > self.cells:
            raise torch.OutOfMemoryError("injected: more than the device holds")


def test_an_injected_error_above_a_size_is_found_at_every_length_by_doubling_then_bisecting(tokenizer):
    device = Device(cells=3000)
    mm = probe_limit(device, tokenizer, limit_bytes=1e9, max_input_token_length=128, progress=False)
    found = mm.metadata["max_rows"]
    assert list(found) == [128, 64, 32, 16]  # longest first, down to an eighth
    for width, rows in found.items():
        most = 3000 // width
        assert 0.95 * most <= rows <= most  # within the 5% the search stops at, never above what fits
    assert mm.metadata["steps"] == len(device.calls) - 1 <= 30  # the warm-up, then a few steps per length
    first = [rows for rows, width in device.calls[1:] if width == 128]
    assert first[:5] == [1, 2, 4, 8, 16] and first[5] == 32  # doubling from 1 at the longest length
    # each shorter length starts from twice the rows that ran at the longer one
    assert [rows for rows, width in device.calls if width == 64][0] == 2 * found[128]
    budget = MemoryBudget(mm, 1e9, memory_margin=0.0)  # the failures bound the plan, whatever the fit says
    for width, rows in found.items():
        assert int(budget.rows_allowed(width)) <= rows + max(1, rows // 20)
        failed = [r for r, w in mm.failed_shapes if w == width]
        assert not budget.fits(np.array([min(failed)]), np.array([[width]]))[0]


@pytest.mark.slow
def test_on_the_cpu_the_tracker_holds_a_step_to_the_limit_minus_what_is_resident(tokenizer):
    def work(batch):  # 256 bytes a token slot, and a sum
        return torch.ones(batch["input_ids"].numel(), 64).sum()

    mm = probe_limit(work, tokenizer, limit_bytes=96_000, resident_bytes=32_000, max_input_token_length=32,
                     progress=False)
    assert mm.metadata["max_rows"] == {32: 7, 16: 15, 8: 31, 4: 62}  # 64,000 bytes for a step
    assert max(p["peak_bytes"] for p in mm.probes_ if not p["out_of_memory"]) <= 64_000
    with pytest.raises(ValueError, match=r"limit_bytes should be above resident_bytes=32000"):
        probe_limit(work, tokenizer, limit_bytes=32_000, resident_bytes=32_000, max_input_token_length=32)
    with pytest.raises(ValueError, match=r"limit_bytes should be above what one row of 32 tokens needs"):
        probe_limit(Device(cells=8), tokenizer, limit_bytes=1e9, max_input_token_length=32, progress=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_allocator_is_capped_at_the_limit_for_the_search():
    from pathlib import Path

    from transformers import AutoTokenizer

    from dynabatch.memory.device import backend_of

    # the tokenizer that travels with the repository (the GPU machine has no MiniLM wheel)
    tokenizer = AutoTokenizer.from_pretrained(Path(__file__).resolve().parents[2] / "benchmarks/assets/kjv-wordpiece")

    cuda = backend_of("cuda")
    device = torch.device("cuda", torch.cuda.current_device())
    held = torch.ones(64 * 2**20 // 4, device=device)  # 64 MiB resident, counted against the limit

    def work(batch):  # 1 MiB a token slot
        return torch.ones(batch["input_ids"].numel(), 2**18, device=device).sum()

    limit = cuda.allocated(device) + 200 * 2**20
    mm = probe_limit(work, tokenizer, limit_bytes=limit, max_input_token_length=32, device=device, progress=False)
    found = mm.metadata["max_rows"]
    for width, rows in found.items():  # at most 200 token slots of 1 MiB fit beside what is held
        assert 100 <= rows * width <= 200
    beyond = torch.empty(2 * limit, dtype=torch.uint8, device=device)  # the cap is gone after the search
    del held, beyond


_NO_BAR = """
import torch
from transformers import AutoTokenizer

from dynabatch.demo import minilm_path
from dynabatch.memory.limit_probe import probe_limit


def work(batch):  # a device of 200 padded tokens a call
    if batch["input_ids"].numel() > 200:
        raise torch.OutOfMemoryError("injected: more than the device holds")


probe_limit(work, AutoTokenizer.from_pretrained(minilm_path()), limit_bytes=1e9, max_input_token_length=16,
            progress=False)
"""


def test_no_progress_bar_leaves_no_thread_of_tqdm(threads_left):
    # a disabled bar was made where progress=False: tqdm starts its monitor thread with its first bar, a disabled one
    # too, and keeps it for the process's life (as tokenizing did, eb72896). A fresh interpreter, as no bar ran there
    assert threads_left(_NO_BAR) == ["MainThread"]
