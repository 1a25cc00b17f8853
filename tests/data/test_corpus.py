"""The format layer: ``dynabatch.read_texts`` reads every format the command line reads (CSV, TSV, JSONL, Arrow, text
lines, Parquet, a ``datasets`` folder), into Arrow (never one Python str a text), with the command's refusals naming
the library's arguments (the flags' naming: tests/cli/test_corpus.py)."""

from __future__ import annotations

import csv
import json
import os

import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest

from dynabatch import read_texts
from dynabatch.data.corpus import FORMATS, SUFFIXES, open_corpus

TEXTS = ["In the beginning", "", "And God said, \"Let there be light\"", "é€"]


def _write(folder, kind):
    """``TEXTS`` (with ids) in format ``kind``: the path to read and the format to pass (``auto``: the suffix)."""
    ids = [f"d{i}" for i in range(len(TEXTS))]
    table = pa.table({"id": ids, "text": TEXTS})
    if kind in ("csv", "tsv"):
        path = folder / f"docs.{kind}"
        with open(path, "w", newline="", encoding="utf-8") as out:
            writer = csv.writer(out, delimiter="," if kind == "csv" else "\t")
            writer.writerows([["id", "text"], *zip(ids, TEXTS)])
    elif kind == "jsonl":
        path = folder / "docs.jsonl"
        path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in zip(ids, TEXTS)))
    elif kind == "arrow":
        path = folder / "docs.feather"
        feather.write_feather(table, path)
    elif kind == "text":
        path = folder / "docs.txt"
        path.write_text("".join(t + "\n" for t in TEXTS), encoding="utf-8")
    elif kind == "parquet":
        path = folder / "parquet"
        path.mkdir()
        pq.write_table(table.slice(0, 2), path / "a.parquet")
        pq.write_table(table.slice(2), path / "b.parquet")
    else:
        import datasets

        path = folder / "saved"
        datasets.Dataset(table).save_to_disk(str(path))
    return path


@pytest.mark.parametrize("kind", [f for f in FORMATS if f != "auto"])
def test_every_format_the_command_line_reads_gives_the_same_texts_in_arrow(tmp_path, kind):
    path = _write(tmp_path, kind)
    source = read_texts(path)
    assert source.take(range(len(TEXTS))) == TEXTS
    assert source.char_lengths().tolist() == [len(t) for t in TEXTS]
    assert source.items is None  # Arrow, never a Python str a text
    assert read_texts(str(path), format=kind).take([2]) == [TEXTS[2]]  # the format named, the same texts
    if kind != "text":
        assert open_corpus(path).ids("id").to_pylist() == [f"d{i}" for i in range(len(TEXTS))]


def test_an_arrow_stream_file_is_read_too(tmp_path):
    path = tmp_path / "docs.arrow"
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, pa.schema([("text", pa.string())])) as writer:
        writer.write_table(pa.table({"text": TEXTS}))
    assert read_texts(path).take([0, 3]) == [TEXTS[0], TEXTS[3]]


def test_refusals_name_the_librarys_arguments(tmp_path):
    (tmp_path / "docs.dat").write_text("a text\n")
    with pytest.raises(ValueError, match=r"^source should be a file whose suffix names its format, or given format "
                                         r"parquet, csv, tsv, jsonl, arrow, text \(one document a line\) or datasets; "
                                         rf"suffixes {', '.join(SUFFIXES)} \(a CSV, TSV, JSONL or text file's "
                                         r"followed by \.gz, \.bz2, \.zst, \.lz4 where it is compressed\), but got "
                                         r"source="):
        read_texts(tmp_path / "docs.dat")
    assert read_texts(tmp_path / "docs.dat", format="text").take([0]) == ["a text"]  # named, never guessed
    with pytest.raises(ValueError, match=r"^format should be one of \("):
        read_texts(tmp_path / "docs.dat", format="xml")
    with pytest.raises(ValueError, match=r"^format should be 'auto' for a source that is not a path"):
        read_texts(["a"], format="csv")
    (tmp_path / "docs.jsonl").write_text('{"text": "a"}\n{"text": null}\n{"body": "c"}\n')
    with pytest.raises(ValueError, match=r"^column should name a column without missing texts, but got "
                                         r"column='text' with 2 missing \(null\) texts, at rows 1, 2: fill or drop"):
        read_texts(tmp_path / "docs.jsonl")
    with pytest.raises(ValueError, match=r"^column should be a column of the input \['body', 'text'\], but got "
                                         r"column='title'$"):
        read_texts(tmp_path / "docs.jsonl", column="title")


