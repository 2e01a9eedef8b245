"""A sweep directory's own files, and its index: one row per run, rebuilt from the run directories.

``OUT/<name>/`` holds ``sweep.toml`` (the sweep file as run), ``sweep.json`` (name,
description, the swept keys in x-axis order, and the run ids in sweep order), one directory
per run (``testbed.run``'s layout; a failed run also holds ``error.txt``: the error on its first
line, then the traceback, or a summary that lists its failures) and ``index.parquet``.

The index has the columns ``run_id``, ``status`` (``complete`` | ``failed``), ``error``
(``None`` unless failed), every :class:`RunSpec` field (typed from its annotation, nullable;
``workload_params`` as a JSON string), then every summary field in first-seen order (missing
ones null; a table-valued field such as ``tokens`` as one column per entry, ``tokens_cold``;
``run_id``, ``engine`` and ``metadata_only`` come from the spec; another summary
field that shares a spec field's name is ``summary_<name>``, e.g. ``summary_requests``, the
requests served, beside ``requests``, the number asked for).
Runs of the sweep never
attempted, or interrupted before finishing, have no row. Everything comes from files, so
:func:`build_index` can be rerun at any time, e.g. after copying runs from other machines.
"""

from __future__ import annotations

import json
import typing
from pathlib import Path
from typing import Any

import pandas as pd

from testbed.core.run_dir import ERROR, INDEX, SPEC, SWEEP, RunDir, SweepDir
from testbed.core.run_dir import SWEEP_TOML as SWEEP_TOML
from testbed.run import failure, is_complete
from testbed.spec.runspec import RunSpec
from testbed.sweep.spec import SweepSpec

SWEEP_FILE, INDEX_FILE, ERROR_FILE, SPEC_FILE = SWEEP, INDEX, ERROR, SPEC  # testbed.core.run_dir's
COMPLETE = "complete"
FAILED = "failed"

_SPEC_KEYS = RunSpec.keys()
_REPEATS_SPEC = {"run_id", "engine", "metadata_only"}  # summary fields that copy the spec
_DTYPES = {int: "Int64", float: "Float64", bool: "boolean", str: "string"}  # nullable


def write_manifest(sweep_dir: Path, sweep: SweepSpec) -> None:
    """Writes ``sweep.toml`` and ``sweep.json`` (replacing an earlier version's)."""
    sweep_dir.mkdir(parents=True, exist_ok=True)
    if sweep.source_text:  # a sweep expanded from a mapping has no file to copy
        _write_text(SweepDir(sweep_dir).source, sweep.source_text)
    manifest = {
        "name": sweep.name,
        "description": sweep.description,
        "swept": list(sweep.swept),
        "runs": sweep.run_ids,
    }
    _write_text(SweepDir(sweep_dir).manifest, json.dumps(manifest, indent=1) + "\n")


def read_manifest(sweep_dir: Path) -> dict[str, Any]:
    """``sweep.json`` of ``sweep_dir``; for a directory of runs written by ``kvtb run --out``
    (no ``sweep.json``), a manifest derived from the runs' ``spec.json``: every subdirectory
    holding one is a run, and the swept keys are those whose values differ between runs."""
    sweep_dir = Path(sweep_dir)
    if SweepDir(sweep_dir).manifest.is_file():
        return json.loads(SweepDir(sweep_dir).manifest.read_text())
    run_ids = sorted(path.parent.name for path in sweep_dir.glob(f"*/{SPEC_FILE}"))
    if not run_ids:
        raise FileNotFoundError(
            f"{sweep_dir} has neither {SWEEP_FILE} nor run directories (*/{SPEC_FILE}): "
            "give a sweep directory or the --out directory of `kvtb run`"
        )
    specs = [json.loads(SweepDir(sweep_dir).run(r).spec.read_text()) for r in run_ids]
    swept = [
        key
        for key in _SPEC_KEYS
        if key != "run_id"
        and len({json.dumps(spec.get(key), sort_keys=True, default=str) for spec in specs}) > 1
    ]
    return {
        "name": sweep_dir.name,
        "description": f"Runs found in `{sweep_dir.name}` (no {SWEEP_FILE}).",
        "swept": swept,
        "runs": run_ids,
    }


