"""Chunk keys, the connector's configuration and byte sizes."""

from __future__ import annotations

import numpy as np
import pytest

from connector.config import ConnectorConfig
from testbed.core.keys import KeyExtras, MultiModalInput, chunk_hashes, extend_chunk_hashes
from testbed.core.sizes import parse_bytes


def test_chunk_hashes_chain_prefixes_and_ignore_the_partial_tail():
    a = list(range(1000))
    assert len(chunk_hashes(a, 256)) == 3
    b = a[:512] + [9] + a[513:]
    ha, hb = chunk_hashes(a, 256), chunk_hashes(b, 256)
    assert ha[:2] == hb[:2] and ha[2] != hb[2]
    c = [1] + a[1:]
    assert all(x != y for x, y in zip(chunk_hashes(c, 256), ha, strict=True))
    assert chunk_hashes(np.array(a), 256) == ha
    assert all(len(h) == 16 for h in ha)


def test_incremental_hashing_equals_hashing_at_once():
    tokens = list(range(5000))
    grown: list[bytes] = []
    for n in (0, 1, 3, 3, 7, 19):
        extend_chunk_hashes(grown, tokens, 256, n)
    assert grown == chunk_hashes(tokens, 256)
    with pytest.raises(ValueError, match="need"):
        extend_chunk_hashes([], tokens[:100], 64, 2)


def test_a_lora_adapter_keys_every_chunk_and_its_path_counts_too():
    tokens = list(range(1000))
    plain = chunk_hashes(tokens, 256)
    assert chunk_hashes(tokens, 256, extras=KeyExtras()) == plain  # no extras: plain keys
    sql = chunk_hashes(tokens, 256, extras=KeyExtras(lora=("sql", "/adapters/sql")))
    moved = chunk_hashes(tokens, 256, extras=KeyExtras(lora=("sql", "/adapters/sql-v2")))
    for keys in (sql, moved):
        assert len(keys) == 3 and not set(keys) & set(plain)
    assert not set(sql) & set(moved)


def test_a_multimodal_input_keys_the_chunks_it_overlaps_and_those_after():
    tokens = [7] * 1000  # the same placeholder tokens behind every image
    image = MultiModalInput("image-x", offset=300, length=100)  # inside chunk 1
    plain = chunk_hashes(tokens, 256)
    x = chunk_hashes(tokens, 256, extras=KeyExtras(mm_inputs=(image,)))
    y = chunk_hashes(
        tokens, 256, extras=KeyExtras(mm_inputs=(MultiModalInput("image-y", 300, 100),))
    )
    shifted = chunk_hashes(
        tokens, 256, extras=KeyExtras(mm_inputs=(MultiModalInput("image-x", 320, 100),))
    )
    assert x[0] == y[0] == shifted[0] == plain[0]  # chunk 0 holds no image
    for other in (y, shifted, plain):  # another image, or the same one elsewhere
        assert x[1] != other[1] and x[2] != other[2]
    grown: list[bytes] = []
    extend_chunk_hashes(grown, tokens, 256, 2, KeyExtras(mm_inputs=(image,)))
    assert extend_chunk_hashes(grown, tokens, 256, 3, KeyExtras(mm_inputs=(image,))) == x
    with pytest.raises(ValueError, match="placeholder order"):
        KeyExtras(mm_inputs=(MultiModalInput("b", 500, 10), MultiModalInput("a", 100, 10)))


def test_connector_config_names_bad_keys_and_values():
    config = ConnectorConfig.from_extra_config(
        {"kvtb.server_url": "tcp://127.0.0.1:1", "kvtb.load_async": "false", "other": 1}
    )
    assert config.load_async is False and config.server_url == "tcp://127.0.0.1:1"
    with pytest.raises(ValueError, match="kvtb.server_ulr.*valid keys: kvtb.server_url"):
        ConnectorConfig.from_extra_config({"kvtb.server_ulr": "x"})
    with pytest.raises(ValueError, match="kvtb.mq_timeout_s"):
        ConnectorConfig.from_extra_config({"kvtb.mq_timeout_s": "soon"})
    for never in (0, float("nan"), float("inf")):  # a timeout must be finite and positive
        with pytest.raises(ValueError, match=r"kvtb.mq_timeout_s must be .*in \[0.001, 3600\] s"):
            ConnectorConfig(mq_timeout_s=never)


def test_byte_sizes_parse_with_units_and_reject_nonsense():
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("2GB") == 2 * 10**9
    assert parse_bytes("4096") == 4096
    with pytest.raises(ValueError, match="not a byte size"):
        parse_bytes("lots")
