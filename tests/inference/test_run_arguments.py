"""``run`` on real batches of real texts: argument checks. Models are real (see conftest.py); nothing of dynabatch is mocked.
"""

import pickle
import re
import threading

import pytest
import torch
from runner_helpers import (
    _lengths,
    _load,
)

from dynabatch import RunResult, run
from dynabatch.inference.report import RunReport

pytestmark = pytest.mark.usefixtures("one_thread")


# --- argument checks ---------------------------------------------------------------------------------


def test_bad_arguments_are_named(tokenizer, texts):
    loader = _load(texts[:10], tokenizer)
    with pytest.raises(TypeError, match="fn should be a callable taking a batch, but got fn='model' of type str"):
        run("model", loader)
    with pytest.raises(ValueError, match=r"on_oom should be one of \('raise', 'skip'\), but got on_oom='ignore'"):
        run(_lengths, loader, on_oom="ignore")
    with pytest.raises(TypeError, match="output_path should be None, a str or an os.PathLike.*of type int"):
        run(_lengths, loader, output_path=3)
    with pytest.raises(TypeError, match="progress should be a bool"):
        run(_lengths, loader, progress="yes")
    plain = [{"input_ids": torch.ones(2, 3, dtype=torch.long)}]
    with pytest.raises(
        TypeError,
        match=r"loader should be a dynabatch DataLoader or an iterable of dynabatch Batches"
        r".*but got loader=<list of 1 item: \[\{'input_ids': tensor.* yielding a batch of type dict",
    ):
        run(_lengths, plain, progress=False)
    with pytest.raises(TypeError, match="loader should be"):
        run(_lengths, 42, progress=False)


def test_a_model_a_missing_gpu_and_an_unknown_device_fail_before_any_batch(tokenizer, texts, monkeypatch):
    from transformers import BertConfig, BertModel

    loader = _load(texts[:10], tokenizer)
    model = BertModel(BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=16, num_hidden_layers=1,
                                 num_attention_heads=2, intermediate_size=32))
    with pytest.raises(TypeError, match=r"fn should be a callable taking a dynabatch.Batch \(a dict of tensors\), such "
                                        r"as lambda batch: model\(\*\*batch\) .*, but got fn=<BertModel> of type "
                                        r"BertModel$"):
        run(model, loader, progress=False)
    with pytest.raises(ValueError, match=r"device should be a valid torch device such as 'cpu' or 'cuda:0', "
                                         r"but got device='gpu'"):
        run(_lengths, loader, device="gpu", progress=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without a GPU, wherever this runs
    with pytest.raises(ValueError, match=r"device should be an available device \(torch.cuda.is_available\(\) "
                                         r"is False: no CUDA device here\), but got device='cuda'"):
        run(_lengths, loader, progress=False, device="cuda")


def test_run_result_pickles_with_its_report(tokenizer, texts):
    result = run(_lengths, _load(texts[:10], tokenizer), progress=False)
    again = pickle.loads(pickle.dumps(result))
    assert isinstance(again, RunResult) and isinstance(again.report, RunReport)
    assert again.report.rows == 10 and again.failed == []


@pytest.mark.parametrize("stream", [False, True])
def test_a_loader_is_run_by_one_run_at_a_time(tokenizer, texts, stream):
    # Two runs of one loader at once (in two threads, or one in fn) shared its plan's one pass in measured mode (the
    # default where memory can be measured): each ran part of the batches, and both raised IncompleteRunError (found
    # probing two runs in two threads of one process). The second is refused; the first, and later runs, complete.
    loader = _load(texts, tokenizer, stream=stream)
    want = torch.stack(list(run(_lengths, _load(texts, tokenizer), memory="off", progress=False)))  # another loader
    refused, first_batch, second_tried = [], threading.Event(), threading.Event()
    message = r"loader should be run by one run at a time .* while another run of it has not ended"

    def in_thread():
        first_batch.wait()
        try:
            run(_lengths, loader, memory="measured", progress=False)
        except ValueError as exc:
            refused.append(str(exc))
        second_tried.set()

    def nested(batch):
        if not first_batch.is_set():
            first_batch.set()
            second_tried.wait(60)
            with pytest.raises(ValueError, match=message):
                run(_lengths, loader, progress=False)
        return _lengths(batch)

    other = threading.Thread(target=in_thread)
    other.start()
    result = run(nested, loader, memory="measured", progress=False)
    other.join()
    assert len(refused) == 1 and re.search(message, refused[0])
    assert torch.equal(torch.stack(list(result)), want) and result.failed == []
    again = run(_lengths, loader, memory="measured", progress=False)
    assert torch.equal(torch.stack(list(again)), want)
