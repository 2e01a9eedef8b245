"""``whatif.json``: the documented schema, written and read back in one call."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from testbed.analysis.whatif import WhatIfOptions, load_whatif, what_if_workload, write_whatif
from testbed.spec.runspec import RunSpec

PARAMS = {"num_documents": 20, "document_tokens": [32, 256]}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("whatif")
    run = RunSpec(workload="rag", requests=60, workload_params=PARAMS, profile="llama3-8b")
    options = WhatIfOptions(
        chunk_sizes=(64, 128), policies=("lru", "belady"), at_tokens=(1000, 3000),
        policy_points=2, time_profiles=("flat", "h100"),
    )  # fmt: skip
    whatif = what_if_workload(run, options)
    write_whatif(whatif, out)
    return out, whatif


def test_whatif_json_lists_points_per_chunk_size_and_policy(written):
    out, _ = written
    document = json.loads((out / "whatif.json").read_text())
    assert document["schema"] == 1 and document["source"]["kind"] == "workload"
    assert document["stored_bytes_per_token"] == 131072  # llama3-8b
    assert set(document["curves"]) == {"64", "128"}
    for policies in document["curves"].values():
        assert set(policies) == {"lru", "belady"}
        for points in policies.values():
            for point in points:
                assert {"capacity_tokens", "token_hit_rate", "mean_request_hit_rate"} <= set(point)
            capacities = [p["capacity_tokens"] for p in points]
            assert capacities[-1] is None  # unlimited, last
            assert {1000, 3000} <= set(capacities)
            assert capacities[:-1] == sorted(capacities[:-1])
    gauge = document["min_capacity"]["64"]
    assert [row["fraction"] for row in gauge] == [0.6, 0.8, 0.9, 0.95, 0.99]
    assert all(row["capacity_bytes"] == row["capacity_tokens"] * 131072 for row in gauge)
    assert {row["time_profile"] for row in document["time"]["break_even"]} == {"flat", "h100"}
    assert document["tables"] == {"lru_curves": "lru_curves.parquet", "reuse": "reuse.parquet"}


def test_load_whatif_gives_back_what_was_computed(written):
    out, computed = written
    loaded = load_whatif(out)
    pd.testing.assert_frame_equal(
        loaded.points.reset_index(drop=True),
        computed.points.reset_index(drop=True)[loaded.points.columns],
        check_dtype=False,
    )
    assert loaded.point(64, 1000) == computed.point(64, 1000)
    assert len(loaded.curves) == len(computed.curves) > 0
    assert set(loaded.reuse["group"]) == {"all"}  # rag requests have no groups
    # The exact curve's steps agree with the points at the same capacities.
    steps = loaded.curves[loaded.curves["chunk_size"] == 64]
    last = steps[steps["capacity_tokens"] <= 3000].iloc[-1]
    assert last["token_hit_rate"] == pytest.approx(loaded.point(64, 3000)["token_hit_rate"])


def test_loading_a_directory_without_whatif_json_says_what_to_run(tmp_path):
    with pytest.raises(FileNotFoundError, match="kvtb whatif"):
        load_whatif(tmp_path)
