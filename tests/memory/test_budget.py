"""The one memory budget (memory/budget.py): which budget a run plans under, and what is refused.

No accelerator here: a CUDA device is torch.cuda's memory functions replaced by counters, and a device of a given
size is the CPU inside ``simulated_memory``.
"""

import numpy as np
import pytest
import torch

from dynabatch.memory.budget import AUTO_SHARE, MemoryBudget, resolve_max_memory
from dynabatch.memory.units import check_max_memory
from dynabatch.memory.device import simulated_memory
from dynabatch.memory.model import MemoryModel

GIB = 2**30


@pytest.fixture
def cuda_with_free(monkeypatch):
    """A CUDA device of 16 GiB, ``free`` GiB of them free (torch's functions answer as on that device)."""

    def install(free_gib):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(free_gib * GIB), 16 * GIB))
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)

    return install


def test_auto_is_a_share_of_the_free_memory_of_a_device_with_memory_of_its_own(cuda_with_free):
    cuda_with_free(10)
    assert AUTO_SHARE == "90%"
    assert resolve_max_memory("auto", "cuda") == pytest.approx(0.9 * 10 * GIB)
    assert resolve_max_memory("auto") == pytest.approx(0.9 * 10 * GIB)  # the first accelerator by default
    assert resolve_max_memory("50%", "cuda:0") == pytest.approx(5 * GIB)
    cuda_with_free(4)  # read when asked: after the model is loaded, less is free
    assert resolve_max_memory("auto", "cuda") == pytest.approx(0.9 * 4 * GIB)
    assert resolve_max_memory("20GB", "cuda") == 20e9 and resolve_max_memory("20GiB", "cuda") == 20 * GIB
    assert resolve_max_memory(None, "cuda") is None  # the relative rule


def test_on_the_cpu_auto_keeps_the_relative_rule_and_a_percentage_is_refused(caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="dynabatch.memory.budget"):
        assert resolve_max_memory("auto", "cpu") is None
    assert "has no memory of its own: batches stay under the first batch's measured peak" in caplog.text
    assert resolve_max_memory(4096, "cpu") == 4096 and resolve_max_memory("1MiB", "cpu") == 2**20
    with pytest.raises(ValueError, match=r"^max_memory should be bytes or a size such as '20GB' on cpu \(no device "
                                         r"memory is known there: a percentage is a share of a device's free "
                                         r"memory\), but got max_memory='90%'$"):
        resolve_max_memory("90%", "cpu")


def test_on_a_simulated_device_auto_and_percentages_are_of_its_free_memory():
    with simulated_memory(total=10_000_000, free=8_000_000):
        assert resolve_max_memory("auto", "cpu") == pytest.approx(7_200_000)
        assert resolve_max_memory("25%", "cpu") == pytest.approx(2_000_000)


@pytest.mark.parametrize("value, error, match", [
    ("150%", ValueError, (r"^max_memory should be a percentage in \(0%, 100%\] of the device's free memory, but got "
                          r"max_memory='150%'$")),
    ("0%", ValueError, r"^max_memory should be a percentage in \(0%, 100%\]"),
    ("12XB", ValueError, (r"^max_memory should be a number of bytes > 0, a size such as '12GB' or '512MiB', or a "
                          r"percentage such as '80%' \(of a device's free memory\), but got max_memory='12XB'$")),
    (-1, ValueError, r"^max_memory should be a number of bytes > 0.*but got max_memory=-1$"),
    (True, TypeError, (r"^max_memory should be None \(the relative rule\), 'auto', a number of bytes > 0, a size "
                       r"such as '20GB', or a percentage such as '90%' of the device's free memory, but got "
                       r"max_memory=True of type bool$")),
])
def test_what_no_device_could_resolve_is_refused_before_anything_loads(value, error, match):
    with pytest.raises(error, match=match):
        check_max_memory(value)
    with pytest.raises(error, match=match):
        resolve_max_memory(value, "cpu")


def test_a_budget_smaller_than_one_row_of_the_longest_text_is_refused():
    mm = MemoryModel().fit([1, 4, 16, 1], [8, 64, 16, 128], [1000 + r * 100 * n for r, n in
                                                                 [(1, 8), (4, 64), (16, 16), (1, 128)]])
    one_row = float(mm.predict(1, 128))  # 13,800 bytes
    budget = MemoryBudget(mm, 10_000, memory_margin=0.0)
    with pytest.raises(ValueError, match=r"^max_memory should be at least one row of the longest text \(13,800 bytes "
                                         r"predicted for 1 x 128 tokens, planned to 1 of the budget\); here 10,000 "
                                         r"bytes: pass a larger max_memory, a smaller max_input_token_length, or "
                                         r"max_memory=None \(the relative rule\), but got max_memory='10KB'$"):
        budget.check_one_row(128, given="10KB")
    budget.check_one_row(64)  # 7,400 bytes fit
    MemoryBudget(mm, one_row, memory_margin=0.0).check_one_row(128)  # exactly one row fits
    with pytest.raises(ValueError, match=r"planned to 0\.9 of the budget\); here 14,000 bytes"):
        MemoryBudget(mm, 14_000).check_one_row(128)  # the margin counts: 12,600 bytes for the rows
    assert int(np.asarray(budget.rows_allowed(128, max_memory=2 * one_row))) == 2  # another budget, same rule
