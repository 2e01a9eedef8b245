"""Server behaviours seen through the raw protocol: pending lookups, TTLs, dead clients."""

from __future__ import annotations

import time

from testbed import protocol as p
from testbed.keys import chunk_hashes
from testbed.rpc import RpcClient

C = 64
LAYOUT = p.KVLayout(num_layers=2, block_size=16, bytes_per_token=128)


def register(url: str, role: str) -> RpcClient:
    client = RpcClient(url, role=role, timeout_s=2.0, heartbeat_interval_s=0.2)
    client.call(p.RegisterWorker(model="m", world_size=1, kv_rank=0, layout=LAYOUT))
    return client


def lookup(client: RpcClient, session: str, hashes: list[bytes]) -> p.LookupResult:
    reply = client.call(p.Lookup(session_id=session, model="m", world_size=1, chunk_hashes=hashes))
    assert isinstance(reply, p.LookupResult)
    return reply


def stats(client: RpcClient) -> p.ServerStats:
    reply = client.call(p.GetStats())
    assert isinstance(reply, p.ServerStats)
    return reply


def test_a_lookup_waits_for_an_in_flight_store_and_is_polled(start_server):
    server = start_server("--chunk-size", str(C), "--lookup-pending-timeout", "5")
    hashes = chunk_hashes(list(range(3 * C)), C)
    worker = register(server.url, "worker")
    scheduler = RpcClient(server.url, role="scheduler")
    with worker, scheduler:
        first = p.OpItem(session_id="writer", chunk_hashes=hashes[:1])
        worker.call(p.StoreCommit(store_id=worker.call(p.StoreBegin(items=[first])).store_id))
        plan = worker.call(p.StoreBegin(items=[p.OpItem(session_id="writer", chunk_hashes=hashes)]))
        assert isinstance(plan, p.StorePlan)
        pending = lookup(scheduler, "reader", hashes)
        assert pending.pending and pending.hit_chunks == 0
        still = scheduler.call(p.LookupPoll(session_id="reader"))
        assert isinstance(still, p.LookupResult) and still.pending
        worker.call(p.StoreCommit(store_id=plan.store_id))
        settled = scheduler.call(p.LookupPoll(session_id="reader"))
        assert isinstance(settled, p.LookupResult)
        assert not settled.pending and settled.hit_chunks == 3 and settled.num_locks == 3


def test_a_pending_lookup_settles_on_what_is_committed_after_its_timeout(start_server):
    server = start_server("--chunk-size", str(C), "--lookup-pending-timeout", "0.3")
    hashes = chunk_hashes(list(range(2 * C)), C)
    with register(server.url, "worker") as worker, RpcClient(server.url) as scheduler:
        worker.call(p.StoreBegin(items=[p.OpItem(session_id="w", chunk_hashes=hashes)]))
        assert lookup(scheduler, "r", hashes).pending
        time.sleep(0.5)  # the writer never commits
        settled = scheduler.call(p.LookupPoll(session_id="r"))
        assert isinstance(settled, p.LookupResult) and not settled.pending
        assert settled.hit_chunks == 0


def test_a_silent_client_is_reaped_locks_released_and_stores_aborted(start_server):
    server = start_server("--chunk-size", str(C), "--client-timeout", "0.6")
    hashes = chunk_hashes(list(range(2 * C)), C)
    observer = RpcClient(server.url, role="observer", heartbeat_interval_s=0.1)
    writer = register(server.url, "writer")
    item = p.OpItem(session_id="w", chunk_hashes=hashes)
    writer.call(p.StoreCommit(store_id=writer.call(p.StoreBegin(items=[item])).store_id))
    doomed = RpcClient(server.url, role="doomed")  # takes locks, then goes silent
    assert lookup(doomed, "doomed-session", hashes).num_locks == 2
    other = [p.OpItem(session_id="x", chunk_hashes=chunk_hashes([9] * C, C))]
    writer.call(p.StoreBegin(items=other))  # never committed
    with observer:
        assert stats(observer).num_locks == 2 and stats(observer).num_inflight_stores == 1
        doomed.close()
        writer.close()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (
            stats(observer).num_locks or stats(observer).num_workers
        ):
            time.sleep(0.1)
        final = stats(observer)
    assert final.num_locks == 0 and final.num_workers == 0 and final.num_inflight_stores == 0
    assert final.num_objects == 2  # committed objects stay; the aborted reservation is gone


def test_sessions_expire_after_their_ttl(start_server):
    server = start_server("--chunk-size", str(C), "--session-ttl", "0.5")
    with RpcClient(server.url, heartbeat_interval_s=0.1) as client:
        lookup(client, "short-lived", chunk_hashes(list(range(C)), C))
        assert stats(client).num_sessions == 1
        time.sleep(1.0)
        assert stats(client).num_sessions == 0
