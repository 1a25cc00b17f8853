"""TextSource and read_texts: texts by position from lists, Arrow, datasets, Parquet files and iterators (every other
format of files: tests/data/test_corpus.py)."""

import unicodedata

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dynabatch import read_texts
from dynabatch.data.text_source import TextSource, is_text_source, source_of

TEXTS = ["In the beginning", "", "And God said, Let there be light", "é€"]


def _same(source: TextSource) -> None:
    assert len(source) == len(TEXTS)
    assert source.char_lengths().tolist() == [len(t) for t in TEXTS]
    assert source.take([3, 0, 2]) == [TEXTS[3], TEXTS[0], TEXTS[2]]
    assert source.bad().tolist() == []


def test_every_kind_of_source_gives_the_same_texts(tmp_path):
    import datasets

    pq.write_table(pa.table({"text": TEXTS[:2]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"text": TEXTS[2:], "n": [1, 2]}), tmp_path / "b.parquet")
    _same(TextSource(TEXTS))
    _same(read_texts(pa.array(TEXTS)))
    _same(read_texts(pa.table({"body": TEXTS}), column="body"))
    _same(read_texts(datasets.Dataset.from_dict({"text": TEXTS})))
    _same(read_texts(tmp_path))  # a directory of Parquet files, in name order
    _same(read_texts([tmp_path / "a.parquet", tmp_path / "b.parquet"]))
    _same(read_texts(str(tmp_path / "*.parquet")))
    _same(read_texts(iter(TEXTS), chunk_size=3))  # an iterator, read 3 texts at a time


def test_a_dataset_view_gives_its_own_rows_in_its_order():
    import datasets

    view = datasets.Dataset.from_dict({"text": TEXTS}).select([2, 0])
    assert read_texts(view).take([0, 1]) == [TEXTS[2], TEXTS[0]]


def test_a_spilled_source_removes_its_file_when_closed():
    source = read_texts(iter(TEXTS))
    folder = source._spill
    source.close()
    import os

    assert not os.path.exists(folder)


def test_bad_items_are_positions_and_take_gives_empty_strings():
    source = read_texts(pa.array(["a", None, "b"]))
    assert source.bad().tolist() == [1] and source.take([1, 2]) == ["", "b"]
    assert TextSource(["a", None, float("nan")]).bad().tolist() == [1, 2]


def test_what_streams():
    assert is_text_source(iter(TEXTS)) and is_text_source(pa.array(TEXTS)) and is_text_source(TextSource(TEXTS))
    assert not is_text_source(TEXTS) and not is_text_source(tuple(TEXTS))


@pytest.mark.parametrize(
    ("source", "kwargs", "error", "match"),
    [
        (pa.table({"text": ["a"]}), {"column": "body"}, ValueError,
         r"^column should be a column of the table \['text'\], but got column='body'$"),
        (pa.array([1, 2]), {}, TypeError, r"^source should be an Arrow array of strings \(it holds Arrow type int64\)"),
        (iter(["a", 3]), {}, TypeError,
         r"^texts\[1\] should be a str \(or None, a bad input\), but got texts\[1\]=3 of type int$"),
        (iter([]), {}, ValueError, r"^source should hold at least one text, but got an iterable that yielded none "
                                   r"\(an iterator or generator yields its texts once"),
        ("missing.parquet", {}, ValueError, r"^source should be an existing file, folder or glob, but got "
                                            r"source='missing.parquet'$"),
        (["missing.parquet"], {}, ValueError, r"^source should be existing Parquet files"),
        (42, {}, TypeError, r"^source should be Parquet paths, a datasets.Dataset"),
        (["a"], {"column": 1}, TypeError, r"^column should be a str naming the text column"),
    ],
)
def test_bad_sources_are_refused(source, kwargs, error, match):
    with pytest.raises(error, match=match):
        read_texts(source, **kwargs)


def test_parquet_column_of_numbers_is_refused(tmp_path):
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "n.parquet")
    with pytest.raises(ValueError, match=r"^column should be a column of string values \(the input's 'text' holds "
                                         r"int64\), but got column='text'$"):
        read_texts(tmp_path / "n.parquet")
    with pytest.raises(TypeError, match=r"^column should be a column of strings \(in n.parquet it is int64\)"):
        read_texts([tmp_path / "n.parquet"])


def test_a_dataset_column_of_labels_lists_or_bytes_is_refused_naming_the_column_and_its_type():
    # "source should be an Arrow array of strings, but got source=<ChunkedArray of 2 items>": neither named
    import datasets

    features = datasets.Features({"label": datasets.ClassLabel(names=["no", "yes"]),
                                  "tags": datasets.Sequence(datasets.Value("string")), "raw": datasets.Value("binary")})
    dataset = datasets.Dataset.from_dict({"label": [0, 1], "tags": [["a"], ["b"]], "raw": [b"a", b"b"]},
                                         features=features)
    for column, feature in (("label", r"ClassLabel\(names=\['no', 'yes'\]\), Arrow type int64"),
                            ("tags", r"(List|Sequence)\(.*\), Arrow type list<item: string>"),
                            ("raw", r"Value\('binary'\), Arrow type binary")):
        with pytest.raises(TypeError, match=rf"^column should be a column of strings \(the dataset's column "
                                            rf"'{column}' holds {feature}\), but got column='{column}'"):
            read_texts(dataset, column)
    with pytest.raises(TypeError, match=r"^column should be a column of strings \(the table's column 'n' holds Arrow "
                                        r"type int64\), but got column='n'"):
        read_texts(pa.table({"n": [1, 2]}), "n")


