"""``run`` on several devices at once (``devices=``) and with batches built ahead (``prefetch``)."""

import threading

import pytest
import torch
from runner_helpers import _lengths, _load, _oom_over

from dynabatch import run


def _on(device_log):
    """``make_fn``: records which thread made the fn for which device, and which device ran each batch."""

    def make_fn(device):
        device_log.append((str(device), threading.current_thread()))  # the object: an ended thread's ident is reused

        def fn(batch):
            assert batch["input_ids"].device.type == device.type
            return _lengths(batch)

        return fn

    return make_fn


def test_two_devices_give_every_row_once_in_input_order(texts, tokenizer):
    alone = run(_lengths, _load(texts, tokenizer), progress=False)
    made = []
    both = run(make_fn=_on(made), loader=_load(texts, tokenizer), devices=["cpu", "cpu"], progress=False)
    assert len(both) == len(texts) and both.failed == []
    assert all(torch.equal(a, b) for a, b in zip(alone, both))
    assert sorted(d for d, _ in made) == ["cpu", "cpu"] and len({id(t) for _, t in made}) == 2  # one thread each
    workers = {"cpu (worker 0)", "cpu (worker 1)"}  # one device named twice: each worker its own name
    ran = {r.device for r in both.report.records}
    assert ran <= workers and both.report.rows == len(texts)
    assert set(both.report.device_budgets) <= workers
    busiest = max(sum(r.seconds for r in both.report.records if r.device == w) for w in ran)
    assert both.report.seconds == pytest.approx(busiest)  # side by side: the busiest worker's time, not the sum


def test_each_device_splits_only_its_own_batch_on_out_of_memory(texts, tokenizer):
    calls = {}

    def make_fn(device):
        fn = _oom_over(_lengths, 3) if not calls else _lengths  # only the first device runs out of memory
        calls[len(calls)] = fn
        return fn

    result = run(make_fn=make_fn, loader=_load(texts, tokenizer), devices=["cpu", "cpu"], progress=False, memory="off")
    alone = run(_lengths, _load(texts, tokenizer), progress=False)
    assert all(torch.equal(a, b) for a, b in zip(alone, result))
    assert result.report.oom_events >= 1
    # every event is the first device's own (a call over 3 rows there), split there; the second ran as planned
    assert sum(rows > 3 for rows, _ in calls[0].calls) == result.report.oom_events


def _device_lost():
    return torch.AcceleratorError("CUDA error: an illegal memory access was encountered")


def test_a_failed_device_puts_its_batch_back_once_and_a_second_failure_raises(texts, tokenizer):
    crashed = []

    def make_fn(device):
        def fn(batch):
            if not crashed:
                crashed.append(batch.indices.tolist())
                raise _device_lost()
            return _lengths(batch)

        return fn

    result = run(make_fn=make_fn, loader=_load(texts, tokenizer), devices=["cpu", "cpu"], progress=False)
    assert len(crashed) == 1 and all(r is not None for r in result)  # the other worker ran the crashed batch

    def always_lost(device):
        def fn(batch):
            raise _device_lost()

        return fn

    with pytest.raises(torch.AcceleratorError, match="illegal memory access"):
        run(make_fn=always_lost, loader=_load(texts, tokenizer), devices=["cpu", "cpu"], progress=False)


def test_devices_store_results_in_one_store(texts, tokenizer, tmp_path):
    result = run(make_fn=_on([]), loader=_load(texts, tokenizer), devices=["cpu", "cpu"], progress=False,
                 output_path=tmp_path / "store", key="lengths")
    alone = run(_lengths, _load(texts, tokenizer), progress=False)
    assert all(torch.equal(a, b) for a, b in zip(alone, result))
    positions = result.to_arrow().column("position").to_pylist() if hasattr(result, "to_arrow") else None
    assert positions is None or sorted(positions) == list(range(len(texts)))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"devices": "cpu"}, TypeError, r"devices should be None or a list of devices"),
        ({"devices": []}, ValueError, r"devices should be None or a list of at least one device"),
        ({"devices": ["cpu"], "device": "cpu"}, ValueError, r"device should be None when devices is given"),
        ({"devices": ["cpu"], "prefetch": 2}, ValueError, r"prefetch should be None or 0 with devices"),
        ({"devices": ["gpu"]}, ValueError, r"devices\[0\]"),
        ({"devices": ["cpu"], "prefetch": -1}, ValueError, r"prefetch"),
    ],
)
def test_bad_devices_and_prefetch_are_refused(texts, tokenizer, kwargs, error, match):
    with pytest.raises(error, match=match):
        run(make_fn=lambda device: _lengths, loader=_load(texts, tokenizer), progress=False, **kwargs)


