"""The one fingerprint (dynabatch/_digest.py): ``row_hashes``, one 64-bit hash per row of a flat store, and
``FileDigests``, every byte of a file, remembered by what ``stat`` says."""

import json
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynabatch import _digest
from dynabatch._digest import FileDigests, row_hashes


def _flat(rows):
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum([len(r) for r in rows], out=offsets[1:])
    return np.concatenate([np.asarray(r, dtype=np.int32) for r in rows] or [np.zeros(0, np.int32)]), offsets


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 50), max_size=6), min_size=1, max_size=20))
def test_equal_rows_hash_equal_and_a_hash_depends_only_on_its_row(rows):
    values, offsets = _flat(rows)
    hashes = row_hashes({"input_ids": values}, offsets)
    for i, row in enumerate(rows):
        alone, alone_offsets = _flat([row])
        assert hashes[i] == row_hashes({"input_ids": alone}, alone_offsets)[0]  # not its position or neighbours
        for j, other in enumerate(rows):
            assert (hashes[i] == hashes[j]) == (row == other)  # no collision among these small rows


def test_order_length_streams_and_their_names_count():
    values, offsets = _flat([[1, 2], [2, 1], [1, 2, 0], [1, 2]])
    hashes = row_hashes({"input_ids": values}, offsets)
    assert len(set(hashes[:3].tolist())) == 3 and hashes[0] == hashes[3]  # order and a trailing 0 count
    extra = np.array([0, 0, 0, 0, 0, 0, 0, 1, 0], dtype=np.int32)  # token_type_ids differ in row 3 only
    both = row_hashes({"input_ids": values, "token_type_ids": extra}, offsets)
    assert both[0] != both[3] and not (both == hashes).any()
    assert (row_hashes({"ids": values}, offsets) != hashes).all()
    empty = row_hashes({"input_ids": np.zeros(0, np.int32)}, np.zeros(3, dtype=np.int64))
    assert empty[0] == empty[1]


def test_a_million_rows_in_chunks_match_rows_hashed_alone():
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 9, size=1_000_000)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = rng.integers(0, 30_000, size=int(offsets[-1]), dtype=np.int32)
    hashes = row_hashes({"input_ids": values}, offsets)  # several chunks of about a million values
    for i in (0, 123_456, 999_999):
        alone = row_hashes({"input_ids": values[offsets[i]:offsets[i + 1]]}, np.array([0, lengths[i]]))
        assert hashes[i] == alone[0]


_OLD_SAMPLED = 16 * 64 * 1024  # the earlier identity read 16 blocks of 64 KiB of a file larger than this


def _settled(path, seconds_ago=60):
    """``path``'s modification time set in the past: a file modified just now is not remembered."""
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns - seconds_ago * 1_000_000_000))


@pytest.fixture()
def weights(tmp_path):
    """A 'weights' file of 3 MB, larger than what the earlier identity sampled, settled."""
    path = tmp_path / "model.safetensors"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 3_000_000, dtype=np.uint8).tobytes())
    assert path.stat().st_size > _OLD_SAMPLED
    _settled(path)
    return path


