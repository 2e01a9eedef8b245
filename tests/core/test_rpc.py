"""The RPC client does its I/O in the thread that asks: a reply does not wait for another
Python thread to get the GIL (vLLM's engine loop holds it almost all the time). Deferred
requests can be waited for once sent, so that what other connections send next comes after."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from testbed.core import protocol as p
from testbed.core.rpc import RpcClient, ServerUnavailable


@pytest.fixture
def no_background(monkeypatch):
    """Clients whose background thread does nothing: only the callers' own threads do I/O."""
    monkeypatch.setattr(RpcClient, "_run", lambda self: None)


def test_a_reply_arrives_when_the_asking_thread_waits_for_it(server, no_background):
    with RpcClient(server.url, token=server.token) as client:
        reply = client.submit(p.Ping()).result(5.0)
        assert isinstance(reply, p.Pong)
        lookup = p.Lookup(session_id="s", model="m", world_size=1, chunk_hashes=[bytes(16)])
        assert isinstance(client.call(lookup), p.LookupResult)


def test_a_reply_arrives_when_the_asking_thread_only_polls(server, no_background):
    """The scheduler's way: it never blocks, it asks ``done()`` at each step."""
    with RpcClient(server.url, token=server.token) as client:
        future = client.submit(p.Ping())
        deadline = time.monotonic() + 5.0
        while not future.done() and time.monotonic() < deadline:
            pass  # a busy engine loop: this thread holds the GIL throughout
        assert future.done() and isinstance(future.result(0), p.Pong)
        assert future.arrived_at is not None and future.arrived_at >= future.sent_at


def test_clients_on_several_threads_share_one_connection(server):
    with RpcClient(server.url, token=server.token) as client:
        replies: list[p.Reply] = []

        def ask() -> None:
            for _ in range(50):
                replies.append(client.call(p.Ping()))

        threads = [threading.Thread(target=ask) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert len(replies) == 200 and all(isinstance(r, p.Pong) for r in replies)


def test_a_request_to_no_server_fails_within_its_timeout():
    with RpcClient("tcp://127.0.0.1:9", timeout_s=0.3) as client:
        started = time.monotonic()
        with pytest.raises(ServerUnavailable):
            client.submit(p.Ping()).result(5.0)
        assert time.monotonic() - started < 3.0
        assert not client.alive


def test_settling_the_deferred_waits_until_the_server_has_answered_them(server):
    """A replay's order: the scheduler's deferred releases and ends of sessions are applied
    before the workers' next operations, which travel on connections of their own."""
    with RpcClient(server.url, token=server.token) as client:
        assert isinstance(client.call(p.Ping()), p.Pong)  # connected
        assert client.settle_deferred(0.0)  # nothing deferred: nothing to wait for
        os.kill(server.process.pid, signal.SIGSTOP)
        try:
            client.defer(p.EndSession(session_id="s"))
            client.flush()
            started = time.monotonic()
            assert not client.settle_deferred(0.3)  # sent, not answered: the server is stopped
            assert time.monotonic() - started >= 0.25
            assert not client.settle_deferred(0.1)  # still waited for: kept after the timeout
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
        assert client.settle_deferred(5.0)
        os.kill(server.process.pid, signal.SIGSTOP)
        try:
            client.defer(p.EndSession(session_id="t"))
            client.submit(p.Ping())  # carries it: the frame waited for is the request's
            assert not client.settle_deferred(0.1)
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
        assert client.settle_deferred(5.0)
