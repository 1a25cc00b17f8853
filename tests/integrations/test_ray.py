"""``dynabatch.integrations.ray``: memory-safe dynamic batches inside Ray Data's ``map_batches``.

Real model (all-MiniLM-L6-v2, offline), real held-out texts (pyjokes' jokes and
Python's own pydoc topics, which nothing in dynabatch was tuned on). The tests
that call a predictor directly on a window (what each actor does) run in this
process; the ``ray_cluster`` ones run on one local Ray (``num_cpus=2``) shared
by the module. Out-of-memory errors are injected by raising
``torch.OutOfMemoryError`` from the model call, as a device would; nothing of
dynabatch or Ray is mocked.
"""

import collections
import itertools
import json
import logging
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

import dynabatch
from dynabatch import BatchOutOfMemoryError, MemoryModel
from dynabatch.integrations.ray import (PLANS, DynamicBatchPredictor, default_window, map_texts, stored_results,
                                       to_column)

MAX_LEN = 64
ROOT = Path(dynabatch.__file__).resolve().parents[1]
OOM = "CUDA out of memory. Tried to allocate 2.00 GiB"


def _minilm():
    from transformers import AutoModel, AutoTokenizer

    from dynabatch.demo import minilm_path

    return AutoTokenizer.from_pretrained(minilm_path()), AutoModel.from_pretrained(minilm_path()).eval()


class Embed(DynamicBatchPredictor):
    """The issue's example: MiniLM's first-token embedding."""

    def setup(self):
        tok, model = _minilm()
        return tok, lambda b: model(**b).last_hidden_state[:, 0]


class Recording(Embed):
    """Embed that keeps each window's plan and report."""

    def setup(self):
        self.log = []
        return super().setup()

    def window_done(self, report, plan):
        super().window_done(report, plan)
        self.log.append((plan, report, self.reference_bytes))


class Faulty(Recording):
    """Embed on a simulated device: batches of more than ``max_rows`` rows, and any batch holding ``poison``,
    run out of memory; with ``marker``, the first actor to reach its 2nd window dies there (once per job)."""

    def __init__(self, *, max_rows=None, poison=None, marker=None, **kwargs):
        self.max_rows, self.poison, self.marker = max_rows, poison, marker
        self.calls = []  # (rows, width) of every model call
        self.windows_called = 0
        super().__init__(**kwargs)

    def setup(self):
        tok, embed = super().setup()

        def fn(batch):
            rows, width = batch["input_ids"].shape
            self.calls.append((rows, width))
            if (self.max_rows and rows > self.max_rows) or self.poison in batch.texts:
                raise torch.OutOfMemoryError(OOM)
            return embed(batch)

        return tok, fn

    def __call__(self, batch):
        self.windows_called += 1
        if self.marker and self.windows_called == 2:
            try:
                fd = os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)  # atomic: one actor dies, once
            except FileExistsError:
                pass
            else:
                os.write(fd, str(os.getpid()).encode())
                os.close(fd)
                os._exit(1)
        out = super().__call__(batch)
        out["pid"] = np.full(len(out["id"]), os.getpid())
        out["oom_splits"] = np.full(len(out["id"]), self.log[-1][1].oom_splits)  # the window's splits
        return out


@pytest.fixture(scope="module")
def held_out():
    """120 texts of 2 to 64+ tokens: pyjokes' jokes (13 languages) and pydoc topics, shuffled."""
    import pydoc_data.topics

    from dynabatch.demo import joke_texts

    rng = np.random.default_rng(0)
    jokes = joke_texts()
    topics = sorted(pydoc_data.topics.topics.values())
    texts = [jokes[i] for i in rng.choice(len(jokes), 100, replace=False)]
    texts += [topics[i] for i in rng.choice(len(topics), 20, replace=False)]
    return [texts[i] for i in rng.permutation(len(texts))]


@pytest.fixture(scope="module")
def alone(held_out):
    """Each text's embedding computed on its own, unpadded: what every output must equal."""
    tok, model = _minilm()
    out = {}
    with torch.inference_mode():
        for text in held_out:
            if text not in out:
                inputs = tok(text, truncation=True, max_length=MAX_LEN, return_tensors="pt")
                out[text] = model(**inputs).last_hidden_state[0, 0].numpy()
    return out


def _window(texts, start=0):
    return {"id": np.arange(start, start + len(texts)), "text": np.array(texts, dtype=object)}


def _assert_exact(rows, alone, skip=()):
    """Every row's output is its own text's embedding (float32 rounding of a padded batch: 2e-5)."""
    for row in rows:
        if row["text"] in skip:
            continue
        np.testing.assert_allclose(row["output"], alone[row["text"]], atol=2e-5, rtol=0, err_msg=row["text"][:60])


def _rows(out):
    """A window's output dict as one dict per row (an Arrow column's rows as Python values)."""
    out = {key: column.to_pylist() if isinstance(column, pa.Array) else column for key, column in out.items()}
    return [{key: out[key][i] for key in out} for i in range(len(out["id"]))]


# --- one actor's windows, in this process ---------------------------------------------------------------------


@pytest.mark.usefixtures("one_thread")
def test_windows_come_back_in_place_exact_and_later_windows_are_planned_by_what_was_measured(held_out, alone):
    predictor = Recording(batch_size=8, max_input_token_length=MAX_LEN)
    got = []
    for start in range(0, 120, 30):
        window = _window(held_out[start : start + 30], start)
        out = predictor(window)
        assert sorted(out) == ["id", "output", "text"]
        assert out["output"].shape == (30, 384) and out["output"].dtype == np.float32
        assert out["id"] is window["id"] and out["text"] is window["text"]  # input columns pass through
        got.extend(_rows(out))
    assert [row["id"] for row in got] == list(range(120))
    _assert_exact(got, alone)

    plans = [plan for plan, _, _ in predictor.log]
    assert plans[0] == "relative" and set(plans) <= set(PLANS)
    assert "measured" in plans  # a later window was sized to the reference from the start
    reference = predictor.reference_bytes
    assert reference == predictor.log[0][1].records[0].peak_bytes  # the first window's first (hardest) batch
    assert predictor.reference_width == predictor.log[0][1].records[0].width == MAX_LEN
    assert predictor.windows == 4 and predictor.replans == 0
    for plan, report, _ in predictor.log:
        if plan == "measured":  # the model keeps every batch at or under (1 - memory_margin) of the reference
            assert max(r.peak_bytes for r in report.records) <= 0.9 * reference
            assert max(r.rows for r in report.records) > 8  # shorter texts: larger batches than batch_size
    assert all(p["source"] == "ray" for p in predictor.memory_model.probes_)


