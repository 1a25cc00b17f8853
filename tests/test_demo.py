"""dynabatch.demo: the demo inputs and chat model refuse what they would overwrite or cannot give, before any work."""

import json
from pathlib import Path

import pytest

from dynabatch import demo


def test_the_chat_model_never_overwrites_a_folder_it_did_not_write(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"someone's model")
    with pytest.raises(ValueError, match=r"folder should be a missing or empty folder, or an earlier demo model"):
        demo.chat_model(tmp_path)
    assert (tmp_path / "weights.bin").read_bytes() == b"someone's model"
    with pytest.raises(ValueError, match=r"folder should be a folder"):
        demo.chat_model(tmp_path / "weights.bin")


def test_corpus_and_chats_take_rows_from_the_passages_in_order(tmp_path):
    import pyarrow.dataset as ds

    paths = demo.corpus(tmp_path / "corpus", rows=25, rows_per_file=10)
    assert [p.rsplit("/", 1)[1] for p in paths] == ["part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]
    table = ds.dataset(tmp_path / "corpus").to_table()
    assert table.column("id").to_pylist() == [f"kjv-{i:05d}" for i in range(25)]
    assert table.column("text").to_pylist() == demo.kjv_passages()[:25]
    path = demo.chats(tmp_path / "chats.jsonl", rows=4)
    lines = [json.loads(line) for line in Path(path).read_text().splitlines()]
    assert [len(c["messages"]) for c in lines] == [2, 1, 1, 2]  # a system message every third conversation
    with pytest.raises(ValueError, match=r"rows should be at most the 24,408 KJV passages, but got rows=24409"):
        demo.corpus(tmp_path / "all", rows=24_409)
    with pytest.raises(TypeError, match=r"rows should be a positive integer"):
        demo.chats(tmp_path / "c.jsonl", rows=2.5)


def test_the_demo_command_refuses_in_one_line_naming_the_extra_or_the_flag(tmp_path, monkeypatch, capsys):
    import sys

    monkeypatch.setenv("DYNABATCH_CACHE_DIR", str(tmp_path / "cache"))  # no Llama-2 tokenizer cached: it is read
    monkeypatch.setitem(sys.modules, "tinycoder", None)  # as where the examples extra is not installed
    with pytest.raises(SystemExit) as stop:
        demo.main(["chat-model", str(tmp_path / "model")])
    assert stop.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error == ("python -m dynabatch.demo chat-model: error: dynabatch.demo.llama2_tokenizer_path() needs "
                     "tinycoder, which is not installed: pip install 'torch-dynabatch[examples]'")
    assert "Traceback" not in capsys.readouterr().err
    for argv, message in ((["corpus", str(tmp_path / "c"), "--rows", "0"], "--rows should be a positive integer"),
                          (["corpus", str(tmp_path / "c"), "--rows-per-file", "0"],
                           "--rows-per-file should be a positive integer"),
                          (["chats", str(tmp_path / "c.jsonl"), "--rows", "24409"],
                           "--rows should be at most the 24,408 KJV passages, but got --rows=24409")):
        with pytest.raises(SystemExit, match="2"):
            demo.main(argv)
        assert message in capsys.readouterr().err
    assert not (tmp_path / "c").exists() and not (tmp_path / "c.jsonl").exists()
