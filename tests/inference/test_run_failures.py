"""``run`` when things fail: every input accounted for, errors of ``fn`` naming their inputs, ``on_error="skip"``,
and a worker error that is not a device failure stopping the run on every path, several devices included.

Models are real where they matter (see conftest.py); failures are injected into ``fn`` or the store's file writes.
"""

import errno
import itertools
import math
import threading
import time

import pyarrow.dataset as ds
import pytest
import torch
from runner_helpers import _lengths, _load

from dynabatch import IncompleteRunError, build_dynamic_batch_dataloader, run
from dynabatch.data.collate import take_rows
from dynabatch.inference.store_writer import CommitPolicy

pytestmark = pytest.mark.usefixtures("one_thread")

TWO = ["cpu", "cpu"]


def _raises_at(*positions):
    """``fn`` that raises ``ValueError`` on any batch holding one of ``positions``."""

    def fn(batch):
        bad = sorted(set(batch.indices.tolist()) & set(positions))
        if bad:
            raise ValueError(f"cannot process input {bad[0]}")
        return _lengths(batch)

    return fn


def _stored(path):
    return ds.dataset(path).to_table(columns=["position"]).column("position").to_pylist()


def _no_thread_left():
    return not [t.name for t in threading.enumerate() if t.name.startswith("dynabatch")]


# --- fn's errors name their inputs; on_error="skip" sets them aside ------------------------------------------------


def _counted(fn):
    """``fn``, recording the input positions of each call (``.calls``)."""

    def wrapped(batch):
        wrapped.calls.append(batch.indices.tolist())
        return fn(batch)

    wrapped.calls = []
    return wrapped


@pytest.mark.parametrize("bad", [0, 7, 23])
def test_an_error_of_fn_names_the_row_it_raises_on_within_bounded_calls_on_one_device_and_several(tokenizer, texts,
                                                                                                   bad):
    ids = [f"doc-{i}" for i in range(len(texts))]
    for options in ({}, {"devices": TWO}):
        fn = _counted(_raises_at(bad))
        call = {"make_fn": lambda device, fn=fn: fn} if options else {"fn": fn}
        with pytest.raises(ValueError, match=rf"^cannot process input {bad}\ndynabatch.run: fn\(batch\) raised on "
                                             rf"input position {bad} \(id doc-{bad}\), alone \(a row of batch \d+\); "
                                             r"on_error='skip' \(--on-error skip on the command line\) sets"):
            run(loader=_load(texts, tokenizer, ids=ids, batch_size=24), progress=False, **call, **options)
        holding = [c for c in fn.calls if bad in c]  # the batch, then the half holding it at each halving
        rows = len(holding[0])
        assert rows > 8 and len(holding[-1]) == 1 and len(holding) <= 1 + math.ceil(math.log2(rows))
        if not options:  # one device: every call after the batch's is one of its parts, at most two a halving
            assert len(fn.calls) - fn.calls.index(holding[0]) - 1 <= 2 * math.ceil(math.log2(rows))
        assert _no_thread_left()


def test_a_model_that_raises_on_every_call_is_named_after_log2_rows_calls(tokenizer, texts):
    def broken(batch):
        raise RuntimeError("the model is broken")

    fn = _counted(broken)
    loader = _load(texts, tokenizer, ids=[f"doc-{i}" for i in range(len(texts))], batch_size=24)
    first = loader.batch_sampler.batches[0]
    with pytest.raises(RuntimeError, match=rf"input position {first[0]} \(id doc-{first[0]}\), alone"):
        run(fn, loader, progress=False)
    assert [len(c) for c in fn.calls] == [len(first), 12, 6, 3, 1]  # each first half: ceil(log2(24)) - 1 more calls