def test_a_csv_of_its_header_alone_is_refused_as_an_input_of_no_rows_when_its_ids_are_read_first(tmp_path):
    # its rows are counted when first read: by the ids, the refusal was "id_column='id': source should hold ..."
    (tmp_path / "docs.csv").write_text("id,text\n")
    corpus = open_corpus(tmp_path / "docs.csv")
    with pytest.raises(ValueError, match=r"^source should hold at least one text, but got source='.*docs.csv' with no "
                                         r"rows$"):
        corpus.ids("id")


def test_a_byte_order_mark_is_no_part_of_the_first_text_in_any_format(tmp_path):
    # a text file's first line kept it ('\ufeffIn the beginning'), where pyarrow drops it from a CSV or JSONL file
    bom = "\ufeff".encode()
    (tmp_path / "docs.txt").write_bytes(bom + "In the beginning\nAnd God said\n".encode())
    (tmp_path / "docs.csv").write_bytes(bom + b"text\nIn the beginning\n")
    (tmp_path / "docs.jsonl").write_bytes(bom + b'{"text": "In the beginning"}\n')
    for name in ("docs.txt", "docs.csv", "docs.jsonl"):
        assert read_texts(tmp_path / name).take([0]) == ["In the beginning"], name


def test_an_arrow_file_holding_bytes_that_are_not_utf8_is_refused_naming_its_column_file_and_row(tmp_path):
    raw = pa.array([b"In the beginning", b"\xff\xfe"], pa.binary())
    feather.write_feather(pa.table({"text": pa.Array.from_buffers(pa.string(), 2, raw.buffers())}),
                          tmp_path / "docs.arrow")
    with pytest.raises(ValueError, match=r"^column='text' of source='.*docs.arrow': texts should be UTF-8 text, but "
                                         r"got the texts holding bytes that are not UTF-8 at row 1 "):
        open_corpus(tmp_path / "docs.arrow").texts("text")


def test_a_malformed_jsonl_line_is_named_by_its_line(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "a"}\n{"text": "b"}\n{"text": "no end\n')
    with pytest.raises(ValueError, match=r"^source should be a JSONL file \(one JSON object a line\), but got "
                                         r"source='.*docs.jsonl': line 3, column 10: Unterminated string"):
        read_texts(path)
    # bytes that are not UTF-8 in a string: pyarrow reads them; the texts failed when taken ("'utf-8' codec can't
    # decode byte 0xff in position 0"), naming no file and no line
    path.write_bytes(b'{"text": "a"}\n{"text": "\xff\xfe"}\n')
    with pytest.raises(ValueError, match=r"^source should be a JSONL file \(one JSON object a line\), but got "
                                         r"source='.*docs.jsonl': line 2: not UTF-8 \(invalid start byte at byte "
                                         r"10\)$"):
        open_corpus(path)


def test_a_latin1_csv_is_refused_naming_the_line_and_column_of_its_first_bad_value(tmp_path):
    # pyarrow's "In CSV column #1: CSV conversion error to large_string: invalid UTF8 data" named no line
    path = tmp_path / "docs.csv"
    path.write_bytes('id,text\n1,"two\nlines"\n2,caf\xe9\n'.encode("latin-1"))
    with pytest.raises(ValueError, match=r"^source should be a UTF-8 CSV file: .*, but got source='.*docs.csv': line 4: "
                                         r"column 'text' holds bytes that are not UTF-8 \(b'caf\\xe9'\): save the "
                                         r"file as UTF-8$"):
        read_texts(path)


@pytest.mark.parametrize("name", ["long.csv", "long.tsv", "long.jsonl"])
def test_a_document_longer_than_pyarrows_block_is_read(tmp_path, name):
    # pyarrow parses rows within 1 MiB blocks: a row over two of them was refused, "try to increase block size?"
    long = "In the beginning " * 200_000  # 3.4 MB on one line
    path = tmp_path / name
    if name.endswith(".jsonl"):
        path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(["a", long, "b"])))
    else:
        sep = "\t" if name.endswith(".tsv") else ","
        path.write_text(f"id{sep}text\n0{sep}a\n1{sep}{long}\n2{sep}b\n")
    texts = read_texts(str(path))
    assert len(texts) == 3 and texts.take([0, 1, 2]) == ["a", long, "b"]


