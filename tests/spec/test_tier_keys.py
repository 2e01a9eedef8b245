"""The hierarchy's run keys: parsed, checked, swept, and out of the id of runs without tiers."""

from __future__ import annotations

import pytest

from testbed.run.servers import tier_arguments
from testbed.spec.runspec import RunSpec


def test_a_spec_without_tiers_keeps_the_id_it_had() -> None:
    plain = RunSpec()
    assert plain.run_id == RunSpec(tiers=[], tier_write="write_through").run_id
    assert RunSpec(tiers=["disk:1GiB"]).run_id != plain.run_id


def test_one_tier_may_be_a_string_and_the_server_gets_its_flags() -> None:
    spec = RunSpec.from_mapping({"tiers": "disk:1GiB", "tier_write": "selective:2"})
    assert spec.tiers == ["disk:1GiB"]
    assert tier_arguments(spec) == [
        "--tier", "disk:1GiB",
        "--tier-write", "selective:2",
        "--tier-promote", "none",
        "--prefetch", "wait",
        "--lookup-pending-timeout", "30.0",
    ]  # fmt: skip
    assert tier_arguments(RunSpec()) == []


@pytest.mark.parametrize(
    ("values", "says"),
    [
        ({"tiers": ["tape:1GiB"]}, "unknown kind 'tape'"),
        ({"tier_write": "later"}, "tier write policy 'later' is unknown"),
        ({"prefetch": "timeout:x"}, "prefetch policy 'timeout:x' is unknown"),
        (
            {"tiers": ["disk:1GiB"], "engine": "oracle", "policy": "fifo"},
            "one tier below L1 with LRU",
        ),
        ({"tiers": ["disk:1GiB"], "metadata_only": True}, "metadata_only"),
    ],
)
def test_bad_tier_keys_are_refused(values: dict, says: str) -> None:
    with pytest.raises(ValueError) as err:
        RunSpec.from_mapping(values)
    assert says in str(err.value)


def test_none_is_a_promotion_policy_where_the_key_has_no_none():
    """TOML's ``"none"`` means "no value" only for a key that may be None (a capacity); for
    ``tier_promote`` it is the policy's name, and a spec.json read back keeps it."""
    spec = RunSpec.from_mapping({"tier_promote": "none", "capacity_tokens": "unlimited"})
    assert spec.tier_promote == "none"
    assert spec.capacity_tokens is None
    again = RunSpec.from_mapping({"tier_promote": "retain", "capacity_tokens": "none"})
    assert again.tier_promote == "retain" and again.capacity_tokens is None


def test_promote_none_is_a_policy_name_not_an_absent_value() -> None:
    spec = RunSpec.from_mapping({"tier_promote": "none"})
    assert spec.tier_promote == "none"
    assert RunSpec.from_mapping(spec.to_dict()).run_id == spec.run_id  # spec.json reads back
