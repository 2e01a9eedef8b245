"""Scenarios where clients fail: killed while holding things, or losing their replies.

Runs in the chaos process. ``client_kill``: a client process (``testbed.chaos.holder``)
holding a lock group, pins, a reservation and a pending lookup is SIGKILLed; its server must
release all of it once the client is silent past its client timeout, and keep the data it
had committed. The full run also SIGKILLs a whole replay engine mid-run and then runs
another engine over what the dead one stored. ``lost_replies``: a live client (it keeps
heartbeating) sends stores, retrieves and lookups but gives up on their replies at once (a
timeout of zero); it aborts half of what it gave up on, as the connector does; the server's
deadlines must expire the rest, and the chunks it never stored must be storable again.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import zmq

from testbed.chaos.holder import MODEL as HOLDER_MODEL
from testbed.chaos.holder import STORED as HOLDER_STORED
from testbed.chaos.lab import CHUNK_SIZE, Lab
from testbed.chaos.probes import BYTES_PER_TOKEN, ProbeClient, chunk_hashes
from testbed.chaos.report import ScenarioResult
from testbed.chaos.watch import Held, wait_quiescent
from testbed.core import protocol as p
from testbed.core.closing import Closing
from testbed.core.keys import ChunkHash

_HOLDER_TIMEOUT_S = 2.0
_ENGINE_CLIENT_TIMEOUT_S = 15.0
"""Above the connector's 10 s heartbeat interval, so that live engines are never reaped."""


def client_kill(lab: Lab) -> ScenarioResult:
    result = lab.result(
        "a client SIGKILLed while holding a lock group, pins, a reservation and a pending "
        "lookup loses all of it once silent past the client timeout (every other deadline is "
        "far off), and what it committed stays readable"
        + ("; so does a whole engine killed mid-run" if lab.config.engine_kill else ""),
    )
    server = lab.server(
        "--chunk-size", str(CHUNK_SIZE),
        "--capacity", "64MiB",
        "--client-timeout", str(_HOLDER_TIMEOUT_S),
        "--op-ttl", "600",
        "--read-lock-ttl", "600",
        "--lookup-pending-timeout", "600",
        "--session-ttl", "3600",
    )  # fmt: skip
    holder = subprocess.Popen(
        [sys.executable, "-m", "testbed.chaos.holder", server.url, str(server.token_file)],
        stdout=subprocess.PIPE,
        stderr=open(lab.dir / "holder.log", "w"),  # noqa: SIM115
        text=True,
    )
    try:
        line = holder.stdout.readline() if holder.stdout else ""
        with ProbeClient(server.url, server.token, model=HOLDER_MODEL) as checker:
            stats = checker.stats()
            result.checks["the client held locks, pins, a reservation and a pending lookup"] = (
                line.startswith("HOLDING")
                and stats.num_locks > 0
                and stats.num_pins > 0
                and stats.num_inflight_stores > 0
                and stats.num_inflight_retrieves > 0
                and stats.num_pending_lookups > 0
            )
            result.details["held_before_kill"] = Held.of(stats).record()
            os.kill(holder.pid, signal.SIGKILL)
            holder.wait()
            killed_at = time.monotonic()
            held = wait_quiescent(checker.rpc, _HOLDER_TIMEOUT_S + 3.0)
            result.details["released_after_s"] = round(time.monotonic() - killed_at, 2)
            _record_held(result, held)
            checker.register()
            found = checker.lookup("checker:read", HOLDER_STORED)
            errors = len(HOLDER_STORED) - found.hit_chunks
            errors += checker.retrieve(
                "checker:read", found.handle, HOLDER_STORED[: found.hit_chunks]
            )
            checker.end_session("checker:read")
            result.add(integrity_errors=errors)
            result.checks["its committed data survives it"] = errors == 0
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    if lab.config.engine_kill:
        _kill_an_engine(lab, result)
    return result


