"""Tier names as the user writes them: parsed, refused with a message that says what to write,
and formatted back."""

from __future__ import annotations

import argparse

import pytest

from server.config import ServerConfig
from server.flags import add_config_arguments, config_from_args
from server.tiers.policies import WritePolicy, parse_prefetch, parse_write
from server.tiers.spec import TierSpec, format_tier, parse_tier


def test_a_disk_tier_with_units_and_a_directory_parses() -> None:
    assert parse_tier("disk:8GiB:/data/kv") == TierSpec("disk", 8 << 30, "/data/kv")
    assert parse_tier("disk:512MiB") == TierSpec("disk", 512 << 20, None)
    assert parse_tier("disk:4096").capacity_bytes == 4096


def test_a_redis_url_keeps_its_colons() -> None:
    spec = parse_tier("redis:4GiB:redis://127.0.0.1:6379")
    assert spec.where == "redis://127.0.0.1:6379" and spec.kind == "redis"


def test_a_tier_names_its_eviction_policy_after_the_kind() -> None:
    assert parse_tier("disk@lfu:1MiB").policy == "lfu"
    assert parse_tier("disk:1MiB").policy == "lru"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("disk", "KIND[@POLICY]:CAPACITY"),
        ("tape:1GiB", "unknown kind 'tape'"),
        ("disk:lots", "not a byte size"),
        ("disk:0", "at least 1 byte"),
        ("disk@mru:1GiB", "unknown eviction policy 'mru'"),
        ("redis:1GiB:localhost:6379", "redis://HOST:PORT"),
    ],
)
def test_a_bad_tier_is_refused_with_what_to_write(text: str, says: str) -> None:
    with pytest.raises(ValueError) as err:
        parse_tier(text)
    assert says in str(err.value)


@pytest.mark.parametrize(
    "text", ["disk:1GiB:/x", "disk@fifo:123", "redis:2GiB:redis://h:1", "redis:5"]
)
def test_format_reads_back(text: str) -> None:
    assert parse_tier(format_tier(parse_tier(text))) == parse_tier(text)


@pytest.mark.parametrize(
    ("values", "says"),
    [
        ({"tier_write": "sometimes"}, "write_through, write_back or selective:N"),
        ({"tier_write": "selective:0"}, "selective:N"),
        ({"prefetch": "timeout:-1"}, "timeout:S"),
        ({"tier_promote": "always"}, "none, retain"),
        ({"tiers": ("disk",)}, "KIND[@POLICY]:CAPACITY"),
        ({"tiers": ("disk:1MiB",), "metadata_only": True}, "needs a host pool"),
    ],
)
def test_a_server_config_with_bad_tier_settings_is_refused_saying_what_to_write(
    values: dict, says: str
) -> None:
    with pytest.raises(ValueError) as err:
        ServerConfig(**values)
    assert says in str(err.value)


def test_policies_parse_with_the_peers_names() -> None:
    assert parse_write("selective:2") == WritePolicy("selective", 2)
    assert str(parse_write("write_back")) == "write_back"
    assert parse_prefetch("timeout:0.5").wait_s(2.0) == 0.5
    assert parse_prefetch("wait").wait_s(2.0) == 2.0
    assert parse_prefetch("best_effort").wait_s(2.0) == 0.0


def test_the_tier_flag_repeats_in_order() -> None:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    args = parser.parse_args(
        ["--tier", "disk:1MiB:/a", "--tier", "disk:4MiB", "--prefetch", "best_effort"]
    )
    config = config_from_args(args)
    assert config.tiers == ("disk:1MiB:/a", "disk:4MiB") and config.prefetch == "best_effort"