def test_no_token_candidates_are_the_texts_of_droppable_characters_alone_in_every_kind_of_source():
    # whitespace, controls, zero-width (format), combining marks, private use, U+FFFD: a normalizer may drop each
    dropped = ["", " \t", "\u200b", "\ufeff\x01", "\u0301\u00a0", "\ue000\u3000", "\ufffd\u2028"]
    texts = ["a", *dropped, None, "b ", "e\u0301", "\u200bx", ""]
    for source in (TextSource(texts), source_of(iter(texts)), source_of(pa.array(texts, pa.large_string()))):
        positions, distinct, which = source.no_token_candidates()
        assert positions.tolist() == [*range(1, 8), 12] and [distinct[k] for k in which] == [*dropped, ""]
        assert sorted(distinct) == sorted(dropped)


def test_a_list_and_an_arrow_array_of_one_character_each_have_the_same_candidates():
    # one rule, two engines (Python's Unicode tables for lists, RE2's for Arrow): they may differ only where one
    # Unicode version has assigned a code point the other's does not know (a few dozen), never by a category
    chars = [chr(c) for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF]
    listed = TextSource(chars).no_token_candidates()[0]
    arrow = source_of(pa.array(chars)).no_token_candidates()[0]
    differ = [chars[i] for i in set(listed.tolist()) ^ set(arrow.tolist())]
    assert len(differ) < 200 and all(unicodedata.category(c) == "Cn" for c in differ), len(differ)


def _not_utf8(texts):
    """A string array whose bytes are ``texts``' as given (Arrow does not check them when a file is read)."""
    raw = pa.array(texts, pa.binary())
    return pa.Array.from_buffers(pa.string(), len(raw), raw.buffers())


def test_bytes_that_are_not_utf8_are_refused_naming_the_row_in_every_kind_of_arrow_source(tmp_path):
    from dynabatch.data.text_source import source_of

    strings = _not_utf8([b"In the beginning", b"God", b"\xff\xfe created", b"the heaven"])
    pq.write_table(pa.table({"text": strings}), tmp_path / "a.parquet")
    with pytest.raises(ValueError, match=r"^texts should be UTF-8 text, but got a.parquet's column 'text' holding "
                       r"bytes that are not UTF-8 at row 2 \(invalid start byte at byte 0: b'\\xff\\xfe created'\)"):
        source_of(tmp_path / "a.parquet", chunk_size=2)  # row 2: the second record batch's first
    for arrow in (strings, pa.chunked_array([strings[:1], strings[1:]]), pa.table({"text": strings})):
        with pytest.raises(ValueError, match=r"^texts should be UTF-8 text, but got the texts holding bytes that are "
                           r"not UTF-8 at row 2 "):
            source_of(arrow).char_lengths()  # an Arrow array, a chunked one, a table's column, read in place
    assert source_of(_not_utf8([b"caf\xc3\xa9", b"ok"])).char_lengths().tolist() == [4, 2]  # UTF-8: as before


def test_a_spilled_source_hands_its_pages_back_after_each_record_batch_read():
    # A read maps the file's cached pages around it (64 KB), so rows scattered over a whole file would map most of it
    # before one hand-back at the end: the resident memory of a take would grow with the corpus.
    class Map:
        def __init__(self, mapped):
            self.mapped, self.calls = mapped, 0

        def madvise(self, option):
            self.calls += 1
            self.mapped.madvise(option)

    source = read_texts(iter([f"text {i}" for i in range(100)]), chunk_size=10)  # ten record batches
    source._map = spy = Map(source._map)
    assert source.take([95, 5, 55, 6]) == ["text 95", "text 5", "text 55", "text 6"]
    assert spy.calls == 3  # once per record batch read
    source.close()


def test_an_iterable_with_a_lone_surrogate_is_refused_naming_its_position():
    texts = iter(["a", "b", "c \ud800 d"])  # pyarrow's bare UnicodeEncodeError named neither text nor position
    with pytest.raises(ValueError, match=r"^texts\[2\] should be text that encodes as UTF-8, .* which pyarrow refused"):
        source_of(texts, chunk_size=2)


def test_a_pandas_frame_gives_its_columns_texts_not_its_column_names():
    # iterated as "any iterable of str", a DataFrame gave its column names: read_texts(frame) was ['id', 'text']
    import pandas as pd

    frame = pd.DataFrame({"id": [7, 3, 5], "text": ["In the beginning", None, "God"]})
    source = read_texts(frame)
    assert len(source) == 3 and source.take([0, 2]) == ["In the beginning", "God"]
    assert source.bad().tolist() == [1]  # a missing text is a bad input, as an Arrow table's null is
    with pytest.raises(ValueError, match=r"^column should be a column of the frame \['id', 'text'\], but got "
                                         r"column='body'$"):
        source_of(frame, "body")
    with pytest.raises(TypeError, match=r"^column should be a column of strings \(the frame's column 'id' holds Arrow "
                                        r"type int64\), but got column='id'"):
        source_of(frame, "id")


def test_a_list_of_texts_given_to_read_texts_is_refused_saying_how_to_pass_texts():
    # a list of str is a list of Parquet paths; the refusal named only paths, not why texts in a list were taken so
    with pytest.raises(ValueError, match=r"^source should be existing Parquet files, directories of them, or globs "
                                         r"\(a list of str names paths: texts go as iter\(texts\)\), but got "
                                         r"source='In the beginning'$"):
        read_texts(["In the beginning", "God"])
    assert read_texts(iter(["In the beginning", "God"])).take([1]) == ["God"]
