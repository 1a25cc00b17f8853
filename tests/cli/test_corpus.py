"""The corpus of a command-line job: formats told by the suffix (never guessed), CSV/TSV as tables, a corpus folder
that never reads the job's own store, a file lacking a column named."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dynabatch.cli.corpus import open_corpus


def test_a_csv_is_a_table_of_strings_quoted_values_holding_commas_quotes_and_line_breaks(tmp_path):
    path = tmp_path / "docs.csv"
    path.write_bytes('\ufeffid,text,lang\n007,"In the beginning, God","en"\n8,"He said ""light""\nand light",en\n'
                     '9,,en\n'.encode())  # a byte order mark, as Excel writes it
    corpus = open_corpus(str(path), keep=["id", "text"])
    assert corpus.format == "csv" and len(corpus) == 3 and sorted(corpus.columns) == ["id", "lang", "text"]
    assert corpus.ids("id").to_pylist() == ["007", "8", "9"]  # no types in a CSV: ids stay as written
    assert corpus.texts("text").take([0, 1, 2]) == ["In the beginning, God", 'He said "light"\nand light', ""]


def test_a_tsv_folder_and_a_csv_glob_read_every_file_in_sorted_order(tmp_path):
    (tmp_path / "tsv").mkdir()
    (tmp_path / "tsv" / "b.tsv").write_text("id\ttext\n2\tsecond\n")
    (tmp_path / "tsv" / "a.tsv").write_text("id\ttext\n1\tfirst, with a comma\n")
    corpus = open_corpus(str(tmp_path / "tsv"))
    assert corpus.format == "tsv" and corpus.texts("text").take([0, 1]) == ["first, with a comma", "second"]
    for name in ("x.csv", "y.csv"):
        (tmp_path / name).write_text(f"text\n{name}\n")
    assert open_corpus(str(tmp_path / "*.csv")).texts("text").take([0, 1]) == ["x.csv", "y.csv"]


@pytest.mark.parametrize(("content", "message"), [
    ("id,text\n", "input should hold at least one text, but got input={path!r} with no rows"),
    ("id,text\n1,a,b\n", ("input should be a UTF-8 CSV file: a first line naming the columns, then as many values a "
                         "row, but got input={path!r}: line 2: CSV parse error: Expected 2 columns, got 3: 1,a,b")),
    ('id,text\n1,"a\nb"\n\n2,x\n3,"q\nr",z\n', ("input should be a UTF-8 CSV file: a first line naming the columns, "
                                               "then as many values a row, but got input={path!r}: line 6: CSV parse "
                                               'error: Expected 2 columns, got 3: 3,"q')),  # lines in values, blank
    ("id,text\n1," + "x" * 200_000 + "\n2,a,b\n", ("input should be a UTF-8 CSV file: a first line naming the columns, "
                                                  "then as many values a row, but got input={path!r}: CSV parse error: "
                                                  "Expected 2 columns, got 3: 2,a,b")),  # past csv's field size limit
])
def test_an_empty_or_ragged_csv_is_refused_naming_the_file(tmp_path, content, message):
    path = tmp_path / "docs.csv"
    path.write_text(content)
    with pytest.raises(ValueError) as info:
        len(open_corpus(str(path)))
    assert str(info.value) == message.format(path=str(path))


# pyarrow reads a file in blocks of 1 MiB (and counts a JSONL error's row within its block); these files span two.
_LINES, _BAD = 14_000, 12_001


@pytest.mark.parametrize(("bad", "message"), [
    ('{"id": "x", "text": "no end', r"line 12001, column 21: Unterminated string"),
    ('{"id": "x", "text": 7}', r"line 12001: column /text holds values of kind string on earlier lines and of kind "
                               r"number here"),
    ('["x", "a list"]', r"line 12001: a JSON array where a JSON object should be"),
])
def test_a_malformed_jsonl_line_is_named_by_its_line_in_the_whole_file(tmp_path, bad, message):
    path = tmp_path / "docs.jsonl"
    lines = [f'{{"id": "d{i}", "text": "a text of some words and some more words to fill the blocks, line {i + 1}"}}'
             for i in range(_LINES)]
    lines[_BAD - 1] = bad
    path.write_text("\n".join(lines) + "\n")
    assert path.stat().st_size > 2**20
    with pytest.raises(ValueError, match=rf"^input should be a JSONL file \(one JSON object a line\), but got "
                                         rf"input='.*docs.jsonl': {message}"):
        open_corpus(str(path))


@pytest.mark.parametrize("fmt", ["csv", "tsv"])
def test_a_ragged_row_past_the_first_block_is_named_by_its_line(tmp_path, fmt):
    sep = {"csv": ",", "tsv": "\t"}[fmt]
    path = tmp_path / f"docs.{fmt}"
    rows = [f"d{i}{sep}a text of some words and some more words to fill the blocks; row {i}" for i in range(_LINES)]
    rows[_BAD - 2] = sep.join(["x", "y", "z"])  # line 12,001: the header is line 1
    path.write_text(f"id{sep}text\n" + "\n".join(rows) + "\n")
    assert path.stat().st_size > 2**20
    with pytest.raises(ValueError, match=rf"but got input='.*docs.{fmt}': line {_BAD}: CSV parse error: Expected 2 "
                                         r"columns, got 3"):
        len(open_corpus(str(path)))


def test_an_unknown_suffix_is_refused_naming_the_formats_and_format_text_reads_lines(tmp_path):
    path = tmp_path / "docs.dat"
    path.write_text("id,text\n1,hello world\n")
    with pytest.raises(ValueError, match=r"input should be a file whose suffix names its format, or given --format "
                                         r"parquet, csv, tsv, jsonl, arrow, text \(one document a line\) or datasets; "
                                         r"suffixes \.parquet, \.csv, .*\.txt \(a CSV, TSV, JSONL or text file's "
                                         r"followed by \.gz, \.bz2, \.zst, \.lz4 where it is compressed\), but got "
                                         r"input="):
        open_corpus(str(path))
    lines = open_corpus(str(path), "text")
    assert len(lines) == 2 and lines.texts("text").take([0]) == ["id,text"]
    assert open_corpus(str(tmp_path / "docs.dat"), "csv").texts("text").take([0]) == ["hello world"]


def test_a_folder_of_two_formats_is_refused(tmp_path):
    pq.write_table(pa.table({"text": ["a"]}), tmp_path / "a.parquet")
    (tmp_path / "b.csv").write_text("text\nb\n")
    with pytest.raises(ValueError, match=r"input should be a folder of files of one format \(it holds csv and parquet "
                                         r"files: pass --format\)"):
        open_corpus(str(tmp_path))
    assert len(open_corpus(str(tmp_path), "parquet")) == 1


def test_a_corpus_folder_never_reads_the_output_folder_inside_it(tmp_path):
    data = tmp_path / "data"
    (data / "emb").mkdir(parents=True)
    pq.write_table(pa.table({"id": [1, 2], "text": ["a", "b"]}), data / "part-0.parquet")
    pq.write_table(pa.table({"id": [9], "output": [[0.5]]}), data / "emb" / "part-x.parquet")  # a store's shard
    for exclude in (data / "emb", tmp_path / "." / "data" / "emb"):
        corpus = open_corpus(str(data), exclude=str(exclude))
        assert corpus.files == [str(data / "part-0.parquet")] and len(corpus) == 2
    glob = open_corpus(str(data / "**" / "*.parquet"), exclude=str(data / "emb"))
    assert glob.files == [str(data / "part-0.parquet")]
    with pytest.raises(ValueError, match="outside the output folder"):
        open_corpus(str(data), exclude=str(data))


def test_a_file_lacking_the_text_column_is_named(tmp_path):
    pq.write_table(pa.table({"id": [1], "text": ["a"]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"id": [2]}), tmp_path / "b.parquet")
    corpus = open_corpus(str(tmp_path))
    with pytest.raises(ValueError) as info:
        corpus.require("--text-column", "text", ("string",))
    assert str(info.value) == (f"--text-column should be a column of every file of the input "
                               f"({str(tmp_path / 'b.parquet')!r} lacks it; its columns: ['id']), but got "
                               "--text-column='text'")


def test_a_folder_or_glob_of_jsonl_or_text_files_is_refused_saying_such_an_input_is_one_file(tmp_path):
    # the folder was refused "(or pass --format)", and with --format jsonl as "an existing file, folder or glob",
    # though it exists: neither said that a JSONL, Arrow or text input is one file
    (tmp_path / "a.jsonl").write_text('{"text": "a"}\n')
    (tmp_path / "b.txt").write_text("b\n")
    with pytest.raises(ValueError, match=r"^input should be a folder holding \.parquet, \.csv or \.tsv files \(it "
                                         r"holds jsonl and text files: a JSONL, Arrow or text input is one file, named "
                                         r"as it is\), but got input="):
        open_corpus(str(tmp_path))
    for path, fmt in [(tmp_path, "jsonl"), (tmp_path / "*.jsonl", "jsonl"), (tmp_path / "*.txt", "text")]:
        with pytest.raises(ValueError, match=rf"^input should be one file in format '{fmt}' \(a folder or a glob holds "
                                             r"Parquet, CSV or TSV files\), but got input="):
            open_corpus(str(path), fmt)
    assert open_corpus(str(tmp_path / "a.jsonl"), "jsonl").texts("text").take([0]) == ["a"]