def test_make_fn_that_returns_no_callable_is_refused(texts, tokenizer):
    with pytest.raises(TypeError, match=r"make_fn should be a callable returning fn\(batch\)"):
        run(make_fn=lambda device: None, loader=_load(texts, tokenizer), devices=["cpu"], progress=False)


@pytest.mark.slow
def test_batches_built_ahead_give_the_same_rows_and_re_sized_ones_are_rebuilt(texts, tokenizer, minilm):
    def embed(batch):
        with torch.no_grad():
            return minilm(**batch).last_hidden_state.mean(1)

    ahead = run(embed, _load(texts, tokenizer), progress=False, prefetch=2, memory="measured")
    built_now = run(embed, _load(texts, tokenizer), progress=False, prefetch=0, memory="measured")
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(ahead, built_now))
    assert [r.rows for r in ahead.report.records] == [r.rows for r in built_now.report.records]
    assert built_now.report.rebuilt_batches == 0
    assert ahead.report.rebuilt_batches > 0  # batches built ahead that a measured peak re-sized: built again


def test_a_run_that_raises_stops_reading_a_plain_iterable_ahead(texts, tokenizer):
    import time

    batches = list(_load(texts, tokenizer))

    def fn(batch):
        raise RuntimeError("the model broke")

    with pytest.raises(RuntimeError, match=r"^the model broke\ndynabatch.run: fn\(batch\) raised on input position \d+, "
                                           r"alone \(a row of batch 0\)"):
        run(fn, iter(batches), progress=False)
    deadline = time.monotonic() + 5
    while any(t.name == "dynabatch-read-ahead" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(t.name == "dynabatch-read-ahead" for t in threading.enumerate())


def test_the_progress_bar_counts_a_crashed_workers_batch_once(texts, tokenizer, capsys):
    import re

    state = {"oom": None, "pieces": 0, "crash": False}
    lock = threading.Lock()

    def make_fn(device):
        def fn(batch):
            rows = batch["input_ids"].shape[0]
            with lock:
                if state["oom"] is None and rows > 1:  # the first batch splits, its first half finishes...
                    state["oom"] = threading.get_ident()
                    raise torch.OutOfMemoryError("CUDA out of memory (injected)")
                if threading.get_ident() == state["oom"] and not state["crash"]:
                    state["pieces"] += 1
                    if state["pieces"] == 2:  # ...and its device fails on its second half
                        state["crash"] = True
                        raise _device_lost()
            return _lengths(batch)

        return fn

    result = run(make_fn=make_fn, loader=_load(texts, tokenizer), devices=["cpu", "cpu"], progress=True)
    assert state["crash"] and all(r is not None for r in result)
    counts = re.findall(r"(\d+)/(\d+) ", capsys.readouterr().err)
    assert counts and counts[-1] == (str(len(texts)), str(len(texts)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_real_gpu_batches_are_pinned_copied_on_their_own_stream_and_give_the_cpus_rows(texts, tokenizer,
                                                                                             monkeypatch):
    from dynabatch.memory import device as devices

    streams, pinned = [], []
    real = devices.StreamCopier.__call__

    def noted(copier, tensors):
        streams.append(copier.stream)
        pinned.append(all(t.is_pinned() for t in tensors.values() if isinstance(t, torch.Tensor)))
        return real(copier, tensors)

    monkeypatch.setattr(devices.StreamCopier, "__call__", noted)
    on_gpu = run(_lengths, _load(texts, tokenizer), device="cuda", progress=False)
    on_cpu = run(_lengths, _load(texts, tokenizer), progress=False)
    assert all(torch.equal(a, b) for a, b in zip(on_gpu, on_cpu)) and on_gpu.failed == []
    assert streams and all(s is streams[0] and s != torch.cuda.current_stream() for s in streams) and all(pinned)
