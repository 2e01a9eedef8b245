"""The capacity what-if of a source: LRU curves at every capacity, the runs on the curve that
measures the same quantity as they do.

A run's token hit rate counts vLLM's own prefix hits and the external cache's; the oracle's
counts the external cache alone (it has no engine). So a source's runs are compared with two
curves, never mixed (:mod:`testbed.analysis.whatif`):

- **measured runs** (an engine in front of the cache server) on the curve of the accesses a
  run recorded (its chunk log, :func:`what_if_run`): ``(E + X(c)) / P`` at every capacity
  ``c``, the quantity the runs measure; the run with the largest capacity records the stream
  (an unlimited one when there is one). ``E / P``, vLLM's own share, is the floor: what lies
  above it is what the external cache buys.
- **oracle runs** on the workload's curve (:func:`what_if_workload`, keyed as the oracle keys
  it): the external cache alone, with Belady's optimum beside LRU.

:func:`capacity_whatif` does it for a source of one workload (a sweep of several workloads:
:func:`capacity_whatifs`, one each); a source without the inputs (no chunk log, a trace file
not found from here) gets :attr:`CapacityWhatIf.reason`. Runs with an unlimited cache are drawn
where the curve stops changing (the capacity that holds every chunk), labelled ``(unlimited)``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from testbed.analysis.chunklog import has_chunk_log
from testbed.analysis.source import ORACLE, Source, open_source
from testbed.analysis.whatif import figures
from testbed.analysis.whatif.analyze import (
    SIMULATED_POLICIES,
    WhatIfOptions,
    what_if_run,
    what_if_workload,
)
from testbed.analysis.whatif.results import WhatIf
from testbed.analysis.whatif.runlog import run_spec

log = logging.getLogger(__name__)

RUN, WORKLOAD = "run", "workload"
_IDENTITY = ("workload", "requests", "seed", "workload_params", "max_output_tokens")
_RESIDUAL_COLUMNS = [
    "chunk_size",
    "capacity_tokens",
    "policy",
    "prompt_tokens",
    "measured_external_hit_tokens",
    "predicted_external_hit_tokens",
    "residual_tokens",
    "requests_over",
    "requests_under",
]
MEASURED_COLUMNS = ["label", "chunk_size", "capacity_tokens", "unlimited", "token_hit_rate"]
MEASURED_QUANTITY = "token hit rate: vLLM's prefix cache + the external cache (%)"
ORACLE_QUANTITY = "token hit rate: the external cache alone (%)"


@dataclass(frozen=True)
class CapacityWhatIf:
    """A source's what-if (of one workload), or why there is none."""

    whatif: WhatIf | None
    """The first panel's curves (the run's when there are measured runs)."""
    kind: str | None
    """``run`` (a run's recorded accesses), ``workload`` (the workload's), ``None``."""
    measured: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=MEASURED_COLUMNS))
    """The source's runs as points (every panel's): :data:`MEASURED_COLUMNS`."""
    reason: str = ""
    """Why there is no what-if (``""`` when there is)."""
    panels: tuple[figures.CurvePanel, ...] = ()
    """The comparisons to draw, each runs against a curve of the same quantity."""
    workload: str = ""
    """The workload's label (sweeps of several workloads)."""

    @property
    def applies(self) -> bool:
        return self.whatif is not None

    def describe(self) -> str:
        """One sentence per panel: what the curves are of, or why there are none."""
        if self.whatif is None:
            return f"No capacity what-if: {self.reason}."
        lines = []
        for panel in self.panels:
            meta = panel.whatif.meta
            sizes = ", ".join(str(size) for size in meta["chunk_sizes"])
            lines.append(
                f"{panel.title}: {meta['num_requests']} requests, {meta['prompt_tokens']:,} "
                f"prompt tokens, chunk sizes {sizes}; {len(panel.points)} runs as points."
            )
        return "\n".join(lines)

    def residual(self) -> pd.DataFrame:
        """The run curve's predicted against measured external hits at the recording run's
        own capacity and chunk size, one row (none without a run curve)."""
        run = None if self.whatif is None else self.whatif.meta.get("run")
        if not run:
            return pd.DataFrame(columns=_RESIDUAL_COLUMNS)
        capacity = run.get("capacity_tokens")
        row = {**run, "capacity_tokens": "unlimited" if capacity is None else capacity}
        return pd.DataFrame([row], columns=_RESIDUAL_COLUMNS)


def capacity_whatifs(
    source: Source, policies: tuple[str, ...] = ("lru", "belady"), policy_points: int = 3
) -> list[CapacityWhatIf]:
    """:func:`capacity_whatif` of each workload of ``source`` (in the order of the runs)."""
    keys = [k for k in _IDENTITY if k in source.runs]
    identity = source.runs[keys].astype(str).apply(tuple, axis=1)
    results = []
    for value in dict.fromkeys(identity):
        runs = source.runs[identity == value]
        result = capacity_whatif(source, policies, policy_points, runs=runs)
        label = str(runs["workload"].iloc[0]) if "workload" in runs else ""
        results.append(_with_workload(result, figures.short_workload(label)))
    return results


