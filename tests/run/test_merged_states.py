"""A fleet's per-instance servers' states summed as one: counts, nested counts (tiers by name,
peer counts) and servers that have nothing to report, each summed once."""

from __future__ import annotations

from testbed.run.server_state import merged_states


def test_nested_counts_are_summed_once_and_missing_ones_left_out() -> None:
    first = {"num_objects": 1, "peers": {"chunks": 2}, "tiers": _l2(1)}
    second = {"num_objects": 2, "peers": {"chunks": 3}, "tiers": _l2(4)}
    quiet = {"num_objects": 4, "peers": None, "tiers": {}}
    for order in ([first, second, quiet], [quiet, second, first]):
        merged = merged_states(order)
        assert merged == {
            "num_objects": 7,
            "peers": {"chunks": 5},
            "tiers": _l2(5),
        }
    assert merged_states([quiet, quiet]) == {"num_objects": 8, "peers": None, "tiers": {}}
    assert merged_states([first, None]) is None


def _l2(reads: int) -> dict[str, dict[str, object]]:
    return {"L2": {"kind": "disk", "reads": reads}}
