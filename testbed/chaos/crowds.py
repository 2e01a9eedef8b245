"""Scenarios where other clients take what they can: descriptors, and the lock table.

Runs in the chaos process. ``connection_flood``: a server limited to 256 descriptors
(``prlimit``) is flooded with TCP connections that never send anything; it must close them
(counted, logged) fast enough that an authenticated client is answered within seconds and
reads back what it stores. ``lock_hog``: one client locks everything its lookups can until
the server refuses it for its quota (typed ``quota`` errors); meanwhile a replay engine on the
same server must never be refused, lose a byte, or count a refusal as a miss of its own.
"""

from __future__ import annotations

import socket
import time
from typing import Any

from testbed.chaos.lab import CHUNK_SIZE, Lab
from testbed.chaos.probes import ProbeClient, chunk_hashes
from testbed.chaos.report import ScenarioResult
from testbed.chaos.watch import wait_quiescent
from testbed.core import protocol as p
from testbed.core.rpc import RemoteError

_DESCRIPTORS = 256
_RUN_TIMEOUT_S = 300.0


def connection_flood(lab: Lab) -> ScenarioResult:
    num_idle = 350 if lab.config.quick else 1000
    result = lab.result(
        f"{num_idle} TCP connections that never send a byte, against a server limited to "
        f"{_DESCRIPTORS} descriptors: it closes them (counted, logged) and an authenticated "
        "client is answered within seconds and reads back what it stores",
    )
    server = lab.server(
        "--chunk-size", str(CHUNK_SIZE), "--capacity", "16MiB", "--auth-timeout", "2",
        wrapper=["prlimit", f"--nofile={_DESCRIPTORS}:{_DESCRIPTORS}"],
    )  # fmt: skip
    host, port = server.url.removeprefix("tcp://").rsplit(":", 1)
    idle: list[socket.socket] = []
    try:
        for _ in range(-(-num_idle // 50)):  # in bursts the listen backlog holds
            idle += [_idle_connection(host, int(port)) for _ in range(50)]
            time.sleep(0.2)
        started = time.monotonic()
        with ProbeClient(server.url, server.token, timeout_s=10.0) as client:
            client.register()
            waited_s = time.monotonic() - started
            errors = client.cycle("during-flood", num_chunks=16)
            stats = client.stats()
            held = wait_quiescent(client.rpc, 2.0)
    finally:
        for connection in idle:
            connection.close()
    result.add(requests_total=7, requests_completed=7, integrity_errors=errors)
    result.set(unauthenticated_closed=stats.unauthenticated_closed)
    result.maximum(max_connect_wait_s=waited_s)
    if held is not None:
        result.set(**held.leaks())
    lab.stop(server)
    log = (lab.dir / "server-0.log").read_text()
    result.checks["the server closed connections that never authenticated"] = (
        stats.unauthenticated_closed > 0
    )
    result.checks["it said so in its log"] = "sent no authenticated request" in log
    result.checks["an authenticated client was answered within 5 s"] = waited_s < 5.0
    return result


def _idle_connection(host: str, port: int) -> socket.socket:
    connection = socket.socket()
    connection.setblocking(False)
    connection.connect_ex((host, port))
    return connection


def lock_hog(lab: Lab) -> ScenarioResult:
    n = lab.config.shared_requests
    engine = not lab.config.quick
    result = lab.result(
        "one client locks all its lookups can until it is refused for its quota (typed "
        "`quota` errors); another client on the same server meanwhile is never refused and "
        "reads every byte right"
        + (
            f", and neither is a replay of {n} requests, which stores what it computes"
            if engine
            else ""
        ),  # fmt: skip
    )
    server = lab.server(
        "--chunk-size", str(CHUNK_SIZE), "--capacity", "64MiB", "--max-tracked-chunks", "4096",
        "--read-lock-ttl", "600",
    )  # fmt: skip
    with ProbeClient(server.url, server.token, model="hog") as hog:
        hog.register()
        hashes = chunk_hashes("hog", 256)
        hog.store("hog:writer", hashes)
        codes: list[str] = []
        for index in range(32):  # 32 x 256 chunks: twice the server-wide table
            reply = hog.rpc.submit(
                p.Lookup(session_id=f"hog:{index}", model="hog", world_size=1, chunk_hashes=hashes)
            ).result(10.0)
            if isinstance(reply, p.Error):
                codes.append(reply.code)
        held_by_hog = hog.stats().num_locks
        summary: dict[str, Any] = {}
        if engine:
            child = lab.run(lab.spec("docqa", n), server, "engine")
            child.wait(_RUN_TIMEOUT_S)
            summary = lab.record_run(result, child) or {}
        starved = _other_client(server.url, server.token, result)
    starved += int(summary.get("limit_refusals") or 0)
    starved += int(bool((summary.get("tokens") or {}).get("unavailable")))
    result.set(quota_refusals=len(codes), starved_requests=starved)
    result.checks["the hog was refused for its quota, typed as such"] = bool(codes) and set(
        codes
    ) == {"quota"}
    # Its quota is a quarter of the 4,096 tracked chunks: two lookups of 256 (each tracks
    # its lock group and its session's refresh list).
    result.checks["the hog held no more than its quota"] = held_by_hog == 512
    if engine:
        result.checks["the engine stored into the cache beside the hog"] = bool(
            summary.get("stored_bytes")
        )
    result.details.update(hog_locks=held_by_hog, starved=starved)
    return result


def _other_client(url: str, token: str, result: ScenarioResult) -> int:
    """Another client stores, looks up (8 sessions) and reads back beside the hog; returns
    its requests that were refused."""
    refused = 0
    with ProbeClient(url, token, model="other") as other:
        other.register()
        for index in range(8):
            result.add(requests_total=5)
            try:
                errors = other.cycle(f"other-{index}", num_chunks=32)
            except RemoteError:
                refused += 1
                continue
            result.add(requests_completed=5, integrity_errors=errors)
    return refused
