import textwrap

import pytest
import torch

from dynabatch.compat.multitask.gradnorm import GradNormBalancer, gradnorm_update, shared_parameter

# Two optimizer steps of a shared parameter W; each rank sees its own micro-batches, tasks "a" and "b"
# in different amounts (rank 0 has no "b" in the first step). Shared by the workers and the reference.
DATA = textwrap.dedent(
    """
    import torch

    def micro_batches(rank, step):
        g = torch.Generator().manual_seed(100 * step + rank)
        tasks = (["a"] * 3 if rank == 0 and step == 0 else ["a", "b", "b"]) if rank == 0 else ["a", "b"] * (2 + step)
        return [(task, torch.rand(4, generator=g) * (1 + rank + 2 * (task == "b"))) for task in tasks]

    def accumulate(balancer, parameter, batches):
        for task, x in batches:
            loss_sum = ((parameter * x).sum() - 1.0) ** 2 * (1 + len(task))
            balancer.accumulate({task: loss_sum}, {task: 4.0})
    """
)

WORKER = DATA + textwrap.dedent(
    """
    import json, os, sys
    import torch.distributed as dist
    from dynabatch.compat.multitask.gradnorm import GradNormBalancer, gradnorm_update, shared_parameter

    rank, out = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo")
    parameter = torch.nn.Parameter(torch.linspace(0.1, 0.4, 4))
    balancer = GradNormBalancer(parameter, alpha=1.5, lr=0.1)
    weights, history = {"a": 1.0, "b": 1.0}, []
    for step in range(2):
        accumulate(balancer, parameter, micro_batches(rank, step))
        weights = balancer.step(weights)
        history.append(weights)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(history, f)
    dist.destroy_process_group()
    """
)


@pytest.mark.slow
def test_ranks_agree_on_the_weights_of_all_their_samples_together(tmp_path, run_two_ranks):
    histories = run_two_ranks(WORKER, tmp_path)
    assert histories[0] == histories[1]  # every rank the same weights
    scope: dict = {}
    exec(DATA, scope)
    parameter = torch.nn.Parameter(torch.linspace(0.1, 0.4, 4))
    balancer = GradNormBalancer(parameter, alpha=1.5, lr=0.1)
    weights = {"a": 1.0, "b": 1.0}
    for step in range(2):  # one process over both ranks' micro-batches
        scope["accumulate"](balancer, parameter, scope["micro_batches"](0, step) + scope["micro_batches"](1, step))
        weights = balancer.step(weights)
        assert histories[0][step] == pytest.approx(weights, abs=1e-6)
    assert histories[0][1] != pytest.approx({"a": 1.0, "b": 1.0}, abs=1e-3)  # the weights did move


def test_gradnorm_update_matches_hand_computation():
    w = {"a": 1.0, "b": 1.0, "c": 2.0}
    losses, initial = {"a": 1.0, "b": 1.0}, {"a": 2.0, "b": 1.0}
    norms = {"a": 1.0, "b": 3.0}
    new = gradnorm_update(w, losses, initial, norms, alpha=1.5, lr=0.1)
    # by hand: G = (1, 3), mean 2; ratios (0.5, 1) / 0.75; targets 2 * r**1.5 = (1.0887, 3.0792);
    # G - T < 0 for both -> w + lr * g = (1.1, 1.3), rescaled to the old sum 2 -> (0.91667, 1.08333)
    assert new["a"] == pytest.approx(1.1 * 2 / 2.4, rel=1e-9)
    assert new["b"] == pytest.approx(1.3 * 2 / 2.4, rel=1e-9)
    assert new["c"] == 2.0  # not in the step: unchanged
    assert gradnorm_update(w, {"a": 1.0}, initial, norms, alpha=1.5, lr=0.1) == w  # one task: nothing to balance


def test_shared_parameter_is_outside_the_output_head():
    from transformers import BertConfig, BertForSequenceClassification

    model = BertForSequenceClassification(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                                     num_attention_heads=2, intermediate_size=16))
    param = shared_parameter(model)
    names = {id(p): n for n, p in model.named_parameters()}
    assert not names[id(param)].startswith("classifier")
    assert names[id(param)] == [n for n, _ in model.named_parameters() if not n.startswith("classifier")][-1]