def test_an_error_no_part_of_its_batch_raises_is_raised_naming_the_batch(tokenizer, texts, tmp_path):
    def whole(batch):  # raises on the batch as a whole (its size), on no row
        if len(batch.indices) > 12:
            raise RuntimeError("too many rows for this model")
        return _lengths(batch)

    loader = _load(texts, tokenizer, ids=[f"doc-{i}" for i in range(len(texts))], batch_size=24)
    first = loader.batch_sampler.batches[0]
    with pytest.raises(RuntimeError, match=rf"raised on batch \d+: 24 rows at input positions {first[0]}, .*, but "
                                           r"on none of its parts when retried in halves"):
        run(whole, loader, output_path=tmp_path / "store", progress=False)
    stored = ds.dataset(tmp_path / "store").to_table(columns=["id"]).column("id").to_pylist()
    assert sorted(stored) == sorted(f"doc-{p}" for p in first.tolist())  # the halves that ran are stored


def test_after_splitting_down_to_one_row_the_note_names_that_row(tokenizer, texts):
    def fn(batch):
        if len(batch.indices) > 1:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")  # split down to single rows
        return _raises_at(11)(batch)

    ids = [f"doc-{i}" for i in range(len(texts))]
    with pytest.raises(ValueError, match=r"^cannot process input 11\ndynabatch.run: fn\(batch\) raised on input "
                                         r"position 11 \(id doc-11\), alone \(a row of batch \d+\)"):
        run(fn, _load(texts, tokenizer, ids=ids), progress=False)


@pytest.mark.parametrize("devices", [None, TWO])
def test_on_error_skip_sets_the_rows_fn_raises_on_aside_with_the_errors_text(tokenizer, texts, devices):
    fn = _raises_at(3, 40)
    call = {"make_fn": lambda device: fn, "devices": devices} if devices else {"fn": fn}
    result = run(loader=_load(texts, tokenizer), on_error="skip", progress=False, **call)
    assert result.failed == [3, 40] and result[3] is None and result[40] is None
    assert result.failures == {3: "ValueError: cannot process input 3", 40: "ValueError: cannot process input 40"}
    assert result.report.error_rows == 2 and result.report.rows == len(texts)  # every input once
    want = run(_lengths, _load(texts, tokenizer), progress=False)
    # the tokens counted real are those of the rows that ran to completion, as the padded ones are: a share <= 1
    stored_tokens = sum(int(row[0]) for p, row in enumerate(want) if p not in (3, 40))
    assert result.report.real_tokens == stored_tokens <= result.report.padded_tokens
    assert all(torch.equal(a, b) for p, (a, b) in enumerate(zip(result, want)) if p not in (3, 40))


def test_rows_set_aside_are_failure_records_of_the_store_and_a_rerun_retries_them(tokenizer, texts, tmp_path):
    path = tmp_path / "store"
    first = run(_raises_at(5), _load(texts, tokenizer), output_path=path, on_error="skip", progress=False)
    assert first.failures == {5: "ValueError: cannot process input 5"} and 5 not in _stored(path)
    calls = []
    again = run(lambda b: calls.extend(b.indices.tolist()) or _lengths(b), _load(texts, tokenizer), output_path=path,
                progress=False)
    assert calls == [5] and again.failed == [] and sorted(_stored(path)) == list(range(len(texts)))


def test_bad_inputs_are_in_failures_with_their_cause(tokenizer, texts):
    from dynabatch.inference.runner import BAD_INPUT

    result = run(_lengths, _load([*texts[:10], None, *texts[10:20]], tokenizer, on_bad_input="skip"),
                 progress=False)
    assert result.failures == {10: BAD_INPUT} and result.failed == [10]


@pytest.mark.parametrize("stream", [False, True])
def test_with_skip_and_every_input_bad_run_lists_every_input_failed_and_runs_no_batch(tokenizer, tmp_path, stream):
    from dynabatch.inference.runner import BAD_INPUT

    calls = []
    fn = lambda b: calls.append(b) or _lengths(b)  # noqa: E731
    for path in (None, tmp_path / "store"):
        loader = _load([None, 3, b"x"], tokenizer, on_bad_input="skip", ids=["a", "b", "c"], stream=stream)
        result = run(fn, loader, output_path=path, progress=False)
        assert list(result) == [None] * 3 and result.failed == [0, 1, 2] and result.failures[2] == BAD_INPUT
        assert result.report.skipped_inputs == 3 and calls == []