def _kill_an_engine(lab: Lab, result: ScenarioResult) -> None:
    server = lab.server(
        "--chunk-size", str(CHUNK_SIZE),
        "--capacity", "64MiB",
        "--client-timeout", str(_ENGINE_CLIENT_TIMEOUT_S),
    )  # fmt: skip
    n = lab.config.run_requests
    spec = lab.spec("docqa", n, seed=1)
    victim = lab.run(spec, server, "killed-engine")
    killed = victim.wait_for(max(1, n // 2), 300.0)
    with ProbeClient(server.url, server.token, model="checker") as checker:
        at_kill = _when_holding(checker, timeout_s=3.0)
        victim.kill()
        result.checks["an engine was killed mid-run"] = killed and victim.summary() is None
        result.details["engine_held_at_kill"] = Held.of(at_kill).record()
        started = time.monotonic()
        held = wait_quiescent(checker.rpc, _ENGINE_CLIENT_TIMEOUT_S + 5.0)
        result.details["engine_released_after_s"] = round(time.monotonic() - started, 2)
        _record_held(result, held)
    after = lab.run(spec, server, "after")
    after.wait(300.0)
    summary = lab.record_run(result, after)
    result.checks["the next engine reads what the dead one stored"] = (
        summary is not None and (summary.get("external_hit_tokens") or 0) > 0
    )


def _when_holding(checker: ProbeClient, timeout_s: float) -> p.ServerStats:
    """Stats as soon as the engine holds locks, pins or operations (or at the timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = checker.stats()
        if not Held.of(stats).quiescent or time.monotonic() >= deadline:
            return stats


def lost_replies(lab: Lab) -> ScenarioResult:
    result = lab.result(
        "a live client that gives up on its replies at once (zero timeout) leaks nothing: the "
        "reservations and pins it aborts go at once, the rest expire by their deadlines "
        "(op, read-lock and pending-lookup TTLs) while it keeps heartbeating, every request "
        "is still answered, and the chunks it never stored can be stored again",
    )
    op_ttl_s, lock_ttl_s = 1.5, 2.0
    server = lab.server(
        "--chunk-size", str(CHUNK_SIZE),
        "--capacity", "64MiB",
        "--op-ttl", str(op_ttl_s),
        "--read-lock-ttl", str(lock_ttl_s),
        "--lookup-pending-timeout", "0.5",
        "--client-timeout", "60",
    )  # fmt: skip
    stored = chunk_hashes("lossy/stored", 4)
    num_ops = 8
    abandoned = [chunk_hashes(f"lossy/new-{i}", 2) for i in range(num_ops)]
    with (
        ProbeClient(server.url, server.token, model="lossy") as base,
        _Forgetful(server.url, server.token) as lossy,
    ):
        base.register()
        base.store("lossy:base", stored)
        _abandon(lossy, base.epoch, stored, abandoned)
        before = _wait_held(base, lossy)
        result.checks["the client held pins, reservations, locks and pending lookups"] = bool(
            before.num_pins and before.num_inflight_stores and before.num_locks
        ) and bool(before.num_pending_lookups)
        result.details["held_before"] = Held.of(before).record()
        after = _heartbeat_until_quiescent(base, lossy, max(op_ttl_s, lock_ttl_s) + 3.0)
        _record_held(result, Held.of(after))
        result.details.update(expired_ops=after.expired_ops, aborted_ops=after.aborted_ops)
        result.details["expired_locks"] = after.expired_locks
        result.checks["the client stayed connected (not reaped)"] = after.num_clients >= 2
        result.checks["abandoned chunks are storable again"] = _storable_again(base, abandoned)
        lossy.receive(timeout_s=5.0, until_all=True)
        result.set(requests_total=lossy.sent, requests_completed=lossy.received)
    return result


def _abandon(
    lossy: _Forgetful, epoch: int, stored: list[ChunkHash], abandoned: list[list[ChunkHash]]
) -> None:
    """Per ``abandoned[i]``: a store of it (op ``100 + i``), a retrieve pinning ``stored`` (op
    ``200 + i``), a lookup locking ``stored`` and one pending on the store; every reply given
    up on at once, then the even ``i``'s two operations aborted."""
    lossy.send(_register("lossy"))
    for i, hashes in enumerate(abandoned):
        item = p.OpItem(session_id=f"lossy:{i}", chunk_hashes=hashes)
        lossy.send(p.StoreBegin(op_id=100 + i, epoch=epoch, items=[item]))
        pins = p.OpItem(session_id=f"lossy:{i}", chunk_hashes=stored)
        lossy.send(p.RetrieveBegin(op_id=200 + i, epoch=epoch, items=[pins]))
        lossy.send(_lookup(f"lossy:{i}", stored))  # locks
        lossy.send(_lookup(f"lossy:pending-{i}", stored + hashes))  # pending on the store
    lossy.receive(timeout_s=0.0)  # the zero timeout: every reply is given up on
    num_ops = len(abandoned)
    lossy.send(p.Abort(op_ids=[op for i in range(0, num_ops, 2) for op in (100 + i, 200 + i)]))


def _heartbeat_until_quiescent(
    base: ProbeClient, lossy: _Forgetful, timeout_s: float
) -> p.ServerStats:
    """The lossy client heartbeats (dropping its replies) until the server holds nothing or
    ``timeout_s`` has passed; the server's stats at that point."""
    deadline = time.monotonic() + timeout_s
    while True:
        lossy.send(p.Heartbeat())
        lossy.receive(timeout_s=0.0)
        stats = base.stats()
        if Held.of(stats).quiescent or time.monotonic() >= deadline:
            return stats
        time.sleep(0.2)


def _storable_again(base: ProbeClient, abandoned: list[list[ChunkHash]]) -> bool:
    """Whether the first abandoned store's chunks are absent (nothing pending) and the
    second's can be stored whole."""
    again = base.lookup("lossy:again", abandoned[0])
    committed = base.store("lossy:again", abandoned[1])
    base.end_session("lossy:again")
    return not again.pending and again.miss_status == "absent" and committed == 2


def _record_held(result: ScenarioResult, held: Held | None) -> None:
    if held is None:
        result.details["held_after"] = "no answer"
        result.add(leaked_locks=1)  # cannot tell: count as leaked
        return
    result.add(**held.leaks())
    result.details.setdefault("held_after", []).append(held.record())


def _wait_held(base: ProbeClient, lossy: _Forgetful, timeout_s: float = 2.0) -> p.ServerStats:
    """Stats once the lossy client's requests have been handled (its replies arrived)."""
    deadline = time.monotonic() + timeout_s
    while lossy.received < lossy.sent and time.monotonic() < deadline:
        lossy.receive(timeout_s=0.05)
    return base.stats()


def _register(model: str) -> p.RegisterWorker:
    layout = p.KVLayout(num_layers=2, block_size=16, bytes_per_token=BYTES_PER_TOKEN)
    return p.RegisterWorker(model=model, world_size=1, kv_rank=0, layout=layout)


def _lookup(session_id: str, hashes: list[ChunkHash]) -> p.Lookup:
    return p.Lookup(session_id=session_id, model="lossy", world_size=1, chunk_hashes=hashes)


class _Forgetful(Closing):
    """A raw DEALER client that sends requests and drops their replies, counting them."""

    def __init__(self, url: str, token: str) -> None:
        self.token = token
        self.sent = 0
        self.received = 0
        self._pending: list[bytes] = []
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(url)

    def send(self, request: p.Request) -> None:
        self.sent += 1
        request.rid = self.sent
        request.auth = self.token
        self._socket.send(p.encode(request))

    def receive(self, timeout_s: float, *, until_all: bool = False) -> None:
        """Takes the replies that have arrived (waiting up to ``timeout_s`` for the first, or
        with ``until_all`` until every request is answered) and drops them."""
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = max(0.0, deadline - time.monotonic())
            if not self._socket.poll(int(remaining * 1e3)):
                return
            while True:
                try:
                    self._socket.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self.received += 1
            if not until_all or self.received >= self.sent:
                return

    def close(self) -> None:
        self._socket.close(0)
        self._context.term()
