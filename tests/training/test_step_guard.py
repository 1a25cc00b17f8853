"""OOM guard on a real model: the same gradient after an injected out-of-memory split; sizes remembered."""

import pytest
import torch
from torch import nn

from dynabatch.data.collate import split_rows
from dynabatch.memory.measure import track_peak_memory
from dynabatch.training.loss import count_items, per_sample_losses, weighted_loss_sum
from dynabatch.training.oom_guardian import GradientCheckpointManager, OOMGuardian, guarded_step


@pytest.fixture(scope="module")
def gpt2(one_thread):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=500, n_embd=32, n_layer=2, n_head=2, n_positions=64,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


def _batch():
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 500, (8, 24), generator=gen)
    mask = torch.ones_like(ids)
    mask[5:, 14:] = 0  # right padding on three rows
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100),
            "task_type": ["a", "b"] * 4}


def _step_fn(model, total_items, weights):
    def step(batch):
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        sums, counts = per_sample_losses(out.logits, batch["labels"], shift=True)
        w = torch.tensor([weights[t] for t in batch["task_type"]])
        loss = weighted_loss_sum(sums, counts, w, "tokens") / total_items
        loss.backward()
        return float(loss.detach())
    return step


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _peaks(model, batch, step):
    """Peak of the forward alone and of forward + backward."""
    model.zero_grad(set_to_none=True)
    with track_peak_memory("cpu") as fwd:
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    with track_peak_memory("cpu") as full:
        step(batch)
    model.zero_grad(set_to_none=True)
    return fwd.peak_bytes, full.peak_bytes


class _FailOnce:
    """Raises a real torch.OutOfMemoryError the first time the backward reaches a lower layer's weight,
    after the upper layers' gradients have been accumulated."""

    def __init__(self, param):
        self.armed = True
        self.handle = param.register_hook(self)

    def __call__(self, grad):
        if self.armed:
            self.armed = False
            raise torch.OutOfMemoryError("injected: out of memory in the backward")
        return grad


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_split_after_injected_oom_gives_the_unsplit_gradient(gpt2, where):
    batch = _batch()
    n = count_items(batch["labels"], shift=True, normalization="tokens")
    step = _step_fn(gpt2, n, {"a": 1.0, "b": 2.5})
    fwd_peak, full_peak = _peaks(gpt2, batch, step)
    assert fwd_peak < full_peak
    gpt2.zero_grad(set_to_none=True)
    reference = guarded_step(step, batch, list(gpt2.parameters()))
    expected = _grads(gpt2)
    if where == "forward":  # a simulated device smaller than the forward's peak
        guardian = OOMGuardian("cpu", max_memory_mb=int(fwd_peak * 0.8) / 1e6, simulate_limit=True)
        injector = None
    else:  # the backward fails half-way, some gradients already accumulated
        guardian = OOMGuardian("cpu", max_memory_mb=full_peak * 4 / 1e6, simulate_limit=True)
        injector = _FailOnce(gpt2.transformer.h[0].mlp.c_fc.weight)
    gpt2.zero_grad(set_to_none=True)
    result = guarded_step(step, batch, list(gpt2.parameters()), guardian=guardian, task_types=batch["task_type"])
    if injector is not None:
        injector.handle.remove()
    assert result.splits >= 1 and sum(result.rows) == 8
    assert (result.early_gradients > 0) == (where == "backward")
    got = _grads(gpt2)
    worst = max(float((got[k] - expected[k]).abs().max()) for k in expected)
    assert worst <= 1e-6
    assert sum(result.outputs) == pytest.approx(reference.outputs[0], rel=1e-6)
    assert all(p.requires_grad for p in gpt2.parameters())  # frozen parameters are thawed
    # what failed caps these tasks' batches by their padded cells: fewer rows when wider, more when narrower
    remembered = guardian.remembered_batch_size(["a"], 24)
    assert max(result.rows) <= remembered < 8
    assert guardian.remembered_batch_size(["a"], 40) <= remembered * 24 // 40
    assert guardian.remembered_batch_size(["a"], 10) >= 8
    assert guardian.remembered_batch_size(["c"], 24) is None  # another task learned nothing
    # the next batch of that shape is split before it runs: no new out-of-memory error
    before = guardian.num_out_of_memory
    gpt2.zero_grad(set_to_none=True)
    again = guarded_step(step, batch, list(gpt2.parameters()), guardian=guardian, task_types=batch["task_type"])
    assert guardian.num_out_of_memory == before and max(again.rows) <= remembered
    worst = max(float((p.grad - expected[k]).abs().max()) for k, p in gpt2.named_parameters())
    assert worst <= 1e-6


def test_a_single_row_that_does_not_fit_raises(gpt2):
    batch = _batch()
    guardian = OOMGuardian("cpu", max_memory_mb=1024 / 1e6, simulate_limit=True)
    step = _step_fn(gpt2, 10, {"a": 1.0, "b": 1.0})
    with pytest.raises(torch.OutOfMemoryError):
        guarded_step(step, batch, list(gpt2.parameters()), guardian=guardian, task_types=batch["task_type"])
    assert all(p.requires_grad for p in gpt2.parameters())
    gpt2.zero_grad(set_to_none=True)


def test_split_rows_trims_right_padding_and_keeps_lists():
    parts = split_rows(_batch(), [5, 3])
    assert [p["input_ids"].shape for p in parts] == [(5, 24), (3, 14)]
    assert parts[1]["task_type"] == ["b", "a", "b"]
    with pytest.raises(ValueError, match=r"sizes should be positive row counts summing to the batch's 8 rows"):
        split_rows(_batch(), [5, 2])


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


def test_gradient_checkpointing_on_plain_torch_and_hf(gpt2):
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

    assert GradientCheckpointManager.enable_gradient_checkpointing(gpt2)
    assert GradientCheckpointManager.is_enabled(gpt2) and gpt2.config.use_cache is False
    GradientCheckpointManager.disable_gradient_checkpointing(gpt2)
    assert not GradientCheckpointManager.is_enabled(gpt2)
    with pytest.raises(TypeError, match=r"model should be a torch.nn.Module"):
        GradientCheckpointManager.enable_gradient_checkpointing("model")
