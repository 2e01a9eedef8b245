"""Server behaviours seen through the raw protocol: pending lookups, TTLs, dead clients."""

from __future__ import annotations

import time

from testbed.core import protocol as p
from testbed.core.closing import Closing
from testbed.core.keys import chunk_hashes
from testbed.core.rpc import RpcClient
from tests.support.cache_harness import connect
from tests.support.quiescence import assert_quiescent

C = 64
LAYOUT = p.KVLayout(num_layers=2, block_size=16, bytes_per_token=128)


class Worker(Closing):
    """A registered raw client: op ids and its epoch filled in."""

    def __init__(self, server, role: str = "worker", **kwargs) -> None:
        kwargs.setdefault("timeout_s", 2.0)
        kwargs.setdefault("heartbeat_interval_s", 0.2)
        self.rpc = connect(server, role=role, **kwargs)
        reply = self.rpc.call(p.RegisterWorker(model="m", world_size=1, kv_rank=0, layout=LAYOUT))
        self.epoch = reply.epoch

    def begin_store(self, session: str, hashes: list[bytes], handle: bytes = b"") -> p.StorePlan:
        item = p.OpItem(session_id=session, chunk_hashes=hashes, handle=handle)
        plan = self.rpc.call(
            p.StoreBegin(op_id=self.rpc.new_op_id(), epoch=self.epoch, items=[item])
        )
        assert isinstance(plan, p.StorePlan)
        return plan

    def store(self, session: str, hashes: list[bytes]) -> p.StoreDone:
        plan = self.begin_store(session, hashes)
        done = self.rpc.call(p.StoreCommit(op_id=plan.op_id))
        assert isinstance(done, p.StoreDone)
        return done

    def close(self) -> None:
        self.rpc.close()


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
    with Worker(server) as worker, connect(server, role="scheduler") as scheduler:
        worker.store("writer", hashes[:1])
        plan = worker.begin_store("writer", hashes)
        pending = lookup(scheduler, "reader", hashes)
        assert pending.pending and pending.hit_chunks == 0
        still = scheduler.call(p.LookupPoll(session_id="reader"))
        assert isinstance(still, p.LookupResult) and still.pending
        worker.rpc.call(p.StoreCommit(op_id=plan.op_id))
        settled = scheduler.call(p.LookupPoll(session_id="reader"))
        assert isinstance(settled, p.LookupResult)
        assert not settled.pending and settled.hit_chunks == 3 and settled.num_locks == 3
        assert len(settled.handle) == 16


def test_a_pending_lookup_settles_on_what_is_committed_after_its_timeout(start_server):
    server = start_server("--chunk-size", str(C), "--lookup-pending-timeout", "0.3")
    hashes = chunk_hashes(list(range(2 * C)), C)
    with Worker(server) as worker, connect(server) as scheduler:
        worker.begin_store("w", hashes)
        assert lookup(scheduler, "r", hashes).pending
        time.sleep(0.5)  # the writer never commits
        settled = scheduler.call(p.LookupPoll(session_id="r"))
        assert isinstance(settled, p.LookupResult) and not settled.pending
        assert settled.hit_chunks == 0 and settled.miss_status == "in_flight"


def test_a_silent_client_is_reaped_locks_released_and_stores_aborted(start_server):
    server = start_server("--chunk-size", str(C), "--client-timeout", "0.6")
    hashes = chunk_hashes(list(range(2 * C)), C)
    observer = connect(server, role="observer", heartbeat_interval_s=0.1)
    writer = Worker(server, "writer", heartbeat_interval_s=10.0)
    writer.store("w", hashes)
    doomed = connect(server, role="doomed")  # takes locks, then goes silent
    assert lookup(doomed, "doomed-session", hashes).num_locks == 2
    writer.begin_store("x", chunk_hashes([9] * C, C))  # never committed
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
    assert_quiescent(final)
    assert final.num_workers == 0
    assert final.num_objects == 2  # committed objects stay; the aborted reservation is gone


def test_sessions_expire_after_their_ttl(start_server):
    server = start_server("--chunk-size", str(C), "--session-ttl", "0.5")
    with connect(server, heartbeat_interval_s=0.1) as client:
        lookup(client, "short-lived", chunk_hashes(list(range(C)), C))
        assert stats(client).num_sessions == 1
        time.sleep(1.0)
        assert stats(client).num_sessions == 0


def test_every_reply_names_the_server_instance(start_server):
    first = start_server("--chunk-size", str(C))
    second = start_server("--chunk-size", str(C))
    epochs = set()
    for server in (first, second):
        with connect(server) as client:
            pong = client.call(p.Ping())
            stats_reply = stats(client)
            assert pong.epoch == stats_reply.epoch == server.epoch == client.server_epoch
            epochs.add(pong.epoch)
    assert len(epochs) == 2


def test_deferred_releases_ride_with_the_next_request_and_keep_their_order(start_server):
    server = start_server("--chunk-size", str(C))
    hashes = chunk_hashes(list(range(3 * C)), C)
    with Worker(server) as worker, connect(server, role="scheduler", timeout_s=2.0) as client:
        worker.store("writer", hashes)
        assert lookup(client, "a", hashes).num_locks == 3
        assert lookup(client, "b", hashes).num_locks == 3
        client.defer(p.FreeLocks(session_id="a", end_token=3 * C))
        client.defer(p.EndSession(session_id="a"))
        time.sleep(0.2)
        assert stats(worker.rpc).num_sessions == 2  # deferred: nothing sent yet
        # One frame: both deferred requests, then the stats, handled in that order.
        seen = stats(client)
        assert seen.num_locks == 3 and seen.num_sessions == 1
        client.defer(p.EndSession(session_id="b"))
        client.flush()
        deadline = time.monotonic() + 2.0
        while stats(worker.rpc).num_sessions and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stats(worker.rpc).num_sessions == 0


def test_a_batch_with_a_wrong_credential_refuses_each_request(start_server):
    server = start_server("--chunk-size", str(C))
    items = [p.EndSession(session_id=f"s{i}", rid=10 + i, auth="wrong") for i in range(2)]
    replies = p.decode_reply(_raw_call(server, p.encode(p.Batch(requests=items, auth="wrong"))))
    assert isinstance(replies, p.Replies)
    codes = [(reply.rid, reply.code) for reply in replies.replies]
    assert codes == [(10, "unauthorized"), (11, "unauthorized")]


def _raw_call(server, frame: bytes) -> bytes:
    import zmq

    with zmq.Context() as context, context.socket(zmq.DEALER) as socket:
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(server.url)
        socket.send(frame)
        assert socket.poll(2000), "no reply"
        return socket.recv()