@pytest.mark.usefixtures("one_thread")
def test_a_window_with_longer_texts_than_measured_is_planned_to_its_own_first_batch(held_out, alone):
    short = sorted(held_out, key=len)
    predictor = Recording(batch_size=8, max_input_token_length=MAX_LEN)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # above all no "MemoryModel extrapolates: padded_length=..." warning
        first = predictor(_window(short[:40]))  # the shortest texts: the model learns short lengths only
        width = predictor.reference_width
        assert width < MAX_LEN
        second = predictor(_window(short[-20:] + short[40:50]))  # the longest ones: beyond what was measured
        assert predictor.log[1][0] in ("relative", "model-relative") and predictor.replans == 1
        assert predictor.reference_width == MAX_LEN and predictor.reference_bytes > predictor.log[0][2]
        third = predictor(_window(short[50:90]))  # within what is measured now
    assert predictor.log[2][0] == "measured" and predictor.replans == 1
    _assert_exact(_rows(first) + _rows(second) + _rows(third), alone)


@pytest.mark.usefixtures("one_thread")
def test_injected_out_of_memory_is_split_and_a_row_failing_alone_goes_to_the_error_column(held_out, alone):
    poison = held_out[7]
    predictor = Faulty(batch_size=4, max_input_token_length=MAX_LEN, max_rows=6, poison=poison, on_oom="skip")
    rows = []
    for start in range(0, 90, 30):
        out = predictor(_window(held_out[start : start + 30], start))
        assert sorted(out) == ["error", "id", "oom_splits", "output", "pid", "text"]
        rows.extend(_rows(out))
    assert [row["id"] for row in rows] == list(range(90))
    failed = [row for row in rows if row["error"]]
    assert [row["text"] for row in failed] == [poison] and failed[0]["output"] is None
    assert failed[0]["error"].startswith("out of memory alone")
    assert all(row["error"] == "" for row in rows if row["text"] != poison)
    _assert_exact(rows, alone, skip={poison})
    reports = [report for _, report, _ in predictor.log]
    assert reports[0].oom_splits >= 2 and reports[0].failed_rows == 1  # tried, ran out of memory, split
    # What ran out of memory in a window is carried to the next: no later batch is planned as large (rows and
    # width) as a shape that ran out of memory before it.
    failed_shapes = []
    for report in reports:
        for r in report.records:
            assert not any(r.rows >= rows_ and r.width >= width for rows_, width in failed_shapes), (r, failed_shapes)
        failed_shapes += [(r.rows, r.width) for r in report.records if r.oom_splits and not r.pre_split]
    assert [plan for plan, _, _ in predictor.log][1:] == ["measured", "measured"]


@pytest.mark.usefixtures("one_thread")
def test_on_oom_raise_names_the_row(held_out):
    predictor = Faulty(batch_size=8, max_input_token_length=MAX_LEN, poison=held_out[3])
    with pytest.raises(BatchOutOfMemoryError, match=r"row 3 of this window ran out of memory on its own .*"
                                                    r"pass on_oom='skip' to get it reported in the 'error' column"):
        predictor(_window(held_out[:20]))


@pytest.mark.usefixtures("one_thread")
def test_a_calibrated_or_saved_memory_model_plans_the_first_window(held_out, alone, tmp_path):
    calibrated = Recording(batch_size=8, max_input_token_length=MAX_LEN, calibrate=True,
                           calibrate_kwargs={"max_probes": 8})
    assert calibrated.memory_model is not None and len(calibrated.memory_model.probes_) >= 8
    out = calibrated(_window(held_out[:30]))
    assert calibrated.log[0][0] == "model-relative"
    out2 = calibrated(_window(held_out[30:60], 30))
    assert calibrated.log[1][0] == "measured"
    _assert_exact(_rows(out) + _rows(out2), alone)

    path = tmp_path / "minilm.json"
    calibrated.memory_model.save(path)
    for given in (path, MemoryModel.load(path)):
        loaded = Recording(batch_size=8, max_input_token_length=MAX_LEN, memory_model=given)
        loaded(_window(held_out[:20]))
        assert loaded.log[0][0] == "model-relative"
    assert len(given.probes_) == len(MemoryModel.load(path).probes_)  # the caller's object was not grown


@pytest.mark.usefixtures("one_thread")
def test_without_learning_every_window_is_planned_on_its_own(held_out):
    predictor = Recording(batch_size=8, max_input_token_length=MAX_LEN, learn_memory=False)
    for start in (0, 20):
        predictor(_window(held_out[start : start + 20], start))
    assert [plan for plan, _, _ in predictor.log] == ["relative", "relative"]
    assert predictor.memory_model is None and predictor.reference_bytes is None


@pytest.mark.usefixtures("one_thread")
def test_generate_rows_lose_their_padding_and_equal_generating_alone(held_out):
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=30522, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0,
                         bos_token_id=101, eos_token_id=102, attn_implementation="eager", initializer_range=0.3)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        llama = LlamaForCausalLM(config).eval()

    def greedy(**inputs):
        return llama.generate(**inputs, max_new_tokens=4, min_new_tokens=4, do_sample=False, suppress_tokens=[0])

    class Generate(DynamicBatchPredictor):
        def setup(self):
            tok, _ = _minilm()
            tok = copy.deepcopy(tok)
            tok.padding_side = "left"
            self.tok = tok
            return tok, lambda b: greedy(**b)

    texts = held_out[:30]
    predictor = Generate(batch_size=4, max_input_token_length=48, loader_kwargs={"return_token_type_ids": False})
    out = predictor(_window(texts))
    assert out["output"].dtype == object and len({len(r) for r in out["output"]}) > 3  # each row its own length
    with torch.inference_mode():
        for text, row in zip(texts, out["output"]):
            inputs = predictor.tok(text, truncation=True, max_length=48, return_tensors="pt",
                                   return_token_type_ids=False)
            assert row.tolist() == greedy(**inputs)[0].tolist(), text
    # Calibrated in the actor: the probes are tokenized as the windows are (no token_type_ids, which generate
    # would refuse), and the model plans the first window.
    calibrated = Generate(batch_size=4, max_input_token_length=48, loader_kwargs={"return_token_type_ids": False},
                          calibrate=True, calibrate_kwargs={"max_probes": 7})
    again = calibrated(_window(texts))
    assert [r.tolist() for r in again["output"]] == [r.tolist() for r in out["output"]]


