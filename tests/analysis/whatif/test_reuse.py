"""Reuse distributions per workload group: which groups are reported on their own, and what
each pools."""

from __future__ import annotations

from testbed.analysis.whatif import reuse
from testbed.analysis.whatif.stack import stack_distances
from testbed.models.access_trace import keyed_trace


def _quantiles(keys, groups):
    trace = keyed_trace(4, keys, [4 * len(k) + 1 for k in keys], groups=groups)
    return reuse.reuse_quantiles(trace, stack_distances(trace), stored_bytes_per_token=2)


def _counts(table):
    return table.groupby("group", sort=False)["count"].first().to_dict()


def test_each_group_pools_its_own_reused_chunks_and_the_unnamed_ones_only_count_in_all():
    keys = [[0, 1], [0, 1], [2], [2], [0], [3]]
    table = _quantiles(keys, ["b", "b", "a", "a", "", "a"])
    # b's second request reuses 2 chunks, a's second 1 (its third is cold); the unnamed one 1.
    assert _counts(table) == {"all": 4, "a": 1, "b": 2}
    # A group's distribution is its own chunks': b's 2 reuses span distances 1 and 2 chunks
    # (8 bytes a chunk: 4 tokens x 2 bytes), a's one reuse is at 1.
    b, a = (table[table["group"] == name]["reuse_distance_bytes"] for name in "ba")
    assert (b.min(), b.max(), a.min(), a.max()) == (8.0, 16.0, 8.0, 8.0)


def test_past_max_groups_the_most_reused_are_reported_ties_by_name(monkeypatch):
    monkeypatch.setattr(reuse, "MAX_GROUPS", 2)
    # Reuses per group: c 3, a 1, b 1, d 2, e 0 (no reuse: never a group of its own).
    keys, groups = [], []
    for name, reuses in (("c", 3), ("a", 1), ("b", 1), ("d", 2), ("e", 0)):
        base = 100 * (ord(name) - ord("a"))
        keys += [[base + k for k in range(reuses)], [base + k for k in range(reuses)]]
        groups += [name, name]
    keys = [k or [900 + i] for i, k in enumerate(keys)]  # e's requests: a cold chunk each
    table = _quantiles(keys, groups)
    counts = _counts(table)
    assert list(counts) == ["all", "c", "d"]  # the two most reused, in name order
    assert (counts["c"], counts["d"]) == (3, 2)
    monkeypatch.setattr(reuse, "MAX_GROUPS", 3)
    assert list(_counts(_quantiles(keys, groups))) == ["all", "a", "c", "d"]  # a before b: a tie
