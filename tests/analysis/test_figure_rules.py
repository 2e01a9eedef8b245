"""Figures that cannot mislead: one palette for token categories in every figure and notebook,
hit-rate axes from 0, sample counts and spread on latency figures, runs compared with curves of
their own quantity, each run its own marker, and time axes that name their clock."""

from __future__ import annotations

import json
import re
from pathlib import Path

import matplotlib
import nbformat
import pandas as pd
import pytest
from matplotlib import colors
from matplotlib import pyplot as plt

matplotlib.use("Agg")

from testbed.analysis import (  # noqa: E402
    attribution_plots,
    capacity_whatif,
    compare,
    open_source,
    over_time,
    plots,
    ttft,
)
from testbed.analysis.attribution import CATEGORIES  # noqa: E402
from testbed.analysis.latency_split import latency_split_figure, run_latency_split  # noqa: E402
from testbed.analysis.palette import (  # noqa: E402
    CATEGORY_COLOURS,
    CATEGORY_LABELS,
    SERVED_BY_COLOURS,
)
from tests.analysis.test_per_request import requests_table  # noqa: E402

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))
RATE_LABEL = re.compile(r"rate|share|\(%\)")


def legend_colours(axes: plt.Axes) -> dict[str, tuple[float, float, float]]:
    """Each legend entry's face colour (bars, dots) or line colour, without its alpha."""
    found = {}
    for handle, label in zip(*axes.get_legend_handles_labels(), strict=True):
        artist = handle.patches[0] if hasattr(handle, "patches") else handle
        if hasattr(artist, "get_facecolor"):
            colour = artist.get_facecolor()
            colour = colour[0] if len(colour) and not isinstance(colour[0], float) else colour
        else:
            colour = artist.get_color()
        found[label] = colors.to_rgb(colour)
    return found


def rate_axes_start_at_zero(figure) -> list[str]:
    """The y labels of rate axes that do not start at 0."""
    wrong = []
    for axes in figure.axes:
        label = axes.get_ylabel()
        if RATE_LABEL.search(label) and axes.get_ylim()[0] != 0:
            wrong.append(label)
    return wrong


TABLE = requests_table(
    [
        {"engine": 60, "external": 20, "cold": 19, "last_token": 1, "ttft_ms": 5.0},
        {"external": 70, "capacity": 29, "last_token": 1, "ttft_ms": 7.0},
        {"engine": 40, "partial_chunk": 59, "last_token": 1, "ttft_ms": 9.0},
        {"cold": 99, "last_token": 1, "ttft_ms": 20.0},
    ]
)


def test_a_token_category_has_one_colour_in_every_figure():
    runs = pd.DataFrame(
        {
            "label": ["a", "b"],
            "engine_hit_tokens": [5, 1],
            "external_hit_tokens": [3, 8],
            "recomputed_tokens": [2, 1],
        }  # fmt: skip
    )
    sources = plots.token_breakdown(runs, "label", "sources")
    tokens = TABLE[list(CATEGORIES)].sum().to_frame().T.assign(label="run")
    causes = attribution_plots.where_tokens_went(tokens, "label", "causes")
    by_class = ttft.ttft_by_hit_figure(TABLE, "ttft")
    drawn = {
        "sources": legend_colours(sources.axes[0]),
        "causes": legend_colours(causes.axes[0]),
        "ttft": legend_colours(by_class.axes[0]),
    }
    for name in ("engine", "external"):
        expected = colors.to_rgb(CATEGORY_COLOURS[name])
        for figure, legend in drawn.items():
            # The category itself, and the class of requests it served (the TTFT figure).
            names = (CATEGORY_LABELS[name], {"engine": "vLLM prefix cache only",
                                             "external": "external cache"}[name])  # fmt: skip
            shown = [c for label, c in legend.items() if label.startswith(names)]
            assert shown and all(c == expected for c in shown), (figure, name, legend)
    for name in CATEGORIES:  # every category in the legend, in its colour
        assert drawn["causes"][CATEGORY_LABELS[name]] == colors.to_rgb(CATEGORY_COLOURS[name])
    assert SERVED_BY_COLOURS["vLLM prefix cache only"] == CATEGORY_COLOURS["engine"]
    for figure in (sources, causes, by_class):
        assert rate_axes_start_at_zero(figure) == []
        plt.close(figure)


