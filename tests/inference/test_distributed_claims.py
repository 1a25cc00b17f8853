"""``run(ranks="claim")`` on two gloo ranks: chunks claimed from the store's counter, measured mode per rank."""

import textwrap

import pytest

_WORKER = textwrap.dedent(
    """
    import contextlib, io, json, os, sys

    import torch
    import torch.distributed as dist
    from transformers import AutoTokenizer

    import dynabatch
    import dynabatch.data.streaming as token_streaming
    import dynabatch.inference.distributed as distributed
    from dynabatch.demo import kjv_passages, minilm_path, vary_lengths

    rank, out = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", rank=rank, world_size=2)
    token_streaming.FIRST_CHUNK = token_streaming.CHUNK_SIZE = distributed.CLAIM_CHUNK = 48  # many small chunks
    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    texts = vary_lengths(kjv_passages(), n=480, max_words=64, seed=11)
    torch.manual_seed(0)
    embed = torch.nn.Embedding(len(tokenizer), 64)

    def fn(batch):  # memory grows with rows and with width (attention-like scores): batches grow as texts shorten
        if rank == 1:
            import time; time.sleep(0.002 * batch["input_ids"].shape[0])  # a slower rank claims fewer chunks
        with torch.no_grad():
            h = embed(batch["input_ids"])
            scores = (h @ h.transpose(1, 2)).softmax(-1) @ h
        return (batch["input_ids"] * batch["attention_mask"]).sum(1) + 0 * scores.sum((1, 2)).long()

    report = {}
    for name, stream in (("stream", True), ("planned", False)):
        loader = dynabatch.build_dynamic_batch_dataloader(texts, tokenizer, batch_size=4, max_input_token_length=64,
                                                          num_workers=0, stream=stream)
        store = os.path.join(out, name)
        result = dynabatch.run(fn, loader, output_path=store, key="sums", ranks="claim", progress=False)
        r = result.report
        report[name] = {
            "rows": [int(x) for x in result], "ran": r.rows, "over": r.batches_over_budget,
            "max_ratio": r.max_peak_ratio, "sizes": [b.rows for b in r.records],
            "tokenized": loader.plan.stream.tokenizations.nonzero()[0].tolist() if stream else None,
        }
    gathered = dynabatch.run(fn, loader, ranks="claim", progress=False)  # no store: rank 0 gathers
    report["gathered"] = [None if x is None else int(x) for x in gathered]
    report["one_chunk"] = {}
    for name, stream in (("stream", True), ("planned", False)):  # 40 texts: one chunk, claimed by one rank
        small = dynabatch.build_dynamic_batch_dataloader(texts[:40], tokenizer, batch_size=4, max_input_token_length=64,
                                                         num_workers=0, stream=stream, progress=False)
        shown = io.StringIO()
        with contextlib.redirect_stderr(shown):
            ran = dynabatch.run(fn, small, ranks="claim").report.rows
        report["one_chunk"][name] = {"ran": ran, "lines": shown.getvalue().splitlines()}
    dist.barrier()
    dist.destroy_process_group()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    """
)


@pytest.fixture(scope="module")
def claimed(tmp_path_factory, run_two_ranks):
    return run_two_ranks(_WORKER, tmp_path_factory.mktemp("claims"), timeout=150)


@pytest.fixture(scope="module")
def expected(tokenizer):
    import dynabatch
    from dynabatch.demo import kjv_passages, vary_lengths

    texts = vary_lengths(kjv_passages(), n=480, max_words=64, seed=11)
    loader = dynabatch.build_dynamic_batch_dataloader(texts, tokenizer, batch_size=4, max_input_token_length=64,
                                                      num_workers=0, stream=False)
    return [int(b["input_ids"].sum()) for b in (loader.plan.collator([p]) for p in range(len(texts)))]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["stream", "planned"])
def test_claiming_ranks_store_every_row_once_in_input_order(claimed, expected, name):
    rank0, rank1 = (r[name] for r in claimed)
    assert rank0["rows"] == rank1["rows"] == expected  # each rank reads the whole store back
    assert rank0["ran"] + rank1["ran"] == len(expected)  # every row ran on exactly one rank
    assert rank0["ran"] > 0 and rank1["ran"] > 0


@pytest.mark.parametrize("name", ["stream", "planned"])
def test_claiming_ranks_run_measured_mode_under_their_own_first_peak(claimed, name):
    for rank in claimed:
        r = rank[name]
        assert r["over"] == 0 and r["max_ratio"] <= 1.0  # 0 batches over the rank's first batch's peak
        assert r["sizes"][0] == 4  # each rank's first batch: its budget
    assert max(max(rank[name]["sizes"]) for rank in claimed) > 4  # batches grew from measured peaks


def test_claiming_ranks_tokenize_only_the_chunks_they_claim(claimed):
    mine = [set(r["stream"]["tokenized"]) for r in claimed]
    assert mine[0] and mine[1] and not mine[0] & mine[1]  # each chunk tokenized once, on one rank: 1.0x the corpus


def test_claiming_ranks_without_a_store_gather_on_rank_0(claimed, expected):
    assert claimed[0]["gathered"] == expected
    assert sum(x is not None for x in claimed[1]["gathered"]) < len(expected)


@pytest.mark.parametrize("name", ["stream", "planned"])
def test_a_rank_that_claims_no_chunk_shows_it_ran_none_and_is_done(claimed, name):
    # One chunk: one rank claims it, the other finds the counter past the last chunk at its first claim. Each closing
    # line counts the rank's own rows (the whole corpus it never reaches was "0/40 rows" on the rank that ran none)
    shares = [rank["one_chunk"][name] for rank in claimed]
    assert sorted(share["ran"] for share in shares) == [0, 40]
    for rank, share in enumerate(shares):
        assert share["lines"][-1].startswith(f"dynabatch rank {rank}: {share['ran']} of 40 rows ran on this rank "
                                             "in "), share["lines"]
        assert share["lines"][-1].endswith("; no chunk left to claim"), share["lines"]
    idle = next(share for share in shares if share["ran"] == 0)
    assert len(idle["lines"]) == 1 and "- texts/s, - tokens/s" in idle["lines"][0]  # done at once, no wait shown
