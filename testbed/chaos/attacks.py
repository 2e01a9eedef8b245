"""Scenarios of hostile clients: fuzz frames, and requests without the right credential.

Runs in the chaos process. ``fuzz``: :func:`testbed.chaos.fuzz.fuzz_server` with the run's
frame count. ``unauthenticated``: every request type without a credential or with a wrong
one; the client token on administration (``drop_objects``); a client with the client token
using another client's sessions and operations; a client that picks its own ZeroMQ routing
id. Nothing of it may be accepted, and the other client's state must be intact; the admin
token must still work.
"""

from __future__ import annotations

import zmq

from testbed.chaos.bystander import OpenOperations
from testbed.chaos.frames import REQUEST_OPS, FrameFuzzer, FuzzCase, FuzzContext
from testbed.chaos.fuzz import FuzzSetup, fuzz_server, send_cases
from testbed.chaos.lab import CHUNK_SIZE, Lab
from testbed.chaos.probes import ProbeClient, chunk_hashes
from testbed.chaos.report import ScenarioResult
from testbed.chaos.watch import wait_quiescent
from testbed.core import protocol as p
from testbed.core.keys import ChunkHash
from testbed.core.rpc import RpcClient

_CASES_PER_OP = 8


def fuzz(lab: Lab) -> ScenarioResult:
    frames = lab.config.fuzz_frames
    result = lab.result(
        f"{frames:,} structure-aware fuzz frames (every request type, valid and mutated: wrong "
        "types, out-of-range values, hostile lengths, truncation, bit flips, 20,000-deep "
        "nesting, oversized and multi-frame messages, bad credentials, another client's ids) "
        "each get one reply; the server never stops, refuses what it must, leaves the other "
        "client's data and operations intact, and holds nothing once the fuzzer is gone",
    )
    setup = FuzzSetup()
    server = lab.server(*setup.server_args())
    report = fuzz_server(server, setup, num_frames=frames, seed=lab.config.seed)
    stats = report.stats
    result.set(
        requests_total=stats.frames,
        requests_completed=stats.answered,
        fuzz_frames=stats.frames,
        fuzz_crashes=int(report.crashed),
        unauthorized_accepted=stats.unauthorized_accepted,
        integrity_errors=report.probe_integrity_errors,
    )
    held = report.held_after
    if held is not None:
        result.set(**held.leaks())
    result.checks["refusals refused"] = stats.violations == 0
    result.checks["replies decodable"] = stats.undecodable_replies == 0
    result.checks["the other client's state intact"] = not report.victim_problems
    result.checks["a frame over twice the limit costs only its connection"] = (
        report.oversized_connection_dropped
    )
    result.checks["the fuzzer reaped after it left"] = report.fuzzer_reaped
    result.details.update(
        frames_per_s=round(stats.frames / stats.wall_s) if stats.wall_s else None,
        cases=dict(stats.kinds),
        replies=dict(stats.replies),
        examples=stats.examples,
        victim_problems=report.victim_problems,
        held_after=None if held is None else held.record(),
    )
    return result


def unauthenticated(lab: Lab) -> ScenarioResult:
    result = lab.result(
        "no request but ping is accepted without the client token; drop_objects needs the "
        "admin token; another client's sessions cannot be freed, ended, polled or taken over "
        "and its operations cannot be committed, ended or aborted; a client-chosen routing id "
        "is refused",
    )
    server = lab.server("--chunk-size", str(CHUNK_SIZE), "--capacity", "64MiB")
    data, fresh = chunk_hashes("owner/data", 4), chunk_hashes("owner/fresh", 2)
    with ProbeClient(server.url, server.token, model="owner") as owner:
        owner.register()
        owner_ops = OpenOperations.open(
            owner, "owner", data, fresh, pinned=1, retrieve_op=501, store_op=500
        )
        cases = _bad_auth_cases(lab.config.seed, server.token, owner_ops, data + fresh)
        stats = send_cases(server.url, cases, alive=lambda: server.process.poll() is None)  # type: ignore[union-attr]
        sent, accepted = _intrude(server.url, server.token, data)
        problems = list(owner_ops.finish())
        held = wait_quiescent(owner.rpc, 2.0)
        if held is not None:
            result.set(**held.leaks())
    dropped, refused = _admin_drop(server.url, server.admin_token, fresh)
    result.set(
        requests_total=stats.frames + sent,
        requests_completed=stats.answered + sent,
        unauthorized_accepted=stats.unauthorized_accepted + accepted,
    )
    result.checks["the other client's state intact"] = not problems
    result.checks["the admin token can drop"] = dropped.num_objects == len(fresh)
    result.checks["the server counted the refusals"] = refused.unauthorized >= len(cases) - (
        _CASES_PER_OP  # pings need no credential
    )
    result.details.update(
        cases=len(cases),
        replies=dict(stats.replies),
        owner_problems=problems,
        examples=stats.examples,
    )
    return result