def capacity_whatif(
    source: Source,
    policies: tuple[str, ...] = ("lru", "belady"),
    policy_points: int = 3,
    *,
    runs: pd.DataFrame | None = None,
) -> CapacityWhatIf:
    """The what-if of ``source``'s runs (or of ``runs``, some of them; see the module
    docstring)."""
    runs = source.runs if runs is None else runs
    keys = [k for k in _IDENTITY if k in runs]
    if len(runs[keys].astype(str).drop_duplicates()) != 1:
        return CapacityWhatIf(
            None, None, reason="the runs differ in workload; a capacity curve is one workload's"
        )
    panels: list[figures.CurvePanel] = []
    try:
        measured = runs[runs["engine"] != ORACLE]
        recorder = _recorder(source, measured)
        if recorder is not None:
            size = run_spec(source.run_dir(recorder)).chunk_size
            multiples = {int(c) for c in measured["chunk_size"] if int(c) % size == 0}
            sizes = (
                tuple(sorted(multiples)) if source.kind == "sweep" else (size, 2 * size, 4 * size)
            )
            measured = measured[measured["chunk_size"].astype(int).isin(sizes)]
            options = WhatIfOptions(
                chunk_sizes=sizes,
                policies=policies if source.kind == "run" else ("lru",),
                at_tokens=_capacities(measured),
                policy_points=policy_points,
            )
            whatif = what_if_run(source.run_dir(recorder), options)
            panels.append(_measured_panel(source, whatif, measured, recorder))
        oracles = runs if recorder is None else runs[runs["engine"] == ORACLE]
        if recorder is None or len(oracles):
            spec = run_spec(source.run_dir(str(runs["run_id"].iloc[0])))
            options = WhatIfOptions(
                chunk_sizes=tuple(sorted({int(c) for c in runs["chunk_size"]})),
                policies=policies,
                at_tokens=_capacities(runs),
                policy_points=policy_points,
            )
            whatif = what_if_workload(spec, options)
            title = f"The external cache alone: {_names(oracles, 'runs')} on the workload's curve"
            points = _points(whatif, source, oracles)
            panels.append(figures.CurvePanel(title, whatif, points, ORACLE_QUANTITY))
    except (FileNotFoundError, ValueError) as exc:  # e.g. a trace path relative to elsewhere
        return CapacityWhatIf(None, None, reason=str(exc))
    kind = RUN if recorder is not None else WORKLOAD
    everything = pd.concat([panel.points for panel in panels], ignore_index=True)
    return CapacityWhatIf(panels[0].whatif, kind, everything, panels=tuple(panels))


def hit_rate_figure(result: CapacityWhatIf | list[CapacityWhatIf], title: str) -> Figure:
    """Every panel of the result(s): a row per workload, the runs on a curve of their own
    quantity (:func:`testbed.analysis.whatif.figures.curve_panels_figure`)."""
    results = [result] if isinstance(result, CapacityWhatIf) else result
    rows = [(r.workload, r.panels) for r in results if r.applies]
    if not rows:
        reasons = "; ".join(f"{r.workload or 'runs'}: {r.reason}" for r in results)
        return figures.not_applicable(title, reasons)
    return figures.curve_panels_figure(rows, title)


def report_figures(sweep_dir: Path, swept: list[str], context: str) -> list[figures.FigureEntry]:
    """``kvtb report``'s what-if figures, first among its figures: when the sweep varies
    capacity or policy, every workload's runs on their curves (:func:`hit_rate_figure`), its
    first workload's minimum capacity and reuse distances. ``[]`` otherwise."""
    if not {"capacity_tokens", "capacity_bytes", "policy"} & set(swept):
        return []
    source = open_source(sweep_dir)
    simulated = set(SIMULATED_POLICIES) - {"lru"}  # lru: the curve
    swept_policies = {str(p) for p in source.runs["policy"]} & simulated
    results = capacity_whatifs(source, ("lru", *sorted({"belady", *swept_policies})), 1)
    applies = [r for r in results if r.applies]
    for result in results:
        if not result.applies:  # an optional figure: the rest of the report stands without it
            log.warning("no what-if for %s %s: %s", sweep_dir, result.workload, result.reason)
    if not applies:
        return []
    first = applies[0]
    suffix = f" — {context}"
    return [
        (
            "whatif_hit_rate.png",
            hit_rate_figure(applies, f"What the external cache buys at every capacity{suffix}"),
            "Token hit rate against the external cache's capacity. Left: the measured runs "
            "(vLLM's prefix cache + the external cache) on the exact LRU curve of the accesses "
            "a run recorded, above vLLM's own share (dashed); right: the oracle runs (the "
            "external cache alone) on the workload's LRU curve, Belady's optimum beside it. "
            "Each panel compares one quantity.",
        ),
        (
            "whatif_min_capacity.png",
            min_capacity_figure(first, f"Minimum LRU capacity — {first.workload}{suffix}"),
            "The smallest LRU capacity that keeps 60-99% of the unlimited cache's hits.",
        ),
        (
            "whatif_reuse.png",
            reuse_figure(first, f"Reuse distance and interval — {first.workload}{suffix}"),
            "CDFs over reused chunks: stack distance in bytes (the LRU capacity that would still "
            "hold the chunk) and time since its last use, on the clock the axis names.",
        ),
    ]


