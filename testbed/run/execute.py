"""Executing one run: workload → engine (+ its own cache server) → run directory.

``<out>/<run_id>/`` receives ``spec.json`` (the resolved spec), ``env.json`` (versions, git
commit, machine, the pool medium), ``spans/`` (OTLP JSON lines from the engine and the
server, with span counts), ``server.log``, ``metrics.parquet`` (one row per request) and,
last, ``summary.json``. A run that does not fit on the machine (``testbed.run.footprint``) is
refused before anything is written; space for the results is reserved at the start, so a
disk that fills during the run costs spans (counted, and listed in the summary's
``missing``), not the summary. A directory without ``summary.json`` is an unfinished run: it
is cleared and redone. A finished run is reused only if it did not fail (:func:`failure`: its
summary lists no failures, :mod:`testbed.run.health`, and no ``error.txt`` says it died) and its
``spec.json`` equals the resolved spec (:meth:`RunSpec.differences`); otherwise it is redone,
with a log line saying why. Every process the run starts is stopped before it returns, and
every process gets absolute paths and the spec's trace sampler.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

from testbed.core.owned_files import ReservedSpace
from testbed.core.run_dir import SPEC, RunDir
from testbed.core.telemetry.setup import TracingConfig, configure_tracing
from testbed.run import footprint
from testbed.run.dispatch import drive_engine
from testbed.run.options import RunOptions
from testbed.run.prepare import prepare_run
from testbed.run.record import environment, resource, write_json, write_summary
from testbed.spec.runspec import RunSpec

log = logging.getLogger(__name__)


def is_complete(run_dir: Path) -> bool:
    return RunDir(run_dir).is_complete()


def failure(run_dir: Path) -> str | None:
    """Why the run in ``run_dir`` failed; ``None`` when it has not (or has not run yet): the
    error recorded in ``error.txt``, else the failures its summary lists."""
    error = RunDir(run_dir).error
    if error.is_file():
        return error.read_text().split("\n", 1)[0] or "run failed"
    if not is_complete(run_dir):
        return None
    found = json.loads(RunDir(run_dir).summary.read_text()).get("failures") or []
    return "; ".join(found) or None


def reuse_differences(run_dir: Path, spec: RunSpec) -> list[str] | None:
    """``None`` when ``run_dir`` holds no finished run; else why the finished run is not a
    run of exactly ``spec`` to reuse: how its ``spec.json`` differs, or that it failed (empty:
    reusable)."""
    if not is_complete(run_dir):
        return None
    failed = failure(run_dir)
    if failed is not None:
        return [f"the run failed ({failed})"]
    path = RunDir(run_dir).spec
    if not path.is_file():
        return [f"{SPEC} is missing"]
    return spec.differences(json.loads(path.read_text()))


def is_reusable(run_dir: Path, spec: RunSpec) -> bool:
    """Whether ``run_dir`` holds a finished run of exactly ``spec``."""
    return reuse_differences(run_dir, spec) == []


def execute_run(spec: RunSpec, out_dir: Path, options: RunOptions | None = None) -> dict[str, Any]:
    """Runs ``spec`` into ``out_dir/<run_id>/`` and returns its summary (existing if complete).

    Every check that can fail (workload, engine settings, an external server) runs before the
    run directory is touched; a run whose server dies or hangs still finishes and writes its
    summary from what it recorded. ``options``: default :class:`RunOptions`.
    """
    options = options or RunOptions()
    run_dir = Path(out_dir).absolute() / spec.run_id
    differences = reuse_differences(run_dir, spec)
    if differences == []:
        return json.loads(RunDir(run_dir).summary.read_text())
    if differences:
        log.warning(
            "run %s: the finished run in %s is not reused (%s); redoing it",
            spec.run_id,
            run_dir,
            "; ".join(differences),
        )
    plan = prepare_run(spec, options, Path(out_dir))
    if run_dir.exists():
        shutil.rmtree(run_dir)  # a half-written run is redone from scratch
    run_dir.mkdir(parents=True)
    results_space = ReservedSpace(RunDir(run_dir).reserve, footprint.RUN_DIR_RESERVE_BYTES)
    write_json(RunDir(run_dir).spec, spec.document())
    write_json(RunDir(run_dir).env, {**environment(), "pool_medium": plan.pool_medium})
    tracing = configure_tracing(
        TracingConfig(
            service_name="kvtb-engine",
            run_dir=run_dir,
            run_id=spec.run_id,
            resource=resource(plan),
            otlp_endpoint=options.otlp_endpoint,
            otlp_protocol=options.otlp_protocol,
            sampling=(spec.trace_sampler, spec.trace_sampler_ratio),
        )
    )
    started = time.perf_counter()
    try:
        outcome = drive_engine(plan, run_dir, options, results_space.release)
    finally:
        results_space.release()  # what could not be written yet, and the results, go there
        if tracing is not None:
            tracing.shutdown()
    return write_summary(plan, outcome, run_dir, time.perf_counter() - started, options)