def record_failure(run_dir: Path, spec: RunSpec, error: str, details: str = "") -> None:
    """Marks ``run_dir`` failed: ``error.txt``, and ``spec.json`` if the run had not written it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    files = RunDir(run_dir)
    if not files.spec.is_file():
        _write_text(files.spec, json.dumps(spec.document(), indent=1, default=str))
    first_line = " ".join(error.split()) or "run failed"
    _write_text(files.error, f"{first_line}\n\n{details}")


def read_failure(run_dir: Path) -> str | None:
    """The error of a failed run, ``None`` if the run has not failed (complete or not yet run):
    :func:`testbed.run.failure`."""
    return failure(run_dir)


def build_index(sweep_dir: Path) -> pd.DataFrame:
    """Builds ``index.parquet`` from the run directories of :func:`read_manifest`; returns it."""
    sweep_dir = Path(sweep_dir)
    run_ids = read_manifest(sweep_dir)["runs"]
    rows = [row for run_id in run_ids if (row := _row(sweep_dir / run_id)) is not None]
    frame = _frame(rows)
    path = SweepDir(sweep_dir).index
    tmp = path.with_name(path.name + ".tmp")
    frame.to_parquet(tmp, index=False)
    tmp.replace(path)
    return frame


def load_index(sweep_dir: Path) -> pd.DataFrame:
    """The sweep's index (built first if ``index.parquet`` does not exist yet)."""
    path = SweepDir(Path(sweep_dir)).index
    return pd.read_parquet(path) if path.is_file() else build_index(sweep_dir)


def _row(run_dir: Path) -> dict[str, Any] | None:
    files = RunDir(run_dir)
    if not files.spec.is_file():
        return None
    spec = json.loads(files.spec.read_text())
    error = read_failure(run_dir)
    summary = json.loads(files.summary.read_text()) if is_complete(run_dir) else {}
    if error is not None:
        status = FAILED  # with what its summary recorded, if it wrote one
    elif is_complete(run_dir):
        status = COMPLETE
    else:
        return None  # never finished: not part of the index until it is run again
    row: dict[str, Any] = {"run_id": run_dir.name, "status": status, "error": error}
    for key in _SPEC_KEYS:
        value = spec.get(key)
        row[key] = json.dumps(value, sort_keys=True) if key == "workload_params" else value
    for key, value in _flat(summary).items():
        if key in _REPEATS_SPEC or key == "failures":  # failures: the error column
            continue
        # A summary field named like a spec field (``requests``: served vs. asked for) keeps
        # both, the summary's as ``summary_<name>``.
        row[f"summary_{key}" if key in row else key] = value
    return row


def _flat(summary: dict[str, Any]) -> dict[str, Any]:
    """Summary fields with table values (``tokens``, ``server_state_after``) as one column per
    entry, ``<field>_<entry>`` (e.g. ``tokens_cold``); lists of lines (``missing``) as one
    string, lines joined by ``"; "``."""
    flat: dict[str, Any] = {}
    for key, value in summary.items():
        if isinstance(value, dict):
            flat.update({f"{key}_{inner}": item for inner, item in value.items()})
        elif isinstance(value, list):
            flat[key] = "; ".join(map(str, value))
        else:
            flat[key] = value
    return flat


def _frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    spec_columns = ["run_id", "status", "error", *_SPEC_KEYS]
    summary_columns = list(
        dict.fromkeys(key for row in rows for key in row if key not in spec_columns)
    )
    frame = pd.DataFrame(rows, columns=[*spec_columns, *summary_columns])
    hints = typing.get_type_hints(RunSpec)
    dtypes = {
        "run_id": "string",
        "status": "string",
        "error": "string",
        "workload_params": "string",
    }
    for key in _SPEC_KEYS:
        if key in dtypes:
            continue
        if typing.get_origin(hints[key]) is typing.Literal:  # a closed set of names
            dtypes[key] = "string"
        else:
            options = [
                t for t in typing.get_args(hints[key]) or (hints[key],) if t is not type(None)
            ]
            dtypes[key] = _DTYPES[options[0]]
    for key in summary_columns:  # flags missing for some runs: nullable, as parquet keeps them
        values = frame[key].dropna()
        if len(values) and values.map(lambda v: isinstance(v, bool)).all():
            dtypes[key] = "boolean"
    return frame.astype(dtypes)


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
