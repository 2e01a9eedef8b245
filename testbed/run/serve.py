"""The serve engine's run: the workload over HTTP to vLLM OpenAI servers, running ones
(``--endpoint``/``--endpoints``) or ones the run launches against its own cache server
(``--launch``), and its checks."""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import ExitStack
from typing import TYPE_CHECKING

from tqdm import tqdm

from testbed.core.run_dir import RunDir
from testbed.core.telemetry import sampling
from testbed.engine.results import EngineResult
from testbed.run import vllm
from testbed.run.footprint import pool_blocks
from testbed.run.interface import CacheServers, EngineEntry, EngineRun
from testbed.run.options import RunOptions
from testbed.run.servable import engine_spec
from testbed.spec.runspec import RunSpec

if TYPE_CHECKING:
    from testbed.engine.serve_launch import LaunchSpec
    from testbed.fleet.kv_events import ZmqEventStream


def check(spec: RunSpec, options: RunOptions) -> None:
    """What vLLM cannot run as asked (:func:`testbed.run.vllm.check_spec`), and the servers:
    one of ``--endpoint``, ``--endpoints`` or ``--launch``, as many as the spec's instances,
    each answering."""
    vllm.check_spec(spec)
    urls = options.serve_urls
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
        from testbed.core.extras import require_engines

        require_engines(["vllm"])
    if spec.servers == "per-instance" and not options.launch:
        raise ValueError(
            "servers 'per-instance' starts a cache server for each vLLM server the run "
            "launches: give --launch (servers named by --endpoints have their own already)"
        )
    if options.launch:
        if options.server is not None:
            raise ValueError(
                "--launch starts the run's own cache server for the vLLM servers it starts; "
                "leave out --server (or send the workload to running servers with --endpoint)"
            )
        return
    if len(urls) != spec.instances:
        raise ValueError(
            f"--endpoints names {len(urls)} servers and the spec {spec.instances} instances; "
            f"run with --instances {len(urls)}"
        )
    _check_answering(urls)


def _check_answering(urls: list[str]) -> None:
    import urllib.request

    for url in urls:
        try:
            with urllib.request.urlopen(url.rstrip("/") + "/v1/models", timeout=2):
                pass
        except (OSError, ValueError) as exc:
            raise ValueError(f"--endpoint {url}: no vLLM server answers there ({exc})") from None


def launch_spec(job: EngineRun, instance: int) -> LaunchSpec:
    """vLLM's server for instance ``instance`` of the run, its connector pointed at the run's
    cache server (the instance's own with servers 'per-instance'; reading the credential from
    the server's token file) and writing its spans into the run directory."""
    from testbed.engine.engine_spec import connector_config
    from testbed.engine.fleet import instance_engine_id
    from testbed.engine.serve_launch import LaunchSpec

    spec = job.spec
    server = job.started[instance if spec.servers == "per-instance" else 0]
    connector = connector_config(
        spec,
        server.endpoint,
        engine_id=instance_engine_id(spec.run_id, instance) if spec.instances > 1 else spec.run_id,
        faults=False,
        token_file=server.token_file,
        run_id=spec.run_id,
        span_dir=str(job.run_dir),
    )
    return engine_spec(LaunchSpec, spec, job.plan.requests, connector=connector.to_extra_config())


def _launch(job: EngineRun, stack: ExitStack, events: ZmqEventStream | None) -> list[str]:
    """Starts the run's vLLM servers (stopped when ``stack`` closes, before the run's cache
    server, so that their spans are flushed) and returns their URLs once they answer."""
    from testbed.engine.serve_launch import VllmServerProcess, start_fleet, stop_fleet
    from testbed.run.collector import SpanCollector

    spec = job.spec
    collector = stack.enter_context(SpanCollector(job.run_dir))
    vllms = [
        VllmServerProcess(
            launch_spec(job, k),
            job.run_dir,
            otlp_endpoint=collector.endpoint,
            env=sampling.environment(spec.trace_sampler, spec.trace_sampler_ratio),
            on_wait=job.progress.waiting,
            instance=k if spec.instances > 1 else None,
            kv_events_endpoint=events.endpoint if events is not None else None,
        )
        for k in range(spec.instances)
    ]
    stack.callback(stop_fleet, vllms)  # each is started once, all at once, by start_fleet
    if job.options.progress:
        logs = ", ".join(str(vllm.log_path) for vllm in vllms)
        tqdm.write(
            f"run {spec.run_id}: starting vLLM's OpenAI server (log: {logs}); "
            "its first requests wait until it answers /health"
        )
    urls = [vllm.url for vllm in start_fleet(vllms)]
    job.progress.waiting(None)
    return urls


def record_vllm_metrics(urls: Sequence[str], run_dir: RunDir, within_s: float = 30.0) -> None:
    """Writes each launched vLLM server's ``/metrics`` into the run directory
    (:meth:`RunDir.vllm_metrics`) once the workload is done: vLLM's own view of the run
    (``vllm:prompt_tokens_cached_by_source`` per hit source, its prefix cache), read before
    the servers stop. A server's counters may still move while its last stores commit, so each
    is read until two reads a second apart agree on every ``vllm:`` sample (the process's own
    samples always move), or ``within_s`` passes: the last read is kept, and the file says it
    had not settled. A server that does not answer leaves a file saying so (the run goes on:
    its own telemetry is the record)."""
    import urllib.request

    for k, url in enumerate(urls):
        instance = k if len(urls) > 1 else None
        deadline = time.monotonic() + within_s
        previous = None
        while True:
            try:
                with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
                    text = response.read().decode()
            except OSError as exc:
                text = f"# kvtb: {url}/metrics did not answer: {exc}\n"
                break
            samples = [line for line in text.splitlines() if line.startswith("vllm:")]
            if samples == previous:
                break
            if time.monotonic() > deadline:
                text = f"# kvtb: not settled within {within_s:.0f} s\n" + text
                break
            previous = samples
            time.sleep(1.0)
        run_dir.vllm_metrics(instance).write_text(text)


def run(job: EngineRun) -> EngineResult:
    """The workload to the servers; several are routed by the spec's router."""
    from testbed.engine.serve import ServeEngine, ServeSpec

    spec, options = job.spec, job.options
    with ExitStack() as stack:
        events = None
        if spec.instances > 1 and options.launch:
            from testbed.fleet.kv_events import ZmqEventStream

            events = stack.enter_context(ZmqEventStream())
        urls = _launch(job, stack, events) if options.launch else options.serve_urls
        routing = None
        if spec.instances > 1:
            from testbed.fleet.routers import make_router
            from testbed.fleet.serve_routing import ServeRouting

            router = make_router(spec.router, spec.router_params, spec.instances, spec.seed)
            blocks = pool_blocks(spec, job.plan.requests)
            routing = ServeRouting(router, spec.instances, spec.block_size, blocks, events)
        serve = ServeSpec(
            endpoints=tuple(urls), arrival=spec.arrival, max_concurrency=spec.max_num_seqs
        )
        with ServeEngine(serve, routing) as engine:
            result = engine.run(job.plan.requests, on_finish=job.progress.finished)
        if options.launch:
            record_vllm_metrics(urls, RunDir(job.run_dir))
        result.effective["launched"] = options.launch
        return result


ENTRY = EngineEntry(
    run=run,
    check=check,
    cache_servers=lambda options: CacheServers.RUN if options.launch else CacheServers.OBSERVED,
    bytes_per_token=vllm.bytes_per_token,
    vocab_size=vllm.vocab_size,
    takes_endpoints=True,
)
