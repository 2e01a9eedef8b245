"""What a notebook analyses: one run, a sweep, or a directory of runs, as one table of runs.

:func:`open_source` takes any directory :func:`testbed.analysis.spans.run_dirs` accepts and
returns a :class:`Source`: one row per complete run (``run_id``, ``label``, every
:class:`~testbed.spec.runspec.RunSpec` field from ``spec.json``, every ``summary.json`` field, named
as in a sweep's ``index.parquet``: a table-valued field one column per entry, ``tokens_cold``;
a summary field named like a spec field ``summary_<name>``), the keys that vary between the
runs (the x-axis and series of the figures), and each run's :class:`~testbed.analysis.tables.Run`.

The notebooks take their source through a first-cell parameter, ``SOURCE``, that the
environment variable :data:`SOURCE_ENV` overrides (papermill's injected parameters override
both)::

    SOURCE = os.environ.get("KVTB_SOURCE", "../runs/quickstart")
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pandas as pd

from testbed.analysis.plots import short_label
from testbed.analysis.spans import is_run_dir, run_dirs
from testbed.analysis.tables import Run, figure_axes
from testbed.core.run_dir import SUMMARY, RunDir, SweepDir

T = TypeVar("T")
SOURCE_ENV = "KVTB_SOURCE"
"""Environment variable the notebooks read their source directory from (when set)."""
ORACLE = "oracle"
_NOT_COMPARED = {"run_id", "model"}  # differ between runs without being a parameter
_NOT_PARAMETERS = {"run_id", "spec_schema"}  # spec.json fields that say which spec, not what


@dataclass(frozen=True, eq=False)
class Source:
    """The complete runs under ``path``, one row each in :attr:`runs` (in the sweep's order)."""

    path: Path
    kind: str
    """``run`` (a run directory) or ``sweep`` (a sweep, or a directory of runs)."""
    runs: pd.DataFrame
    x: str
    """The figures' x-axis: a swept key (a numeric one first), ``run_id`` when nothing varies."""
    series: tuple[str, ...]
    """The other keys that tell runs apart."""
    _dirs: dict[str, Path] = field(repr=False)
    _loaded: dict[str, Run] = field(default_factory=dict, repr=False)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def measured(self) -> pd.DataFrame:
        """The runs with an engine and a cache server (every engine but the oracle)."""
        return self.runs[self.runs["engine"] != ORACLE]

    @property
    def oracles(self) -> pd.DataFrame:
        return self.runs[self.runs["engine"] == ORACLE]

    @property
    def swept(self) -> list[str]:
        """The x-axis and series keys, without ``run_id``."""
        return [k for k in (self.x, *self.series) if k != "run_id"]

    def run(self, run_id: str) -> Run:
        """One run (loaded once: its spans and tables are cached on the :class:`Run`)."""
        if run_id not in self._loaded:
            self._loaded[run_id] = Run(self._dirs[run_id])
        return self._loaded[run_id]

    def run_dir(self, run_id: str) -> Path:
        return self._dirs[run_id]

    def measured_runs(self) -> Iterator[tuple[str, Run]]:
        """``(label, run)`` of every measured run, in order."""
        for row in self.measured.itertuples():
            yield str(row.label), self.run(str(row.run_id))

    def each(self, function: Callable[[Run], T]) -> dict[str, T]:
        """``function`` of every measured run, by label (in order)."""
        return {label: function(run) for label, run in self.measured_runs()}

    def dirs(self) -> dict[str, Path]:
        """The directory of every measured run, by label."""
        return self.each(lambda run: run.path)

    def requests(self) -> dict[str, pd.DataFrame]:
        """The per-request table of every measured run, by label."""
        return self.each(lambda run: run.requests)

    def spans(self) -> dict[str, pd.DataFrame]:
        """The spans of every measured run, by label."""
        return self.each(lambda run: run.spans)

    def first_measured(self) -> Run | None:
        """The first measured run (``None`` when there is none)."""
        measured = self.measured
        return self.run(str(measured["run_id"].iloc[0])) if len(measured) else None

    def measured_run(self) -> Run:
        """The run a figure of one run shows: the first measured run. A ``ValueError`` when
        the source holds oracle runs only (they record no telemetry)."""
        run = self.first_measured()
        if run is None:
            raise ValueError(
                f"{self.path} holds oracle runs only: the oracle records no requests or spans"
            )
        return run


def open_source(path: Path | str) -> Source:
    """The runs of a run directory, a sweep directory or a directory of runs."""
    path = Path(path)
    dirs = {directory.name: directory for directory in run_dirs(path)}
    if not dirs:
        raise FileNotFoundError(f"{path} holds no complete run yet (no {SUMMARY})")
    runs = pd.DataFrame([run_row(directory) for directory in dirs.values()])
    kind = "run" if is_run_dir(path) else "sweep"
    manifest = SweepDir(path).manifest
    if kind == "sweep" and manifest.is_file():
        swept = list(json.loads(manifest.read_text())["swept"])
    else:
        swept = varying_keys(runs)
    x, series = figure_axes(swept, runs)
    labelled = [k for k in (x, *series) if k != "run_id"]
    runs.insert(1, "label", [_label(row, labelled) for _, row in runs.iterrows()])
    return Source(path, kind, runs, x, tuple(series), dirs)


def run_row(run_dir: Path) -> dict[str, Any]:
    """One run as a row of a sweep's index: its spec fields, then its summary fields."""
    spec = json.loads(RunDir(run_dir).spec.read_text())
    summary = json.loads(RunDir(run_dir).summary.read_text())
    row: dict[str, Any] = {"run_id": run_dir.name}
    for key, value in spec.items():
        if key not in _NOT_PARAMETERS:
            row[key] = json.dumps(value, sort_keys=True) if isinstance(value, dict) else value
    for key, value in summary.items():
        entries = value.items() if isinstance(value, dict) else [(None, value)]
        for inner, item in entries:
            name = key if inner is None else f"{key}_{inner}"
            if name in ("run_id", "engine", "metadata_only"):
                continue
            row[f"summary_{name}" if name in spec else name] = item
    return row


def varying_keys(runs: pd.DataFrame) -> list[str]:
    """The spec keys whose values differ between ``runs`` (``engine`` first, if it does)."""
    from testbed.spec.runspec import RunSpec

    spec_keys = RunSpec.keys()
    keys = [k for k in spec_keys if k in runs and k not in _NOT_COMPARED]
    return [k for k in keys if runs[k].astype(str).nunique() > 1]


def _label(row: pd.Series, keys: list[str]) -> str:
    """``engine k=v ...`` over the swept keys; a lone run: ``engine run_id``."""
    if not keys:
        return f"{row['engine']} {row['run_id']}"
    return " ".join([str(row["engine"]), *(f"{k}={value_text(k, row[k])}" for k in keys)])


def value_text(key: str, value: object) -> str:
    """A parameter's value as a label: ``unlimited`` for a missing capacity (``none`` for
    another missing value), whole numbers without a decimal point, trace paths shortened."""
    if value is None or (not isinstance(value, str | list | dict) and bool(pd.isna(value))):
        return "unlimited" if key.startswith("capacity") else "none"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return short_label(value)