def test_one_byte_changed_anywhere_changes_the_digest_and_pieces_on_any_cores_agree(weights, tmp_path, monkeypatch):
    monkeypatch.setattr(_digest, "_PIECE", 256 * 1024)  # 12 pieces: every lane and the last, short piece
    before = FileDigests(None).digest(weights)
    assert {FileDigests(None, cores=c).digest(weights) for c in (2, 3, 16)} == {before}
    data = bytearray(weights.read_bytes())
    for where in (0, 1_234_567, len(data) // 2, len(data) - 1):  # the middle lies between the old sampled blocks
        data[where] ^= 1
        weights.write_bytes(bytes(data))
        assert FileDigests(None, cores=3).digest(weights) != before
        data[where] ^= 1
    weights.write_bytes(bytes(data))
    assert FileDigests(None, cores=3).digest(weights) == before
    weights.write_bytes(bytes(data) + b"\x00")
    assert FileDigests(None).digest(weights) != before


def test_a_rerun_reads_no_byte_of_an_unchanged_file_and_any_change_of_size_or_times_reads_it_again(weights,
                                                                                                     tmp_path):
    cache = tmp_path / "cache" / "file-digests.json"
    first = FileDigests(cache)
    digest = first.digest(weights)
    first.save()
    again = FileDigests(cache)
    assert again.digest(weights) == digest and again.hashed_bytes == 0  # a hit: nothing read
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 1  # same size
    weights.write_bytes(bytes(data))
    _settled(weights, 30)  # a change of the times alone is enough
    changed = FileDigests(cache)
    same_size = changed.digest(weights)
    assert same_size != digest and changed.hashed_bytes == len(data)
    changed.save()
    weights.write_bytes(bytes(data[:-1]))  # the size
    _settled(weights, 30)
    assert FileDigests(cache).digest(weights) not in (digest, same_size)
    moved = tmp_path / "moved.safetensors"
    os.replace(weights, moved)  # another path: hashed again, the same bytes the same digest
    assert FileDigests(cache).digest(moved) == FileDigests(None).digest(moved)


def test_a_file_modified_just_now_is_not_remembered(tmp_path):
    path, cache = tmp_path / "config.json", tmp_path / "cache.json"
    path.write_text("{}")
    files = FileDigests(cache)
    files.digest(path)
    files.save()
    later = FileDigests(cache)
    later.digest(path)
    assert later.hashed_bytes == 2


@pytest.mark.parametrize("content", [b"not json", b"[1, 2]", b'{"format": 1, "files": {"x": 3}}', b"\xff\xfe",
                                     b'{"format": 99, "files": {}}'])
def test_a_damaged_cache_is_ignored_and_rewritten(weights, tmp_path, content):
    cache = tmp_path / "cache.json"
    cache.write_bytes(content)
    files = FileDigests(cache)
    digest = files.digest(weights)
    assert digest == FileDigests(None).digest(weights) and files.hashed_bytes == weights.stat().st_size
    files.save()
    assert json.loads(cache.read_text())["format"] == 1 and FileDigests(cache).digest(weights) == digest


def test_a_cache_that_cannot_be_written_or_read_only_costs_time(weights, tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    files = FileDigests(blocked / "cache.json")  # under a file: neither read nor written
    digest = files.digest(weights)
    files.save()
    assert digest == FileDigests(None).digest(weights) and not (blocked / "cache.json").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_a_second_process_after_the_same_files_waits_for_the_first_then_reads_none_of_their_bytes(weights, tmp_path):
    import threading

    cache, second = tmp_path / "cache.json", []
    with FileDigests(cache).held() as first:  # the lock is per open file: a thread stands for another process

        def after() -> None:
            with FileDigests(cache).held() as files:
                second.append((files.digest(weights), files.hashed_bytes))

        waiting = threading.Thread(target=after)
        waiting.start()
        waiting.join(0.5)
        assert waiting.is_alive() and not second  # it waits for the holder
        digest = first.digest(weights)
    waiting.join(30)
    assert second == [(digest, 0)]


def test_a_holder_stuck_past_the_wait_costs_the_waiter_its_own_hashing_only(weights, tmp_path, monkeypatch):
    import threading

    monkeypatch.setattr(_digest, "_LOCK_WAIT", 0.3)
    cache, second = tmp_path / "cache.json", []
    with FileDigests(cache).held():  # holds the lock and never hashes in time

        def after() -> None:
            with FileDigests(cache).held() as files:
                second.append((files.digest(weights), files.hashed_bytes))

        waiting = threading.Thread(target=after)
        waiting.start()
        waiting.join(30)
    assert second == [(FileDigests(None).digest(weights), weights.stat().st_size)]
