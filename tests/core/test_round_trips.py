"""A round trip split by the server's stamps (``testbed.core.round_trips``), against a real
server on loopback: each leg's time lands where it was spent. A server stopped before it reads
a request is request transit; a server waiting for a peer that never answers is handler time;
a reply nobody reads for a while is reply-read time."""

from __future__ import annotations

import os
import signal
import time

import pytest
import zmq

from testbed.core import protocol as p
from testbed.core.round_trips import RoundTrips
from testbed.core.rpc import RpcClient
from testbed.core.telemetry import attributes as a
from tests.support.cache_harness import connect

HELD_S = 0.3


@pytest.fixture
def no_background(monkeypatch):
    """Clients whose background thread does nothing: replies are read only when asked for."""
    monkeypatch.setattr(RpcClient, "_run", lambda self: None)


def _trips(future) -> RoundTrips:
    trips = RoundTrips()
    trips.took(future)
    return trips


def test_a_reply_carries_the_servers_read_and_reply_times_on_the_clients_clock(server):
    with connect(server) as client:
        future = client.submit(p.Ping())
        assert isinstance(future.result(5.0), p.Pong)
    assert future.sent_at <= future.received_ns / 1e9 <= future.replied_ns / 1e9
    assert future.replied_ns / 1e9 <= future.arrived_at
    trips = _trips(future)
    assert trips.stamped == 1
    assert set(trips.attributes()) == {
        a.SERVER_MS, a.POLL_WAIT_MS, a.REQUEST_TRANSIT_MS, a.HANDLER_MS, a.REPLY_READ_MS
    }  # fmt: skip


def test_a_server_stopped_before_it_reads_the_request_is_request_transit(server):
    with connect(server) as client:
        assert isinstance(client.call(p.Ping()), p.Pong)  # connected
        os.kill(server.process.pid, signal.SIGSTOP)
        try:
            future = client.submit(p.Ping())
            time.sleep(HELD_S)
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
        future.result(5.0)
    trips = _trips(future)
    assert trips.request_transit_s >= HELD_S * 0.9
    assert trips.handler_s < HELD_S / 3 and trips.reply_read_s < HELD_S / 3


def test_a_lookup_waiting_for_a_silent_peer_is_handler_time(start_server):
    server = start_server("--chunk-size", "64", "--capacity", "16MiB")
    silent = zmq.Context.instance().socket(zmq.ROUTER)  # reads the probe, never answers
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        with connect(server, admin=True) as admin:
            admin.call(p.SetPeers(peers=[p.PeerEndpoint(url=f"tcp://127.0.0.1:{port}", token="t")]))
        with connect(server, timeout_s=10.0) as client:
            lookup = p.Lookup(session_id="s", model="m", world_size=1, chunk_hashes=[bytes(16)])
            future = client.submit(lookup)
            assert isinstance(future.result(10.0), p.LookupResult)
    finally:
        silent.close(linger=0)
    trips = _trips(future)
    assert trips.handler_s >= 0.5  # the peer's timeout (1 s), spent on the server
    assert trips.request_transit_s < 0.2 and trips.reply_read_s < 0.2


def test_a_reply_nobody_reads_is_reply_read_time(server, no_background):
    with connect(server) as client:
        assert isinstance(client.call(p.Ping()), p.Pong)  # connected: a submit sends at once
        future = client.submit(p.Ping())
        time.sleep(HELD_S)  # the reply is in the socket; this client does not look
        future.result(5.0)
    trips = _trips(future)
    assert trips.reply_read_s >= HELD_S * 0.9
    assert trips.request_transit_s < HELD_S / 3 and trips.handler_s < HELD_S / 3


def test_a_reply_without_stamps_adds_only_to_the_round_trip():
    class Answered:
        sent_at, arrived_at, received_ns, replied_ns = 1.0, 1.5, 0, 0

    trips = _trips(Answered())
    assert trips.server_s == 0.5 and trips.stamped == 0
    assert a.HANDLER_MS not in trips.attributes()
    Answered.received_ns, Answered.replied_ns = 3 * 10**9, 4 * 10**9  # another host's clock
    assert _trips(Answered()).stamped == 0
