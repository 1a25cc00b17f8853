"""Every refusal of a command-line value: one line on stderr, exit status 2, naming the flag as typed (never the
library's arguments), before any model loads: a percentage judged by the devices chosen, a token cap and an absolute
budget by the first batch's tokens and the model's config."""

from __future__ import annotations

import pathlib
import re

import pytest

from dynabatch.cli import main
from dynabatch.cli._checks import FLAGS

_ON_CPU = ("should be bytes or a size such as '20GB' on cpu (no device memory is known there: a percentage is a share "
           "of a device's free memory), but got --max-memory='90%'")

# (command, flag, bad value, what the line says after the flag; None: the flag named is enough)
BAD = [(command, flag, value, said) for command in ("embed", "generate") for flag, value, said in [
    ("--batch-size", "0", "should be a positive integer, but got --batch-size=0"),
    ("--batch-size", "-3", None),
    ("--batch-size", "x", None),
    ("--max-length", "0", "should be a positive integer, but got --max-length=0"),
    ("--max-length", "100", None),  # above the model's 64 positions
    ("--max-memory", "90%", _ON_CPU),
    ("--max-memory", "150%", None),
    ("--max-memory", "12XB", None),
    ("--max-memory", "0", None),
    ("--max-memory", "-5GB", None),
]] + [
    ("embed", "--max-batch-tokens", "0", "should be a positive integer, but got --max-batch-tokens=0"),
    ("embed", "--max-batch-tokens", "1.5", None),
    ("generate", "--max-new-tokens", "0", "should be a positive integer, but got --max-new-tokens=0"),
    ("generate", "--min-new-tokens", "0", "should be a positive integer, but got --min-new-tokens=0"),
    ("generate", "--top-k", "0", None),
    ("generate", "--top-p", "1.5", "should be a number in (0, 1], but got --top-p=1.5"),
    ("generate", "--temperature", "inf", "should be a finite number above 0, but got --temperature=inf"),
    ("generate", "--temperature", "nan", None),
    ("generate", "--seed", str(2**64), None),
]


@pytest.fixture()
def inputs(tmp_path, bert_dir, gpt2_dir):
    (tmp_path / "docs.txt").write_text("In the beginning God created the heaven and the earth.\nAnd God said\n")
    return {"embed": ["embed", str(tmp_path / "docs.txt"), str(tmp_path / "out"), "--model", str(bert_dir)],
            "generate": ["generate", str(tmp_path / "docs.txt"), str(tmp_path / "out"), "--model", str(gpt2_dir),
                         "--sample", "--max-new-tokens", "8"]}


