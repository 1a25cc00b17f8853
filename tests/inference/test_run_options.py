"""``run``'s options: each rule resolved or refused in one place, one spelling for each thing, and the seams
between options that used to override each other silently."""

import os
import signal
import threading
import time

import _processes
import pytest
import torch
from runner_helpers import MAX_LEN, _lengths, _load

from dynabatch import run

pytestmark = pytest.mark.usefixtures("one_thread")


# --- one meaning each ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"memory": "fast"}, ValueError,
         r"^memory should be one of \('auto', 'measured', 'guarded', 'record', 'off'\), but got memory='fast'$"),
        ({"ranks": "all"}, ValueError, r"^ranks should be one of \('auto', 'lockstep', 'claim', 'single'\)"),
        ({"ranks": "claim"}, ValueError, r"^ranks should be 'auto' or 'single' without a torch.distributed process "
                                         r"group"),
        ({"prefetch": 2, "devices": ["cpu"]}, ValueError, r"^prefetch should be None or 0 with devices"),
        ({"make_fn": lambda d: _lengths}, ValueError, r"^make_fn should be None without devices"),
        ({"on_error": "ignore"}, ValueError,
         r"^on_error should be one of \('raise', 'skip'\), but got on_error='ignore'$"),
        ({"batch_sizes": 3}, TypeError, r"run\(\) got an unexpected keyword argument 'batch_sizes'"),
    ],
)
def test_options_no_run_can_honour_are_refused_before_any_batch(tokenizer, texts, kwargs, error, match):
    calls = []
    fn = None if "make_fn" in kwargs or "devices" in kwargs else (lambda b: calls.append(b) or _lengths(b))
    if "devices" in kwargs and "make_fn" not in kwargs:
        kwargs = {**kwargs, "make_fn": lambda device: _lengths}
    with pytest.raises(error, match=match):
        run(fn, _load(texts[:10], tokenizer), progress=False, **kwargs)
    assert calls == []


def test_measured_mode_on_a_shuffled_loader_is_refused_not_run_in_plan_order(tokenizer, texts):
    loader = _load(texts[:20], tokenizer, shuffle=True)
    with pytest.raises(ValueError, match=r"memory should be 'guarded', 'record' or 'off' here \(a shuffled loader's "
                                         r"order cannot be kept: batches are re-planned longest first"):
        run(_lengths, loader, memory="measured", progress=False)
    ran = []
    run(lambda b: ran.append(b.indices.tolist()) or _lengths(b), loader, progress=False)  # auto: guarded
    assert [i for b in ran for i in b] == [i for b in loader.batch_sampler for i in b]  # the shuffled order


@pytest.mark.parametrize("old", ["adapt", "measure_memory", "distributed", "lockstep"])
def test_the_spellings_of_earlier_versions_are_unknown_keywords(tokenizer, texts, old):
    with pytest.raises(TypeError, match=rf"^run\(\) got an unexpected keyword argument '{old}'$"):
        run(_lengths, _load(texts[:5], tokenizer), progress=False, **{old: True})


def test_devices_take_make_fn_and_fn_with_devices_is_refused(tokenizer, texts):
    want = run(_lengths, _load(texts[:30], tokenizer), progress=False)
    got = run(loader=_load(texts[:30], tokenizer), make_fn=lambda device: _lengths, devices=["cpu", "cpu"],
              progress=False)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    with pytest.raises(ValueError, match=r"^fn should be None with devices \(fn is always fn\(batch\); pass make_fn="):
        run(lambda device: _lengths, _load(texts[:30], tokenizer), devices=["cpu", "cpu"], progress=False)
    with pytest.raises(ValueError, match=r"^fn should be given, or make_fn given with devices \(one of the two\)"):
        run(_lengths, _load(texts[:5], tokenizer), make_fn=lambda d: _lengths, devices=["cpu"], progress=False)


