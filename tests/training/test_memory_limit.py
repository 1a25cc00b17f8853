"""From a memory limit to a run: the recipe of docs/training.md as written, every step under the limit."""

import re
from pathlib import Path

import pytest
import torch

DOCS = Path(__file__).resolve().parents[2] / "docs" / "training.md"


def recipe(heading: str) -> str:
    """The code block under ``### {heading}`` of the "Training within a memory limit" section."""
    text = DOCS.read_text(encoding="utf-8")
    start = text.index(f"### {heading}")
    return re.search(r"```python\n(.*?)```", text[start:], re.S).group(1)


class StepPeaks:
    """What the training holds at the peak of each step (bytes held before it plus its measured peak), by the
    CPU tracker: entered when a step begins, left when it ends."""

    def __init__(self) -> None:
        self.totals: list[int] = []

    def begin(self, model, optimizer) -> None:
        from dynabatch import track_peak_memory
        from dynabatch.training.memory_limit import resident_bytes

        self.held = sum(resident_bytes(model, optimizer, "cpu").values())
        self.block = track_peak_memory("cpu")
        self.mem = self.block.__enter__()

    def end(self) -> None:
        self.block.__exit__(None, None, None)
        self.totals.append(self.held + self.mem.peak_bytes)

    def measured(self, loader, namespace):
        """``loader``'s batches, each step of the loop's body measured."""
        for batch in loader:
            self.begin(namespace["model"], namespace["optimizer"])
            try:
                yield batch
            finally:
                self.end()


def _check(peaks: StepPeaks, namespace: dict, steps: int) -> None:
    limit = namespace["budget"].memory_model.metadata["limit_bytes"]
    assert limit == 100e6 and len(peaks.totals) == steps == len(namespace["sampler"]) > 1
    assert max(peaks.totals) <= limit  # every step under the limit, weights and optimizer state included
    assert max(peaks.totals) >= 0.5 * limit  # and the batches use it
    assert sum(len(b) for b in namespace["sampler"]) == 200


@pytest.mark.slow
def test_the_trainer_recipe_runs_as_written_and_every_step_stays_under_the_limit(tmp_path, monkeypatch, one_thread):
    from transformers import TrainerCallback

    monkeypatch.chdir(tmp_path)
    peaks, namespace = StepPeaks(), {}

    class Measure(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            peaks.begin(namespace["model"], namespace["trainer"].optimizer)

        def on_step_end(self, args, state, control, **kwargs):
            peaks.end()

    code = recipe("With the HF `Trainer`")
    assert code.count("trainer.train()") == 1
    namespace["Measure"] = Measure
    exec(compile(code.replace("trainer.train()", "trainer.add_callback(Measure()); trainer.train()"), str(DOCS),
                 "exec"), namespace)
    _check(peaks, namespace, namespace["trainer"].state.global_step)


@pytest.mark.slow
def test_the_plain_loop_recipe_runs_as_written_and_every_step_stays_under_the_limit(one_thread):
    peaks, namespace = StepPeaks(), {}
    code = recipe("In a plain loop")
    assert code.count("    for batch in loader:") == 1
    namespace["peaks"] = peaks
    exec(compile(code.replace("    for batch in loader:", "    for batch in peaks.measured(loader, globals()):"),
                 str(DOCS), "exec"), namespace)
    _check(peaks, namespace, len(peaks.totals))


def test_measuring_leaves_the_model_as_it_was(tokenizer, one_thread):
    from transformers import GPT2Config, GPT2LMHeadModel

    from dynabatch import training_budget

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2, n_positions=32))
    model.eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    budget = training_budget(model, tokenizer, "40MB", max_length=32, method="probe", progress=False)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()) and not model.training
    assert torch.equal(torch.get_rng_state(), rng) and all(p.grad is None for p in model.parameters())
    found = budget.memory_model.metadata["max_rows"]  # the probe: the most rows that ran at each length
    assert list(found) == [32, 16, 8, 4] and found[32] < found[16] < found[8] < found[4]
    assert int(budget.rows_allowed(32)) <= found[32]  # planned to 0.9 of what a step may use
    with pytest.raises(ValueError, match=r"limit should be above what the model and its optimizer state hold "
                                         r"\(0\.0\d+ GB: weights"):
        training_budget(model, tokenizer, "10MB", max_length=32, progress=False)
    with pytest.raises(ValueError, match=r"limit should be bytes or a size such as '20GB' on cpu "
                                         r"\(no device memory is known there"):
        training_budget(model, tokenizer, "80%", max_length=32, progress=False)
    with pytest.raises(ValueError, match=r"method should be one of \('calibrate', 'probe'\)"):
        training_budget(model, tokenizer, "40MB", max_length=32, method="nemo")