def _bad_auth_cases(
    seed: int, token: str, owner_ops: OpenOperations, chunks: list[ChunkHash]
) -> list[FuzzCase]:
    """:data:`_CASES_PER_OP` frames of every request type with a missing or wrong credential,
    naming the owner's sessions, its operations 500 and 501 and ``chunks``."""
    context = FuzzContext(
        token=token,
        epoch=owner_ops.client.epoch,
        foreign_sessions=owner_ops.sessions,
        foreign_op_ids=(500, 501),
        chunk_hashes=tuple(chunks),
        models=("owner",),
    )
    fuzzer = FrameFuzzer(seed, context)
    return [
        fuzzer.case(index, kind="bad_auth", op=op)
        for index, op in enumerate(op for op in REQUEST_OPS for _ in range(_CASES_PER_OP))
    ]


def _intrude(url: str, token: str, data: list[ChunkHash]) -> tuple[int, int]:
    """With the client token: the administration and ownership attempts, then a self-chosen
    routing id. Every one is answered; returns how many were sent and how many accepted."""
    accepted = 0
    with RpcClient(url, role="intruder", token=token) as intruder:
        attempts = _admin_attempts(data) + _ownership_attempts(data)
        for request in attempts:
            accepted += _accepted(intruder.submit(request).result())
    impostor_refused = _own_routing_id_refused(url, token)
    return len(attempts) + 1, accepted + (0 if impostor_refused else 1)


def _admin_drop(
    url: str, admin_token: str, chunks: list[ChunkHash]
) -> tuple[p.Dropped, p.ServerStats]:
    """With the admin token: drops ``chunks``, then reads the server's stats."""
    with RpcClient(url, role="admin", token=admin_token) as admin:
        dropped = admin.call(p.DropObjects(chunk_hashes=chunks))
        assert isinstance(dropped, p.Dropped)
        stats = admin.call(p.GetStats())
        assert isinstance(stats, p.ServerStats)
    return dropped, stats


def _admin_attempts(data: list[ChunkHash]) -> list[p.Request]:
    return [
        p.DropObjects(),
        p.DropObjects(force=True),
        p.DropObjects(chunk_hashes=data, force=True),
    ]


def _ownership_attempts(data: list[ChunkHash]) -> list[p.Request]:
    return [
        p.FreeLocks(session_id="owner:1", end_token=1 << 40),
        p.EndSession(session_id="owner:1"),
        p.LookupPoll(session_id="owner:1"),
        p.Lookup(session_id="owner:1", model="owner", world_size=1, chunk_hashes=data),
        p.StoreCommit(op_id=500),
        p.RetrieveEnd(op_id=501, ok=[True]),
        p.Abort(op_ids=[500, 501]),
    ]


def _accepted(reply: p.Reply) -> int:
    """1 if the reply did what an intruder asked (an ``Aborted`` of nothing did nothing)."""
    if isinstance(reply, p.Error):
        return 0
    if isinstance(reply, p.Aborted):
        return int(reply.num_aborted > 0)
    return 1


def _own_routing_id_refused(url: str, token: str) -> bool:
    context = zmq.Context()
    try:
        socket = context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.ROUTING_ID, b"chaos-impostor")
        socket.connect(url)
        socket.send(p.encode(p.GetStats(rid=1, auth=token)))
        if not socket.poll(5000):
            socket.close(0)
            return False
        reply = p.decode_reply(socket.recv())
        socket.close(0)
        return isinstance(reply, p.Error) and reply.code == "forbidden"
    finally:
        context.term()
