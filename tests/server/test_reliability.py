"""The server under hostile or careless clients: frames, memory, ownership, credentials, files.

Each test reproduces one finding of a hostile review of the server (a frame that stopped it,
memory that grew without bound, operations nobody owned, a cache any local user could empty,
files left in /dev/shm) and checks the behaviour that replaced it.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from server.launch import ServerProcess
from server.reclaim import server_files_dir
from testbed.core import protocol as p
from testbed.core.keys import chunk_hashes
from testbed.core.rpc import RemoteError, RpcClient
from tests.server.test_protocol_flows import Worker, lookup, stats
from tests.support.cache_harness import Harness, connect
from tests.support.quiescence import assert_quiescent

C = 64


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def hashes(n: int, seed: int = 0) -> list[bytes]:
    return [(seed * 1_000_003 + i).to_bytes(16, "little") for i in range(n)]


def raw_socket(server) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.url)
    return sock


def ask(sock: zmq.Socket, frame: bytes) -> p.Reply:
    sock.send(frame)
    assert sock.poll(5000), "no reply"
    return p.decode_reply(sock.recv())


# ---------------------------------------------------------------------------------------------
# A frame no client can use to stop the server
# ---------------------------------------------------------------------------------------------


def test_deeply_nested_frames_get_errors_and_the_server_keeps_serving(server):
    sock = raw_socket(server)
    nested = b"\x91" * 1000 + b"\xc0"
    frames = [
        nested + b"\x00" * 8,  # the 1,009-byte frame that used to raise RecursionError
        b"\x82\xa1x" + nested + b"\xa2op\xa4ping",  # nested before the tag
        b"\x82\xa2op\xa4ping\xa1x" + nested,  # nested in an unknown field
        b"\x82\xa2op\xa6lookup\xaachunk_hashes" + b"\x91" * 100_000 + b"\xc0",
    ]
    try:
        for frame in frames:
            reply = ask(sock, frame)
            assert isinstance(reply, p.Error) and reply.code == "malformed", reply
        assert isinstance(ask(sock, p.encode(p.Ping())), p.Pong)
    finally:
        sock.close()
    assert server.process.poll() is None


# ---------------------------------------------------------------------------------------------
# Bounded memory
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_huge_lookup_repeated_keeps_the_servers_memory_bounded(start_server):
    server = start_server(
        "--chunk-size", "64", "--capacity", "1GiB", "--metadata-only",
        "--max-chunks-per-request", "65536",
    )  # fmt: skip
    keys = hashes(65_536)
    with Worker(server) as worker, connect(server, timeout_s=30.0) as scheduler:
        for start in range(0, len(keys), 16_384):
            worker.store("writer", keys[start : start + 16_384])
        baseline = rss_mib(server.pid)
        for _ in range(12):  # the same 65,536-hash lookup, over and over
            result = lookup(scheduler, "reader", keys)
            assert result.hit_chunks == len(keys)
        after = stats(scheduler)
        grown = rss_mib(server.pid) - baseline
    assert after.num_lock_groups == 1 and after.num_locks == len(keys)  # the latest one only
    assert grown < 64, f"server grew by {grown:.0f} MiB"
    assert after.index_bytes > 0


def test_limits_refuse_tiny_objects_too_many_sessions_and_oversized_requests(start_server):
    server = start_server(
        "--chunk-size", str(C), "--max-sessions", "50", "--max-chunks-per-request", "100"
    )
    with connect(server, timeout_s=5.0) as client:
        tiny = p.KVLayout(num_layers=1, block_size=16, bytes_per_token=4)  # 256-byte objects
        with pytest.raises(RemoteError, match="min-object-bytes") as refused:
            client.call(p.RegisterWorker(model="m", world_size=1, kv_rank=0, layout=tiny))
        assert refused.value.code == "limit"
        for i in range(50):
            lookup(client, f"s{i}", hashes(1))
        with pytest.raises(RemoteError, match="max-sessions"):
            lookup(client, "one-too-many", hashes(1))
        with pytest.raises(RemoteError, match="max-chunks-per-request"):
            lookup(client, "s0", hashes(101))
        assert stats(client).num_sessions == 50 and stats(client).refused_limits == 3


def huge_store(worker: Worker) -> p.StoreBegin:
    """A store of 65,536 chunks: handled in many slices of the server's work."""
    return p.StoreBegin(
        op_id=worker.rpc.new_op_id(),
        epoch=worker.epoch,
        items=[p.OpItem(session_id="big", chunk_hashes=hashes(65_536))],
    )


HUGE_STORES = ("--chunk-size", "64", "--capacity", "8GiB", "--metadata-only",
               "--max-chunks-per-request", "65536")  # fmt: skip
"""A server that takes :func:`huge_store`."""


