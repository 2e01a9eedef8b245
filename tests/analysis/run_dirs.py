"""Run and sweep directories written by hand, laid out as ``testbed.run`` and
``testbed.sweep`` lay them out (spec.json, summary.json, spans/, metrics.parquet, sweep.json),
for the analysis that reads only those files."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from testbed.spec.runspec import RunSpec


def write_run(
    directory: Path,
    spec: RunSpec,
    summary: Mapping[str, Any],
    requests: pd.DataFrame | None = None,
) -> Path:
    """A complete run directory named by ``spec``'s run id under ``directory``."""
    run_dir = directory / spec.run_id
    (run_dir / "spans").mkdir(parents=True, exist_ok=True)
    (run_dir / "spec.json").write_text(json.dumps(spec.document(), default=str))
    if requests is not None:
        requests.to_parquet(run_dir / "metrics.parquet", index=False)
    (run_dir / "summary.json").write_text(
        json.dumps({"run_id": spec.run_id, "engine": spec.engine, **summary})
    )
    return run_dir


def write_sweep(directory: Path, name: str, swept: Sequence[str], run_dirs: Sequence[Path]) -> Path:
    """``directory/name/sweep.json`` over run directories already under it."""
    sweep_dir = directory / name
    manifest = {"name": name, "description": "", "swept": list(swept)}
    manifest["runs"] = [path.name for path in run_dirs]
    (sweep_dir / "sweep.json").write_text(json.dumps(manifest))
    return sweep_dir