# --- a worker's error that is not a device failure stops the run, several devices included -------------------------


def test_rows_the_store_refuses_stop_a_run_on_two_devices_with_nothing_lost(tokenizer, texts, tmp_path, monkeypatch):
    # the first shard, typing the columns, is early
    monkeypatch.setattr("dynabatch.inference.store_writer.COMMIT", CommitPolicy(rows=8))
    loader = _load(texts, tokenizer)
    odd = int(loader.batch_sampler.batches[3][0])

    def make_fn(device):
        def fn(batch):  # one batch's vectors do not fit the stored schema (3 values, not 2)
            out = _lengths(batch)
            if odd not in batch.indices.tolist():
                return out
            deadline = time.monotonic() + 30  # a shard has typed the columns (before it, lengths may vary: lists)
            while not list(path.glob("part-*.parquet")) and time.monotonic() < deadline:
                time.sleep(0.01)
            return torch.cat([out, out[:, :1]], 1)

        return fn

    path = tmp_path / "store"
    with pytest.raises(ValueError, match=r"should have dtype float32 and shape \(2,\) in every row"):
        run(make_fn=make_fn, loader=loader, devices=TWO, output_path=path, progress=False)
    stored = _stored(path)
    assert len(stored) == len(set(stored)) < len(texts) and odd not in stored and _no_thread_left()
    done = run(_lengths, _load(texts, tokenizer), output_path=path, progress=False)
    assert sorted(_stored(path)) == list(range(len(texts))) and done.report.rows == len(texts) - len(stored)


def test_a_write_that_keeps_failing_stops_a_run_on_two_devices_and_a_rerun_stores_the_rest(tokenizer, texts, tmp_path,
                                                                                          monkeypatch):
    import pyarrow.parquet as pq

    monkeypatch.setattr("dynabatch.inference.store_writer.COMMIT", CommitPolicy(rows=8))
    monkeypatch.setattr("dynabatch.inference.store_shards.RETRY_SECONDS", 0.0)  # the retries' waits: test_store.py
    real_write, writes = pq.write_table, []

    def no_space_after_two(*args, **kwargs):  # the disk fills up after two shards
        writes.append(1)
        if len(writes) > 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(*args, **kwargs)

    monkeypatch.setattr(pq, "write_table", no_space_after_two)
    path = tmp_path / "store"
    with pytest.raises(OSError, match="No space left on device"):
        run(make_fn=lambda device: _lengths, loader=_load(texts, tokenizer), devices=TWO, output_path=path,
            progress=False)
    stored = _stored(path)
    assert len(stored) == len(set(stored)) < len(texts) and _no_thread_left()
    monkeypatch.setattr(pq, "write_table", real_write)
    done = run(_lengths, _load(texts, tokenizer), output_path=path, progress=False)
    assert sorted(_stored(path)) == list(range(len(texts))) and done.report.rows == len(texts) - len(stored)


# --- one accounting at the end of every run -------------------------------------------------------------------------


def test_inputs_neither_returned_nor_failed_raise_naming_them(tokenizer, texts):
    batches = list(_load(texts[:30], tokenizer))
    gap = min(p for p in batches[2].indices.tolist() if p != 29)  # not the last position: the inputs are 30
    holey = [b if gap not in b.indices.tolist() else _without(b, gap) for b in batches]
    with pytest.raises(IncompleteRunError, match=rf"^run should account for every input \(a result, or a place in "
                                                 rf"failed with its cause\), but got 1 of 30 inputs with neither "
                                                 rf"\(positions {gap}\)") as raised:
        run(_lengths, holey, progress=False)
    assert raised.value.missing == [gap] and raised.value.partial[gap] is None