def test_notebooks_draw_with_the_librarys_colours_only():
    for path in NOTEBOOKS:
        book = nbformat.read(path, as_version=4)
        code = "\n".join(cell.source for cell in book.cells if cell.cell_type == "code")
        assert not re.search(r"colou?r\s*=|tab:|#[0-9a-fA-F]{6}", code), path.name


@pytest.mark.vllm
def test_the_sweep_figures_follow_the_rules(small_sweep):
    source = open_source(small_sweep)

    panels = compare.sweep_figure(source.runs, source.x, source.series, title="compare")
    assert rate_axes_start_at_zero(panels) == []
    latency = [a for a in panels.axes if "p50, bar to p99" in " ".join(a.get_ylabel().split())]
    assert latency and all(a.get_ylim()[0] == 0 for a in latency)
    for axes in latency:  # every point's sample count and its spread
        counts = [t.get_text() for t in axes.texts if t.get_text().startswith("n=")]
        assert len(counts) == len(source.measured)
        assert axes.containers  # the bars up to p99
    assert "wall clock" in " ".join(latency[0].get_ylabel().split())
    plt.close(panels)

    figure = over_time.hit_rate_over_time_figure(source.requests(), "over time")
    assert rate_axes_start_at_zero(figure) == [] and "clock" in figure.axes[0].get_xlabel()
    plt.close(figure)
    figure = latency_split_figure(source.each(run_latency_split), "split")
    axes = figure.axes[0]
    assert "wall clock" in axes.get_xlabel() and axes.get_xlim()[0] == 0
    assert sum(t.get_text().startswith("n=") for t in axes.texts) == 3 * len(source.measured)
    plt.close(figure)
    run = source.measured_run()
    clock = ttft.ttft_clock([run.spec["engine"]])
    figure = ttft.ttft_by_hit_figure(run.requests, "ttft", clock)
    assert "projected replay clock" in figure.axes[0].get_ylabel()
    plt.close(figure)


@pytest.mark.vllm
def test_runs_meet_curves_of_their_own_quantity_each_with_its_own_marker(small_sweep):
    source = open_source(small_sweep)
    (result,) = capacity_whatif.capacity_whatifs(source)
    measured, oracle = result.panels
    engines = source.runs.set_index("label")["engine"]
    # Measured runs (vLLM + external hits) on the curve of recorded accesses, oracle runs (the
    # external cache alone) on the workload's: never one on the other's.
    assert {engines[label] for label in measured.points["label"]} == {"replay"}
    assert {engines[label.removesuffix(" (unlimited)")] for label in oracle.points["label"]} == {
        "oracle"
    }
    assert measured.whatif.meta["source"]["kind"] == "run"
    assert oracle.whatif.meta["source"]["kind"] == "workload"
    recorded = json.loads((small_sweep / "sweep.json").read_text())["runs"]
    assert measured.whatif.meta["source"]["run_id"] in recorded
    figure = capacity_whatif.hit_rate_figure(result, "capacity")
    left, right = figure.axes
    assert "vLLM's prefix cache + the external cache" in left.get_ylabel()
    assert "external cache alone" in right.get_ylabel()
    assert rate_axes_start_at_zero(figure) == []
    runs = [line for line in left.get_lines() if line.get_label().startswith("run: ")]
    assert len(runs) == len(measured.points)
    styles = {(line.get_marker(), colors.to_hex(line.get_markerfacecolor())) for line in runs}
    assert len(styles) == len(runs)  # no two runs drawn alike
    floor = [line for line in left.get_lines() if "vLLM's prefix cache alone" in line.get_label()]
    assert floor and colors.to_rgba(floor[0].get_color()) == colors.to_rgba(
        CATEGORY_COLOURS["engine"]
    )
    plt.close(figure)
    reuse = capacity_whatif.reuse_figure(result, "reuse")
    assert "the cache server's clock" in reuse.axes[1].get_xlabel()
    plt.close(reuse)