# --- the seams -------------------------------------------------------------------------------------------------


def test_a_pooled_vector_as_wide_as_the_first_batch_is_refused_before_a_row_is_stored(tokenizer, tmp_path):
    from dynabatch.demo import kjv_passages

    texts = kjv_passages()[:40]  # long passages: the first batch is cut to MAX_LEN tokens, as wide as the vector
    pooled = lambda b: b["input_ids"].float()[:, :1].repeat(1, MAX_LEN)  # noqa: E731 (one MAX_LEN-d vector per row)
    store = tmp_path / "store"
    with pytest.raises(ValueError, match=r"should say how its rows are read, but got a 2-D tensor of shape "
                                         rf"\(4, {MAX_LEN}\) whose dimension 1 equals the batch's width {MAX_LEN}"):
        run(pooled, _load(texts, tokenizer), output_path=store, progress=False)
    assert not [f for f in os.listdir(store) if f.endswith(".parquet")]  # refused before any row was written
    rows = run(pooled, _load(texts, tokenizer), output_path=store, token_outputs="whole", progress=False)
    assert all(row.shape == (MAX_LEN,) for row in rows)  # declared: every row whole, none cut


def test_one_device_that_cannot_fit_a_row_is_no_device_failure_and_counts_each_input_once(tokenizer, texts):
    from dynabatch import BatchOutOfMemoryError

    lock, made = threading.Lock(), []

    def make_fn(device):
        with lock:
            broken = not made  # the first device to start fits nothing, not even one row
            made.append(device)

        def fn(batch):
            if broken:
                raise torch.OutOfMemoryError("CUDA out of memory (injected: this device fits nothing)")
            return _lengths(batch)

        return fn

    with pytest.raises(BatchOutOfMemoryError, match=r"ran out of memory on its own") as raised:
        run(loader=_load(texts, tokenizer), make_fn=make_fn, devices=["cpu", "cpu"], progress=False)
    partial = raised.value.partial  # out of memory is not a device failure: the run stops, on_oom="raise"
    assert partial.report.rows == sum(r is not None for r in partial) < len(texts)
    made.clear()
    result = run(loader=_load(texts, tokenizer), make_fn=make_fn, devices=["cpu", "cpu"], progress=False,
                 on_oom="skip")
    assert result.report.rows == len(texts)  # each input once: run, or set aside with its cause
    assert result.failed and all(result[p] is None for p in result.failed)
    cause = "out of memory alone: OutOfMemoryError: CUDA out of memory (injected: this device fits nothing)"
    assert set(result.failures.values()) == {cause}
    want = run(_lengths, _load(texts, tokenizer), progress=False)
    assert all(a is None or torch.equal(a, b) for a, b in zip(result, want))


def test_ctrl_c_on_two_devices_stops_every_thread_and_keeps_the_finished_rows(tokenizer, texts, tmp_path):
    calls = []
    lock = threading.Lock()

    def make_fn(device):
        def fn(batch):
            with lock:
                calls.append(time.monotonic())
                if len(calls) == 3:
                    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, delivered to the main thread
            time.sleep(0.02)
            return _lengths(batch)

        return fn

    store = tmp_path / "store"
    loader = _load(texts, tokenizer, batch_size=2)
    # Python's own Ctrl-C handler, unblocked (a library an earlier test of this process loaded may have set another)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    try:
        run(loader=loader, make_fn=make_fn, devices=["cpu", "cpu"], output_path=store, key="lengths", progress=False)
    except KeyboardInterrupt:
        pass
    else:
        pytest.fail(f"run returned after {len(calls)} calls of {len(loader.batch_sampler)} planned, without Ctrl-C "
                    f"(the SIGINT handler before the test: {previous!r})")
    finally:
        signal.signal(signal.SIGINT, previous)
    stopped = len(calls)
    time.sleep(0.3)
    assert len(calls) == stopped < 20  # no call after run raised
    assert not [t.name for t in threading.enumerate() if t.name.startswith("dynabatch")]
    done = run(_lengths, _load(texts, tokenizer, batch_size=2), output_path=store, key="lengths", progress=False)
    assert 0 < len(texts) - done.report.rows < len(texts)  # the rows finished before Ctrl-C were committed
    want = run(_lengths, _load(texts, tokenizer), progress=False)
    assert all(torch.equal(a, b) for a, b in zip(done, want))


