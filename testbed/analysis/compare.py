"""Runs side by side: every swept key visible at once, oracle bounds where there are any.

:func:`sweep_figure` draws small multiples of per-run metrics against the source's x-axis
with one line per combination of the other swept keys, each told apart by colour, line
style *and* marker and named in the legend (``mla=True`` against ``mla=False`` at every TP
size of a TP × MLA sweep). A metric no measured run has is left out, and so is a point
whose value is missing: nothing is drawn as NaN. :func:`oracle_gaps` lists only the
measured runs that have an oracle with the same parameters. :func:`stored_bytes_per_rank`
says what each KV rank stored (TP shards heads, MLA stores one latent copy).
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Iterator, Mapping, Sequence

import numpy as np
import pandas as pd
from matplotlib import pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from testbed.analysis import metrics, plots
from testbed.analysis.plots import axis_label
from testbed.analysis.source import ORACLE, Source, value_text
from testbed.analysis.tables import compare_to_oracle
from testbed.analysis.ttft import ttft_clock
from testbed.core.sizes import format_bytes
from testbed.core.telemetry import attributes as a

MIB = 2**20
PANELS: dict[str, tuple[str, float]] = {
    "token_hit_rate": ("token hit rate (%)", 0.01),
    "external_token_hit_rate": ("external token hit rate (%)", 0.01),
    "stored_bytes": ("bytes stored (MiB)", MIB),
    "retrieved_bytes": ("bytes retrieved (MiB)", MIB),
    "evicted_bytes": ("bytes evicted (MiB)", MIB),
    "lookup_p50_ms": ("lookup (ms of wall clock): p50, bar to p99", 1.0),
    "store_p50_ms": ("store (ms of wall clock): p50, bar to p99", 1.0),
    "retrieve_p50_ms": ("retrieve (ms of wall clock): p50, bar to p99", 1.0),
    "ttft_p50_ms": ("TTFT (ms): p50, bar to p99", 1.0),
}
"""Column → (axis label, divisor) of the default panels. A ``*_p50_ms`` panel draws each
point's spread up to its ``*_p99_ms`` and its sample count (``*_count``); every panel's
y-axis starts at 0, rates run to 100 %."""
_STYLES = ("-", "--", ":", "-.")
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def sweep_figure(
    runs: pd.DataFrame,
    x: str,
    series: Sequence[str] = (),
    panels: Mapping[str, tuple[str, float]] = PANELS,
    title: str = "",
) -> Figure:
    """One panel per column of ``panels`` that a measured run has: the metric against ``x``,
    one line per combination of ``series`` values (colour, line style and marker each
    change with it). Oracle runs are grey crosses on a dashed line, in the panels where
    they have a value."""
    measured = _measured(runs)
    shown = [
        c for c in panels if c in runs and pd.to_numeric(measured[c], errors="coerce").notna().any()
    ]
    columns = min(3, max(1, len(shown)))
    rows = max(1, -(-len(shown) // columns))
    figure, grid = plt.subplots(
        rows,
        columns,
        figsize=(4.6 * columns + 1.5, 3.6 * rows + 0.8),
        layout="constrained",
        squeeze=False,
    )
    figure.suptitle(textwrap.fill(title, 110))
    positions, ticks = _x_positions(runs[x])
    groups = list(_series_groups(runs, series))
    for panel, column in zip(grid.flat, shown, strict=False):
        ylabel, scale = panels[column]
        for number, (name, members) in enumerate(groups):
            _line(panel, _measured(members), x, column, scale, positions, name, number)
        for name, members in _series_groups(runs[runs["engine"] == ORACLE], series):
            _line(panel, members, x, column, scale, positions, f"oracle{name}", None)
        if column == "ttft_p50_ms":
            ylabel = ylabel.replace("(ms)", f"(ms, {ttft_clock(_measured(runs)['engine'])})")
        _format_panel(panel, x, column, ylabel, positions, ticks)
    for panel in list(grid.flat)[len(shown) :]:
        panel.axis("off")
    _legend_or_notice(figure, grid.flat[0], shown)
    return figure


def _format_panel(
    panel: Axes,
    x: str,
    column: str,
    ylabel: str,
    positions: Mapping[str, float],
    ticks: list[str] | None,
) -> None:
    """Labels, grid, x ticks (``ticks`` as labels, else the positions, logarithmic for sizes
    of more than two values) and the y range (0-100 for a rate, from 0 otherwise)."""
    panel.set_ylabel(textwrap.fill(ylabel, 40))
    panel.set_xlabel(axis_label(x))
    panel.grid(True, alpha=0.3)
    if ticks is not None:
        panel.set_xticks(range(len(ticks)), ticks, rotation=20, ha="right")
    else:
        xs = sorted(set(positions.values()))
        if x in ("chunk_size", "capacity_tokens", "capacity_bytes") and len(xs) > 2:
            panel.set_xscale("log", base=2)
        panel.set_xticks(xs, [f"{v:g}" for v in xs])
        panel.minorticks_off()
    if column.endswith("_rate"):
        panel.set_ylim(0, 100)
    else:
        panel.set_ylim(bottom=0)


def _legend_or_notice(figure: Figure, first: Axes, shown: Sequence[str]) -> None:
    """The figure's legend from its ``first`` panel's lines, or, when no panel is ``shown``,
    a notice in that panel that no measured run is there to compare."""
    if not shown:
        first.text(
            0.5,
            0.5,
            "no measured run to compare",
            ha="center",
            va="center",
            transform=first.transAxes,
        )
    else:
        handles, labels = first.get_legend_handles_labels()
        figure.legend(
            handles, labels, loc="outside lower center", ncols=min(4, len(labels)), fontsize="small"
        )


RUN_COLUMNS: dict[str, str] = {
    "summary_requests": "requests",
    "token_hit_rate": "token hit rate",
    "external_token_hit_rate": "external hit rate",
    "stored_bytes": "stored",
    "evicted_bytes": "evicted",
    "lookup_p50_ms": "lookup p50 ms",
    "ttft_p50_ms": "TTFT p50 ms",
    "integrity_errors": "integrity errors",
    "sampling_text": "traces",
}
"""Column → heading of :func:`runs_table`."""


def runs_table(source: Source, columns: Mapping[str, str] = RUN_COLUMNS) -> pd.DataFrame:
    """The source's runs for reading: ``label``, ``engine``, the swept keys and ``columns``
    (those the runs have), as text: rates in %, bytes in binary units, a value a run does not
    have (an oracle's bytes) as ``–``."""
    runs = source.runs
    table = pd.DataFrame({"run": runs["label"], "engine": runs["engine"]})
    for key in source.swept:
        table[key] = [value_text(key, value) for value in runs[key]]
    for column, heading in columns.items():
        if column in runs:
            table[heading] = runs[column].map(lambda v, c=column: _text(c, v))
    return table.set_index("run")


def bytes_per_rank_figure(per_rank: pd.DataFrame, title: str) -> Figure:
    """Bars of :func:`stored_bytes_per_rank`: per run, the MiB each KV rank stored."""
    ranks = {c: c for c in per_rank.columns if c != "label"}
    return plots.grouped_bars(per_rank, "label", ranks, "bytes stored (MiB)", title, scale=MIB)


def oracle_gaps(source: Source, metric: str = "token_hit_rate") -> pd.DataFrame:
    """Each measured run's ``metric`` beside the oracle run with the same swept parameters,
    and the gap: only runs that have such an oracle (none when the source has no oracle)."""
    keys = [k for k in source.swept if k in source.runs]
    columns = ["run_id", "engine", *keys, metric, "oracle", "gap"]
    if source.oracles.empty or not keys:
        return pd.DataFrame(columns=columns)
    table = compare_to_oracle(source.runs, keys, metric)
    return table[table["oracle"].notna()].reset_index(drop=True)[columns]


def stored_bytes_per_rank(tables: Mapping[str, pd.DataFrame]) -> pd.DataFrame:
    """Per run (``tables``: label → its spans): ``label`` and one column ``rank K`` per KV
    rank with the bytes its connector stores committed (``kvcache.bytes`` of the store spans,
    0 for a store that failed)."""
    rows = []
    for label, spans in tables.items():
        stores = spans[spans["name"] == a.CONNECTOR_STORE]
        ranks = metrics.column(stores, a.KV_RANK, 0).astype("int64")
        per_rank = pd.to_numeric(metrics.column(stores, a.BYTES)).groupby(ranks).sum()
        rows.append({"label": label, **{f"rank {int(r)}": float(b) for r, b in per_rank.items()}})
    table = pd.DataFrame(rows)
    ranks = sorted((c for c in table.columns if c != "label"), key=lambda c: int(c.split()[1]))
    return table.reindex(columns=["label", *ranks]).fillna(0.0) if len(table) else table


def _text(column: str, value: object) -> str:
    if value is None or (not isinstance(value, str) and bool(pd.isna(value))):
        return "–"
    if column.endswith("_rate"):
        return f"{float(value):.1%}"  # type: ignore[arg-type]
    if column.endswith("_bytes"):
        return format_bytes(float(value))  # type: ignore[arg-type]
    if column.endswith("_ms"):
        return f"{float(value):.3g}"  # type: ignore[arg-type]
    if isinstance(value, float) and value.is_integer():
        return f"{int(value):,}"
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value)


