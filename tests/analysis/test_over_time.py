"""Hit rates over time and the server's timeline, on the workload clock."""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib import pyplot as plt

from testbed.analysis import cache_timeline as ct
from testbed.analysis import over_time as ot
from testbed.core.telemetry import attributes as a
from tests.analysis.test_per_request import requests_table

T0 = pd.Timestamp("2026-01-01", tz="UTC")


def at(seconds: float) -> pd.Timestamp:
    return T0 + pd.Timedelta(seconds=seconds)


def span(name: str, start_s: float, **attributes) -> dict:
    return {
        "name": name,
        "span_id": attributes.pop("span_id", f"{name}@{start_s}"),
        "start_time": at(start_s),
        "end_time": at(start_s + 0.01),
        **attributes,
    }


def test_hit_rate_over_time_weighs_tokens_per_slice_and_skips_empty_slices():
    table = requests_table(
        [
            {"arrival_s": 0, "cold": 100},
            {"arrival_s": 1, "engine": 50, "external": 50, "cold": 100},
            {"arrival_s": 9, "external": 30, "cold": 10},
        ]
    )
    over = ot.hit_rate_over_time(table, bins=5)
    assert list(over["requests"]) == [2, 1]  # slices [0, 1.8) and [7.2, 9]; three are empty
    assert over["token_hit_rate"].tolist() == [100 / 300, 30 / 40]
    assert over["external_token_hit_rate"].tolist() == [50 / 300, 30 / 40]
    assert over["time_s"].tolist() == [0.9, 8.1]
    assert ot.hit_rate_over_time(table.drop(columns="arrival_s")).empty


def test_busiest_groups_are_those_with_the_most_requests_in_arrival_order():
    table = requests_table(
        [
            {"group": g, "arrival_s": t, "cold": 1}
            for g, t in [("b", 0), ("a", 1), ("a", 2), ("b", 3), ("c", 4)]
        ]
    )
    assert ot.busiest_groups(table, top=2) == ["b", "a"]


def test_server_events_are_placed_on_the_workload_clock():
    requests = requests_table([{"arrival_s": 10, "cold": 5}, {"arrival_s": 20, "cold": 5}])
    requests["span_id"] = ["req-0", "req-1"]
    spans = pd.DataFrame(
        [
            span(a.CONNECTOR_REQUEST, 1.0, span_id="req-0"),
            span(a.CONNECTOR_REQUEST, 2.0, span_id="req-1"),
            span(a.SERVER_STORE, 1.2, **{a.USED_BYTES: 100}),
            span(a.SERVER_EVICT, 1.5, **{a.EVICTED_OBJECTS: 2, a.EVICTED_BYTES: 64,
                 a.EVICT_REASON: "capacity", a.CAPACITY_BYTES: 128, a.USED_BYTES: 64}),
            span(a.SERVER_EVICT, 2.5, **{a.EVICTED_OBJECTS: 1, a.EVICTED_BYTES: 32,
                 a.EVICT_REASON: "capacity", a.CAPACITY_BYTES: 128, a.USED_BYTES: 96}),
            span(a.SERVER_EVICT, 3.0, **{a.EVICTED_OBJECTS: 4, a.EVICTED_BYTES: 8,
                 a.EVICT_REASON: "drop", a.CAPACITY_BYTES: 128, a.USED_BYTES: 88}),
            span(a.SERVER_STORE, 0.5, **{a.USED_BYTES: 0}),  # before any admission
        ]
    )  # fmt: skip
    timeline = ct.server_timeline(spans, requests)
    assert timeline.clock == "arrival_s" and timeline.capacity_bytes == 128
    evictions = timeline.evictions
    assert evictions["arrival_s"].tolist() == [10.0, 20.0, 20.0]
    assert np.allclose(evictions["run_s"], [1.0, 2.0, 2.5])  # the first span started at 0.5
    assert evictions["cumulative_bytes"].tolist() == [64, 96, 8]  # per reason
    assert evictions["cumulative_objects"].tolist() == [2, 3, 4]
    usage = timeline.usage
    assert usage["used_bytes"].tolist() == [0, 100, 64, 96, 88]
    assert usage["arrival_s"].tolist() == [10.0, 10.0, 10.0, 20.0, 20.0]
    assert ct.server_timeline(spans, requests, unlimited=True).capacity_bytes is None
    alone = ct.server_timeline(spans, requests.iloc[0:0])
    assert alone.clock == "run_s" and alone.evictions["arrival_s"].isna().all()

    summary = ct.eviction_summary(
        {"run": timeline, "empty": ct.server_timeline(spans.iloc[0:0], requests)}
    )
    assert summary.to_dict("records") == [
        {"run": "run", "reason": "capacity", "evictions": 2, "objects": 3, "bytes": 96},
        {"run": "run", "reason": "drop", "evictions": 1, "objects": 4, "bytes": 8},
        {"run": "empty", "reason": "none", "evictions": 0, "objects": 0, "bytes": 0},
    ]

    figure = ot.evictions_figure({"run": timeline}, "Evictions")
    used, evicted = figure.axes
    assert [t.get_text() for t in evicted.get_legend().get_texts()] == [
        "run: capacity (3 objects)",
        "run: drop (4 objects)",
    ]
    assert used.get_ylim()[0] == 0
    plt.close(figure)
    empty = ot.evictions_figure({"run": ct.server_timeline(spans.iloc[0:0], requests)}, "None")
    assert any("no evictions" in t.get_text() for t in empty.axes[1].texts)
    plt.close(empty)


def test_the_group_figure_draws_a_line_per_busiest_group_and_the_rest_as_dots():
    table = requests_table(
        [{"group": f"g{i % 3}", "arrival_s": i, "engine": i, "cold": 10} for i in range(9)]
    )
    figure = ot.group_hit_rate_figure(table, "Groups", top=2)
    labels = [t.get_text() for t in figure.axes[0].get_legend().get_texts()]
    assert labels == ["other groups (1)", "g0", "g1", "all requests (per time slice)"]
    plt.close(figure)
