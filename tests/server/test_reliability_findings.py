"""Reliability findings of ``kvtb chaos``, reproduced: a pending lookup nobody polls and lookup
work multiplied by the KV ranks."""

from __future__ import annotations

import os
import time

from testbed.chaos.probes import ProbeClient, chunk_hashes
from testbed.core import protocol as p
from testbed.core.rpc import RpcClient
from tests.support.quiescence import assert_quiescent


def test_a_pending_lookup_nobody_polls_stops_counting_as_in_flight_after_its_timeout(
    start_server,
):
    server = start_server("--chunk-size", "64", "--lookup-pending-timeout", "0.3")
    with ProbeClient(server.url, server.token, model="m", heartbeat_interval_s=0.2) as client:
        client.register()
        hashes = chunk_hashes("pending", 2)
        op_id = client.begin_store("writer", hashes)  # in flight: the lookup waits on it
        assert client.lookup("reader", hashes).pending  # the client loses this reply
        client.commit(op_id, ok=False)
        time.sleep(1.5)  # five pending timeouts
        stats = client.stats()
    assert_quiescent(stats)


def test_a_lookup_costs_at_most_max_chunks_per_request_chunk_operations(start_server, tmp_path):
    """1,024 hashes at world size 4,096 (a 19 KB frame) are 4 M key checks with the chunk log
    on (every `kvtb run` server has one): seconds of server CPU for one frame, 300 such
    frames a second can keep it busy for good. Either refuse it as over the limit or do it
    in well under a second."""
    server = start_server("--chunk-size", "64", "--run-dir", str(tmp_path))
    hashes = [os.urandom(16) for _ in range(1024)]
    request = p.Lookup(session_id="s", model="m", world_size=4096, chunk_hashes=hashes)
    with RpcClient(server.url, token=server.token, timeout_s=120.0) as client:
        started = time.monotonic()
        reply = client.submit(request).result()
        elapsed_s = time.monotonic() - started
    assert (isinstance(reply, p.Error) and reply.code == "limit") or elapsed_s < 0.5