def test_a_huge_store_is_handled_in_slices_and_other_clients_are_served_meanwhile(start_server):
    server = start_server(*HUGE_STORES)
    with Worker(server) as worker, connect(server) as other:
        replies: list[str] = []
        store = worker.rpc.submit(huge_store(worker), timeout_s=30.0)
        store.add_done_callback(lambda _: replies.append("store"))
        time.sleep(0.01)
        ping = other.submit(p.Ping())
        ping.add_done_callback(lambda _: replies.append("ping"))
        store.result(30.0), ping.result(30.0)
    # The ping came after the store began and was answered before the store finished.
    assert replies == ["ping", "store"]


# ---------------------------------------------------------------------------------------------
# Every operation has an owner and a deadline
# ---------------------------------------------------------------------------------------------


def test_an_unfinished_reservation_and_unended_pins_expire_by_their_deadline(start_server):
    server = start_server(
        "--chunk-size", str(C), "--op-ttl", "0.5", "--lookup-pending-timeout", "5"
    )
    keys = hashes(3)
    with Worker(server) as worker, connect(server, heartbeat_interval_s=0.1) as scheduler:
        worker.store("w", keys[:1])
        worker.begin_store("w", keys)  # reserved, never committed; the client stays alive
        pinned = worker.rpc.call(
            p.RetrieveBegin(
                op_id=worker.rpc.new_op_id(),
                epoch=worker.epoch,
                items=[p.OpItem(session_id="r", chunk_hashes=keys[:1])],
            )
        )
        assert pinned.items[0].num_present == 1
        assert stats(scheduler).num_inflight_stores == 1 and stats(scheduler).num_pins == 1
        time.sleep(1.0)
        after = stats(scheduler)
        assert_quiescent(after)
        assert after.expired_ops == 2
        assert lookup(scheduler, "later", keys).hit_chunks == 1  # not pending: absent
        assert worker.store("w2", keys).num_committed == 2  # the chunks can be stored again


def test_a_client_that_gave_up_waiting_aborts_what_it_never_saw_answered(start_server):
    server = start_server(*HUGE_STORES)
    with Worker(server) as worker, connect(server) as observer:
        begin = huge_store(worker)
        late = worker.rpc.submit(begin, timeout_s=0.05)
        with pytest.raises(Exception, match="no reply"):
            late.result(5.0)
        worker.rpc.fire(p.Abort(op_ids=[begin.op_id]))  # what the worker client does on a timeout
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and stats(observer).aborted_ops == 0:
            time.sleep(0.05)
        final = stats(observer)
    assert_quiescent(final)
    assert final.aborted_ops == 1 and final.num_objects == 0


# ---------------------------------------------------------------------------------------------
# Credentials and ownership
# ---------------------------------------------------------------------------------------------


def _zmtp_request(host: str, port: int, body: bytes) -> bytes:
    """One request over ZeroMQ's wire protocol (ZMTP 3.0, NULL security) using only the
    standard library, as another local user could write it."""
    with socket.create_connection((host, port), timeout=5) as conn:
        greeting = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00")
        conn.sendall(greeting + b"\x00" + b"\x00" * 31)
        _recv_exact(conn, 64)
        ready = b"\x05READY\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
        conn.sendall(b"\x04" + bytes([len(ready)]) + ready)
        flags, size = _recv_exact(conn, 2)
        _recv_exact(conn, size)  # the server's READY
        conn.sendall(b"\x00" + bytes([len(body)]) + body)
        flags, size = _recv_exact(conn, 2)
        size = struct.unpack(">Q", _recv_exact(conn, 8))[0] if flags & 0x02 else size
        return _recv_exact(conn, size)


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


def test_a_stranger_cannot_empty_the_cache_and_a_client_cannot_administer_it(server):
    with Harness(server) as h:
        tokens = list(range(3 * C + 1))
        h.prefill("victim", tokens, list(range(13)))
        assert h.stats().num_objects == 3
        host, port = server.url.removeprefix("tcp://").split(":")
        frame = msgspec.msgpack.encode({"op": "drop_objects"})  # 17 bytes, no credential
        reply = p.decode_reply(_zmtp_request(host, int(port), frame))
        assert isinstance(reply, p.Error) and reply.code == "unauthorized"
        with pytest.raises(RemoteError, match="admin token") as refused:
            h.rpc.call(p.DropObjects())  # the client token is not enough
        assert refused.value.code == "unauthorized"
        assert h.stats().num_objects == 3 and h.matched("probe", tokens) == 3 * C
        with connect(server, admin=True) as admin:
            assert admin.call(p.DropObjects(force=True)).num_objects == 3  # the admin can


