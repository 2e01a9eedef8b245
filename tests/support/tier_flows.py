"""Raw-protocol flows against a real server with tiers below L1: store chunks, look them up to
the end (polling while the lookup is pending), read tier stats; deadline polls, no sleeps."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

from testbed.core import protocol as p
from testbed.core.closing import Closing
from testbed.core.rpc import RpcClient
from tests.support.cache_harness import ServerLike, connect

C = 64
LAYOUT = p.KVLayout(num_layers=2, block_size=16, bytes_per_token=128)
OBJECT_BYTES = C * 128
"""One chunk's object (one rank) under :data:`LAYOUT`."""


class Worker(Closing):
    """A registered raw worker that stores chunks (slots reserved and committed)."""

    def __init__(self, server: ServerLike) -> None:
        self.rpc = connect(server, role="worker", timeout_s=5.0, heartbeat_interval_s=0.2)
        reply = self.rpc.call(p.RegisterWorker(model="m", world_size=1, kv_rank=0, layout=LAYOUT))
        self.epoch = reply.epoch

    def store(self, session: str, hashes: list[bytes]) -> p.StoreDone:
        item = p.OpItem(session_id=session, chunk_hashes=hashes)
        plan = self.rpc.call(
            p.StoreBegin(op_id=self.rpc.new_op_id(), epoch=self.epoch, items=[item])
        )
        assert isinstance(plan, p.StorePlan)
        done = self.rpc.call(p.StoreCommit(op_id=plan.op_id))
        assert isinstance(done, p.StoreDone)
        return done

    def close(self) -> None:
        self.rpc.close()


def lookup(
    client: RpcClient, session: str, hashes: list[bytes], end: bool = True
) -> p.LookupResult:
    """A lookup polled until it settles; with ``end``, its locks freed and its session ended."""
    reply = client.call(p.Lookup(session_id=session, model="m", world_size=1, chunk_hashes=hashes))
    deadline = time.monotonic() + 30.0
    while isinstance(reply, p.LookupResult) and reply.pending and time.monotonic() < deadline:
        reply = client.call(p.LookupPoll(session_id=session))
    assert isinstance(reply, p.LookupResult) and not reply.pending, reply
    if end:
        release(client, session)
    return reply


def release(client: RpcClient, session: str) -> None:
    """Frees the session's locks and ends it (as a request that loaded nothing)."""
    client.call(p.FreeLocks(session_id=session, end_token=1 << 40))
    client.call(p.EndSession(session_id=session))


def stats(client: RpcClient) -> p.ServerStats:
    reply = client.call(p.GetStats())
    assert isinstance(reply, p.ServerStats)
    return reply


def l2(client: RpcClient) -> p.TierStats:
    return stats(client).tiers[0]


def until(
    client: RpcClient, test: Callable[[p.ServerStats], bool], timeout_s: float = 30.0
) -> p.ServerStats:
    """The server's stats once ``test`` holds of them (fails after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        current = stats(client)
        if test(current):
            return current
        assert time.monotonic() < deadline, f"not reached in {timeout_s} s: {current}"
        time.sleep(0.01)


@contextlib.contextmanager
def below_l1(server: ServerLike, hashes: list[bytes]) -> Iterator[tuple[Worker, RpcClient]]:
    """A worker and a scheduler connection once ``hashes`` are stored, written to the first
    tier below L1 (one write each) and dropped from L1: only a lower tier holds them."""
    with (
        Worker(server) as worker,
        connect(server, role="scheduler") as scheduler,
        connect(server, admin=True) as admin,
    ):
        worker.store("a", hashes)
        until(scheduler, lambda s: s.tiers[0].writes == len(hashes))
        admin.call(p.DropObjects(chunk_hashes=hashes))
        yield worker, scheduler