def test_an_iterable_that_names_a_position_twice_is_refused_naming_it(tokenizer, texts, tmp_path):
    # Two loaders chained each number their inputs from 0: the second's result for a position replaced the first's,
    # so 40 inputs came back as 20 results and nothing said so (in memory, on two devices, and in a store)
    first, second = _load(texts[:20], tokenizer), _load(texts[20:40], tokenizer)
    again = (r"^loader should name each input position once \(batch.indices\), but got input positions [0-9, .]+ "
             r"again in batch \d+: its result would replace the other")
    for kwargs in ({}, {"output_path": tmp_path / "store"}):
        with pytest.raises(ValueError, match=again):
            run(_lengths, itertools.chain(first, second), progress=False, **kwargs)
    with pytest.raises(ValueError, match=again):
        run(loader=itertools.chain(first, second), make_fn=lambda device: _lengths, devices=TWO, progress=False)
    batch = next(iter(first))
    twice = [take_rows(batch, [0, 0, 1])]  # one batch naming a position twice
    with pytest.raises(ValueError, match=rf"^loader should name each input position once \(batch.indices\), but got "
                                         rf"input positions {batch.indices[0].item()} again in batch 0"):
        run(_lengths, twice, progress=False)
    negative = take_rows(batch, [0])
    negative.indices = torch.tensor([-1])  # a result kept at -1 would stand for the last input
    with pytest.raises(ValueError, match=r"^batch.indices should be input positions \(integers >= 0\), but got "
                                         r"batch.indices=\[-1\]"):
        run(_lengths, [negative], progress=False)
    negative.indices = torch.tensor([0.5])
    with pytest.raises(TypeError, match=r"^batch.indices should be integer input positions, but got batch.indices of "
                                        r"dtype torch.float32"):
        run(_lengths, [negative], progress=False)
    negative.indices = torch.tensor([0, 1])
    with pytest.raises(ValueError, match=r"^batch.indices should name one input position per row of the batch "
                                         r"\(1 rows\), but got 2 positions"):
        run(_lengths, [negative], progress=False)


def _without(batch, position):
    keep = [i for i, p in enumerate(batch.indices.tolist()) if p != position]
    return take_rows(batch, keep)


def test_a_row_fn_gives_as_none_is_a_failure_record_of_the_store(tokenizer, texts, tmp_path):
    from dynabatch import PerRow
    from dynabatch.inference.store_writer import NONE_ROW

    def fn(batch):
        return PerRow([None if p == 4 else float(p) for p in batch.indices.tolist()])

    in_memory = run(fn, _load(texts[:20], tokenizer), progress=False)
    assert in_memory[4] is None and in_memory.failed == []  # in memory None is its result
    stored = run(fn, _load(texts[:20], tokenizer), output_path=tmp_path / "store", progress=False)
    assert stored.failures == {4: NONE_ROW} and stored[4] is None and stored[5] == 5.0


def test_inputs_lost_on_the_way_to_the_sink_are_named_by_position_and_id(tokenizer, texts, monkeypatch):
    from dynabatch.inference.sink import MemorySink

    write = MemorySink.write
    lost = list(range(7))

    def losing(self, positions, rows, hashes, varying=()):  # the rows of inputs 0-6 never reach the sink
        keep = [i for i, p in enumerate(positions.tolist()) if p not in lost]
        write(self, positions[keep], [rows[i] for i in keep], None if hashes is None else hashes[keep], varying)

    monkeypatch.setattr(MemorySink, "write", losing)
    ids = [f"t{i}" for i in range(20)]
    loader = build_dynamic_batch_dataloader(texts[:20], tokenizer, batch_size=4, max_input_token_length=64, ids=ids,
                                            progress=False)
    with pytest.raises(IncompleteRunError, match=r"but got 7 of 20 inputs with neither \(positions 0, 1, 2, 3, 4, "
                                                 r"\.\.\.; ids t0, t1, t2, t3, t4, \.\.\.\)"):
        run(_lengths, loader, progress=False)
