"""The link model: a disk hit costs its read on top of the host copy, a shared disk adds the
writes, and every named figure carries its source."""

from __future__ import annotations

import numpy as np
import pytest

from testbed.models.links import LINKS, TIER_PROFILES, tier_profile
from testbed.models.profiles import PROFILES
from testbed.models.tier_time import tiered_ttft_s
from testbed.models.time_model import make_time_model

MB = 1e6


def test_every_link_and_profile_names_its_datasheet():
    assert all(link.source for link in LINKS.values())
    assert {"gen4", "gen5"} <= set(TIER_PROFILES)
    assert LINKS["nvme-gen5"].read_bytes_per_s > LINKS["nvme-gen4"].read_bytes_per_s
    with pytest.raises(ValueError, match="choose one of"):
        tier_profile("gen9")


def test_a_prefetch_on_a_disk_shares_it_with_the_write_back_and_a_duplex_link_does_not():
    gen4 = tier_profile("gen4")
    disk = LINKS["nvme-gen4"]
    alone = gen4.prefetch_s({"disk": np.array([100 * MB])})
    expected = disk.latency_s + 100 * MB / disk.rate("read")
    assert alone[0] == pytest.approx(expected)
    shared = gen4.prefetch_s({"disk": np.array([100 * MB])}, written_bytes=50 * MB)
    assert shared[0] == pytest.approx(expected + 50 * MB / disk.rate("write"))
    # The remote store's network link is duplex: writes to it do not slow a read from it.
    remote = gen4.prefetch_s({"remote": np.array([100 * MB])}, written_bytes=50 * MB)
    net = LINKS["eth25"]
    assert remote[0] == pytest.approx(net.latency_s + 100 * MB / net.rate("read"))


def test_the_same_hit_projects_a_longer_ttft_from_disk_than_from_host_and_longer_on_gen4():
    profile = PROFILES["llama3-8b"]
    model = make_time_model("h100", profile)
    b = profile.stored_bytes_per_token(1)
    prompts = np.array([8192.0])
    host = tiered_ttft_s(model, tier_profile("gen5"), prompts, {"host": np.array([8000.0])},
                         bytes_per_token=b)  # fmt: skip
    disk5 = tiered_ttft_s(model, tier_profile("gen5"), prompts, {"disk": np.array([8000.0])},
                          bytes_per_token=b)  # fmt: skip
    disk4 = tiered_ttft_s(model, tier_profile("gen4"), prompts, {"disk": np.array([8000.0])},
                          bytes_per_token=b)  # fmt: skip
    nothing = tiered_ttft_s(model, tier_profile("gen5"), prompts, {}, bytes_per_token=b)
    assert host[0] < disk5[0] < disk4[0]
    link = LINKS["nvme-gen5"]
    assert disk5[0] - host[0] == pytest.approx(link.latency_s + 8000 * b / link.rate("read"))
    assert host[0] < nothing[0]  # a host hit of 8000 tokens pays on an H100


def test_hits_beyond_the_last_prompt_token_are_cut_from_the_lowest_tier():
    model = make_time_model("flat", PROFILES["llama3-8b"])
    links = tier_profile("gen5")
    full = tiered_ttft_s(model, links, np.array([512.0]),
                         {"host": np.array([256.0]), "disk": np.array([256.0])},
                         bytes_per_token=1000)  # fmt: skip
    cut = tiered_ttft_s(model, links, np.array([512.0]),
                        {"host": np.array([256.0]), "disk": np.array([255.0])},
                        bytes_per_token=1000)  # fmt: skip
    assert full[0] == pytest.approx(cut[0])
