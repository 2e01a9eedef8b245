"""Metrics and tables computed from real span files (and from hand-made frames)."""

from __future__ import annotations

import pandas as pd
import pytest

from testbed.analysis import load_spans, metrics, tables
from testbed.core.telemetry import attributes as a
from tests.support.cache_harness import Harness, cache_cycle

C = 64


def test_request_metrics_follow_their_definitions():
    requests = pd.DataFrame(
        {
            "prompt_tokens": [100, 300],
            "engine_hit_tokens": [50, 0],
            "external_hit_tokens": [0, 150],
            "recomputed_tokens": [50, 150],
        }
    )
    assert metrics.token_hit_rate(requests) == pytest.approx(200 / 400)
    assert metrics.external_token_hit_rate(requests) == pytest.approx(150 / 400)
    assert metrics.mean_request_hit_rate(requests) == pytest.approx((0.5 + 0.5) / 2)
    assert metrics.token_breakdown(requests).to_dict() == {
        "engine": 50,
        "external": 150,
        "recomputed": 200,
    }


@pytest.fixture(scope="module")
def server_spans(tmp_path_factory):
    from server.launch import ServerProcess

    run_dir = tmp_path_factory.mktemp("spans")
    args = ["--chunk-size", str(C), "--run-dir", str(run_dir)]
    with ServerProcess(args) as server, Harness(server) as h:
        cache_cycle(h, C)
    return load_spans(run_dir)


def test_lock_hold_times_pair_each_lookup_with_its_releases(server_spans):
    holds = metrics.lock_hold_times(server_spans)
    # The cycle's second request: chunk 0 freed (the engine held it), chunks 1-2 retrieved.
    assert sorted(holds["released_by"]) == ["free", "retrieve"]
    assert set(holds["session_id"]) == {"engine:cycle-b"}
    assert (holds["hold_ms"] > 0).all()
    assert metrics.lock_hold_times(server_spans[server_spans["name"] != a.SERVER_LOOKUP]).empty


def test_latency_percentiles_and_operations_cover_the_server_side(server_spans):
    table = metrics.latency_percentiles(server_spans)
    for name in (a.SERVER_LOOKUP, a.SERVER_STORE, a.SERVER_RETRIEVE, a.SERVER_LOCK_RELEASE):
        assert table.loc[name, "count"] >= 1
        assert table.loc[name, "p50"] <= table.loc[name, "p99"]
    ops = tables.operations_table(server_spans)
    assert set(ops["side"]) == {"server"}
    assert {"lookup", "store", "retrieve", "lock_release", "end_session"} <= set(ops["op"])
    assert metrics.stored_bytes(server_spans) == 3 * C * 128  # three chunks of the tiny layout
