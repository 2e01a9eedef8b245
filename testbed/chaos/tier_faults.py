"""Scenarios where a disk tier below L1 fails: full, unreadable, slow.

Runs in the chaos process. Each starts a server with a disk tier, stores chunks through a
probe (a pattern derived from each hash, ``testbed.chaos.probes``), drops them from L1 so that
only the tier holds them, damages the tier, then looks them up and reads back every chunk
that hit, byte for byte. ``tier_disk_full``: the tier's directory is a small tmpfs in a private
mount namespace, so writes fail with ``ENOSPC`` (cause ``full``). ``tier_read_error``: files
deleted and flipped behind the server (``io_error``, ``corrupt``: misses ``tier_read_failed``).
``tier_slow_disk``: every tier operation delayed past the prefetch timeout (misses
``prefetch_timeout``, then hits once the chunks arrive). Each must leave 0 integrity errors, 0
server crashes, every loss counted, and a clean stop.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

from server.launch import ServerProcess
from testbed.chaos import mounts
from testbed.chaos.lab import CHUNK_SIZE, Lab
from testbed.chaos.mounts import Tmpfs
from testbed.chaos.probes import BYTES_PER_TOKEN, ProbeClient, chunk_hashes
from testbed.chaos.report import ScenarioResult
from testbed.core import protocol as p
from testbed.core.keys import ChunkHash
from testbed.core.rpc import RpcClient

OBJECT_BYTES = CHUNK_SIZE * BYTES_PER_TOKEN
_WAIT_S = 60.0


def tier_disk_full(lab: Lab) -> ScenarioResult:
    chunks = 16 if lab.config.quick else 64
    result = lab.result(
        f"a disk tier whose file system fills ({chunks} chunks, room for a quarter) fails its "
        "writes with cause 'full', holds nothing it could not write, serves what it wrote with "
        "every byte right, and the server stops cleanly",
    )
    reason = mounts.unavailable()
    if reason is not None:
        result.skipped = reason
        return result
    tier_dir = lab.dir / "l2"
    tier_dir.mkdir(exist_ok=True)
    wrapper = mounts.wrapper([Tmpfs(tier_dir, chunks // 4 * OBJECT_BYTES)])
    server = _server(lab, tier_dir, chunks, wrapper=wrapper)
    with ProbeClient(server.url, server.token, timeout_s=10.0) as probe:
        hashes = store_below(lab, server, probe, chunks)
        tier = tier_after(probe, lambda t: t.writes + t.failures >= chunks)
        hit, errors = read_back(probe, "full", hashes)
        stats = probe.stats()
    _finish(lab, result, server, chunks, hit, errors, stats)
    full = tier.failures_by_cause.get("full", 0)
    result.checks["writes past the disk's room failed with cause 'full'"] = full > 0
    result.checks["the tier holds only what it wrote"] = tier.num_objects == tier.writes
    result.checks["what was written is served below L1"] = 0 < hit <= tier.writes
    result.details.update(writes=tier.writes, full=full, hit_chunks=hit)
    return result


def tier_read_error(lab: Lab) -> ScenarioResult:
    chunks = 16 if lab.config.quick else 64
    result = lab.result(
        f"a disk tier whose files are deleted or damaged behind the server ({chunks} chunks, "
        "one in two) answers misses with cause tier_read_failed, counted, never a wrong byte",
    )
    tier_dir = lab.dir / "l2"
    server = _server(lab, tier_dir, chunks)
    with ProbeClient(server.url, server.token, timeout_s=10.0) as probe:
        hashes = store_below(lab, server, probe, chunks)
        files = sorted(tier_dir.glob("*.kv"))
        for number, path in enumerate(files[::2]):
            if number % 2:
                path.unlink()
            else:
                data = bytearray(path.read_bytes())
                data[len(data) // 2] ^= 0xFF
                path.write_bytes(bytes(data))
        hit, errors = 0, 0
        for number, chunk in enumerate(hashes):  # one lookup per chunk: each fault seen
            got, wrong = read_back(probe, f"read-{number}", [chunk])
            hit, errors = hit + got, errors + wrong
        stats = probe.stats()
    _finish(lab, result, server, chunks, hit, errors, stats)
    tier = stats.tiers[0]
    damaged = len(files[::2])
    result.checks["every damaged chunk a counted tier_read_failed miss"] = (
        stats.tier_read_failures == damaged and tier.failures == damaged
    )
    result.checks["every intact chunk served from the tier"] = hit == chunks - damaged
    result.details.update(damaged=damaged, failures_by_cause=tier.failures_by_cause)
    return result


def tier_slow_disk(lab: Lab) -> ScenarioResult:
    chunks = 8 if lab.config.quick else 32
    result = lab.result(
        f"a disk tier slower than the prefetch timeout ({chunks} chunks, 50 ms each, timeout "
        "10 ms) answers misses with cause prefetch_timeout, counted, and the chunks that arrive "
        "later hit with every byte right",
    )
    tier_dir = lab.dir / "l2"
    server = _server(lab, tier_dir, chunks, "--tier-delay", "0.05", "--prefetch", "timeout:0.01")
    with ProbeClient(server.url, server.token, timeout_s=10.0) as probe:
        hashes = store_below(lab, server, probe, chunks)
        late = settled(probe, "late", hashes)
        probe.free_locks("late")
        probe.end_session("late")
        tier_after(probe, lambda t: t.promotions >= 1)
        hit, errors = read_back(probe, "later", hashes)
        stats = probe.stats()
    _finish(lab, result, server, chunks, hit, errors, stats)
    result.checks["the first lookup missed with cause prefetch_timeout"] = (
        late.miss_status == "prefetch_timeout" and stats.prefetch_timeouts >= 1
    )
    result.checks["chunks that arrived later hit"] = hit >= 1
    result.details.update(first_hit=late.hit_chunks, later_hit=hit)
    return result


# ---------------------------------------------------------------------------------------------


def _server(
    lab: Lab, tier_dir: Path, chunks: int, *extra: str, wrapper: Sequence[str] = ()
) -> ServerProcess:
    return lab.server(
        "--chunk-size", str(CHUNK_SIZE),
        "--capacity", str(4 * chunks * OBJECT_BYTES),
        "--tier", f"disk:{4 * chunks * OBJECT_BYTES}:{tier_dir}",
        "--lookup-pending-timeout", "30",
        "--token-file", str(lab.dir / "tokens.json"),  # readable outside its namespace
        *extra,
        wrapper=wrapper,
    )  # fmt: skip


def store_below(
    lab: Lab, server: ServerProcess, probe: ProbeClient, chunks: int
) -> list[ChunkHash]:
    """Stores ``chunks`` new chunks, waits for their writes below, drops them from L1."""
    probe.register()
    hashes = chunk_hashes(lab.name, chunks)
    probe.store("store", hashes)
    tier_after(probe, lambda t: t.writes + t.failures + t.dropped_writes >= chunks)
    with RpcClient(server.url, role="chaos-admin", token=server.admin_token) as admin:
        admin.call(p.DropObjects(chunk_hashes=hashes))
    return hashes


def tier_after(probe: ProbeClient, done: Callable[[p.TierStats], bool]) -> p.TierStats:
    deadline = time.monotonic() + _WAIT_S
    while True:
        tier = probe.stats().tiers[0]
        if done(tier) or time.monotonic() > deadline:
            return tier
        time.sleep(0.01)


def read_back(probe: ProbeClient, session: str, hashes: list[ChunkHash]) -> tuple[int, int]:
    """A lookup polled to its end, then a retrieve of its hit: (chunks hit, wrong bytes)."""
    found = settled(probe, session, hashes)
    errors = probe.retrieve(session, found.handle, hashes[: found.hit_chunks])
    probe.free_locks(session)
    probe.end_session(session)
    return found.hit_chunks, errors


def settled(probe: ProbeClient, session: str, hashes: list[ChunkHash]) -> p.LookupResult:
    """A lookup polled until it is no longer pending."""
    found = probe.lookup(session, hashes)
    deadline = time.monotonic() + _WAIT_S
    while found.pending and time.monotonic() < deadline:
        reply = probe.rpc.call(p.LookupPoll(session_id=session))
        assert isinstance(reply, p.LookupResult)
        found = reply
    return found


def _finish(
    lab: Lab,
    result: ScenarioResult,
    server: ServerProcess,
    chunks: int,
    hit: int,
    errors: int,
    stats: p.ServerStats,
) -> None:
    result.add(requests_total=chunks, requests_completed=chunks, integrity_errors=errors)
    result.set(
        leaked_locks=stats.num_locks,
        leaked_pins=stats.num_pins,
        leaked_inflight=stats.num_inflight_stores + stats.num_inflight_retrieves,
    )
    lab.stop(server)
    code = None if server.process is None else server.process.returncode
    result.checks["the server stopped cleanly (exit 0)"] = code == 0