def _one_line(argv, capsys, command, loads=False):
    """The one line of a refusal (exit status 2); ``loads``: transformers' "Loading weights" bar came before it."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    if loads:
        err = "".join(f"{line}\n" for line in re.split(r"[\r\n]+", err) if line and "Loading weights" not in line)
    assert info.value.code == 2 and "Traceback" not in err and err.count("\n") == 1, err
    assert err.startswith(f"dynabatch {command}: error: "), err
    return err.strip().removeprefix(f"dynabatch {command}: error: ")


@pytest.mark.parametrize(("command", "flag", "value", "said"), BAD, ids=[" ".join(case[:3]) for case in BAD])
def test_a_bad_value_of_any_numeric_flag_is_one_line_naming_it_before_any_model_loads(
        inputs, tmp_path, capsys, no_model_loads, command, flag, value, said):
    line = _one_line([*inputs[command], flag, value], capsys, command)
    assert flag in line, line
    if said is not None:
        assert line == f"{flag} {said}"
    assert not (tmp_path / "out").exists()  # the folder the job made is taken back


_LIBRARY_NAME = re.compile(r"(?<![\w-])(" + "|".join(FLAGS) + r")(?!\w)")


@pytest.fixture(params=["transformers", "sentence-transformers"])
def embed_model(request, bert_dir, st_model_folder):
    return str(bert_dir) if request.param == "transformers" else str(st_model_folder(max_seq_length=64))


def test_a_token_cap_below_the_first_batch_is_one_line_naming_the_flags_before_any_model_loads(
        inputs, embed_model, tmp_path, capsys, no_model_loads, monkeypatch):
    argv = [*inputs["embed"][:-1], embed_model, "--batch-size", "2", "--no-progress"]
    tokens = _one_line([*argv, "--max-batch-tokens", "3"], capsys, "embed")
    least = re.fullmatch(r"--max-batch-tokens should be at least 2 x (\d+) = (\d+) padded tokens \(the first batch, "
                         r"the --batch-size=2 longest texts \1 tokens wide\); pass a larger --max-batch-tokens, a "
                         r"smaller --batch-size or a smaller --max-length, but got --max-batch-tokens=3", tokens)
    assert least is not None, tokens
    assert not (tmp_path / "out").exists()  # the folder the job made is taken back
    monkeypatch.undo()  # the model loads: the least the first batch holds runs
    assert main([*argv, "--max-batch-tokens", least.group(2)]) == 0
    assert "2 of 2 texts stored" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["embed", "generate"])
def test_an_absolute_budget_below_one_row_is_one_line_naming_the_flag_before_any_model_loads(
        inputs, command, tmp_path, capsys, no_model_loads):
    memory = _one_line([*inputs[command], "--max-memory", "1KB", "--no-progress"], capsys, command)
    assert memory.startswith("--max-memory should be at least one row of the longest text"), memory
    assert re.search(r"or --max-memory=none \(the relative rule\), but got --max-memory='1KB'$", memory), memory
    assert not _LIBRARY_NAME.search(memory), memory
    assert not (tmp_path / "out").exists()


def test_max_memory_none_is_the_relative_rule(inputs, capsys):
    assert main([*inputs["embed"], "--max-memory", "none", "--no-progress"]) == 0
    assert "2 of 2 texts stored" in capsys.readouterr().out


@pytest.mark.parametrize("flag", ["--report", "--plot"])
@pytest.mark.parametrize("command", ["embed", "generate"])
def test_a_report_or_plot_inside_the_output_folder_is_refused_before_any_model_loads(
        inputs, command, flag, tmp_path, capsys, no_model_loads):
    # written there, it made the store's folder one the same command refused ("holding 1 other entries")
    (tmp_path / "out").mkdir()
    inside = tmp_path / "out" / "sub" / "run.json"
    line = _one_line([*inputs[command], flag, str(inside)], capsys, command)
    assert line == (f"{flag} should be a file outside the output folder (the store holds its own files alone: a rerun "
                    f"would refuse it), but got {flag}={str(inside)!r} inside output={str(tmp_path / 'out')!r}")
    assert list((tmp_path / "out").iterdir()) == []


@pytest.mark.parametrize("command", ["embed", "generate"])
def test_a_plot_of_a_format_matplotlib_cannot_write_is_refused_before_any_model_loads(
        inputs, command, tmp_path, capsys, no_model_loads):
    # it was taken, the whole job ran, and matplotlib's ValueError ended the command as a traceback, exit status 1,
    # with no summary
    plot = str(tmp_path / "batches.txt")
    line = _one_line([*inputs[command], "--plot", plot], capsys, command)
    assert line.startswith("--plot should be a file of a format matplotlib writes (.eps, ") and ".png" in line, line
    assert line.endswith(f", but got --plot={plot!r}"), line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["embed", "generate"])
def test_a_store_or_report_inside_the_model_folder_is_refused_before_any_model_loads(
        inputs, command, tmp_path, capsys, no_model_loads):
    # every file of the model folder is its identity: a store written there changed it, so each rerun refused the
    # store as another model's and the job could never resume
    model = tmp_path / "model"
    model.mkdir()
    for file in pathlib.Path(inputs[command][4]).iterdir():
        if file.is_file():
            (model / file.name).write_bytes(file.read_bytes())
    argv = [*inputs[command][:2], str(model / "out"), "--model", str(model), *inputs[command][5:]]
    line = _one_line(argv, capsys, command)
    assert line == (f"OUTPUT should lie outside --model (the command reads it: writing there would overwrite or "
                    f"add to it), but got OUTPUT={str(model / 'out')!r} and --model={str(model)!r}")
    report = str(model / "run.json")
    line = _one_line([*inputs[command], "--model", str(model), "--report", report], capsys, command)
    assert line.startswith(f"--report should lie outside --model "), line
    assert not (model / "out").exists() and not (model / "run.json").exists()


_CONVERSATIONS = '{"id": 1, "text": "a", "messages": [{"role": "user", "content": "hi"}]}\n'
# (command, what the corpus file holds, the flags beside it, what the line says): each refused by reading its values
BAD_CORPORA = [(command, *case) for command in ("embed", "generate") for case in [
    ('{"id": 1, "text": "a"}\n{"id": 2, "text": null}\n', [],
     "--text-column should name a column without missing texts, but got --text-column='text' with 1 missing (null) "
     "texts, at rows 1: fill or drop them"),
    ('{"id": 1, "text": "a"}\n{"id": 1, "text": "b"}\n', ["--id-column", "id"],
     "--id-column='id': ids should be unique (one stable id per text), but got 1 id given to several texts (first: 1 "
     "at positions 0, 1)"),
]] + [("generate", _CONVERSATIONS + '{"id": 2, "text": "b", "messages": [{"role": "user"}]}\n',
       ["--messages-column", "messages"], "--messages-column should hold lists of {'role': ..., 'content': ...} "
       "messages (a role and a content in each, neither missing nor null), but got row 1: ")]


@pytest.mark.parametrize(("command", "rows", "flags", "said"), BAD_CORPORA,
                         ids=[f"{case[0]} {case[3][:14]}" for case in BAD_CORPORA])
def test_a_bad_corpus_value_is_refused_before_the_output_or_the_models_folder_is_touched(
        inputs, tmp_path, capsys, no_model_read, command, rows, flags, said):
    (tmp_path / "docs.jsonl").write_text(rows)
    argv = [command, str(tmp_path / "docs.jsonl"), *inputs[command][2:], *flags]
    assert _one_line(argv, capsys, command).startswith(said)
    assert not (tmp_path / "out").exists()


# (command, flags, the refusal): an option that means something only beside another, given where it means nothing
TIED = [
    ("generate", ["--messages-column", "messages", "--text-column", "text"],
     "--messages-column should be left out with --text-column (the prompts are one column, the texts of --text-column "
     "or the conversations of --messages-column: give one), but got --messages-column='messages' and "
     "--text-column='text'"),
    ("embed", ["--prompt", "query: ", "--prompt-name", "query"],
     "--prompt-name should be left out with --prompt (--prompt is the prompt itself, --prompt-name names one the model "
     "saved: give one), but got --prompt-name='query' and --prompt='query: '"),
    ("calibrate", ["--task", "forward", "--num-beams", "4"],
     "--num-beams should be given with --task generate (a forward or a training step has no beams), but got "
     "--num-beams=4"),
    ("calibrate", ["--task", "train", "--max-new-tokens", "64"],
     "--max-new-tokens should be given with --task generate (a forward or a training step generates no tokens), but "
     "got --max-new-tokens=64"),
]


@pytest.mark.parametrize(("command", "flags", "said"), TIED, ids=[" ".join(case[1]) for case in TIED])
def test_an_option_given_where_it_means_nothing_is_refused_even_at_its_default_value(
        inputs, bert_dir, tmp_path, capsys, no_model_read, command, flags, said):
    calibrate = ["calibrate", "--model", str(bert_dir), "--batch-size", "2", "--max-length", "8", "-o",
                 str(tmp_path / "mm.json")]
    argv = calibrate if command == "calibrate" else inputs[command]
    assert _one_line([*argv, *flags], capsys, command) == said


@pytest.mark.parametrize("command", ["embed", "generate"])
def test_a_report_or_plot_onto_the_input_or_onto_each_other_is_refused_before_anything_is_written(
        inputs, command, tmp_path, capsys, no_model_read):
    # the run wrote the report over the corpus it had read, and the plot over the report, without a word
    corpus = str(tmp_path / "docs.txt")
    line = _one_line([*inputs[command], "--report", corpus], capsys, command)
    assert line == (f"--report should lie outside input (the command reads it: writing there would overwrite or "
                    f"add to it), but got --report={corpus!r} and input={corpus!r}")
    both = str(tmp_path / "run.png")
    line = _one_line([*inputs[command], "--report", both, "--plot", both], capsys, command)
    assert line == f"--plot should be another file than --report (each writes its own file), but got --plot={both!r}"
    assert (tmp_path / "docs.txt").read_text().startswith("In the beginning") and not (tmp_path / "out").exists()


def test_weights_in_a_folder_linked_into_the_model_are_found_as_its_identity_reads_them(bert_dir, tmp_path):
    # the weights check walked with Path.rglob, which does not follow linked folders, where the model's identity reads
    # through them: a folder whose weights lie only in a linked module folder was refused as holding none
    import shutil

    from dynabatch.cli._checks import check_model_folder

    model, module = tmp_path / "model", tmp_path / "trained" / "0_Transformer"
    model.mkdir()
    module.mkdir(parents=True)
    for file in bert_dir.iterdir():
        shutil.copy(file, (module if file.suffix == ".safetensors" else model) / file.name)
    (model / "0_Transformer").symlink_to(module, target_is_directory=True)
    assert check_model_folder("--model", str(model)).hidden_size == 32
    from dynabatch.cli._checks import model_files  # the one walk of both

    assert [p.relative_to(model).as_posix() for p in model_files(str(model)) if p.suffix == ".safetensors"] == [
        "0_Transformer/model.safetensors"]


@pytest.mark.parametrize("command", ["embed", "generate", "calibrate"])
def test_a_model_folder_without_weights_is_one_line_before_any_model_loads(
        inputs, command, bert_dir, gpt2_dir, tmp_path, capsys, no_model_loads):
    # its config and tokenizer passed every check, then the load raised OSError with a traceback, exit status 1
    bare = tmp_path / "bare"
    bare.mkdir()
    for file in (gpt2_dir if command == "generate" else bert_dir).iterdir():
        if file.suffix == ".json":
            (bare / file.name).write_bytes(file.read_bytes())
    argv = (["calibrate", "--batch-size", "2", "--max-length", "8", "-o", str(tmp_path / "mm.json")]
            if command == "calibrate" else inputs[command][:3])
    line = _one_line([*argv, "--model", str(bare)], capsys, command)
    assert line.startswith(f"--model should be a model folder holding its weights (a .safetensors or .bin file; the "
                           f"load refuses it otherwise), but got --model={str(bare)!r} with no file named "), line