@pytest.mark.usefixtures("one_thread")
def test_a_pandas_window_and_an_empty_window(held_out, alone):
    import pandas as pd

    predictor = Embed(batch_size=8, max_input_token_length=MAX_LEN, text_column="body", output_column="vector")
    frame = pd.DataFrame({"id": range(20), "body": held_out[:20]})
    out = predictor(frame)
    assert list(out.columns) == ["id", "body", "vector"] and list(out["id"]) == list(range(20))
    for text, vector in zip(out["body"], out["vector"]):
        np.testing.assert_allclose(vector, alone[text], atol=2e-5, rtol=0)
    empty = predictor({"id": np.arange(0), "body": np.array([], dtype=object)})
    assert len(empty["vector"]) == 0 and sorted(empty) == ["body", "id", "vector"]


# Windows of one job, one with a failed row (None) and one without, as on_oom / on_error="skip" makes them:
# (rows of a window, rows of another, the Arrow type both columns have).
SKIPPED_WINDOWS = {
    "vectors": ([torch.ones(3), torch.zeros(3)], [None, torch.ones(3)], pa.list_(pa.float32(), 3)),
    "per-token rows": ([torch.ones(2, 4), torch.ones(2, 4)], [torch.ones(5, 4), None],
                       pa.list_(pa.list_(pa.float32(), 4))),
    "token ids": ([torch.tensor([1, 2]), torch.tensor([3, 4])], [torch.tensor([5]), None], pa.list_(pa.int64())),
    "a score each": ([np.float32(0.5), np.float32(1.0)], [None, np.float32(2.0)], pa.float32()),
    "every row of one failed": ([torch.ones(3), torch.ones(3)], [None, None], pa.list_(pa.float32(), 3)),
    # a per-token float per token (the run's result says so): a list in the window whose lengths happen to be equal
    "per-token floats": ([torch.ones(2), torch.zeros(2)], [torch.ones(3), None], pa.list_(pa.float32()), {()}),
}


@pytest.mark.parametrize("frame", [False, True], ids=["numpy", "pandas"])
@pytest.mark.parametrize("kind", sorted(SKIPPED_WINDOWS))
def test_with_skip_a_window_with_a_failed_row_and_one_without_make_one_column_type(kind, frame):
    """Ray joins windows' columns when a job sorts, repartitions, converts or writes its output: one type, failed
    rows null (a tensor column and a column of objects cannot be joined, and objects are written pickled)."""
    import pandas as pd

    from dynabatch.integrations.ray._columns import frame_column, output_column

    windows, want, *varying = SKIPPED_WINDOWS[kind][:2], *SKIPPED_WINDOWS[kind][2:]
    columns = [output_column(rows, nullable=True, varying=varying[0] if varying else ()) for rows in windows]
    if frame:
        columns = [pa.Array.from_pandas(frame_column(c, pd.RangeIndex(len(c)))) for c in columns]
    assert {c.type for c in columns} - {pa.null()} == {want}  # a window whose every row failed: nulls alone
    # joined as Ray joins blocks (Arrow's permissive promotion: a null column takes the other's type)
    joined = pa.concat_tables([pa.table({"output": c}) for c in columns], promote_options="permissive")
    assert joined.schema.field("output").type == want
    expected = [None if r is None else np.asarray(r).tolist() for rows in windows for r in rows]
    assert joined.column("output").to_pylist() == expected
    if kind == "vectors":  # where no row can fail: Ray's tensor column, as before
        assert output_column(windows[0], nullable=False).shape == (2, 3)


def test_with_skip_rows_the_stores_encoding_refuses_stay_a_column_of_objects():
    from dynabatch.integrations.ray._columns import output_column

    for rows in ([torch.ones(2, 3), None, torch.ones(2, 4)], [torch.ones(2), np.ones(2)],
                 [torch.ones(2, dtype=torch.complex64), None]):
        column = output_column(rows, nullable=True)
        assert isinstance(column, np.ndarray) and column.dtype == object and len(column) == len(rows)
        assert [row is None for row in column] == [row is None for row in rows]


class Sums(DynamicBatchPredictor):
    """A model-free predictor: each row's token count and sum of token ids (exact in float32, however batched).
    With ``record``, every model call appends its texts to a file in that directory; with ``fail_at``, the actor's
    ``fail_at``-th window raises, failing the job (a job killed there)."""

    def __init__(self, *, record=None, fail_at=None, **kwargs):
        self.record, self.fail_at, self.windows_called = record, fail_at, 0
        super().__init__(**kwargs)

    def setup(self):
        from transformers import AutoTokenizer

        from dynabatch.demo import minilm_path

        def fn(batch):
            if self.record:
                with open(os.path.join(self.record, f"{os.getpid()}.jsonl"), "a", encoding="utf-8") as f:
                    f.write(json.dumps(list(batch.texts)) + "\n")
            mask = batch["attention_mask"]
            return torch.stack([mask.sum(1), (batch["input_ids"] * mask).sum(1)], 1).float()

        return AutoTokenizer.from_pretrained(minilm_path()), fn

    def __call__(self, batch):
        self.windows_called += 1
        if self.windows_called == self.fail_at:
            raise RuntimeError("the job was killed in this window")
        return super().__call__(batch)


class PoisonedSums(Sums):
    """Sums on a simulated device where any batch holding ``poison`` runs out of memory, even alone (or raises
    ``RuntimeError(error)``, where ``error`` is given: a model failing on that input)."""

    def __init__(self, *, poison, error=None, **kwargs):
        self.poison, self.error = poison, error
        super().__init__(**kwargs)

    def setup(self):
        tokenizer, sums = super().setup()

        def fn(batch):
            if self.poison in batch.texts:
                raise torch.OutOfMemoryError(OOM) if self.error is None else RuntimeError(self.error)
            return sums(batch)

        return tokenizer, fn


def _ran(record):
    """How many times the model ran each text, from ``Sums``' record."""
    return collections.Counter(text for file in Path(record).glob("*.jsonl")
                               for line in file.read_text(encoding="utf-8").splitlines() for text in json.loads(line))


def _stored(path):
    """The store read as plain Parquet (hidden files are not read): each id's output, and every id stored."""
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    ids = table.column("id").to_pylist()
    return dict(zip(ids, table.column("output").to_pylist())), ids


