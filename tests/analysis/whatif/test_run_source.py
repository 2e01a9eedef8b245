"""``what_if_run`` on a run directory written as issue 9's telemetry contract says."""

from __future__ import annotations

import json

from testbed.analysis.whatif import WhatIfOptions, load_whatif, what_if_run, write_whatif
from testbed.spec.runspec import RunSpec
from tests.analysis.synthetic import Prompt, SyntheticRun

C = 4


def _run_dir(tmp_path, *, drop_before_last: bool):
    run = SyntheticRun(tmp_path / "run", chunk_size=C, tp=2)
    run.request("r0", Prompt(("A", "B"), tail=1))
    run.request("r1", Prompt(("A", "B", "C"), tail=2), engine_hit=C)
    if drop_before_last:
        run.evict(Prompt(("A", "B")).hashes[1:], reason="drop")
    run.request("r2", Prompt(("A", "B", "C", "D")), engine_hit=0)
    run.request("r3", Prompt(("X",), tail=3))
    path = run.close()
    spec = RunSpec(chunk_size=C, block_size=C, tp=2)
    (path / "spec.json").write_text(json.dumps({"run_id": spec.run_id, **spec.to_dict()}))
    return path, run.admissions


def test_an_unlimited_runs_own_log_predicts_its_external_hits_exactly(tmp_path):
    path, admissions = _run_dir(tmp_path, drop_before_last=False)
    whatif = what_if_run(path, WhatIfOptions(policies=("lru",)))
    run = whatif.meta["run"]
    # r1: hit A B (8 tokens) beyond its engine hit of 4 → 4; r2: A B C of 16 tokens → 12.
    assert whatif.run_requests["external_hit_tokens"].tolist() == [0, 4, 12, 0]
    assert whatif.run_requests["predicted_external_hit_tokens"].tolist() == [0, 4, 12, 0]
    assert run["residual_tokens"] == 0 and run["capacity_tokens"] is None
    assert run["prompt_tokens"] == sum(a.prompt_tokens for a in admissions.values())
    point = whatif.point(C, None)
    assert point["external_hit_tokens"] == 16
    assert point["hit_tokens"] == 16 + C  # the engine's own hit counts in the hit rate
    write_whatif(whatif, tmp_path / "out")
    loaded = load_whatif(tmp_path / "out")
    assert loaded.meta["run"] == json.loads(json.dumps(run))
    assert loaded.run_requests["predicted_external_hit_tokens"].sum() == 16


def test_a_chunk_dropped_behind_the_stacks_back_is_the_reported_residual(tmp_path):
    path, _ = _run_dir(tmp_path, drop_before_last=True)
    whatif = what_if_run(path, WhatIfOptions(policies=("lru",), chunk_sizes=(C, 2 * C)))
    run = whatif.meta["run"]
    # Without B, r2 hit only A: 4 tokens measured; an LRU cache of unlimited size keeps 12.
    assert run["measured_external_hit_tokens"] == 4 + 4
    assert run["predicted_external_hit_tokens"] == 4 + 12
    assert run["residual_tokens"] == 8 and run["requests_over"] == 1
    assert sorted(whatif.meta["chunk_sizes"]) == [C, 2 * C]
