"""guarded_step on a real model: the same gradient after an injected out-of-memory split; StepGuard remembers sizes."""

import pytest
import torch

from dynabatch.data.collate import split_rows
from dynabatch.memory.measure import track_peak_memory
from dynabatch.training.loss import count_items, per_sample_losses, weighted_loss_sum
from dynabatch.training.step_guard import StepGuard, guarded_step


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
        guardian = StepGuard(limit_bytes=int(fwd_peak * 0.8))
        injector = None
    else:  # the backward fails half-way, some gradients already accumulated
        guardian = StepGuard(limit_bytes=full_peak * 4)
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
    guardian = StepGuard(limit_bytes=1024)
    step = _step_fn(gpt2, 10, {"a": 1.0, "b": 1.0})
    with pytest.raises(torch.OutOfMemoryError):
        guarded_step(step, batch, list(gpt2.parameters()), guardian=guardian, task_types=batch["task_type"])
    assert all(p.requires_grad for p in gpt2.parameters())
    gpt2.zero_grad(set_to_none=True)



def test_an_error_after_every_gradient_arrived_raises_it_and_adds_no_gradient():
    # The parts ran with every parameter frozen: their backward raised "element 0 of tensors does not require grad".
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    batch = {"input_ids": torch.randn(6, 4), "attention_mask": torch.ones(6, 4, dtype=torch.long)}

    def step(part):
        model(part["input_ids"]).sum().backward()
        if len(part["input_ids"]) == 6:
            raise torch.OutOfMemoryError("out of memory logging the step")

    with pytest.raises(torch.OutOfMemoryError, match="logging the step") as info:
        guarded_step(step, batch, list(model.parameters()), guardian=StepGuard())
    assert any("after every parameter's gradient had arrived" in note for note in info.value.__notes__)
    assert torch.allclose(model.weight.grad, batch["input_ids"].sum(0, keepdim=True))  # the rows' gradient, once
    assert all(p.requires_grad for p in model.parameters())


def test_split_rows_trims_right_padding_and_keeps_lists():
    parts = split_rows(_batch(), [5, 3])
    assert [p["input_ids"].shape for p in parts] == [(5, 24), (3, 14)]
    assert parts[1]["task_type"] == ["b", "a", "b"]
    with pytest.raises(ValueError, match=r"sizes should be positive row counts summing to the batch's 8 rows"):
        split_rows(_batch(), [5, 2])


def test_step_guard_refuses_a_limit_that_is_not_a_positive_integer():
    with pytest.raises(ValueError, match=r"limit_bytes should be a positive integer, but got limit_bytes=0"):
        StepGuard(limit_bytes=0)
    assert StepGuard().failed_shapes() == [] and StepGuard().remembered_batch_size([], 8) is None