@pytest.mark.usefixtures("one_thread")
def test_a_predictor_with_output_path_runs_only_the_rows_its_store_does_not_hold(held_out, tmp_path):
    store, record = tmp_path / "store", tmp_path / "record"
    record.mkdir()
    ids = np.array([f"doc-{i}" for i in range(40)], dtype=object)
    texts = np.array(held_out[:40], dtype=object)
    options = {"batch_size": 4, "max_input_token_length": MAX_LEN, "learn_memory": False}
    expected = Sums(**options)({"id": ids, "text": texts})["output"]  # without a store: every row, in place

    first = Sums(**options, output_path=str(store), key="sums")
    summary = first({"id": ids[:25], "text": texts[:25]})
    assert {name: values.tolist() for name, values in summary.items()} == {
        "rows": [25], "held": [0], "ran": [25], "failed": [0]}
    rerun = Sums(**options, output_path=store, key="sums", record=str(record))  # a new actor opens the store
    summary = rerun({"id": ids, "text": texts})
    assert {name: values.tolist() for name, values in summary.items()} == {
        "rows": [40], "held": [25], "ran": [15], "failed": [0]}
    assert _ran(record) == collections.Counter(texts[25:].tolist())  # the model ran the 15 missing rows only
    rerun({"id": ids[25:], "text": texts[25:]})  # the same rows again (a window Ray retries): their shard replaced
    got, stored = _stored(store)
    assert sorted(stored) == sorted(ids.tolist()) and len(list(store.glob("part-*.parquet"))) == 2
    for i, row in zip(ids, expected):
        np.testing.assert_array_equal(got[i], row)

    empty = rerun({"id": np.array([], dtype=object), "text": np.array([], dtype=object)})
    assert {name: values.tolist() for name, values in empty.items()} == {"rows": [0], "held": [0], "ran": [0],
                                                                          "failed": [0]}
    import pandas as pd

    frame = rerun(pd.DataFrame({"id": ids[:5], "text": texts[:5]}))  # a pandas window: a pandas summary
    assert frame.to_dict("list") == {"rows": [5], "held": [5], "ran": [0], "failed": [0]}

    with pytest.raises(ValueError, match="should hold results of these inputs at their ids, but got 1 stored rows "
                                         "computed from other inputs \\(ids doc-3\\)"):
        rerun({"id": ids[3:4], "text": np.array(["another text under a stored id"], dtype=object)})
    with pytest.raises(ValueError, match="the id_column='id' column should hold ids of type string, as the ids of "
                                         "the results at output_path=.*, but got ids of type int64"):
        rerun({"id": np.arange(2), "text": texts[:2]})
    with pytest.raises(ValueError, match="id_column should be a column of the batch \\['text'\\]"):
        rerun({"text": texts[:2]})


@pytest.mark.usefixtures("one_thread")
def test_a_row_without_a_result_is_not_stored_and_a_rerun_tries_it_again(held_out, tmp_path):
    window = {"id": np.arange(10), "text": np.array(held_out[:10], dtype=object)}
    options = {"batch_size": 4, "max_input_token_length": MAX_LEN, "learn_memory": False,
               "output_path": tmp_path, "key": "sums", "poison": held_out[7]}
    summary = PoisonedSums(on_oom="skip", **options)(window)
    assert {name: values.tolist() for name, values in summary.items()} == {
        "rows": [10], "held": [0], "ran": [10], "failed": [1]}
    assert sorted(_stored(tmp_path)[1]) == [0, 1, 2, 3, 4, 5, 6, 8, 9]
    with pytest.raises(BatchOutOfMemoryError, match="row 7 of this window ran out of memory on its own .*pass "
                                                    "on_oom='skip' to leave it unstored"):
        PoisonedSums(**options)(window)  # the rerun runs row 7 alone: it fails again, named by its window row


@pytest.mark.usefixtures("one_thread")
def test_a_row_fn_raises_on_is_named_by_its_id_and_window_row_not_as_another_input(held_out, tmp_path):
    # run's note named the row by its place among the texts the window ran ("input position 2", no id): on the
    # command line, `dynabatch embed --ray` blamed input position 2 for the row of id kjv-00050 (found by a probe)
    ids = np.array([f"doc-{i}" for i in range(10)], dtype=object)
    window = {"id": ids, "text": np.array(held_out[:10], dtype=object)}
    options = {"batch_size": 4, "max_input_token_length": MAX_LEN, "learn_memory": False, "output_path": tmp_path,
               "key": "sums"}
    Sums(**options)({"id": ids[:5], "text": window["text"][:5]})  # rows 0-4 held: row 7 is the third row it runs
    with pytest.raises(RuntimeError, match="cannot process this input") as raised:
        PoisonedSums(poison=held_out[7], error="cannot process this input", **options)(window)
    note = " ".join(raised.value.__notes__)
    assert "raised on window row 7 (id doc-7), alone" in note and "input position" not in note, note


def test_to_column_stacks_equal_shapes_and_keeps_the_rest_as_objects():
    assert to_column([torch.ones(2, 3), torch.zeros(2, 3)]).shape == (2, 2, 3)
    assert to_column([torch.tensor(1.5, dtype=torch.bfloat16)] * 3).dtype == np.float32
    labels = to_column(["a", "bb"])
    assert labels.dtype == object and labels.tolist() == ["a", "bb"]
    mixed = to_column([{"x": torch.ones(1)}, (torch.zeros(1), 2)])
    assert isinstance(mixed[0]["x"], np.ndarray) and isinstance(mixed[1][0], np.ndarray)
    assert to_column([]).shape == (0,)


# --- arguments --------------------------------------------------------------------------------------------------