@pytest.mark.skipif(not os.path.exists("/proc/self/task") or len(os.sched_getaffinity(0)) < 2,
                    reason="reads /proc; workers need two cores")
@pytest.mark.parametrize("ends", ["returns", "raises"])
def test_the_tokenizer_worker_processes_an_eager_loader_started_end_with_the_run(texts, monkeypatch, ends):
    # Found by SIGINT mid-run of a 20,000-text eager loader (a slow tokenizer): its worker was still this process's
    # child after run raised KeyboardInterrupt, and after a run that returned, until the interpreter exited
    from transformers import BertTokenizerLegacy

    from dynabatch.data import workers
    from dynabatch.demo import minilm_path

    monkeypatch.setattr(workers, "POOL_MIN_SECONDS", 0)  # workers for a corpus this small
    before = set(_processes.descendants([os.getpid()]))
    loader = _load(texts * 4, BertTokenizerLegacy.from_pretrained(minilm_path()), stream=False, tokenize_cores=2,
                   progress=False)
    started = set(_processes.descendants([os.getpid()])) - before
    assert started, "the build started no tokenizer worker: the test tests nothing"

    def fn(batch):
        if ends == "raises":
            raise RuntimeError("fn fails")
        return _lengths(batch)

    try:
        run(fn, loader, progress=False)
    except RuntimeError:
        assert ends == "raises"
    assert not started & set(_processes.descendants([os.getpid()]))  # ended and reaped as run returns


@pytest.mark.parametrize("memory", ["off", "record", "guarded"])
def test_a_dynabatch_loaders_batches_are_built_ahead_in_every_memory_mode(tokenizer, texts, memory):
    loader = _load(texts, tokenizer)
    collate = loader.plan.collator
    threads = []

    class Recorded:  # the loader's collator, noting the thread that builds each batch
        def __getattr__(self, name):
            return getattr(collate, name)

        def __call__(self, positions):
            threads.append(threading.current_thread().name)
            return collate(positions)

    loader.plan.collator = Recorded()  # what run builds batches with
    try:
        rows = run(_lengths, loader, memory=memory, progress=False)
    finally:
        loader.plan.collator = collate
    assert any(name.startswith("dynabatch-prefetch") for name in threads)  # prefetch=2 means it, not only measured
    want = run(_lengths, _load(texts, tokenizer), progress=False)
    assert all(torch.equal(a, b) for a, b in zip(rows, want))


def test_the_partial_result_of_an_out_of_memory_error_names_the_bad_inputs_skipped_too(tokenizer, texts):
    from runner_helpers import _fails_at

    from dynabatch import BatchOutOfMemoryError

    corpus = [*texts[:20], None, *texts[20:30]]
    loader = _load(corpus, tokenizer, on_bad_input="skip")
    with pytest.raises(BatchOutOfMemoryError) as raised:
        run(_fails_at(_lengths, 3), loader, progress=False)
    assert 20 in raised.value.partial.failed and raised.value.partial.report.skipped_inputs == 1


def test_claiming_ranks_refuse_a_shuffled_loader_rather_than_drop_its_order(tokenizer, texts, tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'group'}", rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match=r"^ranks should be 'lockstep' or 'single' for a shuffled loader \(ranks "
                                             r"claim chunks of the plan in its planned order"):
            run(_lengths, _load(texts[:20], tokenizer, shuffle=True), ranks="claim", progress=False)
    finally:
        dist.destroy_process_group()