def test_a_column_named_twice_in_a_file_is_refused_naming_the_file(tmp_path):
    # a CSV or Parquet file with two columns of one name failed with pyarrow's KeyError (the texts) or its "Multiple
    # matches for FieldRef" (the ids)
    (tmp_path / "twice.csv").write_text("id,text,id\n1,a,2\n")
    pq.write_table(pa.Table.from_arrays([pa.array(["a"]), pa.array(["b"])], names=["text", "text"]),
                   tmp_path / "twice.parquet")
    with pytest.raises(ValueError, match=r"^column should be a column named once in every file of the input \('.*twi"
                       r"ce.parquet' has 2 named so; its columns: \['text', 'text'\]\): rename all but one, but got "
                       r"column='text'$"):
        read_texts(str(tmp_path / "twice.parquet"))
    corpus = open_corpus(str(tmp_path / "twice.csv"))
    assert corpus.texts("text").take([0]) == ["a"]  # the other column named twice is not read
    with pytest.raises(ValueError, match=r"^id_column should be a column named once in every file .* \['id', 'text', "
                       r"'id'\]\): rename all but one, but got id_column='id'$"):
        corpus.ids("id")


def test_a_column_named_twice_in_an_arrow_file_is_refused_naming_the_file(tmp_path):
    # an Arrow IPC file's columns were not checked so: its texts failed with pyarrow's bare KeyError 'Field "text"
    # exists 2 times in schema', naming neither the argument nor the file
    table = pa.Table.from_arrays([pa.array(["a"]), pa.array([1]), pa.array(["b"])], names=["text", "id", "text"])
    feather.write_feather(table, tmp_path / "twice.feather")
    with pytest.raises(ValueError, match=r"^column should be a column named once in every file of the input \('.*twi"
                       r"ce.feather' has 2 named so; its columns: \['text', 'id', 'text'\]\): rename all but one, "
                       r"but got column='text'$"):
        read_texts(tmp_path / "twice.feather")
    assert open_corpus(tmp_path / "twice.feather").ids("id").to_pylist() == [1]  # the column named once is read


def test_a_compressed_csv_tsv_jsonl_or_text_file_is_read_as_its_suffixes_say(tmp_path):
    # docs.csv.gz was refused as a file whose suffix names no format (though format="csv" read it: pyarrow decompresses
    # by the suffix), a folder of them as holding no CSV files, and format="text" read the compressed bytes as UTF-8
    import bz2
    import gzip

    (tmp_path / "docs.csv.gz").write_bytes(gzip.compress(b"\xef\xbb\xbfid,text\r\n1,A\r\n2,\"B\nb\"\r\n"))
    (tmp_path / "docs.jsonl.bz2").write_bytes(bz2.compress(b'{"text": "A"}\n\n{"text": "B"}\n'))
    (tmp_path / "docs.txt.zst").write_bytes(pa.compress(b"\xef\xbb\xbfA\r\n\nB\n", "zstd", asbytes=True))
    assert read_texts(tmp_path / "docs.csv.gz").take([0, 1]) == ["A", "B\nb"]
    assert read_texts(tmp_path / "docs.jsonl.bz2").take([0, 1]) == ["A", "B"]
    assert read_texts(tmp_path / "docs.txt.zst").take([0, 1, 2]) == ["A", "", "B"]
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "1.csv.gz").write_bytes(gzip.compress(b"text\nA\n"))
    (folder / "2.csv").write_text("text\nB\n")
    assert read_texts(folder).take([0, 1]) == ["A", "B"]
    # the line of a fault is counted in the decompressed file; an empty one is a file of no rows
    (tmp_path / "bad.jsonl.gz").write_bytes(gzip.compress(b'{"text": "A"}\n{"text": "B"}\n{"text":\n'))
    with pytest.raises(ValueError, match=r"source='.*bad.jsonl.gz': line 3, column 9: Expecting value$"):
        read_texts(tmp_path / "bad.jsonl.gz")
    (tmp_path / "ragged.tsv.gz").write_bytes(gzip.compress(b"text\tid\nA\t1\nB\n"))
    with pytest.raises(ValueError, match=r"source='.*ragged.tsv.gz': line 3: CSV parse error: Expected 2 columns"):
        read_texts(tmp_path / "ragged.tsv.gz")
    (tmp_path / "empty.txt.gz").write_bytes(gzip.compress(b""))
    with pytest.raises(ValueError, match=r"^source should hold at least one text, but got source='.*empty.txt.gz' "
                                         r"with no rows$"):
        read_texts(tmp_path / "empty.txt.gz")
    (tmp_path / "docs.parquet.gz").write_bytes(gzip.compress(b"PAR1"))
    with pytest.raises(ValueError, match=r"a CSV, TSV, JSONL or text file's followed by \.gz, \.bz2, \.zst, \.lz4 "
                                         r"where it is compressed\), but got source='.*docs.parquet.gz'$"):
        read_texts(tmp_path / "docs.parquet.gz")