def test_no_client_can_free_poll_or_steal_another_clients_session(server):
    with Harness(server) as victim, connect(server) as thief:
        tokens = list(range(3 * C + 1))
        victim.prefill("writer", tokens, list(range(13)))
        assert victim.matched("reader", tokens) == 3 * C  # 3 chunks locked for the session
        session = victim.side.session_id("reader")
        for request in (
            p.FreeLocks(session_id=session, end_token=10**9),
            p.EndSession(session_id=session),
            p.LookupPoll(session_id=session),
            p.Lookup(session_id=session, model="tiny", world_size=1, chunk_hashes=[]),
        ):
            with pytest.raises(RemoteError) as refused:
                thief.call(request)
            assert refused.value.code == "forbidden", request
        assert victim.stats().num_locks == 3 and victim.stats().forbidden == 4
        # A retrieve naming the session without its lock handle reads, but releases nothing.
        worker = Worker(server, "thief-worker")
        item = p.OpItem(session_id=session, chunk_hashes=chunk_hashes(tokens, C))
        plan = worker.rpc.call(
            p.RetrieveBegin(op_id=worker.rpc.new_op_id(), epoch=worker.epoch, items=[item])
        )
        done = worker.rpc.call(p.RetrieveEnd(op_id=plan.op_id, ok=[True]))
        worker.close()
        assert done.num_locks_released == 0 and victim.stats().num_locks == 3


def test_a_reservation_can_be_committed_only_by_the_client_that_made_it(server):
    keys = hashes(2)
    with Worker(server, "owner") as owner, Worker(server, "impostor") as impostor:
        plan = owner.begin_store("s", keys)
        with pytest.raises(RemoteError) as refused:
            impostor.rpc.call(p.StoreCommit(op_id=plan.op_id))
        assert refused.value.code == "unknown_id"
        assert impostor.rpc.call(p.Abort(op_ids=[plan.op_id])).num_aborted == 0  # not its own
        assert stats(owner.rpc).num_inflight_stores == 1
        assert lookup(owner.rpc, "q", keys).hit_chunks == 0  # never served as hits
        owner.rpc.call(p.Abort(op_ids=[plan.op_id]))


def test_a_client_choosing_its_own_routing_id_is_refused(server):
    """Routing ids are the server's: a client that picked one could reuse a dead client's."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, b"worker-123")
    sock.connect(server.url)
    try:
        request = p.GetStats(auth=server.token)
        reply = ask(sock, p.encode(request))
        assert isinstance(reply, p.Error) and reply.code == "forbidden"
    finally:
        sock.close()


def test_the_token_file_is_private_and_a_missing_credential_is_refused(server):
    assert os.stat(server.token_file).st_mode & 0o077 == 0
    with RpcClient(server.url, token="not-the-token") as client:
        with pytest.raises(RemoteError) as refused:
            client.call(p.GetStats())
        assert refused.value.code == "unauthorized"
        assert isinstance(client.call(p.Ping()), p.Pong)  # ping needs no credential


def test_binding_beyond_loopback_needs_curve_and_curve_authenticates(tmp_path):
    from zmq.auth import create_certificates

    plain = ServerProcess(["--host", "0.0.0.0", "--port", "0"], startup_timeout_s=15)
    with pytest.raises(Exception, match="curve-dir"):
        plain.start()
    keys = tmp_path / "keys"
    keys.mkdir()
    create_certificates(keys, "server")
    client_public, client_secret = create_certificates(keys, "client")
    from testbed.core.rpc import CurveKeys

    with ServerProcess(["--curve-dir", str(keys), "--chunk-size", str(C)]) as server:
        curve = CurveKeys(Path(client_secret), keys / "server.key")
        with RpcClient(server.url, token=server.token, curve=curve) as client:
            assert isinstance(client.call(p.GetStats()), p.ServerStats)
        plain_client = RpcClient(server.url, token=server.token, timeout_s=1.0)
        with plain_client, pytest.raises(Exception, match="no reply"):
            plain_client.call(p.GetStats())  # no CURVE handshake: never connected


# ---------------------------------------------------------------------------------------------
# No leaked files
# ---------------------------------------------------------------------------------------------


def _own_files(pid: int) -> list[Path]:
    return sorted(server_files_dir().glob(f"kvtb-*-{pid}-*"))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_stopped_server_removes_its_pool_and_token_file(sig):
    server = ServerProcess(["--chunk-size", str(C), "--capacity", "16MiB"]).start()
    assert len(_own_files(server.pid)) == 2  # pool and token file
    server.process.send_signal(sig)
    server.process.wait(10)
    assert _own_files(server.pid) == []


def test_files_of_a_killed_server_are_reclaimed_by_the_next_server_and_kvtb_clean():
    killed = ServerProcess(["--chunk-size", str(C), "--capacity", "16MiB"]).start()
    killed.kill()
    assert len(_own_files(killed.pid)) == 2  # SIGKILL: nothing could clean up
    with ServerProcess(["--chunk-size", str(C), "--capacity", "16MiB"]) as _:
        assert _own_files(killed.pid) == []
    again = ServerProcess(["--chunk-size", str(C), "--capacity", "16MiB"]).start()
    again.kill()
    from testbed.cli.kvtb import main

    assert main(["clean"]) == 0
    assert _own_files(again.pid) == []
