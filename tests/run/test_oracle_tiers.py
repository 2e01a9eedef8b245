"""The oracle engine with a disk tier below L1 agrees with the what-if over tiers: an inclusive
LRU hierarchy's per-tier hit tokens equal the one-pass prediction exactly on the real Mooncake
and agentic traces; any other policy equals the what-if's simulated row, labelled so."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from testbed.analysis.attribution import CATEGORIES
from testbed.analysis.whatif import WhatIfOptions, what_if_workload
from testbed.analysis.whatif.tiers import TierGrid
from testbed.models.tier_sim import TierPolicy
from testbed.run import RunOptions, execute_run
from testbed.spec.runspec import RunSpec

DATA = Path(__file__).resolve().parents[3] / "shared/data"
TRACES = {
    "mooncake": f"mooncake:{DATA / 'mooncake/conversation_trace.jsonl'}",
    "agentic": f"agentic:{DATA / 'kv-cache-tester'}",
}
needs_traces = pytest.mark.skipif(not DATA.is_dir(), reason="no shared traces")
CHUNK = 256


def _oracle(tmp_path, workload: str, l1_tokens: int, l2_tokens: int, write: str, promote: str):
    spec = RunSpec(
        engine="oracle", workload=workload, requests=300, chunk_size=CHUNK,
        capacity_tokens=l1_tokens, tier_write=write, tier_promote=promote,
        tiers=[f"disk:{l2_tokens * RunSpec().kv_profile.stored_bytes_per_token(1)}"],
    )  # fmt: skip
    summary = execute_run(spec, tmp_path, RunOptions(progress=False))
    return spec, summary


@needs_traces
@pytest.mark.parametrize("trace", sorted(TRACES))
@pytest.mark.parametrize(
    ("write", "promote", "method"),
    [("write_through", "retain", "one_pass"), ("write_back", "none", "simulated")],
)
def test_the_oracle_with_a_disk_tier_equals_the_whatif_over_tiers(
    tmp_path, trace, write, promote, method
):
    l1, l2 = 16 * CHUNK, 256 * CHUNK
    spec, summary = _oracle(tmp_path, TRACES[trace], l1, l2, write, promote)
    grid = TierGrid((l1,), (l2,), (TierPolicy(write, promote),), belady=False)
    whatif = what_if_workload(spec, WhatIfOptions(policies=("lru",), tiers=grid))
    (row,) = whatif.tiers.to_dict("records")
    tokens = summary["tokens"]
    assert row["method"] == method
    assert (row["host_hit_tokens"], row["disk_hit_tokens"]) == (
        tokens["external_host"],
        tokens["external_disk"],
    )
    assert tokens["external_disk"] > 0  # the second tier served something
    requests = pd.read_parquet(tmp_path / summary["run_id"] / "metrics.parquet")
    assert (requests[list(CATEGORIES)].sum(axis=1) == requests["prompt_tokens"]).all()
    spec_json = json.loads((tmp_path / summary["run_id"] / "spec.json").read_text())
    assert spec_json["tier_promote"] == promote


def test_the_oracle_refuses_a_hierarchy_it_cannot_simulate():
    with pytest.raises(ValueError, match="one tier below L1 with LRU"):
        RunSpec(engine="oracle", tiers=["disk:1GiB"], policy="fifo", capacity_tokens=4096)