def test_a_column_name_that_is_not_utf8_is_refused_naming_the_file_and_line(tmp_path):
    # pyarrow decodes a CSV's first line, or a JSONL file's keys, only when its schema's names are asked for: the
    # bare UnicodeDecodeError raised there named neither the argument, the file nor its line
    (tmp_path / "latin.csv").write_bytes("café,text\n1,a\n".encode("latin-1"))
    (tmp_path / "latin.jsonl").write_bytes('{"café": 1, "text": "a"}\n'.encode("latin-1"))
    (tmp_path / "short.csv").write_bytes("text\na\n".encode("utf-16"))  # too short for a ragged row
    with pytest.raises(ValueError, match=r"^source should be a UTF-8 CSV file: .* but got source='.*latin.csv': line "
                                         r"1: a column name holds bytes that are not UTF-8 \(b'caf\\xe9'\): save the "
                                         r"file as UTF-8$"):
        read_texts(tmp_path / "latin.csv")
    with pytest.raises(ValueError, match=r"^source should be a JSONL file .* but got source='.*latin.jsonl': line 1: "
                                         r"not UTF-8 \(invalid continuation byte at byte 5\)$"):
        read_texts(tmp_path / "latin.jsonl")
    with pytest.raises(ValueError, match=r"source='.*short.csv': UTF-16 text \(it starts with a UTF-16 byte order "
                                         r"mark\), not UTF-8: save it as UTF-8$"):
        read_texts(tmp_path / "short.csv")


@pytest.mark.parametrize("name", ["docs.csv", "docs.tsv", "docs.csv.gz"])
def test_a_quoted_value_never_closed_is_refused_naming_its_line_not_read_with_the_rows_after_it(tmp_path, name):
    # pyarrow (as Python's csv) read the open value to the file's end: rows 3 and 4 were silently one text of row 2
    import gzip

    sep = "\t" if ".tsv" in name else ","
    body = f'id{sep}text\r\n1{sep}"quoted, ""twice""\nover two lines"\r\n2{sep}"Let there be\r\n3{sep}C\r\n4{sep}D\r\n'
    path = tmp_path / name
    path.write_bytes(gzip.compress(body.encode()) if name.endswith(".gz") else body.encode())
    with pytest.raises(ValueError, match=rf"^source should be a UTF-8 {name[5:8].upper()} file: .*, but got "
                                         rf"source='.*{name}': line 4: a quoted value starts here and is never "
                                         r'closed, so the rest of the file would be read into it: close it with a ", '
                                         r'or double a " inside a value \(""\)$'):
        read_texts(path)
    # a quote inside an unquoted value is a character of it, as pyarrow and Python's csv read it: no open value
    path.write_bytes(f'id{sep}text\n1{sep}5" tall\n2{sep}"a\nb"\n'.encode())
    path = path.rename(tmp_path / name.removesuffix(".gz"))
    assert open_corpus(path).texts("text").take([0, 1]) == ['5" tall', "a\nb"]


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="counts the bytes read by /proc/self/io")
@pytest.mark.parametrize("name", ["docs.csv", "docs.csv.gz"])
def test_a_csv_file_is_read_once_to_convert_it_and_check_its_quotes(tmp_path, name):
    # the check for a quoted value never closed counted the quotes in a second read of the whole file (a compressed
    # one decompressed again); the pass that converts it counts them
    import gzip

    # a wide column the job does not read: the converted file (read back for the texts) is small beside the CSV
    body = "other,text\n" + "".join(f'"a ""quoted"" value, {i}",t\n' for i in range(100_000))
    path = tmp_path / name
    path.write_bytes(gzip.compress(body.encode()) if name.endswith(".gz") else body.encode())
    (tmp_path / "warm.csv").write_text("other,text\n1,t\n")
    read_texts(tmp_path / "warm.csv")  # the modules a first conversion imports, read before counting
    corpus = open_corpus(path, keep=["text"])
    before = _bytes_read()
    texts = corpus.texts("text")
    read = _bytes_read() - before
    assert len(texts) == 100_000 and texts.take([7]) == ["t"]
    assert path.stat().st_size <= read < 1.5 * path.stat().st_size


