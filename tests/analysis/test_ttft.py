"""Time to first token per class of request and per run."""

from __future__ import annotations

import pytest
from matplotlib import pyplot as plt

from testbed.analysis import ttft
from tests.analysis.test_per_request import requests_table

TABLE = requests_table(
    [
        {"external": 80, "cold": 20, "ttft_ms": 4.0},
        {"external": 60, "cold": 40, "ttft_ms": 6.0},
        {"engine": 50, "cold": 50, "ttft_ms": 9.0},
        {"engine": 10, "cold": 90, "ttft_ms": None},  # the engine measured none
    ]
)


def test_the_table_has_a_row_per_class_that_has_requests():
    table = ttft.ttft_table({"run": TABLE, "no ttft": TABLE.assign(ttft_ms=None)})
    rows = table.set_index("served_by")
    assert list(rows.index) == [
        "all",
        "external cache",
        "vLLM prefix cache only",
    ]  # no "no hit" row
    assert list(table["run"].unique()) == ["run"]
    assert rows.loc["all", "requests"] == 3
    assert rows.loc["external cache", "p50_ms"] == pytest.approx(5.0)
    assert rows.loc["external cache", "mean_hit_share"] == pytest.approx(0.7)
    assert rows.loc["vLLM prefix cache only", "p99_ms"] == pytest.approx(9.0)
    assert not table.isna().any().any()


def test_the_figures_draw_what_there_is_and_say_when_there_is_nothing():
    figure = ttft.ttft_by_hit_figure(TABLE, "TTFT", clock="wall clock")
    axes = figure.axes[0]
    labels = [t.get_text() for t in axes.get_legend().get_texts()]
    assert labels == [
        "external cache: 2 requests, median TTFT 5 ms",
        "vLLM prefix cache only: 1 requests, median TTFT 9 ms",
    ]
    assert "wall clock" in axes.get_ylabel() and "computed" in axes.get_xlabel()
    (note,) = [t.get_text() for t in axes.texts]
    # What each class paid: tokens computed, and for the external hits the tokens loaded.
    assert "external cache: median 5 ms" in note and "loaded" in note.split("\n")[0]
    assert "an external hit adds its load" in note
    plt.close(figure)
    figure = ttft.ttft_cdf_figure({"run": TABLE, "none": TABLE.drop(columns="ttft_ms")}, "CDF")
    assert [line.get_label() for line in figure.axes[0].get_lines()] == [
        "run (external hits 35%, n=3)"
    ]
    plt.close(figure)
    figure = ttft.ttft_cdf_figure({"none": TABLE.assign(ttft_ms=None)}, "CDF")
    assert any("no run has" in text.get_text() for text in figure.axes[0].texts)
    plt.close(figure)
