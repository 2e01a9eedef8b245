"""The disk store on real files: bytes back as written, files replaced atomically and removed,
failures answered with their cause (never raised), and framing that refuses wrong bytes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from server.objects import ObjectKey
from server.tiers.base import LowerTierStore
from server.tiers.disk import DiskStore
from server.tiers.framing import frame, store_key, unframe
from testbed.core.keys import ChunkHash

KEY = ChunkHash(b"k" * 16)


@pytest.mark.parametrize("direct_io", [False, True])
def test_bytes_come_back_as_written_and_go_with_remove(tmp_path: Path, direct_io: bool) -> None:
    store = DiskStore(tmp_path / "tier", 1 << 20, direct_io=direct_io, fsync=True)
    assert isinstance(store, LowerTierStore)
    data = os.urandom(5000)
    assert store.write(KEY, data)
    assert store.contains(KEY) and store.used_bytes() == 5000
    assert store.read(KEY) == data
    assert [p.name for p in (tmp_path / "tier").iterdir()] == [KEY.hex() + ".kv"]
    store.remove(KEY)
    assert store.read(KEY) is None and store.used_bytes() == 0
    assert list((tmp_path / "tier").iterdir()) == []


def test_a_file_gone_behind_the_store_is_an_io_error_not_an_exception(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, 1 << 20)
    assert store.write(KEY, b"x" * 100)
    (tmp_path / (KEY.hex() + ".kv")).unlink()
    assert store.read(KEY) is None and store.last_failure == "io_error"


def test_a_truncated_file_is_corrupt(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, 1 << 20)
    assert store.write(KEY, b"x" * 100)
    (tmp_path / (KEY.hex() + ".kv")).write_bytes(b"x" * 10)
    assert store.read(KEY) is None and store.last_failure == "corrupt"


def test_a_write_that_cannot_land_fails_with_its_cause(tmp_path: Path) -> None:
    store = DiskStore(tmp_path / "tier", 1 << 20)
    (tmp_path / "tier").rmdir()
    assert not store.write(KEY, b"x") and store.last_failure == "io_error"
    assert not store.contains(KEY)


def test_an_earlier_runs_files_are_removed_at_start(tmp_path: Path) -> None:
    (tmp_path / "old.kv").write_bytes(b"stale")
    DiskStore(tmp_path, 1 << 20)
    assert not (tmp_path / "old.kv").exists()


def test_framing_refuses_another_keys_bytes_and_a_flipped_bit() -> None:
    key = store_key(ObjectKey("m", 1, 0, ChunkHash(b"c" * 16), ""))
    other = store_key(ObjectKey("m", 1, 1, ChunkHash(b"c" * 16), ""))
    assert key != other
    framed = frame(key, b"payload")
    assert unframe(key, framed) == b"payload"
    assert unframe(other, framed) is None
    flipped = bytearray(framed)
    flipped[-1] ^= 1
    assert unframe(key, bytes(flipped)) is None
    assert unframe(key, framed[:-1]) is None
