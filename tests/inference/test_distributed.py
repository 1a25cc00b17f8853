import json
import os
import pickle
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from dynabatch.inference.distributed import RankFailedError, gather_results, world

REPO = Path(__file__).resolve().parents[2]
from dynabatch.inference.runner import run  # noqa: E402

# --------------------------------------------------------------------------- gather_results, one process


def test_world_without_a_process_group():
    assert world() == (0, 1)


def test_rank_failed_error_pickles_with_its_rank_and_causes():
    """It crosses processes (a launcher's, Ray's) whole: its message, the first failed rank and every cause."""
    error = pickle.loads(pickle.dumps(RankFailedError("rank 1 of 2 raised", rank=1, causes={1: "ValueError: bad"})))
    assert (str(error), error.rank, error.causes) == ("rank 1 of 2 raised", 1, {1: "ValueError: bad"})


def test_gather_in_one_process_reorders():
    assert gather_results([2, 0, 1], ["c", "a", "b"], 3) == ["a", "b", "c"]
    assert gather_results(np.array([1, 0]), (torch.tensor(1), torch.tensor(0)), 2) == [torch.tensor(0),
                                                                                      torch.tensor(1)]
    assert gather_results(torch.tensor([0]), [None], 1) == [None]
    assert gather_results([], [], 0) == []


@pytest.mark.parametrize(
    ("positions", "results", "n", "error", "match"),
    [
        ([0, 1, 1, 3, 3], list("abcde"), 4, ValueError,
         (r"^positions should each be computed exactly once, but got 2 computed more than once \(first few: "
         r"1 \(ranks \[0, 0\]\), 3 \(ranks \[0, 0\]\)\)$")),
        ([0, 3], ["a", "d"], 4, ValueError,
         r"^positions should cover range\(n_inputs=4\), but got 2 missing \(first few: 1, 2\)$"),
        ([], [], 9, ValueError, r"but got 9 missing \(first few: 0, 1, 2, 3, 4, \.\.\.\)$"),
        ([0, 4, -1], [1, 2, 3], 4, ValueError,
         (r"^positions should be in range\(n_inputs=4\), but got 2 outside it \(first few: 4 \(rank 0\), "
         r"-1 \(rank 0\)\)$")),
        ([0, 1], ["a"], 2, ValueError,
         r"^len\(results\) should be len\(positions\)=2, one result per position, but got len\(results\)=1$"),
        ([0], "a", 1, TypeError, r"^results should be a list with one result per position, but got results='a'"),
        ([0.0], ["a"], 1, TypeError, r"^positions should be a 1-D list, numpy array or tensor of int input positions"),
        (None, [], 0, TypeError, r"positions=None of type NoneType"),
        ([0], ["a"], -1, ValueError, r"^n_inputs should be a non-negative integer, but got n_inputs=-1$"),
        ([0], ["a"], 1.0, TypeError, r"n_inputs=1.0 of type float"),
    ],
)
def test_gather_errors_in_one_process(positions, results, n, error, match):
    with pytest.raises(error, match=match):
        gather_results(positions, results, n)


# --------------------------------------------------------------------------- two gloo processes

