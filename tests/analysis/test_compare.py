"""Runs side by side: both swept keys visible, no NaN drawn or listed."""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib import pyplot as plt

from testbed.analysis import compare
from testbed.analysis.source import open_source
from testbed.core.telemetry import attributes as a
from testbed.spec.runspec import RunSpec
from tests.analysis.run_dirs import write_run, write_sweep


def _summary(tp: int, mla: bool) -> dict:
    return {
        "token_hit_rate": 0.5 + 0.1 * tp,
        "stored_bytes": (1 if mla else tp) * 2**20,
        # One run has no lookup latency: its point is left out, not drawn as NaN.
        "lookup_p50_ms": None if (tp, mla) == (2, True) else float(tp),
        "retrieve_p50_ms": None,  # no run has it: no panel
    }


def tp_mla_source(tmp_path, oracle: bool = True):
    sweep = tmp_path / "tp_mla"
    runs = [
        write_run(sweep, RunSpec(tp=tp, mla=mla, requests=4), _summary(tp, mla))
        for tp in (1, 2)
        for mla in (False, True)
    ]
    if oracle:
        runs.append(write_run(sweep, RunSpec(engine="oracle", requests=4), {"token_hit_rate": 0.4}))
    return open_source(write_sweep(tmp_path, "tp_mla", ["tp", "mla", "engine"], runs))


def test_both_swept_keys_are_visible_and_missing_values_are_not_drawn(tmp_path):
    source = tp_mla_source(tmp_path)
    figure = compare.sweep_figure(source.runs, source.x, source.series, title="TP x MLA")
    panels = [axes for axes in figure.axes if axes.axison]
    assert [" ".join(axes.get_ylabel().split()) for axes in panels] == [
        "token hit rate (%)",
        "bytes stored (MiB)",
        "lookup (ms of wall clock): p50, bar to p99",
    ]
    hit_rate, stored, lookup = panels
    lines = {line.get_label(): line for line in hit_rate.get_lines()}
    assert list(lines) == ["measured mla=False", "measured mla=True", "oracle mla=False"]
    off, on = lines["measured mla=False"], lines["measured mla=True"]
    assert off.get_linestyle() != on.get_linestyle() and off.get_marker() != on.get_marker()
    assert list(off.get_xdata()) == [1.0, 2.0]
    assert [line.get_label() for line in stored.get_lines()] == list(lines)[:2]  # no oracle
    assert list(stored.get_lines()[1].get_ydata()) == [1.0, 1.0]  # MLA: one copy at any TP
    on_lookup = lookup.get_lines()[1]
    assert list(on_lookup.get_xdata()) == [1.0]  # tp=2 mla=True has no lookup latency
    for line in [*hit_rate.get_lines(), *stored.get_lines(), *lookup.get_lines()]:
        assert not np.isnan(np.asarray(line.get_ydata(), dtype=float)).any()
    assert [t.get_text() for t in hit_rate.get_xticklabels()] == ["1", "2"]
    plt.close(figure)


def test_oracle_gaps_list_only_runs_with_an_oracle(tmp_path):
    source = tp_mla_source(tmp_path)
    gaps = compare.oracle_gaps(source)
    assert list(gaps["tp"]) == [1] and list(gaps["mla"]) == [False]
    assert gaps["gap"].tolist() == [0.6 - 0.4]
    assert not gaps.isna().any().any()
    without = compare.oracle_gaps(tp_mla_source(tmp_path / "no-oracle", oracle=False))
    assert without.empty and "gap" in without


def test_the_runs_table_is_text_without_nan(tmp_path):
    source = tp_mla_source(tmp_path)
    table = compare.runs_table(source)
    assert table.loc["replay tp=1 mla=False", "token hit rate"] == "60.0%"
    assert table.loc["replay tp=2 mla=False", "stored"] == "2.0 MiB"
    assert table.loc["oracle tp=1 mla=False", "stored"] == "–"
    assert table.loc["replay tp=2 mla=True", "lookup p50 ms"] == "–"
    assert not table.isin(["nan", "NaN", "None", "<NA>"]).any().any()


def test_stored_bytes_per_rank_sums_each_kv_rank():
    def store(rank: int, nbytes: int) -> dict:
        return {"name": a.CONNECTOR_STORE, a.KV_RANK: rank, a.BYTES: nbytes}

    spans = {
        "tp=2": pd.DataFrame([store(0, 10), store(1, 20), store(1, 5)]),
        "mla": pd.DataFrame([store(0, 7), {"name": a.CONNECTOR_LOOKUP}]),
    }
    table = compare.stored_bytes_per_rank(spans)
    assert table.to_dict("records") == [
        {"label": "tp=2", "rank 0": 10.0, "rank 1": 25.0},
        {"label": "mla", "rank 0": 7.0, "rank 1": 0.0},
    ]
    plt.close(compare.bytes_per_rank_figure(table, "Per rank"))


def test_an_unlimited_capacity_is_the_last_category_of_a_capacity_axis(tmp_path):
    sweep = tmp_path / "capacity"
    runs = [
        write_run(sweep, RunSpec(capacity_tokens=c, requests=4), {"token_hit_rate": r})
        for c, r in ((None, 0.9), (4096, 0.5), (1024, 0.2))
    ]
    source = open_source(write_sweep(tmp_path, "capacity", ["capacity_tokens"], runs))
    figure = compare.sweep_figure(source.runs, source.x, source.series, title="Capacity")
    axes = figure.axes[0]
    assert [t.get_text() for t in axes.get_xticklabels()] == ["1024", "4096", "unlimited"]
    (line,) = axes.get_lines()
    assert list(line.get_ydata()) == [20.0, 50.0, 90.0]
    plt.close(figure)
