"""Time to first token with and without the cache.

``ttft_ms`` is the engine's (per-request table; METRICS.md: projected on the replay's clock,
wall time for vLLM). Within a run, requests are told apart by what served their hits
(:data:`testbed.analysis.per_request.SERVED_BY`: the external cache loaded some of their
prompt, only vLLM's own prefix cache hit, nothing hit); across runs, by the runs' caches
(capacity, policy, chunk size: whatever the sweep varies).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import numpy as np
import pandas as pd
from matplotlib import ticker
from matplotlib.axis import Axis
from matplotlib.figure import Figure

from testbed.analysis.figure_frame import new_figure, no_data
from testbed.analysis.palette import SERVED_BY_COLOURS
from testbed.analysis.per_request import SERVED_BY, hit_shares

ALL = "all"
QUANTILES = (0.5, 0.9, 0.99)


def ttft_table(tables: Mapping[str, pd.DataFrame]) -> pd.DataFrame:
    """Per run (``tables``: label → per-request table) and per :data:`SERVED_BY` class (and
    ``all``): ``requests`` with a TTFT, ``mean_hit_share`` and the TTFT percentiles
    ``p50_ms``, ``p90_ms``, ``p99_ms``. Classes without a request have no row; runs without
    any TTFT neither."""
    rows = []
    for label, requests in tables.items():
        shares = hit_shares(requests)
        shares = shares[shares["ttft_ms"].notna()]
        if shares.empty:
            continue
        classes = [(ALL, shares)] + [
            (name, shares[shares["served_by"] == name]) for name in SERVED_BY
        ]
        for name, rows_of in classes:
            if rows_of.empty:
                continue
            quantiles = np.quantile(rows_of["ttft_ms"].to_numpy(), QUANTILES)
            rows.append(
                {
                    "run": label,
                    "served_by": name,
                    "requests": len(rows_of),
                    "mean_hit_share": float(rows_of["hit_share"].mean()),
                    **{
                        f"p{round(q * 100)}_ms": float(v)
                        for q, v in zip(QUANTILES, quantiles, strict=True)
                    },
                }
            )
    columns = ["run", "served_by", "requests", "mean_hit_share"]
    return pd.DataFrame(rows, columns=[*columns, *(f"p{round(q * 100)}_ms" for q in QUANTILES)])


def ttft_by_hit_figure(requests: pd.DataFrame, title: str, clock: str = "") -> Figure:
    """One dot per request: its TTFT (log scale) against the prompt tokens vLLM computed for
    it, coloured by what served its hits, a dashed line at each class's median TTFT, and a box
    that says what the classes pay: a request the external cache served computed fewer tokens
    but first loaded its hit; one whose hits came from vLLM's own prefix cache paid nothing for
    them. ``clock``: which clock the TTFTs are on (:func:`ttft_clock`)."""
    figure, axes = new_figure(title, (9, 5.5), 90)
    shares = hit_shares(requests)
    loaded = pd.to_numeric(requests["external_hit_tokens"], errors="coerce").reset_index(drop=True)
    shares = shares.assign(loaded_tokens=loaded.to_numpy())
    shares = shares[shares["ttft_ms"].notna() & (shares["ttft_ms"] > 0)]
    notes = []
    for name in SERVED_BY:
        rows = shares[shares["served_by"] == name]
        if rows.empty:
            continue
        median = float(rows["ttft_ms"].median())
        axes.scatter(
            rows["recomputed_tokens"].clip(lower=1),
            rows["ttft_ms"],
            s=16,
            alpha=0.7,
            color=SERVED_BY_COLOURS[name],
            label=f"{name}: {len(rows)} requests, median TTFT {median:.3g} ms",
        )
        axes.axhline(median, color=SERVED_BY_COLOURS[name], lw=1, linestyle="--")
        notes.append(_class_note(name, rows, median))
    if shares.empty:
        no_data(axes, "no request has a time to first token")
    else:
        _log_scale(axes.yaxis, axes.set_yscale)
        _log_scale(axes.xaxis, axes.set_xscale)
        axes.legend(fontsize="small", loc="upper left")
        text = "\n".join(
            [*notes, "TTFT grows with the tokens computed; an external hit adds its load."]
        )
        axes.text(0.99, 0.02, text, transform=axes.transAxes, ha="right", va="bottom",
                  fontsize="x-small", bbox={"facecolor": "white", "alpha": 0.85})  # fmt: skip
    axes.set_xlabel("prompt tokens vLLM computed (recomputed, log scale)")
    axes.set_ylabel(f"time to first token (ms{', ' + clock if clock else ''}, log scale)")
    return figure


def ttft_clock(engines: Iterable[str]) -> str:
    """Which clock the TTFTs of runs of these engines are on: the replay's projected clock
    (METRICS.md), or the wall clock (vllm, serve)."""
    kinds = {"projected replay clock" if e == "replay" else "wall clock" for e in engines}
    return " / ".join(sorted(kinds))


def _class_note(name: str, rows: pd.DataFrame, median: float) -> str:
    computed = int(rows["recomputed_tokens"].median())
    note = f"{name}: median {median:.3g} ms, {computed} tokens computed"
    if name == SERVED_BY[0]:
        note += f", {int(rows['loaded_tokens'].median())} loaded"
    return note


def ttft_cdf_figure(tables: Mapping[str, pd.DataFrame], title: str, clock: str = "") -> Figure:
    """CDFs of TTFT, one per run (``tables``: label → per-request table), each labelled
    with its external token hit rate and its number of requests."""
    figure, axes = new_figure(title, (9, 5.5), 90)
    drawn = 0
    for label, requests in tables.items():
        if "ttft_ms" not in requests:
            continue
        ttft = pd.to_numeric(requests["ttft_ms"], errors="coerce").dropna()
        values = np.sort(ttft.to_numpy(dtype=float))
        if not len(values):
            continue
        prompt = max(float(requests["prompt_tokens"].sum()), 1.0)
        external = float(requests["external_hit_tokens"].sum()) / prompt
        axes.plot(
            values,
            np.arange(1, len(values) + 1) / len(values),
            label=f"{label} (external hits {external:.0%}, n={len(values)})",
        )
        drawn += 1
    if drawn:
        _log_scale(axes.xaxis, axes.set_xscale)
        axes.legend(fontsize="x-small")
    else:
        no_data(axes, "no run has a time to first token")
    axes.set_xlabel(f"time to first token (ms{', ' + clock if clock else ''}, log scale)")
    axes.set_ylabel("fraction of requests")
    return figure


def _log_scale(axis: Axis, set_scale: Callable[[str], None]) -> None:
    """A log axis with plain numbers (12, 20, 50) as tick labels."""
    set_scale("log")
    plain = ticker.FuncFormatter(lambda value, _: f"{value:g}")
    axis.set_major_formatter(plain)
    axis.set_minor_formatter(plain)