_WORKER = textwrap.dedent(
    """
    import json, os, sys

    import numpy as np
    import torch
    import torch.distributed as dist

    from dynabatch.inference.distributed import gather_results, world
    from dynabatch.sampling.planner import plan_batches
    from dynabatch.sampling.inference_sampler import DynamicBatchSampler

    rank, out = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", rank=rank, world_size=2)
    report = {"world": list(world())}

    for n in (300, 296):  # 67 and 66 batches: odd and even
        lengths = np.random.default_rng(0).integers(1, 129, size=n)
        batches = plan_batches(lengths, batch_size=4, max_input_token_length=128)
        mine = DynamicBatchSampler(batches, num_replicas=None, rank=None)  # the process group's world
        positions, results, steps = [], [], 0
        for batch in mine:
            for p in batch:
                positions.append(p)
                results.append((p * 2, f"text {p}", torch.tensor([p, rank])))
            steps += 1
            dist.all_reduce(torch.ones(1))  # a collective every step: hangs if step counts differ
        gathered = gather_results(positions, results, n)
        report[str(n)] = {
            "n_batches": len(batches), "steps": steps, "positions": positions,
            "gathered": None if gathered is None else [
                [a, s, t.tolist(), t.device.type] for a, s, t in gathered],
        }

    errors = {  # name: (positions, results, n_inputs) per rank
        "overlap": (([0, 1, 2], [0, 1, 2], 4), ([2, 3], [2, 3], 4)),
        "missing": (([0], [0], 4), ([3], [3], 4)),
        "type_on_rank_1": (([0, 1], [0, 1], 3), ([2], "x", 3)),
        "n_inputs_differ": (([0, 1], [0, 1], 4), ([2, 3], [2, 3], 5)),
        "unpicklable_on_rank_1": (([0], [0], 2), ([1], [lambda: 1], 2)),
    }
    for name, args in errors.items():
        try:
            gather_results(*args[rank])
            report[name] = None
        except (TypeError, ValueError) as exc:
            report[name] = [type(exc).__name__, str(exc)]
    report["after_errors"] = gather_results([rank], [rank], 2)  # nothing is left hanging

    from transformers import AutoTokenizer

    import dynabatch
    from dynabatch.demo import kjv_passages, minilm_path
    from dynabatch.inference.runner import run

    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    texts = kjv_passages()[:200]
    loader = dynabatch.build_dynamic_batch_dataloader(texts, tokenizer, batch_size=4,
                                                      max_input_token_length=64, num_workers=0)
    result = run(lambda b: b["input_ids"].sum(dim=1), loader, progress=False)
    report["runner"] = [None if r is None else int(r) for r in result]
    batches = list(loader)  # a plain iterable of the same batches on every rank
    result = run(lambda b: b["input_ids"].sum(dim=1), batches, progress=False)
    report["runner_iterable"] = [None if r is None else int(r) for r in result]
    try:  # each rank handed its own share: refused on every rank, none left waiting
        run(lambda b: b["input_ids"].sum(dim=1), batches[rank::2], progress=False)
        report["per_rank_share"] = None
    except ValueError as exc:
        report["per_rank_share"] = str(exc)
    # Rank 1's loader of other texts with the same token lengths (" the " read " and "): the same batches, other
    # inputs; refused on every rank in both modes, not rows of two corpora mixed in rank 0's result.
    others = [t.replace(" the ", " and ") for t in texts] if rank == 1 else texts
    other_loader = dynabatch.build_dynamic_batch_dataloader(others, tokenizer, batch_size=4,
                                                            max_input_token_length=64, num_workers=0)
    report["inputs_differ"] = {"same_batches": [b.tolist() for b in other_loader.plan.sampler.batches]
                               == [b.tolist() for b in loader.plan.sampler.batches]}
    for mode in ("lockstep", "claim"):
        try:
            run(lambda b: b["input_ids"].sum(dim=1), other_loader, ranks=mode, progress=False)
            report["inputs_differ"][mode] = None
        except ValueError as exc:
            report["inputs_differ"][mode] = str(exc)
    # Rank 0 in lockstep, rank 1 claiming, 3 texts in one batch (the same positions either way): refused on both,
    # not each waiting for ever in a collective the other never makes.
    one_batch = dynabatch.build_dynamic_batch_dataloader(texts[:3], tokenizer, batch_size=4, max_input_token_length=64,
                                                         num_workers=0)
    try:
        run(lambda b: b["input_ids"].sum(dim=1), one_batch, ranks=("lockstep", "claim")[rank], progress=False)
        report["modes_differ"] = None
    except ValueError as exc:
        report["modes_differ"] = str(exc)
    # output_path on rank 0 only (rank 0 would write into the store, rank 1 wait to gather into rank 0): refused on
    # both, in either mode, not each waiting for ever in a collective the other never makes.
    report["store_on_one_rank"] = {}
    for mode in ("lockstep", "claim"):
        try:
            run(lambda b: b["input_ids"].sum(dim=1), loader, ranks=mode, progress=False,
                output_path=os.path.join(out, f"one-rank-{mode}") if rank == 0 else None)
            report["store_on_one_rank"][mode] = None
        except ValueError as exc:
            report["store_on_one_rank"][mode] = str(exc)

    # The display in lockstep: each rank shows its own dealt share, named, its time left what that share costs.
    import contextlib
    import io

    import dynabatch.inference.runner as runner_module

    shown, costs_at_start, meter_class = io.StringIO(), [], runner_module.Meter

    class KeptMeter(meter_class):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            costs_at_start.append(self.costs.left())

    runner_module.Meter = KeptMeter
    try:
        with contextlib.redirect_stderr(shown):
            ran = run(lambda b: b["input_ids"].sum(dim=1), loader, ranks="lockstep").report.rows
    finally:
        runner_module.Meter = meter_class
    report["display"] = {"lines": shown.getvalue().splitlines(), "ran": ran, "costs": costs_at_start[0],
                         "lengths": [int(x) for x in loader.plan.collator.tokenized.lengths]}

    # One results store for both ranks: each writes its own shards, and each rank's result reads the whole store.
    store = os.path.join(out, "store")
    stored = run(lambda b: b["input_ids"].sum(dim=1), loader, output_path=store, key="sum", progress=False)
    report["store"] = {"path": store, "rows": [None if r is None else int(r) for r in stored],
                       "ran": stored.report.rows, "failed": stored.failed}
    dirty = texts[:40]
    dirty[5] = dirty[31] = None  # bad inputs skipped: they run on no rank, yet every input comes back once
    skipping = dynabatch.build_dynamic_batch_dataloader(dirty, tokenizer, batch_size=4, max_input_token_length=64,
                                                        num_workers=0, on_bad_input="skip")
    report["skipped"] = {}
    for way, where in (("gathered", None), ("stored", os.path.join(out, "skipped"))):
        result = run(lambda b: b["input_ids"].sum(dim=1), skipping, output_path=where, progress=False)
        report["skipped"][way] = {"rows": [None if r is None else int(r) for r in result], "failed": result.failed}

    # fn holds a collective (as an FSDP forward does); rank 1 runs out of memory on every call of more than
    # 3 rows, before its collective, so it splits batches the other rank runs whole: the ranks still make the
    # same number of calls, none waits for ever, and every row comes back.
    calls = {"n": 0, "oom": 0}

    def fn(batch):
        rows = batch["input_ids"].shape[0]
        if rank == 1 and rows > 3:
            calls["oom"] += 1
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        calls["n"] += 1
        dist.all_reduce(torch.ones(1))
        return batch["input_ids"].sum(dim=1)

    result = run(fn, loader, progress=False)
    report["lockstep"] = {"rows": [None if r is None else int(r) for r in result], "calls": calls["n"],
                          "oom": calls["oom"], "ran": result.report.rows}

    # The defaults under torch.distributed (guarded mode): fn's memory grows with rows (a 30k-vocabulary head
    # per row), so the plan's grown batches peak far above its first; each rank splits them before they run.
    from dynabatch import track_peak_memory
    from dynabatch.demo import vary_lengths

    torch.manual_seed(0)
    embed, head = torch.nn.Embedding(len(tokenizer), 32), torch.nn.Linear(32, len(tokenizer))

    def lm_head(batch):
        with torch.no_grad():
            top = head(embed(batch["input_ids"]).mean(1)).max(-1).values
        return (batch["input_ids"] * batch["attention_mask"]).sum(1) + 0 * top.long()

    seen = []
    long_loader = dynabatch.build_dynamic_batch_dataloader(vary_lengths(kjv_passages(), n=160, max_words=64, seed=3),
                                                           tokenizer, batch_size=4, max_input_token_length=64,
                                                           num_workers=0)
    result = run(lambda b: seen.append(b) or lm_head(b), long_loader, progress=False)

    def peak(batch):
        with track_peak_memory("cpu") as mem:
            lm_head(batch)
        return mem.peak_bytes

    collate = long_loader.plan.collator
    first = peak(collate(long_loader.plan.sampler.batches[0]))
    report["guarded"] = {
        "rows": [None if r is None else int(r) for r in result], "ran": result.report.rows,
        "calls": [[len(b.indices), peak(b) / first] for b in seen], "pre_split": result.report.pre_split_batches,
        "plan_max": max(peak(collate(b)) for b in long_loader.plan.sampler.batches) / first,
    }

    # fn raises on rank 1 (on_error="raise"): rank 1 raises its error, rank 0 a RankFailedError naming it, none
    # waits for ever in a collective, and the group is still in step for what follows (the next run, the barrier).
    import time

    import dynabatch.inference.distributed as distributed

    def failing(batch):
        if rank == 1:
            raise RuntimeError("injected on rank 1")
        time.sleep(0.05)  # claiming: rank 1 claims a chunk before rank 0 has claimed them all
        return batch["input_ids"].sum(dim=1)

    distributed.CLAIM_CHUNK, chunk = 16, distributed.CLAIM_CHUNK
    report["rank_failed"] = {}
    for mode, where in (("lockstep", None), ("claim", None), ("claim", os.path.join(out, "failed-store"))):
        try:
            run(failing, loader, ranks=mode, output_path=where, key="sum" if where else None, progress=False)
            report["rank_failed"][f"{mode} {where is not None}"] = None
        except Exception as exc:
            report["rank_failed"][f"{mode} {where is not None}"] = [type(exc).__name__, str(exc).split("\\n")[0]]
    distributed.CLAIM_CHUNK = chunk
    report["after_rank_failed"] = [None if r is None else int(r) for r in run(lambda b: b["input_ids"].sum(dim=1),
                                                                              loader, progress=False)]
    dist.barrier()
    dist.destroy_process_group()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    """
)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, run_two_ranks):
    """Runs the worker on two gloo CPU processes; returns their reports."""
    return run_two_ranks(_WORKER, tmp_path_factory.mktemp("gloo"), timeout=120)


