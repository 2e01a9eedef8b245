"""Planning a run: every check that can fail, before the run directory is touched.

The spec against its engine (:attr:`EngineEntry.check`), the run's options, the workload
(loaded, its servable requests split off), this machine (``testbed.run.footprint``) and an
external cache server (it must answer and match the spec). Each problem is a ``ValueError``
whose message names it; nothing is written.

The machine is checked on what the engine will hold. A block-hash trace is read as block
requests first (ids and lengths, no token): the check sees every request the trace yields
(capped by ``requests``), as keys for a block-key engine (``EngineEntry.block_ids``, which then
never makes a token) or as the tokens the others will make, before any is made. A generated
workload is checked on its first :data:`~testbed.run.footprint.SAMPLE_REQUESTS` requests,
extrapolated to the count it will make, then on all of them.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable
from pathlib import Path

from testbed.core import protocol as p
from testbed.core.credentials import ServerEndpoint
from testbed.core.rpc import RemoteError, RpcClient, ServerUnavailable
from testbed.core.telemetry.setup import sdk_disabled
from testbed.models.servable import R, split_servable
from testbed.run import footprint
from testbed.run.interface import CacheServers, EngineEntry
from testbed.run.options import RunOptions
from testbed.run.plan import RunPlan, asked_capacity
from testbed.run.registry import ENGINES
from testbed.spec.inputs import check_workload_content
from testbed.spec.runspec import RunSpec
from testbed.workloads import BlockTraceWorkload, Workload, WorkloadRequest, make_workload
from testbed.workloads.generator import Generator


def prepare_run(spec: RunSpec, options: RunOptions, out_dir: Path = Path("runs")) -> RunPlan:
    """Checks the spec against what will run it and this machine (``testbed.run.footprint``, on a
    sample of the workload first, then on all of it) and loads the workload; raises
    ``ValueError`` with a message naming the problem (nothing is written)."""
    if sdk_disabled():
        raise ValueError(
            "a run's results are computed from its spans, and OTEL_SDK_DISABLED=true turns "
            "them off: unset it (to record fewer requests, sample them: OTEL_TRACES_SAMPLER="
            "traceidratio with OTEL_TRACES_SAMPLER_ARG; the run then says it was sampled)"
        )
    entry = ENGINES[spec.engine]
    _check_options(spec, entry, options)
    bytes_per_token = entry.bytes_per_token(spec)
    use = entry.cache_servers(options)
    own_server = use is CacheServers.RUN and options.server is None
    workload = _make_workload(spec, entry)
    requests: list[WorkloadRequest] = []
    blocks = None  # the oracle keys a block-hash trace from its ids: no token synthesised
    check_workload_content(spec)
    check = functools.partial(
        footprint.check_run,
        spec,
        bytes_per_token=bytes_per_token,
        own_server=own_server,
        out_dir=out_dir,
        engine_kv_bytes=entry.engine_kv_bytes,
    )
    if isinstance(workload, BlockTraceWorkload):
        shapes, rejected = _servable(spec, workload.block_requests())
        check(shapes, keys_only=entry.block_ids)
        if entry.block_ids:
            blocks = shapes
        else:
            requests = list(workload.with_tokens(shapes))
    else:
        sample = _first(spec, workload, footprint.SAMPLE_REQUESTS)
        check(sample, num_requests=_count(spec, workload))
        requests, rejected = _servable(spec, workload)
        check(requests)
    server_info = None
    if options.server is not None and use is not CacheServers.NONE:
        capacity = asked_capacity(spec, bytes_per_token)
        server_info = check_external_server(spec, options.server, capacity, options.asked)
    return RunPlan(
        spec, requests, rejected, server_info, bytes_per_token, own_server, workload, blocks
    )


def _check_options(spec: RunSpec, entry: EngineEntry, options: RunOptions) -> None:
    """The engine's own checks, then the options that only some engines take."""
    entry.check(spec, options)
    if entry.takes_endpoints:
        return
    if spec.servers == "per-instance" and options.server is not None:
        raise ValueError(
            "--server gives one cache server; servers 'per-instance' starts one per instance "
            "(leave out --server, or use servers 'shared')"
        )
    if options.endpoint is not None or options.endpoints or options.launch:
        raise ValueError(
            "--endpoint, --endpoints and --launch apply to the serve engine (--engine serve)"
        )


def _first(spec: RunSpec, requests: Iterable[R], limit: int) -> list[R]:
    """The first ``limit`` of ``requests`` (for a quick check before reading them all)."""
    try:
        return list(itertools.islice(iter(requests), limit))
    except FileNotFoundError as exc:
        raise ValueError(f"workload {spec.workload!r}: {exc}") from None


def _count(spec: RunSpec, workload: Workload) -> int | None:
    """How many requests ``workload`` will yield: a generator's count, else at most the
    spec's ``requests`` (``None``: unknown before reading it)."""
    return workload.num_requests if isinstance(workload, Generator) else spec.requests


def _make_workload(spec: RunSpec, entry: EngineEntry) -> Workload:
    try:
        return make_workload(
            spec.workload,
            num_requests=spec.requests,
            seed=spec.seed,
            vocab_size=entry.vocab_size(spec),
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


def check_external_server(
    spec: RunSpec,
    server: ServerEndpoint,
    capacity_bytes: int | None,
    asked: frozenset[str] | None = None,
) -> p.ServerConfigInfo:
    """The external server's configuration; a clear error if it is not there or does not
    match the spec (a run must record the capacity and policy that really ran). The policy and
    the pool's medium must match where ``asked`` holds them (``None``: the whole spec was
    asked); a key not asked takes the server's."""
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
    def mismatch(key: str, value: str, theirs: str | None) -> bool:
        return (asked is None or key in asked) and value != theirs

    if mismatch("policy", spec.policy, info.policy):
        problems.append(f"its policy is {info.policy}, the spec asks for {spec.policy}")
    if spec.metadata_only != info.metadata_only:
        problems.append(f"it runs with metadata_only={info.metadata_only}")
    if mismatch("pool_medium", spec.pool_medium, info.pool_medium):
        problems.append(f"its pool is {info.pool_medium}, the spec asks for {spec.pool_medium}")
    if problems:
        raise ValueError(f"--server {server.url} does not match the run: " + "; ".join(problems))
    return info