def _bytes_read() -> int:
    with open("/proc/self/io") as io:
        return int(next(line for line in io if line.startswith("rchar:")).split()[1])


@pytest.mark.parametrize("name, encoding", [("excel.tsv", "utf-16"), ("docs.csv", "utf-16-le"), ("docs.jsonl", "utf-16"),
                                            ("docs.txt", "utf-32")])
def test_a_utf16_or_utf32_file_is_refused_as_not_utf8(tmp_path, name, encoding):
    # Excel's "Unicode text" is UTF-16 TSV: its refusal blamed "line 3: CSV parse error: Expected 2 columns, got 1"
    body = {".tsv": "id\ttext\n1\thello\n", ".csv": "id,text\n1,hello\n", ".jsonl": '{"text": "hello"}\n',
            ".txt": "hello\n"}[(tmp_path / name).suffix]
    (tmp_path / name).write_bytes(body.encode(encoding))
    wide = "UTF-16" if encoding.startswith("utf-16") else "UTF-32"
    mark = "a NUL in every other byte" if encoding.endswith("-le") else f"it starts with a {wide} byte order mark"
    with pytest.raises(ValueError, match=rf"got source='.*{name}': {wide} text \({mark}\), not UTF-8: save it as "
                       r"UTF-8$"):
        read_texts(str(tmp_path / name))


def test_string_views_and_dictionaries_of_strings_are_texts_and_ids(tmp_path):
    # polars writes its strings to Arrow files as string_view, pandas its categoricals to Parquet as dictionaries:
    # both were refused, "column should be a column of string values (the input's 'text' holds string_view)"
    from dynabatch.data.ids import check_ids
    from dynabatch.data.text_source import source_of

    feather.write_feather(pa.table({"text": pa.array(["a b", "c"], pa.string_view())}), tmp_path / "views.arrow")
    categorical = pa.table({"id": pa.array(["x", "y", "z"]).dictionary_encode(),
                            "text": pa.array(["a b", "a b", "c"]).dictionary_encode()})
    pq.write_table(categorical, tmp_path / "cat.parquet")
    assert read_texts(str(tmp_path / "views.arrow")).take([0, 1]) == ["a b", "c"]
    corpus = open_corpus(str(tmp_path / "cat.parquet"))
    assert corpus.texts("text").take([0, 1, 2]) == ["a b", "a b", "c"] and corpus.ids("id").to_pylist() == ["x", "y", "z"]
    view = source_of(pa.array(["de", None], pa.string_view()))
    assert view.char_lengths().tolist() == [2, -1] and view.bad().tolist() == [1]
    assert check_ids(pa.array([7, 3]).dictionary_encode(), 2).type == pa.int64()


def test_jsonl_strings_that_look_like_dates_are_read_as_the_strings_written(tmp_path):
    # pyarrow's JSON reader took such a column for timestamp[s]: the texts and ids were refused as "holds
    # timestamp[s]" and a chat message's content came back a datetime
    path = tmp_path / "docs.jsonl"
    rows = [{"id": "2024-01-01T10:00:00Z", "text": "2024-01-01",
             "messages": [{"role": "user", "content": "2024-01-02 10:00"}]},
            {"id": "2024-01-02T10:00:00Z", "text": "2024-03-04",
             "messages": [{"role": "user", "content": "1999-12-31"}]}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert read_texts(path).take([0, 1]) == ["2024-01-01", "2024-03-04"]
    corpus = open_corpus(path)
    assert corpus.ids("id").to_pylist() == ["2024-01-01T10:00:00Z", "2024-01-02T10:00:00Z"]
    assert corpus.values("messages", "messages") == [row["messages"] for row in rows]


def test_blank_lines_are_no_rows_of_a_csv_or_jsonl_file_and_empty_documents_of_a_text_file(tmp_path):
    # the rule the docs state, the same as Python's csv (and pandas) and json.loads line by line read them
    (tmp_path / "docs.csv").write_text('text\na\n\n""\n  \nb\n')
    (tmp_path / "docs.jsonl").write_text('{"text": "a"}\n\n  \n{"text": ""}\n')
    (tmp_path / "docs.txt").write_text("a\n\n  \nb\n")
    assert read_texts(tmp_path / "docs.csv").take(range(4)) == ["a", "", "  ", "b"]
    assert len(read_texts(tmp_path / "docs.jsonl")) == 2
    assert read_texts(tmp_path / "docs.txt").take(range(4)) == ["a", "", "  ", "b"]