@pytest.mark.slow
@pytest.mark.parametrize("n", [300, 296])
def test_two_gloo_ranks_gather_every_result_in_input_order(two_ranks, n):
    rank0, rank1 = (r[str(n)] for r in two_ranks)
    assert rank0["n_batches"] % 2 == (1 if n == 300 else 0)
    assert rank0["steps"] == rank1["steps"] == -(-rank0["n_batches"] // 2)  # an odd plan gets one batch split
    assert sorted(rank0["positions"] + rank1["positions"]) == list(range(n))
    assert rank1["gathered"] is None
    gathered = rank0["gathered"]
    assert len(gathered) == n
    assert [g[:2] for g in gathered] == [[p * 2, f"text {p}"] for p in range(n)]
    assert [g[2][0] for g in gathered] == list(range(n))
    assert {g[2][1] for g in gathered} == {0, 1}  # both ranks computed some
    assert {g[3] for g in gathered} == {"cpu"}


def test_two_gloo_ranks_world(two_ranks):
    assert [r["world"] for r in two_ranks] == [[0, 2], [1, 2]]


def test_two_gloo_ranks_raise_the_same_error_together(two_ranks):
    rank0, rank1 = two_ranks
    for name in ("overlap", "missing", "type_on_rank_1", "n_inputs_differ", "unpicklable_on_rank_1"):
        assert rank0[name] == rank1[name], name
    assert rank0["overlap"] == ["ValueError", ("positions should each be computed exactly once across ranks, but got "
                                "1 computed more than once (first few: 2 (ranks [0, 1]))")]
    assert rank0["missing"] == ["ValueError", ("positions should cover range(n_inputs=4) across ranks, but got 2 "
                                "missing (first few: 1, 2)")]
    assert rank0["type_on_rank_1"] == ["TypeError", ("results should be a list with one result per position, but got "
                                       "results='x' of type str (on rank 1 of 2)")]
    assert rank0["n_inputs_differ"] == ["ValueError", ("n_inputs should be the same on every rank, but got "
                                        "n_inputs=5 on rank 1 and n_inputs=4 on rank 0")]
    kind, message = rank0["unpicklable_on_rank_1"]
    assert kind == "TypeError"
    assert message.startswith("results should be picklable to send to rank 0, but got ")
    assert message.endswith(" (on rank 1 of 2)")
    assert rank0["after_errors"] == [0, 1]
    assert rank1["after_errors"] is None


def test_two_gloo_ranks_run_matches_one_process(two_ranks, tokenizer):
    import dynabatch
    from dynabatch.demo import kjv_passages

    texts = kjv_passages()[:200]
    loader = dynabatch.build_dynamic_batch_dataloader(texts, tokenizer, batch_size=4, max_input_token_length=64,
                                                      num_workers=0)
    single = run(lambda b: b["input_ids"].sum(dim=1), loader, progress=False)
    expected = [int(r) for r in single]
    assert len(expected) == 200
    assert two_ranks[0]["runner"] == expected
    # rank 1 gets only its own rows: the ones it ran, None elsewhere; the two shares cover every input.
    own = two_ranks[1]["runner"]
    assert len(own) == 200
    assert 0 < sum(r is not None for r in own) < 200
    assert all(r is None or r == e for r, e in zip(own, expected))
    assert two_ranks[0]["runner_iterable"] == expected


def test_two_gloo_ranks_share_one_store_and_a_one_process_rerun_runs_only_what_is_missing(two_ranks, tokenizer):
    import os

    import pyarrow.dataset as ds

    import dynabatch
    from dynabatch.demo import kjv_passages

    rank0, rank1 = (r["store"] for r in two_ranks)
    loader = dynabatch.build_dynamic_batch_dataloader(kjv_passages()[:200], tokenizer, batch_size=4,
                                                      max_input_token_length=64, num_workers=0)
    expected = [int(r) for r in run(lambda b: b["input_ids"].sum(dim=1), loader, progress=False)]
    assert rank0["rows"] == rank1["rows"] == expected  # every rank reads the whole store: nothing gathered
    assert rank0["ran"] + rank1["ran"] == 200 and rank0["failed"] == rank1["failed"] == []
    path = rank0["path"]
    shards = sorted(os.listdir(path))
    assert {name.split("_rank")[1][0] for name in shards} == {"0", "1"}  # one store, shards of both ranks
    # Another world size: one process. Rank 1's shards lost (say, its node died): exactly its rows run again.
    lost = [name for name in shards if "_rank1-" in name]
    lost_rows = sorted(ds.dataset([os.path.join(path, n) for n in lost]).to_table().column("position").to_pylist())
    assert len(lost_rows) == rank1["ran"]
    for name in lost:
        os.remove(os.path.join(path, name))
    calls = []
    again = run(lambda b: calls.extend(b.indices.tolist()) or b["input_ids"].sum(dim=1), loader, output_path=path,
                key="sum", progress=False)
    assert sorted(calls) == lost_rows
    assert [int(r) for r in again] == expected
    assert sorted(ds.dataset(path).to_table().column("position").to_pylist()) == list(range(200))


def test_two_gloo_ranks_give_none_for_bad_inputs_skipped(two_ranks, tokenizer):
    import dynabatch
    from dynabatch.demo import kjv_passages

    loader = dynabatch.build_dynamic_batch_dataloader(kjv_passages()[:40], tokenizer, batch_size=4,
                                                      max_input_token_length=64, num_workers=0)
    expected = [int(r) for r in run(lambda b: b["input_ids"].sum(dim=1), loader, progress=False)]
    expected[5] = expected[31] = None
    rank0, rank1 = (r["skipped"] for r in two_ranks)
    assert rank0["gathered"] == {"rows": expected, "failed": [5, 31]}  # rank 0 gathers every row
    assert rank0["stored"] == rank1["stored"] == {"rows": expected, "failed": [5, 31]}


def test_two_gloo_ranks_in_lockstep_each_show_their_own_share(two_ranks):
    # each rank runs its dealt share in rounds with the other: its rows reach its share's total, and the time left
    # counts that share's texts (not the whole corpus at this rank's pace: twice the time on two ranks)
    shares = [r["display"] for r in two_ranks]
    assert sum(s["ran"] for s in shares) == 200 and 0 < shares[0]["ran"] < 200
    for rank, share in enumerate(shares):
        ran = share["ran"]
        assert share["lines"][-1].startswith(f"dynabatch rank {rank}: {ran}/{ran} rows in"), share["lines"]
        assert share["costs"][1] == ran
    assert sum(s["costs"][0] for s in shares) == sum(shares[0]["lengths"])


def test_two_gloo_ranks_refuse_a_loader_already_split_per_rank(two_ranks):
    messages = [r["per_rank_share"] for r in two_ranks]
    assert messages[0] == messages[1]
    assert re.fullmatch(r"loader should yield the same batches on every rank \(run shares them among the ranks "
                        r"itself\), but got \d+ batches on rank 1 and \d+ on rank 0 that differ; pass every rank "
                        r"the whole loader, not its own share", messages[0])


def test_two_gloo_ranks_refuse_loaders_of_other_inputs_in_the_same_batches(two_ranks):
    differ = [r["inputs_differ"] for r in two_ranks]
    assert differ[0] == differ[1]
    assert differ[0]["same_batches"]  # the positions alone match: the check must look at the inputs
    for mode in ("lockstep", "claim"):
        assert re.fullmatch(r"loader should hold the same inputs on every rank .*but got inputs on rank 1 that differ "
                            r"from rank 0's \(other texts, or tokens of another tokenizer\).*same tokenizer and "
                            r"settings", differ[0][mode]), differ[0][mode]


def test_two_gloo_ranks_refuse_ranks_that_differ_between_them(two_ranks):
    assert two_ranks[0]["modes_differ"] == two_ranks[1]["modes_differ"] == (
        "ranks should be the same on every rank, but got ranks='claim' on rank 1 and ranks='lockstep' on rank 0; "
        "pass every rank the same ranks")


def test_two_gloo_ranks_refuse_output_path_on_one_rank_only(two_ranks):
    messages = [r["store_on_one_rank"] for r in two_ranks]
    assert messages[0] == messages[1]
    for mode in ("lockstep", "claim"):
        assert messages[0][mode] == (
            "output_path should be given on every rank or on none (with it every rank writes into the store, without it "
            "rank 0 gathers every rank's rows), but got output_path None on rank 1 and given on rank 0; pass every rank "
            "the same output_path")


def test_two_gloo_ranks_stay_in_lockstep_through_an_out_of_memory_split(two_ranks, tokenizer):
    import dynabatch
    from dynabatch.demo import kjv_passages

    loader = dynabatch.build_dynamic_batch_dataloader(kjv_passages()[:200], tokenizer, batch_size=4,
                                                      max_input_token_length=64, num_workers=0)
    expected = [int(r) for r in run(lambda b: b["input_ids"].sum(dim=1), loader, progress=False)]
    rank0, rank1 = (r["lockstep"] for r in two_ranks)
    assert rank1["oom"] > 0  # the injected errors happened, on rank 1 only
    assert rank0["oom"] == 0
    assert rank0["calls"] == rank1["calls"]  # the collective inside fn ran as often on both: nobody hung
    assert rank0["rows"] == expected  # rank 0 gathered every row, exact
    assert rank0["ran"] + rank1["ran"] == 200


def test_two_gloo_ranks_raise_together_when_fn_raises_on_one_rank(two_ranks):
    rank0, rank1 = (r["rank_failed"] for r in two_ranks)
    assert set(rank0) == set(rank1) == {"lockstep False", "claim False", "claim True"}
    for case in rank0:
        assert rank1[case] == ["RuntimeError", "injected on rank 1"], case  # rank 1 raises fn's own error
        kind, message = rank0[case]
        assert kind == "RankFailedError", case
        expected = (r"run should end on every rank together, but rank 1 of 2 raised RuntimeError: injected on rank 1; "
                    r"rank 0 stopped too \(with output_path, the rows stored so far are kept and a rerun runs only the "
                    r"rows missing\)\. See that rank's log for the traceback")
        assert re.fullmatch(expected, message), case
    assert two_ranks[0]["after_rank_failed"] == two_ranks[0]["runner"]  # still in step: the next run gathers all
    assert two_ranks[1]["after_rank_failed"] is not None


def test_two_gloo_ranks_split_batches_their_measured_peaks_bound_above_the_first(two_ranks, tokenizer):
    import dynabatch
    from dynabatch.demo import kjv_passages, vary_lengths

    loader = dynabatch.build_dynamic_batch_dataloader(vary_lengths(kjv_passages(), n=160, max_words=64, seed=3),
                                                      tokenizer, batch_size=4, max_input_token_length=64,
                                                      num_workers=0)
    expected = [int((b["input_ids"] * b["attention_mask"]).sum()) for b in (loader.plan.collator([p])
                                                                           for p in range(160))]
    rank0, rank1 = (r["guarded"] for r in two_ranks)
    assert rank0["plan_max"] > 1.2  # the plan as it is would go over its first batch's peak
    assert rank0["rows"] == expected and rank0["ran"] + rank1["ran"] == 160  # every row once, in input order
    assert rank0["pre_split"] + rank1["pre_split"] > 0
    for rows, ratio in rank0["calls"] + rank1["calls"]:
        assert ratio <= (1.0 if rows > 4 else 1.02), (rows, ratio)  # no call above the plan's first batch's peak


# --------------------------------------------------------------------------- accelerate, launched by torchrun

_ACCELERATE_WORKER = textwrap.dedent(
    """
    import json, os, sys

    import torch
    from accelerate import Accelerator
    from transformers import AutoModel, AutoTokenizer

    import dynabatch
    from dynabatch.demo import kjv_passages, minilm_path

    accelerator = Accelerator(cpu=True)  # sets up torch.distributed from torchrun's environment
    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    model = AutoModel.from_pretrained(minilm_path()).eval()
    loader = dynabatch.build_dynamic_batch_dataloader(kjv_passages()[:120], tokenizer, batch_size=4,
                                                      max_input_token_length=64, num_workers=0)
    with torch.no_grad():
        rows = dynabatch.run(lambda b: model(**b).last_hidden_state[:, 0], loader, device=accelerator.device,
                             progress=False)
        # A loader passed through prepare, as accelerate users do: run still shards the whole plan once.
        prepared = dynabatch.run(lambda b: model(**b).last_hidden_state[:, 0], accelerator.prepare(loader),
                                 device=accelerator.device, progress=False)
    report = {
        "prepared": [None if r is None else r.tolist() for r in prepared], "prepared_ran": prepared.report.rows,
        "rank": accelerator.process_index, "world": accelerator.num_processes,
        "distributed_type": accelerator.distributed_type.name, "backend": accelerator.state.backend,
        "rows": [None if r is None else r.tolist() for r in rows], "ran": rows.report.rows,
    }
    with open(os.path.join(sys.argv[1], f"rank{accelerator.process_index}.json"), "w") as f:
        json.dump(report, f)
    """
)


@pytest.fixture(scope="module")
def accelerate_ranks(tmp_path_factory):
    """Two CPU processes started by torchrun (what ``accelerate launch --multi_gpu`` runs), set up by Accelerator."""
    pytest.importorskip("accelerate")
    out = tmp_path_factory.mktemp("accelerate")
    script = out / "worker.py"
    script.write_text(_ACCELERATE_WORKER)
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script),
               str(out)]  # --standalone: a rendezvous on a free local port
    log = out / "torchrun.log"
    with open(log, "w") as f:
        proc = subprocess.run(command, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=240,
                              check=False)
    assert proc.returncode == 0, log.read_text()[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_under_accelerate_rank_0_gets_every_row_of_a_one_process_run(accelerate_ranks, tokenizer):
    from transformers import AutoModel

    import dynabatch
    from dynabatch.demo import kjv_passages, minilm_path

    rank0, rank1 = accelerate_ranks
    assert (rank0["world"], rank0["distributed_type"], rank0["backend"]) == (2, "MULTI_CPU", "gloo")
    model = AutoModel.from_pretrained(minilm_path()).eval()
    loader = dynabatch.build_dynamic_batch_dataloader(kjv_passages()[:120], tokenizer, batch_size=4,
                                                      max_input_token_length=64, num_workers=0)
    with torch.no_grad():
        single = run(lambda b: model(**b).last_hidden_state[:, 0], loader, progress=False)
    assert len(rank0["rows"]) == 120
    for got, want in zip(rank0["rows"], single):
        torch.testing.assert_close(torch.tensor(got), want, atol=1e-5, rtol=0)
    # Disjoint shares: rank 1 returns only the rows it ran; together the two ran every input once.
    mine = [p for p, r in enumerate(rank1["rows"]) if r is not None]
    assert 0 < len(mine) == rank1["ran"] and rank0["ran"] + rank1["ran"] == 120
    for rank in accelerate_ranks:
        assert rank["prepared"] == rank["rows"] and rank["prepared_ran"] == rank["ran"]