class Counting(Embed):
    """Counts setup calls, to show that bad arguments are refused before the model loads."""

    setups = 0

    def setup(self):
        type(self).setups += 1
        return super().setup()


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"batch_size": 0}, ValueError, "batch_size should be a positive integer, but got batch_size=0"),
    ({"batch_size": 8.0}, TypeError, "batch_size should be a positive integer, but got batch_size=8.0"),
    ({"text_column": 3}, TypeError, "text_column should be a column name \\(a non-empty str\\), but got text_column=3"),
    ({"output_column": "text"}, ValueError, ("output_column should be another column than text_column='text', "
                                             "but got output_column='text'")),
    ({"on_oom": "ignore"}, ValueError, "on_oom should be one of \\('raise', 'skip'\\), but got on_oom='ignore'"),
    ({"on_oom": "skip", "error_column": "output"}, ValueError,
     "error_column should be another column than text_column and output_column, but got error_column='output'"),
    ({"memory": "off"}, ValueError, "memory should be a mode that measures while learn_memory=True"),
    ({"memory": True}, TypeError, "memory should be one of \\('auto', 'measured', 'guarded', 'record', 'off'\\), but got memory=True"),
    ({"calibrate": True, "memory_model": "m.json"}, ValueError, "memory_model should be None with calibrate=True"),
    ({"memory_model": 3}, TypeError, "memory_model should be None, a MemoryModel, or the path of a saved one"),
    ({"loader_kwargs": {"max_memory": "1GB"}}, ValueError, ("loader_kwargs should be a dict without the "
                                                            "keywords DynamicBatchPredictor sets itself")),
    ({"calibrate_kwargs": {"max_probes": 4}}, ValueError, "calibrate_kwargs should be None without calibrate=True"),
    ({"device": 0}, TypeError, "device should be None, a str or a torch.device, but got device=0"),
    ({"output_path": 3}, TypeError, ("output_path should be None, a str or an os.PathLike \\(a directory for the "
                                     "results store\\), or the store opened for the run \\(open_store\\), but got "
                                     "output_path=3")),
    ({"key": "minilm"}, ValueError, ("key should be None without output_path \\(it identifies the results stored "
                                     "there\\), but got key='minilm'")),
    ({"output_path": "unused", "id_column": "output"}, ValueError,
     "id_column should be another column than output_column and error_column, but got id_column='output'"),
])
def test_bad_arguments_are_refused_before_the_model_loads(kwargs, error, message):
    kwargs = {"batch_size": 8, "max_input_token_length": MAX_LEN, **kwargs}
    Counting.setups = 0
    with pytest.raises(error, match=message):
        Counting(**kwargs)
    assert Counting.setups == 0


def test_setup_must_be_written_and_return_a_tokenizer_and_a_callable(tokenizer):
    with pytest.raises(NotImplementedError, match="Missing should define setup\\(self\\)"):
        type("Missing", (DynamicBatchPredictor,), {})(batch_size=8, max_input_token_length=MAX_LEN)
    for returned, message in [
        (None, "setup\\(\\) should be a \\(tokenizer, fn\\) pair, but got setup\\(\\)=None"),
        ((tokenizer, "fn"), "setup\\(\\)\\[1\\] should be a callable taking a dynabatch.Batch"),
        (("bert", len), "setup\\(\\)\\[0\\] should be a tokenizer object"),
    ]:
        cls = type("Bad", (DynamicBatchPredictor,), {"setup": lambda self, r=returned: r})
        with pytest.raises(TypeError, match=message):
            cls(batch_size=8, max_input_token_length=MAX_LEN)


def test_a_window_without_the_text_column_or_with_the_output_column_is_refused(tokenizer):
    cls = type("Lengths", (DynamicBatchPredictor,), {"setup": lambda self: (tokenizer, lambda b: b["input_ids"])})
    predictor = cls(batch_size=8, max_input_token_length=MAX_LEN, learn_memory=False)
    with pytest.raises(ValueError, match="text_column should be a column of the batch \\['body'\\], but got "
                                         "text_column='text'"):
        predictor({"body": np.array(["a"])})
    with pytest.raises(ValueError, match="output_column should be a column the batch does not have already"):
        predictor({"text": np.array(["a"]), "output": np.array([1])})
    with pytest.raises(TypeError, match="batch should be a dict of numpy arrays"):
        predictor(["a"])


def test_with_on_bad_input_skip_a_text_that_is_not_a_str_is_reported_in_the_error_column(tokenizer):
    """The loader skips it and its result is None: without on_oom / on_error="skip" there was no error column to say
    why, and the None made a column of objects that Ray cannot join to another window's column of vectors."""
    cls = type("Lengths", (DynamicBatchPredictor,),
               {"setup": lambda self: (tokenizer, lambda b: b["attention_mask"].sum(1, keepdim=True).float())})
    predictor = cls(batch_size=8, max_input_token_length=MAX_LEN, learn_memory=False,
                    loader_kwargs={"on_bad_input": "skip"})
    out = predictor({"id": np.arange(3), "text": np.array(["a b", None, "c"], dtype=object)})
    assert out["error"].tolist() == ["", "bad input: not a str (the loader skipped it, on_bad_input='skip')", ""]
    assert out["output"].type == pa.list_(pa.float32(), 1) and out["output"].to_pylist() == [[4.0], None, [3.0]]
    clean = predictor({"id": np.arange(1), "text": np.array(["a"], dtype=object)})  # a window without a bad text
    assert clean["output"].type == out["output"].type and clean["error"].tolist() == [""]
    # a window of none but bad texts: no batch to run (the predictor's probe of its first batch stopped the window)
    nulls = predictor({"id": np.arange(2), "text": np.array([None, None], dtype=object)})
    assert nulls["output"].type == pa.null() and nulls["error"].tolist() == [out["error"][1]] * 2


def test_a_window_with_a_text_that_is_not_a_str_is_refused_naming_the_column_rows_and_ids(tokenizer):
    """The loader's own error named its ``texts`` argument and told to build the loader, which a ``map_batches``
    user never did: this one names the column, the window's rows and their ids, and the predictor's option."""
    import pandas as pd

    cls = type("Lengths", (DynamicBatchPredictor,), {"setup": lambda self: (tokenizer, lambda b: b["input_ids"])})
    predictor = cls(batch_size=8, max_input_token_length=MAX_LEN, learn_memory=False, text_column="body")
    message = ("text_column='body' should hold a str in every row, but got 2 of the window's 4 rows without one "
               "(window rows 1, 3, ids doc-1, doc-3; the first: {} of type {}): clean them, or pass "
               "loader_kwargs={{'on_bad_input': 'skip'}} to get None and the cause in error_column='error' for each")
    ids = np.array([f"doc-{i}" for i in range(4)], dtype=object)
    with pytest.raises(TypeError, match=re.escape(message.format("None", "NoneType"))):
        predictor({"id": ids, "body": np.array(["a", None, "b", 3], dtype=object)})
    with pytest.raises(TypeError, match=re.escape(message.format("nan", "float"))):  # a pandas window's null
        predictor(pd.DataFrame({"id": ids, "body": ["a", np.nan, "b", None]}, index=[7, 8, 9, 10]))


