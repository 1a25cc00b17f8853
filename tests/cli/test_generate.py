"""dynabatch generate: prompts in, each prompt's own reply out, into a store that a killed run resumes."""

from __future__ import annotations

import json
import re
import shutil

import pyarrow.dataset as ds
import pytest
import torch

from dynabatch.cli import main


def _added(tokenizer, prompt, new):
    """The text the ids ``new`` add after the ids ``prompt``: a reply's text (decoded alone, a WordPiece reply that
    starts a word would lose its space)."""
    before, whole = (tokenizer.decode(ids, skip_special_tokens=True) for ids in (prompt, prompt + new))
    assert whole.startswith(before)
    return whole[len(before):]


def _alone(folder, prompts, max_new_tokens):
    """Each prompt's greedy reply, generated alone: the new tokens up to the first EOS (kept), as text."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer, model = AutoTokenizer.from_pretrained(folder), AutoModelForCausalLM.from_pretrained(folder).eval()
    replies = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt")  # the prompt's ids and mask (GPT-2 would add token types)
            new = model.generate(input_ids=ids["input_ids"], attention_mask=ids["attention_mask"],
                                 max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)[0, ids["input_ids"].shape[1]:].tolist()
            end = next((i for i, t in enumerate(new) if t == model.generation_config.eos_token_id), len(new) - 1)
            replies.append(_added(tokenizer, ids["input_ids"][0].tolist(), new[: end + 1]))
    return replies


@pytest.mark.slow
def test_killed_mid_run_then_rerun_stores_each_prompts_own_greedy_reply_once(
        gpt2_dir, texts, tmp_path, cli, kill_after_first_shard, run_command):
    prompts = [" ".join(t.split()[:12]) for t in texts[:40]]
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n", encoding="utf-8")
    out = tmp_path / "replies"
    command = [*cli, "generate", str(tmp_path / "prompts.txt"), str(out), "--model", str(gpt2_dir),
               "--max-new-tokens", "6", "--batch-size", "4", "--no-progress"]
    kill_after_first_shard(command, out, tmp_path / "hook")
    before = ds.dataset(out).count_rows()
    assert 8 <= before < len(prompts)
    again = run_command(command).stdout
    assert f"40 of 40 replies stored in {out} ({40 - before} run now, {before} stored before)" in again
    table = ds.dataset(out).to_table().sort_by("position")
    assert table.column("position").to_pylist() == list(range(40))  # every prompt once
    assert table.column("output").to_pylist() == _alone(gpt2_dir, prompts, 6)


@pytest.fixture()
def chat(gpt2_dir, tmp_path):
    """The tiny GPT-2 with a chat template."""
    from transformers import AutoTokenizer

    chat = tmp_path / "chat-model"
    chat.mkdir()
    for file in gpt2_dir.iterdir():
        (chat / file.name).write_bytes(file.read_bytes())
    tokenizer = AutoTokenizer.from_pretrained(chat)
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    tokenizer.save_pretrained(chat)
    return chat


def test_chat_conversations_are_rendered_by_the_chat_template(chat, tmp_path, capsys):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat)
    conversations = [[{"role": "user", "content": "In the beginning"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "And God said"}]]
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    out = tmp_path / "replies"
    assert main(["generate", str(tmp_path / "chats.jsonl"), str(out), "--model", str(chat), "--messages-column",
                 "messages", "--max-new-tokens", "4", "--no-progress"]) == 0
    assert "2 of 2 replies stored" in capsys.readouterr().out
    rendered = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in conversations]
    stored = ds.dataset(out).to_table().sort_by("position").column("output").to_pylist()
    model = __import__("transformers").AutoModelForCausalLM.from_pretrained(chat).eval()
    with torch.inference_mode():
        for text, reply in zip(rendered, stored):
            ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")
            new = model.generate(input_ids=ids["input_ids"], attention_mask=ids["attention_mask"], max_new_tokens=4,
                                 do_sample=False, pad_token_id=0)[0, ids["input_ids"].shape[1]:].tolist()
            new = new[: new.index(102) + 1] if 102 in new else new  # a reply ends at its first EOS
            assert reply == _added(tokenizer, ids["input_ids"][0].tolist(), new)


def _chats(path, conversations):
    """``path`` a JSONL of the ``conversations`` under ids c0, c1, ...: its rows ``{"id": ..., "messages": ...}``."""
    path.write_text("".join(json.dumps({"id": f"c{i}", "messages": c}) + "\n" for i, c in enumerate(conversations)))
    return path


_CONVERSATIONS = [[{"role": "user", "content": "In the beginning"}],
                  [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "And God said"}],
                  [{"role": "user", "content": "Let there be light"}]]


def test_a_rerun_of_a_chat_job_on_more_conversations_resumes_its_stored_rows(chat, tmp_path, capsys):
    # the stored chats' hashes, checked before the model loads, are those the run's loader computes: rendered by
    # the template and tokenized without special tokens (MiniLM's tokenizer would add [CLS] and [SEP])
    out = tmp_path / "replies"
    argv = ["--model", str(chat), "--messages-column", "messages", "--id-column", "id", "--max-new-tokens", "3",
            "--no-progress"]
    assert main(["generate", str(_chats(tmp_path / "first.jsonl", _CONVERSATIONS[:2])), str(out), *argv]) == 0
    capsys.readouterr()
    assert main(["generate", str(_chats(tmp_path / "grown.jsonl", _CONVERSATIONS)), str(out), *argv]) == 0
    assert f"3 of 3 replies stored in {out} (1 run now, 2 stored before)" in capsys.readouterr().out


def test_a_rerun_on_another_conversation_at_a_stored_id_is_refused_before_any_model_loads(
        chat, tmp_path, capsys, request):
    # the stored chats' hashes were checked only by the run, once the model had loaded
    out = tmp_path / "replies"
    argv = ["--model", str(chat), "--messages-column", "messages", "--id-column", "id", "--max-new-tokens", "3",
            "--no-progress"]
    assert main(["generate", str(_chats(tmp_path / "first.jsonl", _CONVERSATIONS[:2])), str(out), *argv]) == 0
    capsys.readouterr()
    request.getfixturevalue("no_model_loads")
    other = [_CONVERSATIONS[0], [{"role": "user", "content": "And God said"}], _CONVERSATIONS[2]]  # c1's system gone
    with pytest.raises(SystemExit) as info:
        main(["generate", str(_chats(tmp_path / "edited.jsonl", other)), str(out), *argv])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"dynabatch generate: error: output={str(out)!r} should hold results of these inputs at "
                          "their ids, but got 1 stored rows computed from other inputs (ids c1): the texts, their "
                          "order, the tokenizer or its settings differ from the run that stored them"), err


@pytest.mark.parametrize("message", [{"role": "user"}, {"role": "user", "content": None}, {"content": "And God said"},
                                     {"role": None, "content": "And God said"}])
def test_a_message_without_a_role_or_a_content_is_refused_naming_its_row_before_any_model_loads(
        chat, tmp_path, capsys, no_model_loads, message):
    # pyarrow reads a message lacking a key as that key null: the template rendered it as an empty turn
    rows = [[{"role": "user", "content": "In the beginning"}], [message]]
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in rows))
    with pytest.raises(SystemExit) as info:
        main(["generate", str(tmp_path / "chats.jsonl"), str(tmp_path / "replies"), "--model", str(chat),
              "--messages-column", "messages", "--max-new-tokens", "4", "--no-progress"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("dynabatch generate: error: --messages-column should hold lists of {'role': ..., "
                          "'content': ...} messages (a role and a content in each, neither missing nor null), but "
                          "got row 1: [{"), err
    assert not (tmp_path / "replies").exists()


def test_an_empty_prompt_of_no_token_is_refused_naming_its_row_before_the_weights_load(
        no_bos_llama_dir, tmp_path, capsys, no_model_loads):
    # a stream (many prompts) found it as its chunk was tokenized, the last: after the rest ran and was stored
    (tmp_path / "prompts.txt").write_text("In the beginning\n\nGod created\n")
    with pytest.raises(SystemExit) as info:
        main(["generate", str(tmp_path / "prompts.txt"), str(tmp_path / "replies"), "--model", str(no_bos_llama_dir),
              "--max-new-tokens", "4", "--no-progress"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1, err
    assert err == ("dynabatch generate: error: --text-column should name a column of texts that each hold a token once "
                   "tokenized (the model's tokenizer adds no special token to a text: an empty one would be padding "
                   "alone), but got --text-column='text' with 1 texts of no token (empty, or of characters its "
                   "tokenizer drops: whitespace, control, zero-width), at rows 1: fill or drop them\n")
    assert not (tmp_path / "replies").exists()


def test_sampling_options_without_sample_and_a_prompt_limit_past_the_positions_are_refused(gpt2_dir, tmp_path,
                                                                                          capsys):
    (tmp_path / "p.txt").write_text("In the beginning\n")
    base = ["generate", str(tmp_path / "p.txt"), str(tmp_path / "out"), "--model", str(gpt2_dir)]
    cases = [
        ([*base, "--temperature", "0.7"],
         ("--temperature should be given with --sample (greedy decoding has no temperature, top-p or top-k), but got "
         "--temperature=0.7")),
        ([*base, "--seed", "3"], "--seed should be given with --sample (greedy decoding draws nothing to seed), but got "
         "--seed=3"),
        ([*base, "--max-length", "40", "--max-new-tokens", "32"],
         ("--max-length should be at most 32: the model's max_position_embeddings=64 positions hold the prompt and the "
         "--max-new-tokens=32 new tokens, but got --max-length=40")),
        ([*base, "--max-memory", "150%"],
         "--max-memory should be a percentage in (0%, 100%] of the device's free memory, but got --max-memory='150%'"),
        ([*base, "--max-memory", "12XB"],
         ("--max-memory should be a number of bytes > 0, a size such as '12GB' or '512MiB', or a percentage such as "
          "'80%' (of a device's free memory), but got --max-memory='12XB'")),
        ([*base, "--messages-column", "messages"],
         ("--messages-column should be given with a table (Parquet, CSV, JSONL, datasets): a text file's lines have only "
         "their position, but got --messages-column='messages'")),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
        assert capsys.readouterr().err == f"dynabatch generate: error: {message}\n"


def test_a_prompt_whose_generate_raises_is_named_or_set_aside_with_on_error_skip(gpt2_dir, tokenizer, tmp_path,
                                                                                 capsys, monkeypatch):
    from transformers import GPT2LMHeadModel

    poison = tokenizer.convert_tokens_to_ids("zebra")
    forward = GPT2LMHeadModel.forward

    def poisoned(self, input_ids=None, *args, **kwargs):  # the model raises on any batch holding the token "zebra"
        if input_ids is not None and bool((input_ids == poison).any()):
            raise ValueError("cannot process this prompt")
        return forward(self, input_ids, *args, **kwargs)

    prompts = ["In the beginning", "And God said", "the zebra", "Let there be light", "And there was light"]
    (tmp_path / "p.txt").write_text("\n".join(prompts) + "\n")
    out = tmp_path / "replies"
    command = ["generate", str(tmp_path / "p.txt"), str(out), "--model", str(gpt2_dir), "--max-new-tokens", "3",
               "--batch-size", "2", "--no-progress"]
    monkeypatch.setattr(GPT2LMHeadModel, "forward", poisoned)
    with pytest.raises(SystemExit) as stopped:
        main(command)
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and "input position 2" in err and "--on-error skip" in err, err
    assert main([*command, "--on-error", "skip"]) == 0
    said = capsys.readouterr().out
    assert f"4 of 5 replies stored in {out}" in said and "cannot process this prompt" in said, said
    monkeypatch.setattr(GPT2LMHeadModel, "forward", forward)
    assert main(command) == 0  # the model no longer raises: the prompt set aside is retried
    assert f"5 of 5 replies stored in {out} (1 run now, 4 stored before)" in capsys.readouterr().out


def test_the_summary_counts_the_prompts_cut_to_max_length(gpt2_dir, tmp_path, capsys):
    prompts = ["In the beginning", "And God said unto Moses, I AM THAT I AM: and he said, Thus shalt thou say",
               "Let there be light"]
    (tmp_path / "p.txt").write_text("\n".join(prompts) + "\n")
    command = ["generate", str(tmp_path / "p.txt"), str(tmp_path / "replies"), "--model", str(gpt2_dir),
               "--max-new-tokens", "2", "--max-length", "8", "--no-progress"]
    assert main(command) == 0
    said = capsys.readouterr().out
    assert ("  truncated  1 of the inputs were longer than --max-length tokens, cut to it on the tokenizer's "
            "truncation_side (their outputs are of the cut text)") in said, said


def test_id_column_keys_replies_by_id_and_a_rerun_on_a_reordered_grown_input_runs_only_new_ids(
        gpt2_dir, texts, tmp_path, capsys):
    prompts = [" ".join(t.split()[:8]) for t in texts[:12]]
    rows = [{"id": f"p{i}", "text": p} for i, p in enumerate(prompts)]
    first = tmp_path / "first.jsonl"
    first.write_text("".join(json.dumps(r) + "\n" for r in rows[:8]))
    out = tmp_path / "replies"
    command = ["--model", str(gpt2_dir), "--id-column", "id", "--max-new-tokens", "3", "--no-progress"]
    assert main(["generate", str(first), str(out), *command]) == 0
    assert "8 of 8 replies stored" in capsys.readouterr().out
    grown = tmp_path / "grown.jsonl"
    grown.write_text("".join(json.dumps(r) + "\n" for r in reversed(rows)))  # other order, four more prompts
    assert main(["generate", str(grown), str(out), *command]) == 0
    assert f"12 of 12 replies stored in {out} (4 run now, 8 stored before)" in capsys.readouterr().out
    table = ds.dataset(out).to_table()
    assert table.column_names[0] == "id" and "position" not in table.column_names
    assert sorted(table.column("id").to_pylist()) == sorted(r["id"] for r in rows)  # every id once
    by_id = dict(zip(table.column("id").to_pylist(), table.column("output").to_pylist()))
    assert [by_id[f"p{i}"] for i in range(12)] == _alone(gpt2_dir, prompts, 3)


def test_a_flag_left_to_the_models_generation_config_and_the_same_value_given_are_one_job(gpt2_dir, tmp_path, capsys,
                                                                                         request):
    # the key held the flags as given: --temperature 0.7 and none (the model's 0.7) were two jobs, as were
    # --min-new-tokens 2 and none (the model's 2), and --top-p 1.0 and none (transformers' default): it holds the
    # values model.generate applies
    folder = tmp_path / "sampling-model"
    shutil.copytree(gpt2_dir, folder)
    settings = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**settings, "temperature": 0.7, "min_new_tokens": 2}))
    (tmp_path / "p.txt").write_text("In the beginning\nAnd God said, Let there be light\n")
    out = tmp_path / "replies"
    argv = ["generate", str(tmp_path / "p.txt"), str(out), "--model", str(folder), "--max-new-tokens", "3", "--sample",
            "--no-progress"]
    assert main(argv) == 0
    capsys.readouterr()
    request.getfixturevalue("no_model_loads")  # a finished job's rerun loads no model to run nothing
    assert main([*argv, "--temperature", "0.7", "--min-new-tokens", "2", "--top-p", "1.0", "--top-k", "50"]) == 0
    said = capsys.readouterr().out
    assert f"2 of 2 replies stored in {out} (0 run now, 2 stored before)" in said and "nothing to run" in said
    with pytest.raises(SystemExit) as info:
        main([*argv, "--temperature", "0.9"])
    assert info.value.code == 2
    assert "holding rows computed otherwise (temperature=0.7 there, temperature=0.9 here)" in capsys.readouterr().err


def test_a_length_counting_the_prompt_in_the_folders_generation_config_is_refused_before_the_model_loads(
        gpt2_dir, tmp_path, capsys, monkeypatch):
    # generation_config.json's min_length (it counts the padded prompt) was refused by dynabatch.generate only once
    # the weights had loaded, naming model.generation_config.min_length and min_new_tokens, which the command had no
    # flag for. It is read from the folder first, by the library's rule, and --min-new-tokens gets around it.
    import transformers

    folder = tmp_path / "min-length-model"
    folder.mkdir()
    for file in gpt2_dir.iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    settings = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**settings, "min_length": 5}))
    (tmp_path / "p.txt").write_text("In the beginning\nAnd God said, Let there be light\n")
    out = tmp_path / "replies"
    command = ["generate", str(tmp_path / "p.txt"), str(out), "--model", str(folder), "--max-new-tokens", "3",
               "--no-progress"]
    load = transformers.AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("loaded"))
    with pytest.raises(SystemExit) as info:
        main(command)
    assert info.value.code == 2 and not out.exists()
    assert capsys.readouterr().err == (
        "dynabatch generate: error: --model's generation_config.json should set no min_length (it counts the prompt, "
        "which a batch pads to its longest row, so a reply's length would depend on its batch): give "
        f"--min-new-tokens (the tokens of each reply), or remove min_length from {folder / 'generation_config.json'}; "
        f"but got min_length=5 in --model={str(folder)!r}\n")
    with pytest.raises(SystemExit):
        main([*command, "--min-new-tokens", "4"])
    assert "--min-new-tokens should be at most --max-new-tokens=3, but got --min-new-tokens=4" in capsys.readouterr().err
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", load)
    assert main([*command, "--min-new-tokens", "3"]) == 0
    assert "2 of 2 replies stored" in capsys.readouterr().out


def test_settings_of_the_folders_generation_config_generate_refuses_are_refused_before_the_model_loads(
        gpt2_dir, tmp_path, capsys, monkeypatch):
    # A generation_config.json that sets num_return_sequences=2 (refused by GenerationConfig.validate with greedy
    # decoding) or output_scores (refused by dynabatch.generate) was refused only once the weights had loaded, naming
    # do_sample or model.generation_config.output_scores, which the command has no flag for.
    import transformers

    (tmp_path / "p.txt").write_text("In the beginning\nAnd God said, Let there be light\n")
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("loaded"))
    for extra, flags, said in (({"do_sample": True, "num_return_sequences": 2}, [],
                                r"do_sample should be what transformers' GenerationConfig.validate takes \(Greedy "
                                r"methods .*\), but got do_sample=False"),
                               ({"output_scores": True}, ["--sample"], r"output_scores should be unset or False: "
                                r"dynabatch.generate returns each prompt's reply .*, but got output_scores=True")):
        folder = tmp_path / f"model-{len(flags)}"
        shutil.copytree(gpt2_dir, folder)
        settings = json.loads((folder / "generation_config.json").read_text())
        (folder / "generation_config.json").write_text(json.dumps({**settings, **extra}))
        out = tmp_path / f"replies-{len(flags)}"
        with pytest.raises(SystemExit) as info:
            main(["generate", str(tmp_path / "p.txt"), str(out), "--model", str(folder), "--max-new-tokens", "3",
                  "--no-progress", *flags])
        assert info.value.code == 2 and not out.exists()
        err = capsys.readouterr().err
        assert re.fullmatch(r"dynabatch generate: error: --model's generation_config.json should hold settings "
                            rf"model.generate takes with the options given, but {said} \(with "
                            rf"{re.escape(str(folder / 'generation_config.json'))}\): change the options \(--sample\) "
                            rf"or the file, or use another model folder; --model={re.escape(repr(str(folder)))}\n",
                            err), err
