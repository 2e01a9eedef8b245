"""The hit-source layout: L1's chunks first, a range credited by its overlap, sums kept."""

from __future__ import annotations

import pytest

from testbed.core.hit_sources import source_layout, split_range


def test_a_range_is_credited_by_its_overlap_with_the_tiers_in_hierarchy_order():
    by_source = {"host": 512, "disk": 256, "p2p": 256}
    assert source_layout(by_source, 1024) == [
        ("host", 0, 512), ("disk", 512, 768), ("remote", 768, 768), ("p2p", 768, 1024)
    ]  # fmt: skip
    # vLLM held the first 300 tokens and accepted 600 more: [300, 900).
    assert split_range(300, 900, by_source, 1024) == {
        "host": 212, "disk": 256, "remote": 0, "p2p": 132
    }  # fmt: skip


def test_a_server_without_tiers_means_every_hit_token_is_l1s():
    assert split_range(0, 256, {}, 256) == {"host": 256, "disk": 0, "remote": 0, "p2p": 0}
    assert split_range(64, 256, {"host": 256}, 256)["host"] == 192


def test_an_unknown_hit_source_is_an_error_that_names_the_known_ones():
    with pytest.raises(ValueError, match="host, disk, remote, p2p"):
        split_range(0, 10, {"tape": 10}, 10)