class Supplied(PoisonedSums):
    """A subclass that supplies its base's required keyword (``poison``) to ``super().__init__`` itself."""

    def __init__(self, **kwargs):
        super().__init__(poison="no such text", **kwargs)


class Fixed(Sums):
    """A subclass whose own ``__init__`` takes no ``**kwargs``: it sets its base's keywords itself."""

    def __init__(self, *, label, learn=False):
        self.label = label
        super().__init__(batch_size=4, max_input_token_length=MAX_LEN, learn_memory=learn)


def test_check_constructor_reads_the_class_own_signature_and_its_bases_only_through_kwargs():
    """A base's required keyword that the subclass supplies itself was counted as lacking: the keywords a subclass
    requires are its own __init__'s; its bases' add only what it takes, where it passes **kwargs on."""
    from dynabatch.integrations.ray.predictor import check_constructor

    sizes = {"batch_size": 4, "max_input_token_length": MAX_LEN}
    check_constructor(Supplied, sizes, "map_texts")  # refused before: PoisonedSums requires poison
    Supplied(**sizes, learn_memory=False)  # as an actor builds it
    with pytest.raises(TypeError, match=re.escape("map_texts() got an unexpected keyword argument 'poision' for "
                                                  "Supplied() (did you mean 'poison'?)")):
        check_constructor(Supplied, {**sizes, "poision": "x"}, "map_texts")  # the bases' keywords, through **kwargs
    check_constructor(Fixed, {"label": "a", "learn": True}, "map_texts")
    with pytest.raises(TypeError, match=re.escape("map_texts() got an unexpected keyword argument 'batch_size' for "
                                                  "Fixed(): the keywords map_texts does not take itself go to the "
                                                  "predictor, which takes label, learn; but got batch_size=4")):
        check_constructor(Fixed, {"label": "a", **sizes}, "map_texts")  # no **kwargs: its bases' are not taken
    with pytest.raises(TypeError, match=re.escape("Fixed.__init__() should get the keyword argument 'label', but "
                                                  "map_texts() got none: pass label=... to map_texts()")):
        check_constructor(Fixed, {}, "map_texts")
    inherited = type("Inherited", (Fixed,), {})  # no __init__ of its own: Fixed's
    with pytest.raises(TypeError, match=re.escape("Fixed.__init__() should get the keyword argument 'label'")):
        check_constructor(inherited, {"learn": True}, "map_texts")


def test_default_window_and_map_texts_arguments():
    pytest.importorskip("ray")
    assert default_window(16) == 1024 and default_window(100) == 6400 and default_window(1000) == 16384
    with pytest.raises(TypeError,
                       match="predictor_cls should be a subclass of dynabatch.integrations.ray.DynamicBatchPredictor"):
        map_texts(None, object, batch_size=8, max_input_token_length=MAX_LEN)
    with pytest.raises(TypeError, match="ds should be a ray.data.Dataset, but got ds=\\[\\]"):
        map_texts([], Embed, batch_size=8, max_input_token_length=MAX_LEN)


