"""The capacity what-if of a source: LRU curves at every capacity, the measured runs on them.

:func:`capacity_whatif` picks what applies (:mod:`testbed.analysis.whatif`):

- a **run** with a chunk log: the curve of the accesses it recorded (:func:`what_if_run`),
  at its chunk size and twice and four times it; its hit rates count vLLM's own prefix hits,
  as the run's do, so the run's point lies on the curve (up to the residual ``meta["run"]``);
- a **sweep** (or a run without a chunk log) whose runs share one workload: the workload's
  curve per chunk size (:func:`what_if_workload`): the external cache alone, keyed as the
  oracle keys it, so oracle runs lie on it and measured runs lie above it by vLLM's own hits;
- otherwise nothing, and :attr:`CapacityWhatIf.reason` says why.

Measured runs with an unlimited cache are drawn where the curve stops changing (the
capacity that holds every chunk of the workload), labelled ``(unlimited)``.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field

import pandas as pd
from matplotlib import pyplot as plt
from matplotlib.figure import Figure

from testbed.analysis.chunklog import has_chunk_log
from testbed.analysis.source import Source
from testbed.analysis.whatif import figures
from testbed.analysis.whatif.analyze import WhatIfOptions, what_if_run, what_if_workload
from testbed.analysis.whatif.results import WhatIf
from testbed.analysis.whatif.runlog import run_spec

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


@dataclass(frozen=True)
class CapacityWhatIf:
    """A source's what-if, or why there is none."""

    whatif: WhatIf | None
    kind: str | None
    """``run`` (a run's recorded accesses), ``workload`` (the workload's), ``None``."""
    measured: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=MEASURED_COLUMNS))
    """The source's runs as points: :data:`MEASURED_COLUMNS`."""
    reason: str = ""
    """Why there is no what-if (``""`` when there is)."""

    @property
    def applies(self) -> bool:
        return self.whatif is not None

    def describe(self) -> str:
        """One sentence: what the curves are of, or why there are none."""
        if self.whatif is None:
            return f"No capacity what-if: {self.reason}."
        meta = self.whatif.meta
        sizes = ", ".join(str(size) for size in meta["chunk_sizes"])
        what = (
            "the accesses the run recorded (its chunk log)"
            if self.kind == RUN
            else "the workload, keyed as the oracle keys it"
        )
        return (
            f"Curves of {what}: {meta['num_requests']} requests, {meta['prompt_tokens']:,} "
            f"prompt tokens, chunk sizes {sizes}; {len(self.measured)} runs as points."
        )

    def residual(self) -> pd.DataFrame:
        """A run source's predicted against measured external hits at its own capacity and
        chunk size, one row (no rows for a workload's curve)."""
        run = None if self.whatif is None else self.whatif.meta.get("run")
        if not run:
            return pd.DataFrame(columns=_RESIDUAL_COLUMNS)
        capacity = run.get("capacity_tokens")
        row = {**run, "capacity_tokens": "unlimited" if capacity is None else capacity}
        return pd.DataFrame([row], columns=_RESIDUAL_COLUMNS)


def capacity_whatif(
    source: Source, policies: tuple[str, ...] = ("lru", "belady"), policy_points: int = 3
) -> CapacityWhatIf:
    """The what-if that applies to ``source`` (see the module docstring)."""
    runs = source.runs
    try:
        if source.kind == "run" and source.first_measured() is not None:
            run = source.first_measured()
            assert run is not None
            if has_chunk_log(run.path):
                size = int(run.spec["chunk_size"])
                options = WhatIfOptions(
                    chunk_sizes=(size, 2 * size, 4 * size),
                    policies=policies,
                    policy_points=policy_points,
                )
                whatif = what_if_run(run.path, options)
                return CapacityWhatIf(whatif, RUN, _measured(whatif, source))
        keys = [k for k in _IDENTITY if k in runs]
        if len(runs[keys].astype(str).drop_duplicates()) != 1:
            return CapacityWhatIf(
                None, None, reason="the runs differ in workload; a capacity curve is one workload's"
            )
        spec = run_spec(source.run_dir(str(runs["run_id"].iloc[0])))
        capacities = pd.to_numeric(runs["capacity_tokens"], errors="coerce").dropna()
        options = WhatIfOptions(
            chunk_sizes=tuple(sorted({int(c) for c in runs["chunk_size"]})),
            policies=policies,
            at_tokens=tuple(sorted({int(c) for c in capacities})),
            policy_points=policy_points,
        )
        whatif = what_if_workload(spec, options)
    except (FileNotFoundError, ValueError) as exc:  # e.g. a trace path relative to elsewhere
        return CapacityWhatIf(None, None, reason=str(exc))
    return CapacityWhatIf(whatif, WORKLOAD, _measured(whatif, source))


def hit_rate_figure(result: CapacityWhatIf, title: str) -> Figure:
    """The LRU curve per chunk size, Belady's points, the unlimited cache, and the source's
    runs as points (:func:`testbed.analysis.whatif.figures.hit_rate_figure`)."""
    if result.whatif is None:
        return _not_applicable(title, result.reason)
    return figures.hit_rate_figure(result.whatif, result.measured, title=title)


def min_capacity_figure(result: CapacityWhatIf, title: str) -> Figure:
    """The smallest LRU capacity keeping each share of the unlimited cache's hits."""
    if result.whatif is None:
        return _not_applicable(title, result.reason)
    return figures.min_capacity_figure(result.whatif, title=title)


def reuse_figure(result: CapacityWhatIf, title: str) -> Figure:
    """CDFs of reuse distance (bytes) and reuse interval (s)."""
    if result.whatif is None:
        return _not_applicable(title, result.reason)
    return figures.reuse_cdf_figure(result.whatif, title=title)


def _measured(whatif: WhatIf, source: Source) -> pd.DataFrame:
    """The runs as points; an unlimited cache at the capacity that holds every chunk."""
    rows = []
    for row in source.runs.itertuples():
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


def _not_applicable(title: str, reason: str) -> Figure:
    figure, axes = plt.subplots(figsize=(9, 2.5), layout="constrained")
    axes.set_title(textwrap.fill(title, 90))
    axes.axis("off")
    axes.text(
        0.5,
        0.5,
        textwrap.fill(f"No what-if for this source: {reason}", 90),
        ha="center",
        va="center",
        transform=axes.transAxes,
    )
    return figure