def min_capacity_figure(result: CapacityWhatIf, title: str) -> Figure:
    """The smallest LRU capacity keeping each share of the unlimited cache's hits."""
    if result.whatif is None:
        return figures.not_applicable(title, result.reason)
    return figures.min_capacity_figure(result.whatif, title=title)


def reuse_figure(result: CapacityWhatIf, title: str) -> Figure:
    """CDFs of reuse distance (bytes) and reuse interval (s, the clock named on the axis)."""
    if result.whatif is None:
        return figures.not_applicable(title, result.reason)
    return figures.reuse_cdf_figure(result.whatif, title=title)


def _recorder(source: Source, measured: pd.DataFrame) -> str | None:
    """The measured run whose chunk log records the access stream: the largest capacity
    (unlimited first), LRU where the policy varies; ``None`` when no run has a log."""
    candidates = [
        row
        for row in measured.itertuples()
        if has_chunk_log(source.run_dir(str(row.run_id)))
        and pd.notna(getattr(row, "token_hit_rate", None))
    ]
    if not candidates:
        return None

    def order(row: object) -> tuple[bool, float, int]:
        capacity = getattr(row, "capacity_tokens", None)
        unlimited = capacity is None or bool(pd.isna(capacity))
        lru = getattr(row, "policy", "lru") == "lru"
        size = -int(getattr(row, "chunk_size", 0))  # the smallest: it re-chunks to the others
        return (lru, float("inf") if unlimited else float(capacity), size)  # type: ignore[arg-type]

    return str(max(candidates, key=order).run_id)


def _measured_panel(
    source: Source, whatif: WhatIf, measured: pd.DataFrame, recorder: str
) -> figures.CurvePanel:
    row = measured[measured["run_id"] == recorder].iloc[0]
    prompt = float(row.get("prompt_tokens") or 0)
    floor = float(row["engine_hit_tokens"]) / prompt if prompt else None
    label = str(row["label"])
    title = (
        f"vLLM's prefix cache + the external cache: {_names(measured, 'runs')} on the LRU curve "
        f"of the accesses {label} recorded"
        if source.kind == "sweep"
        else f"Run {recorder}: its hit rate on the LRU curve of the accesses it recorded"
    )
    points = _points(whatif, source, measured)
    return figures.CurvePanel(title, whatif, points, MEASURED_QUANTITY, floor)


def _capacities(runs: pd.DataFrame) -> tuple[int, ...]:
    if "capacity_tokens" not in runs:
        return ()
    capacities = pd.to_numeric(runs["capacity_tokens"], errors="coerce").dropna()
    return tuple(sorted({int(c) for c in capacities}))


def _names(runs: pd.DataFrame, noun: str) -> str:
    engines = sorted(set(runs["engine"].astype(str)))
    return f"{' and '.join(engines)} {noun}" if engines else noun


def _points(whatif: WhatIf, source: Source, runs: pd.DataFrame) -> pd.DataFrame:
    """The runs as points; an unlimited cache at the capacity that holds every chunk."""
    rows = []
    for row in runs.itertuples():
        rate = getattr(row, "token_hit_rate", None)
        if rate is None or pd.isna(rate):
            continue
        spec = run_spec(source.run_dir(str(row.run_id)))
        capacity = spec.capacity()
        curve = whatif.lru.get(spec.chunk_size) or next(iter(whatif.lru.values()), None)
        if capacity is None:
            if curve is None:
                continue
            tokens = curve.num_distinct_keys * curve.chunk_size
            label = str(row.label)
            label += "" if "unlimited" in label else " (unlimited)"
        else:
            tokens = capacity // spec.kv_profile.stored_bytes_per_token(spec.tp)
            label = str(row.label)
        rows.append((label, spec.chunk_size, tokens, capacity is None, float(rate)))
    return pd.DataFrame(rows, columns=MEASURED_COLUMNS)


def _with_workload(result: CapacityWhatIf, workload: str) -> CapacityWhatIf:
    return CapacityWhatIf(
        result.whatif,
        result.kind,
        result.measured,
        result.reason,
        tuple(panel.retitled(f"{workload} — {panel.title}") for panel in result.panels),
        workload,
    )
