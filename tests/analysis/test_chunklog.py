"""The chunk event log: raw msgpack streams and chunks.parquet read back alike."""

from __future__ import annotations

import logging

import msgspec
import pandas as pd
import pyarrow.parquet as pq
import pytest

from testbed.analysis.chunklog import (
    CHUNK_PARQUET,
    COLUMNS,
    has_chunk_log,
    load_chunk_log,
    write_chunk_parquet,
)
from tests.analysis.synthetic import ChunkLog, chunk_hashes

HASHES = chunk_hashes(["a", "b", "c"])


def write_stream(path, rows_per_batch=2):
    log = ChunkLog(path, batch_rows=rows_per_batch)
    for position, chunk_hash in enumerate(HASHES):
        log.add("reserve", chunk_hash, 10 + position, kv_rank=0, namespace="m|1|",
                session_id="e:r1", position=position, span_id="aa" * 8, nbytes=512)  # fmt: skip
        log.add("commit", chunk_hash, 20 + position, kv_rank=0, namespace="m|1|",
                session_id="e:r1", position=position, span_id="bb" * 8, nbytes=512)  # fmt: skip
    log.add("lookup", HASHES[0], 30, namespace="m|1|", session_id="e:r2", position=0,
            status="hit", span_id="cc" * 8)  # fmt: skip
    log.add("evict", HASHES[1], 40, kv_rank=0, namespace="m|1|", cause="capacity",
            span_id="dd" * 8, nbytes=512)  # fmt: skip
    log.flush()
    return log


def test_raw_streams_load_with_their_dtypes_in_order(tmp_path):
    write_stream(tmp_path / "chunks" / "server-1.msgpack")
    write_stream(tmp_path / "chunks" / "server-2.msgpack", rows_per_batch=3)
    assert has_chunk_log(tmp_path)
    log = load_chunk_log(tmp_path)
    assert list(log.columns) == list(COLUMNS)
    assert len(log) == 2 * 8
    assert list(log["server"].unique()) == ["server-1", "server-2"]
    assert list(log.loc[log["server"] == "server-1", "seq"]) == list(range(8))
    dtypes = log.dtypes.astype(str).to_dict()
    assert {dtypes[c] for c in ("seq", "time_ns", "nbytes")} == {"int64"}
    assert (dtypes["kv_rank"], dtypes["position"]) == ("int16", "int32")
    for name in ("event", "namespace", "session_id", "status", "cause", "span_id", "server"):
        assert dtypes[name] == "category", name
    assert log["chunk_hash"].iloc[0] == HASHES[0]
    lookup = log[log["event"] == "lookup"].iloc[0]
    assert (lookup["kv_rank"], lookup["status"], lookup["nbytes"]) == (-1, "hit", 0)


def test_the_parquet_file_holds_the_same_rows_compactly(tmp_path):
    write_stream(tmp_path / "chunks" / "server-1.msgpack")
    raw = load_chunk_log(tmp_path)
    rows, size = write_chunk_parquet(tmp_path)
    assert (rows, size) == (8, (tmp_path / CHUNK_PARQUET).stat().st_size)
    assert not (tmp_path / "chunks").exists()  # the raw streams are gone
    schema = pq.read_schema(tmp_path / CHUNK_PARQUET)
    assert str(schema.field("chunk_hash").type) == "binary"
    for name in ("event", "status", "cause", "namespace", "session_id"):
        assert str(schema.field(name).type).startswith("dictionary"), name
    pd.testing.assert_frame_equal(load_chunk_log(tmp_path), raw)


def test_no_chunk_log_is_not_an_empty_one(tmp_path):
    assert not has_chunk_log(tmp_path)
    assert write_chunk_parquet(tmp_path) == (0, 0)
    assert not (tmp_path / CHUNK_PARQUET).exists()
    with pytest.raises(FileNotFoundError, match="no chunk log"):
        load_chunk_log(tmp_path)


def test_a_stream_cut_short_keeps_its_complete_batches(tmp_path, caplog):
    path = tmp_path / "chunks" / "server-1.msgpack"
    write_stream(path, rows_per_batch=4)
    data = path.read_bytes()
    path.write_bytes(data + msgspec.msgpack.encode({"columns": {"seq": [99] * 50}})[:-7])
    with caplog.at_level(logging.WARNING):
        log = load_chunk_log(tmp_path)
    assert len(log) == 8
    assert "unreadable data" in caplog.text


def test_batches_may_lack_columns_and_carry_unknown_ones(tmp_path):
    path = tmp_path / "chunks" / "server-1.msgpack"
    path.parent.mkdir()
    batch = {"columns": {"seq": [0, 1], "event": ["evict", "evict"], "future": [1, 2],
                         "chunk_hash": HASHES[:2]}}  # fmt: skip
    path.write_bytes(msgspec.msgpack.encode(batch))
    log = load_chunk_log(tmp_path)
    assert list(log["kv_rank"]) == [-1, -1] and list(log["session_id"]) == ["", ""]
    path.write_bytes(msgspec.msgpack.encode({"columns": {"seq": [0, 1], "event": ["evict"]}}))
    with pytest.raises(ValueError, match="different lengths"):
        load_chunk_log(tmp_path)


def test_a_long_log_is_converted_a_row_group_at_a_time_reading_a_window_at_a_time(
    tmp_path, monkeypatch
):
    """Memory holds one row group and one read window, whatever the log's length: with both
    made tiny, the file has a group per 5 rows, windows grow to hold a batch, and it loads
    back to exactly the frame the streams give."""
    from testbed.analysis import chunklog

    for server in (1, 2, 3):
        write_stream(tmp_path / "chunks" / f"server-{server}.msgpack", rows_per_batch=server)
    raw = load_chunk_log(tmp_path)
    monkeypatch.setattr(chunklog, "ROW_GROUP_ROWS", 5)
    monkeypatch.setattr(chunklog, "READ_BYTES", 7)  # smaller than any batch
    assert pd.testing.assert_frame_equal(load_chunk_log(tmp_path), raw) is None
    rows, _ = write_chunk_parquet(tmp_path)
    assert rows == len(raw) == 24
    metadata = pq.ParquetFile(tmp_path / CHUNK_PARQUET).metadata
    assert metadata.num_row_groups >= 24 // 5
    assert max(metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)) < 5 + 3
    pd.testing.assert_frame_equal(load_chunk_log(tmp_path), raw)
