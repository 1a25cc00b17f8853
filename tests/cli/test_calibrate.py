"""dynabatch calibrate: a local model folder in, a memory model JSON (and a PNG) out."""

from __future__ import annotations

import json

import pytest
import torch

from dynabatch import MemoryModel
from dynabatch.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


def test_calibrate_generate_writes_the_model_the_table_and_a_plot(gpt2_dir, tmp_path, capsys):
    out, png = tmp_path / "mm.json", tmp_path / "mm.png"
    assert main(["calibrate", "--model", str(gpt2_dir), "--task", "generate", "--max-new-tokens", "3",
                 "--batch-size", "2", "--max-length", "32", "-o", str(out), "--plot", str(png), "--device", "cpu",
                 "--max-probes", "16", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "measured MB" in printed and "largest leave-one-probe-out error" in printed and str(out) in printed
    data = json.loads(out.read_text())
    assert data["metadata"]["task"] == "generate" and data["metadata"]["max_new_tokens"] == 3
    assert data["model"]["class"] == "GPT2LMHeadModel" and data["device"] == "cpu"
    mm = MemoryModel.load(out, device="cpu")
    assert float(mm.predict(2, 32)) > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_calibrate_train_step(gpt2_dir, tmp_path):
    out = tmp_path / "train.json"
    assert main(["calibrate", "--model", str(gpt2_dir), "--task", "train", "--batch-size", "2", "--max-length",
                 "16", "-o", str(out), "--max-probes", "12", "--no-progress"]) == 0
    assert MemoryModel.load(out).metadata["task"] == "train"


def test_bad_options(gpt2_dir, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["calibrate", "--model", str(tmp_path / "missing"), "--batch-size", "2", "--max-length", "16", "-o",
              str(tmp_path / "x.json")])
    assert "--model should be a local model folder" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["calibrate", "--model", str(gpt2_dir), "--batch-size", "0", "--max-length", "16", "-o",
              str(tmp_path / "x.json")])
    assert "--batch-size should be a positive integer, but got --batch-size=0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["calibrate", "--model", str(gpt2_dir), "--task", "fly", "--batch-size", "2", "--max-length", "16",
              "-o", str(tmp_path / "x.json")])
    assert "invalid choice: 'fly'" in capsys.readouterr().err


def test_texts_are_the_non_blank_lines_the_format_layer_reads(gpt2_dir, tmp_path, monkeypatch):
    # --texts was read by its own splitlines(): a byte order mark stayed in the first text, and a form feed or U+2028
    # inside a line split it in two, where every command's text file (--format text) reads one line
    import dynabatch.memory.calibrate

    drawn = []

    class Drawn(Exception):
        pass

    def capture(*args, texts=None, **kwargs):
        drawn.extend(texts)
        raise Drawn

    monkeypatch.setattr(dynabatch.memory.calibrate, "calibrate", capture)
    path = tmp_path / "texts.txt"
    path.write_bytes("\ufeffIn the beginning\r\n\r\n  \rGod\x0csaid\nlet\u2028there be\n".encode())
    with pytest.raises(Drawn):
        main(["calibrate", "--model", str(gpt2_dir), "--batch-size", "2", "--max-length", "16", "--max-new-tokens",
              "4", "--no-progress", "-o", str(tmp_path / "mm.json"), "--texts", str(path)])
    assert drawn == ["In the beginning", "God\x0csaid", "let\u2028there be"]


def test_bad_inputs_fail_in_seconds_before_any_probe(gpt2_dir, tmp_path, capsys, monkeypatch):
    import sys
    import time

    import dynabatch.memory.calibrate

    def no_probe(*args, **kwargs):
        raise AssertionError("calibrate() ran: the bad input was not caught before the first probe")

    monkeypatch.setattr(dynabatch.memory.calibrate, "calibrate", no_probe)
    # A model folder with positions to spare but the tokenizer's model_max_length=512: a config, no weights.
    from transformers import GPT2Config

    wide = tmp_path / "wide"
    GPT2Config(n_embd=32, n_layer=1, n_head=2, n_positions=4096).save_pretrained(wide)
    (wide / "model.safetensors").write_bytes(b"")  # a weights file by name: the check refuses before any is read
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (wide / name).write_bytes((gpt2_dir / name).read_bytes())
    out = str(tmp_path / "mm.json")
    blank, latin = tmp_path / "blank.txt", tmp_path / "latin.txt"  # --texts was read only once the model loaded
    blank.write_text("\n  \n\n", encoding="utf-8")
    latin.write_bytes("caf\u00e9 au lait\n".encode("latin-1"))
    base = ["calibrate", "--model", str(gpt2_dir), "--batch-size", "2", "--no-progress"]
    cases = [
        ([*base, "--max-length", "48", "--max-new-tokens", "32", "-o", out],
         ("--max-length should be at most 32: the model's max_position_embeddings=64 positions hold the prompt and "
         "the --max-new-tokens=32 new tokens, but got --max-length=48")),
        (["calibrate", "--model", str(wide), "--batch-size", "2", "--max-length", "1000", "-o", out],
         "--max-length should be at most the tokenizer's model_max_length=512"),
        ([*base, "--max-length", "16", "-o", str(tmp_path / "no-such-folder" / "mm.json")],
         "--output should be a file in an existing folder, but got --output="),
        ([*base, "--max-length", "16", "-o", str(tmp_path)], "--output should be a file to write, but got --output="),
        ([*base, "--max-length", "16", "-o", out, "--device", "gpu"],
         "--device should be a valid torch device such as 'cpu' or 'cuda:0', but got --device='gpu'"),
        ([*base, "--max-length", "16", "--max-new-tokens", "4", "-o", str(blank), "--texts", str(blank)],
         f"--output should lie outside --texts (the command reads it: writing there would overwrite or add to "
         f"it), but got --output='{blank}' and --texts='{blank}'"),
        ([*base, "--max-length", "16", "-o", out, "--dtype", "int8"],  # the load raised, with a traceback
         "--dtype should be a floating-point torch dtype such as float16 or bfloat16, but got --dtype='int8'"),
        ([*base, "--max-length", "16", "-o", out, "--seed", "-1"],
         "--seed should be a non-negative integer, but got --seed=-1"),
        ([*base, "--max-length", "16", "--max-new-tokens", "4", "-o", out, "--texts", str(blank)],
         f"--texts should be a text file with at least one text (a non-blank line), but got --texts='{blank}'"),
        ([*base, "--max-length", "16", "--max-new-tokens", "4", "-o", out, "--texts", str(latin)],
         f"--texts should be a UTF-8 text file, one document a line, but got --texts='{latin}': 'utf-8' codec can't "
         "decode byte 0xe9 in position 3"),
    ]
    for argv, message in cases:
        start = time.perf_counter()
        with pytest.raises(SystemExit) as info:
            main(argv)
        err = capsys.readouterr().err
        assert info.value.code == 2 and message in err and "Traceback" not in err, err
        assert time.perf_counter() - start < 5
    # No GPU, no matplotlib: simulated.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        main([*base, "--max-length", "16", "-o", out, "--device", "cuda:0"])
    assert ("--device should be an available device (torch.cuda.is_available() is False: no CUDA device here), "
            "but got --device='cuda:0'") in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SystemExit):
        main([*base, "--max-length", "16", "-o", out, "--plot", str(tmp_path / "mm.png")])
    err = capsys.readouterr().err
    assert "--plot should be given with matplotlib installed (pip install 'torch-dynabatch[plot]'), but got --plot=" in err
    assert not (tmp_path / "mm.json").exists() and not (tmp_path / "mm.png").exists()  # the checks leave no file
