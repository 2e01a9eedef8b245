"""An operation's time by part: waiting, server, copy, other; the total where none is known."""

from __future__ import annotations

import pandas as pd
import pytest
from matplotlib import pyplot as plt

from testbed.analysis import latency_split as ls
from testbed.core.telemetry import attributes as a


def op(name: str, duration_ms: float, **parts: float) -> dict:
    return {
        "name": name,
        "run_id": "run",
        "trace_id": "t",
        "span_id": f"{name}-{duration_ms}",
        "start_time": pd.Timestamp("2026-01-01", tz="UTC"),
        "duration_ms": duration_ms,
        **{ls.PARTS[part]: value for part, value in parts.items()},
    }


SPANS = pd.DataFrame(
    [
        op(a.CONNECTOR_LOOKUP, 10.0, waiting=4.0, server=5.0),
        op(a.CONNECTOR_LOOKUP, 6.0, waiting=2.0, server=3.0),
        op(a.CONNECTOR_STORE, 8.0, copy=3.0),
        op(a.CONNECTOR_STORE, 4.0),  # not split: its total only
        op(a.CONNECTOR_RETRIEVE, 5.0, server=4.0, copy=3.0),  # parts overlap by 2 ms
        op(a.SERVER_LOOKUP, 1.0),  # the server's side: not a connector operation
    ]
)


def test_operation_parts_split_each_span_by_what_it_carries():
    parts = ls.operation_parts(SPANS).set_index("span_id")
    assert list(parts["operation"]) == ["lookup", "lookup", "store", "store", "retrieve"]
    lookup = parts.loc[f"{a.CONNECTOR_LOOKUP}-10.0"]
    assert (lookup["waiting_ms"], lookup["server_ms"], lookup["other_ms"]) == (4.0, 5.0, 1.0)
    assert pd.isna(lookup["copy_ms"]) and lookup["split"]
    unsplit = parts.loc[f"{a.CONNECTOR_STORE}-4.0"]
    assert not unsplit["split"] and unsplit["other_ms"] == 4.0
    overlapping = parts.loc[f"{a.CONNECTOR_RETRIEVE}-5.0"]
    assert (overlapping["other_ms"], overlapping["overlap_ms"]) == (0.0, 2.0)


def test_the_split_has_a_row_per_part_recorded_and_sums_to_the_mean_duration():
    split = ls.latency_split(SPANS)
    rows = {(r.operation, r.part): r for r in split.itertuples()}
    assert set(rows) == {
        ("lookup", "waiting"),
        ("lookup", "server"),
        ("lookup", "other"),
        ("store", "copy"),
        ("store", "other"),
        ("store", "total"),
        ("retrieve", "server"),
        ("retrieve", "copy"),
        ("retrieve", "other"),
    }
    assert rows[("lookup", "waiting")].mean_ms == pytest.approx(3.0)
    assert rows[("lookup", "other")].mean_ms == pytest.approx(1.0)
    for operation, mean in (("lookup", 8.0), ("store", 6.0)):
        ours = split[split["operation"] == operation]
        assert ours["mean_ms"].sum() == pytest.approx(mean)
        assert ours["share"].sum() == pytest.approx(1.0)
    assert rows[("store", "total")].count == 1 and rows[("store", "copy")].count == 1
    assert not split.isna().any().any()


def test_spans_without_parts_show_their_total_only():
    bare = SPANS.drop(columns=list(ls.PARTS.values()))
    split = ls.latency_split(bare)
    assert set(split["part"]) == {"total"}
    figure = ls.latency_split_figure({"run": split}, "Latency")
    labels = [t.get_text() for t in figure.axes[0].get_legend().get_texts()]
    assert labels == ["total (the spans carry no parts)"]
    plt.close(figure)
    figure = ls.latency_split_figure({"run": ls.latency_split(SPANS)}, "Latency")
    labels = [t.get_text() for t in figure.axes[0].get_legend().get_texts()]
    assert labels == ["waiting", "server", "copy", "other", "total (the spans carry no parts)"]
    plt.close(figure)
    table = ls.split_table({"a": split, "b": split})
    assert list(table["run"].unique()) == ["a", "b"]