def test_the_module_imports_without_ray():
    # A meta path hook that refuses ray: dynabatch.integrations.ray must import and its predictor work without it.
    code = (
        "import sys\n"
        "class NoRay:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'ray' or name.startswith('ray.'):\n"
        "            raise ImportError('no ray here')\n"
        "sys.meta_path.insert(0, NoRay())\n"
        "import dynabatch.integrations.ray\n"
        "assert 'ray' not in sys.modules\n"
        "print(dynabatch.integrations.ray.default_window(8))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                            check=False)
    assert result.returncode == 0 and result.stdout.strip() == "1024", result.stderr


# --- on a local Ray: 2 actors, as users run it -----------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray for the module (2 CPUs), shut down after it: a later module in this pytest worker
    (tests/cli/test_ray_command.py) starts its own and asserts none is running; its workers import this dynabatch
    and this test module."""
    ray = pytest.importorskip("ray")
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # tests are not importable by name
    path = os.pathsep.join(p for p in [str(ROOT), os.environ.get("PYTHONPATH", "")] if p)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": {
        "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}})
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def faulty_job(ray_cluster, held_out, tmp_path_factory):
    """The held-out texts (column ``body``) through 2 actors (map_texts), sorted by length: batches over 6 rows and
    one text (even alone) run out of memory, and the first actor to reach its 2nd window dies there; Ray restarts it
    and retries the window."""

    marker = tmp_path_factory.mktemp("ray") / "died"
    poison = held_out[11]
    ds = ray_cluster.data.from_items([{"id": i, "body": t} for i, t in enumerate(held_out)], override_num_blocks=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # Ray 2.60 deprecates passing actor options so
        out = map_texts(ds, Faulty, batch_size=4, max_input_token_length=MAX_LEN, window=30, actors=2,
                        sort_by_length=True, text_column="body", ray_remote_args={"max_restarts": 2,
                                                                                  "max_task_retries": 2},
                        max_rows=6, poison=poison, marker=str(marker), on_oom="skip").take_all()
    return out, poison, int(marker.read_text())


def test_held_out_texts_through_two_actors_come_back_once_in_place_and_exact(faulty_job, held_out, alone):
    out, poison, _ = faulty_job
    assert sorted(row["id"] for row in out) == list(range(len(held_out)))  # every row once: none lost or repeated
    assert all(row["body"] == held_out[row["id"]] for row in out)  # in place: each output beside its own row
    assert all(sorted(row) == ["body", "error", "id", "oom_splits", "output", "pid"] for row in out)
    _assert_exact([{**row, "text": row["body"]} for row in out], alone, skip={poison})


def test_injected_out_of_memory_is_survived_and_the_row_failing_alone_reported(faulty_job):
    out, poison, _ = faulty_job
    assert sum(row["oom_splits"] for row in out) > 0  # batches of windows ran out of memory and were split
    failed = [row for row in out if row["error"]]
    assert [row["body"] for row in failed] == [poison] and failed[0]["output"] is None
    assert failed[0]["error"].startswith("out of memory alone")


def test_an_actor_killed_mid_job_is_restarted_and_its_window_run_again(faulty_job):
    out, _, dead = faulty_job  # an actor died in its 2nd window (the marker holds its pid) ...
    assert len({row["pid"] for row in out} - {dead}) >= 2  # ... and a restarted one ran that window again


def test_sorted_by_length_each_window_is_a_run_of_the_longest_first_order(faulty_job, held_out):
    out, _, _ = faulty_job  # every row once, in place, exact, the sort key dropped: the tests above
    # Windows come back in any order (a retried one too): the lengths rise at most at the 3 places where one
    # window's rows end and another's begin.
    lengths = [len(row["body"]) for row in out]  # sorted by the text_column's lengths
    assert sum(b > a for a, b in itertools.pairwise(lengths)) <= len(held_out) // 30 - 1


def test_map_texts_picks_the_window_and_leaves_a_cpu_for_the_stages_that_feed_the_actors(ray_cluster, caplog):
    import logging

    ds = ray_cluster.data.from_items([{"text": "a"}])
    with caplog.at_level(logging.INFO, logger="dynabatch.integrations.ray"):
        mapped = map_texts(ds, Embed, batch_size=16, max_input_token_length=MAX_LEN)  # lazy: nothing runs
    assert isinstance(mapped, ray_cluster.data.Dataset)
    assert "map_texts: windows of 1024 rows, 1 actor(s), 0 GPU(s) each" in caplog.text  # 2 CPUs, no GPU
    with pytest.raises(ValueError, match="actors should be a positive int or a \\(min, max\\) pair of them with "
                                         "min <= max, but got actors=\\(3, 2\\)"):
        map_texts(ds, Embed, batch_size=16, max_input_token_length=MAX_LEN, actors=(3, 2))
    with pytest.raises(ValueError, match="num_gpus should be None or a number >= 0, but got num_gpus=-1"):
        map_texts(ds, Embed, batch_size=16, max_input_token_length=MAX_LEN, num_gpus=-1)


def test_a_killed_map_texts_job_reruns_only_the_rows_its_output_does_not_hold(ray_cluster, held_out, tmp_path,
                                                                               caplog):
    import pyarrow.parquet as pq

    from dynabatch.inference.store_shards import HOST as _HOST

    store, record = tmp_path / "store", tmp_path / "record"
    record.mkdir()
    ids = [f"doc-{i}" for i in range(len(held_out))]
    ds = ray_cluster.data.from_items([{"id": i, "text": t} for i, t in zip(ids, held_out)], override_num_blocks=4)
    options = {"batch_size": 4, "max_input_token_length": MAX_LEN, "window": 30, "actors": 1,
               "output_path": str(store), "key": "sums", "learn_memory": False}
    with pytest.raises(Exception, match="the job was killed in this window"):  # Ray's task error, naming it
        map_texts(ds, Sums, fail_at=3, **options)  # one actor: windows 1 and 2 are committed, the 3rd fails
    shards = sorted(store.glob("part-*.parquet"))
    assert len(shards) == 2 and sum(pq.read_metadata(shard).num_rows for shard in shards) == 60
    # A shard torn by a crash (its rows run again) and a temporary shard of a writer killed while writing it.
    torn, kept = shards
    bytes_ = torn.read_bytes()
    torn.write_bytes(bytes_[:len(bytes_) // 2])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    temp = store / f".tmp-{_HOST}-{dead.pid}-part-w0-00000.parquet"
    temp.write_bytes(bytes_[:100])
    held = set(pq.read_table(kept).column("id").to_pylist())

    with caplog.at_level(logging.INFO, logger="dynabatch.integrations.ray"):
        out = map_texts(ds, Sums, record=str(record), **options)
    assert "of this dataset's 120 rows, 30 were held, 90 ran now, 0 of them without a result" in caplog.text
    assert _ran(record) == collections.Counter(t for i, t in zip(ids, held_out) if i not in held)  # the rest only
    assert not temp.exists() and (store / f".torn-{torn.name}.torn").exists()
    rows = out.take_all()  # what map_texts returns: the store, read by Ray
    assert sorted(map(str, stored_results(store, key="sums").take_all())) == sorted(map(str, rows))  # as read later
    assert sorted(row["id"] for row in rows) == sorted(ids) and all(sorted(row) == ["id", "output"] for row in rows)
    assert sorted(_stored(store)[1]) == sorted(ids)  # every id stored exactly once
    uninterrupted = Sums(batch_size=4, max_input_token_length=MAX_LEN, learn_memory=False)(
        {"id": np.array(ids, dtype=object), "text": np.array(held_out, dtype=object)})["output"]
    got = {row["id"]: row["output"] for row in rows}
    for i, row in zip(ids, uninterrupted):
        np.testing.assert_array_equal(got[i], row)


def test_map_texts_refuses_a_store_of_another_key(ray_cluster, held_out, tmp_path):
    store = tmp_path / "store"
    options = {"batch_size": 4, "max_input_token_length": MAX_LEN, "learn_memory": False}
    Sums(**options, output_path=str(store), key="minilm cls 64")(
        {"id": np.arange(3), "text": np.array(held_out[:3], dtype=object)})
    ds = ray_cluster.data.from_items([{"id": i, "text": t} for i, t in enumerate(held_out[:3])])
    message = (f"key should be the key the results at output_path={str(store)!r} were stored with "
               "(key='minilm cls 64') to resume them, but got key='minilm mean 64': pass that key if the model and "
               "settings are the same, or another output_path for another model or settings")
    with pytest.raises(ValueError, match=re.escape(message)):  # refused in the driver, before any actor starts
        map_texts(ds, Sums, output_path=store, key="minilm mean 64", **options)
    with pytest.raises(ValueError, match="key should be None without output_path \\(it identifies the results "
                                         "stored there\\), but got key='minilm cls 64'"):
        map_texts(ds, Sums, key="minilm cls 64", **options)
    with pytest.raises(TypeError, match="id_column should be a column name \\(a non-empty str\\), but got "
                                        "id_column=None"):
        map_texts(ds, Sums, output_path=store, id_column=None, **options)
    # Ids of the other type than the store's, or of neither type: refused before any actor starts (each window
    # refused them, once its actor had loaded the model, wrapped in Ray's task error).
    named = ray_cluster.data.from_items([{"id": f"doc-{i}", "text": t} for i, t in enumerate(held_out[:3])])
    with pytest.raises(ValueError, match=re.escape("the id_column='id' column should hold ids of type int64, as the "
                                                   f"ids of the results at output_path={str(store)!r}, but got ids of "
                                                   "type string: use the same ids")):
        map_texts(named, Sums, output_path=store, key="minilm cls 64", **options)
    halves = ray_cluster.data.from_items([{"id": i + 0.5, "text": t} for i, t in enumerate(held_out[:3])])
    with pytest.raises(TypeError, match=re.escape("id_column should be a column of str or int ids (Arrow string or "
                                                  "integer), but got id_column='id' of type double")):
        map_texts(halves, Sums, output_path=store, key="minilm cls 64", **options)


def test_map_texts_refuses_an_id_given_to_two_rows_before_any_actor_runs(ray_cluster, held_out, tmp_path):
    """Each window checks its own ids, and each actor the ids stored when it started: an id in two windows ran in
    both, each copy stored from its own text, and the job failed only once both were stored, reading the store. The
    driver reads the dataset's ids first and refuses them by the rule of dynabatch.run and the command line."""
    store, record = tmp_path / "store", tmp_path / "record"
    record.mkdir()
    ids = [0, 1, 2, 3, 4, 2, 0, 1, 2]  # windows of 3 rows: id 2 in all three, ids 0 to 2 in the 1st and the 3rd
    ds = ray_cluster.data.from_items([{"id": i, "text": t} for i, t in zip(ids, held_out)], override_num_blocks=3)
    with pytest.raises(ValueError, match=re.escape("id_column='id': ids should be unique (one stable id per text), "
                                                   "but got 3 ids given to several texts (first: 0 at positions 0, "
                                                   "6)")):
        map_texts(ds, Sums, batch_size=4, max_input_token_length=MAX_LEN, window=3, actors=1, output_path=store,
                  key="sums", learn_memory=False, record=str(record))
    assert not store.exists() and not list(record.iterdir())  # no store made, no row run
    # A dataset whose columns Ray knows only by running it: the read names the id column it lacks (the first
    # window did, once its actor had loaded the model, wrapped in Ray's task error).
    unknown = ray_cluster.data.from_items([{"text": t} for t in held_out[:3]]).map(lambda row: row)
    with pytest.raises(ValueError, match=re.escape("id_column should be a column of the dataset ['text'] (each row's "
                                                   "id, with output_path), but got id_column='id'")):
        map_texts(unknown, Sums, batch_size=4, max_input_token_length=MAX_LEN, output_path=store, key="sums")
    assert not store.exists()


def test_stored_results_refuses_an_id_two_windows_stored(ray_cluster, held_out, tmp_path):
    """A job run with map_batches has no driver step of dynabatch: two actors whose windows share ids, each
    window run before the other's shard was stored, store both copies; the store's reader refuses them (a plain
    Parquet read reads both)."""
    store = tmp_path / "store"
    options = {"batch_size": 4, "max_input_token_length": MAX_LEN, "learn_memory": False, "output_path": store,
               "key": "sums"}
    first, second = Sums(**options), Sums(**options)  # two actors, both started before either window was stored
    first({"id": np.arange(3), "text": np.array(held_out[:3], dtype=object)})
    second({"id": np.arange(1, 4), "text": np.array(held_out[3:6], dtype=object)})
    assert sorted(_stored(store)[1]) == [0, 1, 1, 2, 2, 3]
    with pytest.raises(ValueError, match=re.escape("id_column='id' should hold ids unique in the dataset (each row's "
                                                   "result is stored under its id), but got 2 ids in more than one "
                                                   "row (1, 2): each of their rows ran and output_path=")):
        stored_results(store, key="sums")
    with pytest.raises(ValueError, match="output_path should be the directory of a results store \\(the "
                                         "predictors' output_path\\), but got output_path=.*misspelt"):
        stored_results(tmp_path / "misspelt", key="sums")  # not made: it would read as a store of no rows
    assert not (tmp_path / "misspelt").exists()


def test_map_texts_refuses_a_keyword_the_predictor_does_not_take_before_any_actor_starts(ray_cluster, tmp_path):
    """Each actor's constructor raised it, and Ray said so 2-4 s later as the actor's death (ActorDiedError)."""
    ds = ray_cluster.data.from_items([{"id": 0, "text": "In the beginning"}])
    options = {"batch_size": 4, "max_input_token_length": MAX_LEN}
    with pytest.raises(TypeError, match=re.escape(
            "map_texts() got an unexpected keyword argument 'text_colum' for Sums() (did you mean 'text_column'?): "
            "the keywords map_texts does not take itself go to the predictor, which takes batch_size, calibrate, ")) \
            as caught:
        map_texts(ds, Sums, text_colum="body", **options)  # before the columns: not "a column the dataset lacks"
    assert ", fail_at, " in str(caught.value) and str(caught.value).endswith("; but got text_colum='body'")
    with pytest.raises(TypeError, match=re.escape("PoisonedSums.__init__() should get the keyword argument 'poison', "
                                                  "but map_texts() got none: pass poison=... to map_texts()")):
        map_texts(ds, PoisonedSums, output_path=tmp_path / "store", key="sums", **options)
    assert not (tmp_path / "store").exists()  # refused before the store is opened


def test_map_texts_refuses_columns_the_dataset_lacks_or_has_before_any_actor_starts(ray_cluster, tmp_path):
    """The actors check each window too, but only once their model is loaded, and Ray wraps the error in its own."""
    ds = ray_cluster.data.from_items([{"key": "a", "body": "In the beginning", "output": 1}])
    options = {"batch_size": 4, "max_input_token_length": MAX_LEN}
    with pytest.raises(ValueError, match=re.escape("text_column should be a column of the dataset ['key', 'body', "
                                                   "'output'], but got text_column='text'")):
        map_texts(ds, Sums, sort_by_length=True, **options)  # before the sort, which would fail on it in Ray
    with pytest.raises(ValueError, match=re.escape("output_column should be a column the dataset does not have "
                                                   "already ['key', 'body', 'output'], but got "
                                                   "output_column='output'")):
        map_texts(ds, Sums, text_column="body", **options)
    with pytest.raises(ValueError, match=re.escape("id_column should be a column of the dataset ['key', 'body', "
                                                   "'output'] (each row's id, with output_path), but got "
                                                   "id_column='id'")):
        map_texts(ds, Sums, text_column="body", output_column="vector", output_path=tmp_path / "store", key="k",
                  **options)
    assert not (tmp_path / "store").exists()  # refused before the store is opened
    with pytest.raises(TypeError, match=re.escape("text_column should be a column of str (Arrow string), but got "
                                                  "text_column='key' of type int64")):
        map_texts(ray_cluster.data.from_items([{"key": 1}]), Sums, text_column="key", sort_by_length=True, **options)
    with pytest.raises(TypeError, match="text_column should be a column name \\(a non-empty str\\), but got "
                                        "text_column=3"):
        map_texts(ds, Sums, text_column=3, **options)