def _measured(runs: pd.DataFrame) -> pd.DataFrame:
    return runs[runs["engine"] != ORACLE]


def _series_groups(runs: pd.DataFrame, series: Sequence[str]) -> Iterator[tuple[str, pd.DataFrame]]:
    """``(legend suffix, runs)`` per combination of ``series`` values, in order."""
    if not series:
        yield "", runs
        return
    for values, members in runs.groupby(list(series), sort=True, dropna=False):
        values = values if isinstance(values, tuple) else (values,)
        name = ", ".join(f"{k}={value_text(k, v)}" for k, v in zip(series, values, strict=True))
        yield f" {name}", members


def _x_positions(values: pd.Series) -> tuple[dict[str, float], list[str] | None]:
    """Position per value (as text), and tick labels when the values are categories: flags,
    names, or numbers of which some are missing (an unlimited capacity, drawn last)."""
    originals = dict(zip((str(v) for v in values), values, strict=True))
    coerced = pd.to_numeric(pd.Series(list(originals.values()), dtype=object), errors="coerce")
    numbers = dict(zip(originals, coerced.astype(float), strict=True))
    flags = pd.api.types.is_bool_dtype(values) or any(_is_flag(v) for v in originals.values())
    missing = {text for text, number in numbers.items() if math.isnan(number)}
    if not flags and not missing:
        return numbers, None
    if flags or len(missing) == len(numbers):
        order = list(originals)
    else:
        order = sorted(originals, key=lambda t: (t in missing, 0.0 if t in missing else numbers[t]))
    labels = [value_text(str(values.name), originals[text]) for text in order]
    return {text: float(i) for i, text in enumerate(order)}, labels


