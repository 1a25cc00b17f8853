"""OOMGuardian (a StepGuard with the multi-task budget) and GradientCheckpointManager, the multi-task system's calls."""

import pytest
import torch
from torch import nn

from dynabatch.compat.multitask import GradientCheckpointManager, OOMGuardian
from dynabatch.memory.measure import track_peak_memory


class _Fixed:
    """A stand-in predictor with a known linear cost: 10 MB + 2 MB per row (MB = 10**6 bytes)."""

    def typical_length(self, task):
        return 16.0

    def predict_bytes(self, task, rows, length, is_training=True):
        return (10 + 2 * rows) * 10**6


def test_safe_batch_size_preflight_and_margin():
    guardian = OOMGuardian("cpu", memory_margin_percent=0.10, max_memory_mb=100, predictor=_Fixed())
    assert guardian.estimate_safe_batch_size("T1") == 40  # 10 + 2 * 40 = 90 = 100 * (1 - 0.10)
    guardian.record_out_of_memory(["T1"], 16, 13)  # 13 rows at 16 tokens ran out of memory: 12 at most
    assert guardian.estimate_safe_batch_size("T1", seq_length=16) == 12
    assert guardian.estimate_safe_batch_size("T1", seq_length=8) == 40
    assert guardian.preflight_check(89 / 1000) and not guardian.preflight_check(91 / 1000)  # GB = 10**9 bytes
    guardian.emergency_cleanup()
    for bad in (-0.1, 1.0, 1.5):
        with pytest.raises(ValueError, match=rf"memory_margin_percent should be a number in \[0, 1\).*but got memory_margin_percent={bad}"):
            OOMGuardian("cpu", memory_margin_percent=bad)
    with pytest.raises(ValueError, match=r"max_memory_mb should be a positive number, but got max_memory_mb=0"):
        OOMGuardian("cpu", max_memory_mb=0)


def test_gradient_checkpointing_on_plain_torch_and_hf():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64)) for _ in range(4)])
    x = torch.randn(1024, 64)  # activations, not the gradient buffers, dominate the peak

    def run():
        model.zero_grad(set_to_none=True)
        with track_peak_memory("cpu") as mem:
            model(x).pow(2).sum().backward()
        return mem.peak_bytes, [p.grad.clone() for p in model.parameters()]

    plain_peak, plain_grads = run()
    assert GradientCheckpointManager.enable_gradient_checkpointing(model)
    assert GradientCheckpointManager.is_enabled(model)
    ckpt_peak, ckpt_grads = run()
    assert ckpt_peak < plain_peak
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(plain_grads, ckpt_grads))
    GradientCheckpointManager.disable_gradient_checkpointing(model)
    assert not GradientCheckpointManager.is_enabled(model)

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=100, n_embd=16, n_layer=2, n_head=2, n_positions=32))
    assert GradientCheckpointManager.enable_gradient_checkpointing(gpt2)
    assert GradientCheckpointManager.is_enabled(gpt2) and gpt2.config.use_cache is False
    GradientCheckpointManager.disable_gradient_checkpointing(gpt2)
    assert not GradientCheckpointManager.is_enabled(gpt2)
    with pytest.raises(TypeError, match=r"model should be a torch.nn.Module"):
        GradientCheckpointManager.enable_gradient_checkpointing("model")


def test_simulate_limit_is_the_step_guards_limit_on_the_cpu_only():
    assert OOMGuardian("cpu", max_memory_mb=2, simulate_limit=True).limit_bytes == 2_000_000
    assert OOMGuardian("cpu", max_memory_mb=2).limit_bytes is None
    with pytest.raises(ValueError, match=r"simulate_limit should be False unless device is the CPU and max_memory_mb is set"):
        OOMGuardian("cpu", simulate_limit=True)
