"""The oracle engine's run: prefix arithmetic over the servable requests, no server."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from testbed.engine.results import EngineResult, RequestRecord
from testbed.run.interface import CacheServers, EngineEntry, EngineRun
from testbed.spec.runspec import RunSpec
from testbed.workloads import RequestShape

if TYPE_CHECKING:
    import pandas as pd


def run(job: EngineRun) -> EngineResult:
    """Every request's hits under the spec's policy and capacity (an unlimited cache when
    the spec has none), and what an unlimited cache would have hit."""
    from testbed.models.oracle import simulate_keys
    from testbed.workloads.block_keys import key_trace

    spec, requests = job.spec, job.plan.served
    capacity = spec.capacity()
    chunk_bytes = spec.chunk_size * spec.kv_profile.stored_bytes_per_token(spec.tp)
    policy = "infinite" if capacity is None else spec.policy
    keys = key_trace(requests, spec.chunk_size)
    l1_chunks = None if capacity is None else capacity // chunk_bytes
    disk = _disk_hits(spec, keys, l1_chunks, chunk_bytes) if spec.tiers else None
    oracle = simulate_keys(keys, policy=policy, capacity_chunks=l1_chunks)
    if disk is not None:
        oracle = disk[0]
    # An unlimited cache misses only what no earlier request had: its misses are the cold
    # ones, and what it would have hit beyond the limited cache is the capacity miss.
    unlimited = oracle if capacity is None else simulate_keys(keys)
    result = EngineResult(engine="oracle")
    shapes: Sequence[RequestShape] = requests
    disk_tokens = disk[1] if disk is not None else [None] * len(shapes)
    for request, hit, unlimited_hit, from_disk in zip(
        shapes,
        oracle.per_request_hit_tokens,
        unlimited.per_request_hit_tokens,
        disk_tokens,
        strict=True,
    ):
        result.records.append(
            RequestRecord(
                request_id=request.request_id,
                group=request.group,
                prompt_tokens=request.num_prompt_tokens,
                arrival_s=request.arrival_s,
                hit_tokens=hit,
                unlimited_hit_tokens=unlimited_hit,
                disk_hit_tokens=from_disk,
            )
        )
    job.progress.advance(len(requests))
    return result


def request_table(spec: RunSpec, result: EngineResult) -> pd.DataFrame:
    """The oracle has no engine and no telemetry: its matched chunks are external hits, the
    rest is the partial tail or missed chunks: cold where an unlimited cache misses them too,
    capacity where only the oracle's capacity lost them."""
    import pandas as pd

    from testbed.analysis.attribution import CATEGORIES, EXTERNAL_BY_SOURCE

    table = pd.DataFrame([record.row() for record in result.records])
    chunk_size = spec.chunk_size
    hits = pd.Series([record.hit_tokens or 0 for record in result.records], dtype="int64")
    unlimited = pd.Series(
        [record.unlimited_hit_tokens or record.hit_tokens or 0 for record in result.records],
        dtype="int64",
    )
    prompt = table["prompt_tokens"].astype("int64")
    complete = prompt // chunk_size * chunk_size
    table["workload_request_id"] = table["request_id"]
    table["engine_hit_tokens"] = 0
    table["external_hit_tokens"] = hits
    table["recomputed_tokens"] = prompt - hits
    table["load_failed_tokens"] = 0
    for name in CATEGORIES:
        table[name] = 0
    table["external"] = hits
    disk = pd.Series([record.disk_hit_tokens or 0 for record in result.records], dtype="int64")
    for name in EXTERNAL_BY_SOURCE:
        table[name] = 0
    table["external_disk"] = disk
    table["external_host"] = hits - disk
    table["partial_chunk"] = prompt - complete - (hits - complete).clip(lower=0)
    table["capacity"] = (unlimited - hits).clip(lower=0)
    table["cold"] = (complete - unlimited.clip(lower=hits)).clip(lower=0)
    return table


def _disk_hits(
    spec: Any, keys: Any, l1_chunks: int | None, chunk_bytes: int
) -> tuple[Any, list[int]]:
    """The hierarchy L1 + one disk tier (``testbed.models.tier_sim``, LRU in both, the
    spec's ``tier_write`` and ``tier_promote``): an :class:`OracleResult` of its hits, and
    per request the hit tokens the disk served."""
    from dataclasses import replace

    from server.tiers.spec import parse_tier
    from testbed.models.tier_sim import TierPolicy, replay_tiers

    l2_chunks = parse_tier(spec.tiers[0]).capacity_bytes // chunk_bytes
    l1 = l2_chunks + sum(len(k) for k in keys.request_keys()) if l1_chunks is None else l1_chunks
    outcome = replay_tiers(
        keys.request_keys(), l1, l2_chunks, TierPolicy(spec.tier_write, spec.tier_promote)
    )
    size = keys.chunk_size
    hits = [len(tiers) * size for tiers in outcome.hit_tiers]
    disk = [chunks * size for chunks in outcome.tier_chunks(1)]
    from testbed.models.oracle import simulate_keys

    base = simulate_keys(keys, policy="lru", capacity_chunks=l1)
    total, prompt = sum(hits), base.prompt_tokens
    rates = [h / p for h, p in zip(hits, keys.prompt_tokens.tolist(), strict=True)]
    return (
        replace(
            base,
            hit_tokens=total,
            token_hit_rate=total / prompt if prompt else 0.0,
            mean_request_hit_rate=sum(rates) / len(rates) if rates else 0.0,
            per_request_hit_tokens=hits,
        ),
        disk,
    )


ENTRY = EngineEntry(
    run=run,
    cache_servers=lambda options: CacheServers.NONE,
    engine_pool=False,
    block_ids=True,
    request_table=request_table,
)