def _is_flag(value: object) -> bool:
    return isinstance(value, bool | np.bool_)


def _line(
    axes: plt.Axes,
    runs: pd.DataFrame,
    x: str,
    column: str,
    scale: float,
    positions: Mapping[str, float],
    name: str,
    number: int | None,
) -> None:
    """One series of a panel; ``number`` None draws it as an oracle bound."""
    values = pd.to_numeric(runs[column], errors="coerce")
    keep = values.notna()
    if not keep.any():
        return
    xs = np.array([positions[str(v)] for v in runs.loc[keep, x]])
    ys = values[keep].to_numpy(dtype=float) / scale
    order = np.argsort(xs, kind="stable")
    if number is None:  # an oracle: a bound
        axes.plot(xs[order], ys[order], "x--", color="0.45", label=name.strip())
        return
    colour = plt.rcParams["axes.prop_cycle"].by_key()["color"][number % 10]
    style = _STYLES[number % len(_STYLES)]
    axes.plot(
        xs[order],
        ys[order],
        color=colour,
        linestyle=style,
        marker=_MARKERS[number % len(_MARKERS)],
        label=f"measured{name}",
    )
    if column.endswith("_p50_ms"):
        _spread(axes, runs[keep], column, xs, ys, colour)


def _spread(
    axes: plt.Axes, runs: pd.DataFrame, column: str, xs: np.ndarray, ys: np.ndarray, colour: str
) -> None:
    """A latency point's spread (a bar up to its p99) and its sample count."""
    operation = column.removesuffix("_p50_ms")
    if f"{operation}_p99_ms" in runs:
        upper = pd.to_numeric(runs[f"{operation}_p99_ms"], errors="coerce").to_numpy(dtype=float)
        above = np.nan_to_num(np.maximum(upper - ys, 0.0))
        axes.errorbar(xs, ys, yerr=np.vstack([np.zeros(len(ys)), above]), fmt="none", ecolor=colour,
                      capsize=3, lw=1)  # fmt: skip
    if f"{operation}_count" in runs:
        counts = pd.to_numeric(runs[f"{operation}_count"], errors="coerce").to_numpy(dtype=float)
        for x, y, count in zip(xs, ys, counts, strict=True):
            if not np.isnan(count):
                axes.annotate(f"n={int(count)}", (x, y), xytext=(3, -10), fontsize="xx-small",
                              textcoords="offset points", color=colour)  # fmt: skip
